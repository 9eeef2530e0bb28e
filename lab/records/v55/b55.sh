#!/usr/bin/env bash
# v55 (issue 48): session 27's device calls, the first on an H100 since the batched prefill exists.
# `bash lab/records/v55/b55.sh PHASE`; each phase one device call. Logs go under $OUT/v55PHASE as they are written
# (a call cut short still returns them); large scratch (ground truth, stores) stays under /tmp.
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
PH=$1; W=$OUT/v55$PH; mkdir -p $W; S=$W/summary.txt
note() { echo "$(date +%T) $*" | tee -a $S; }
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv,noheader | tee -a $S
python3 -m pip install -q --no-deps --no-build-isolation -e . >$W/install.log 2>&1 || { note "install failed"; cat $W/install.log; exit 1; }
pt() {  # pt NAME TIMEOUT pytest-args
  local name=$1 t=$2; shift 2
  timeout -k 10 $t python3 -m pytest -q -p no:cacheprovider --durations=10 "$@" >$W/$name.log 2>&1
  note "$name: rc=$? $(tail -1 $W/$name.log)"
}
runr() {  # runr TAG TIMEOUT MODEL FMT [args]: one `run`, its wall time and its TTFT/TPOT line
  local tag=$1 t=$2 m=$3 w=$4; shift 4; local t0=$(date +%s)
  timeout -k 10 $t atomflow-bench run $m --weights $w --json $W/$tag.json "$@" >$W/$tag.log 2>&1; local rc=$?
  note "run $tag: rc=$rc wall $(( $(date +%s) - t0 )) s | $(grep -E 'TTFT|TPOT \(graph\)' $W/$tag.log | tr -s ' ' | tr '\n' ' ')"
  [ $rc -ne 0 ] && tail -5 $W/$tag.log | tee -a $S
}
ttft() {  # ttft MODEL FMT TIMEOUT: the TTFT grid at prompts 128..8192, chunks of 4096
  timeout -k 10 $3 python3 lab/scripts/prefill_chunk_ab.py $1 $2 --prompts 128,512,2048,8192 --chunks 4096 --rounds 2 \
    --json $W/ttft-$1-$2.json >$W/ttft-$1-$2.log 2>&1; note "ttft $1 $2 rc=$?"; tail -4 $W/ttft-$1-$2.log | tee -a $S
}
stop_unless_passed() {  # stop_unless_passed LOG: a phase whose GPU tests fail runs nothing else
  grep -qE "^[0-9]+ passed" <(tail -1 $1) || { note "the GPU tests fail: the rest is not run"; tail -30 $1
    tar czf $OUT/v55$PH.tgz -C $OUT v55$PH; exit 1; }
}
ttft_runs() {  # validate 3B on the prefill path in both formats, the 2048-token chunk's profile, `run` TTFT
  timeout 200 atomflow-bench fetch llama-3.2-3b >/tmp/fetch-3b.log 2>&1
  for w in fp16 fp8; do
    timeout -k 10 200 atomflow-bench validate llama-3.2-3b --weights $w --steps 16 --prefill-chunk 3 --truth /tmp/truth-3b \
      --json $W/validate-3b-$w.json >$W/validate-3b-$w.log 2>&1
    note "validate 3b $w: rc=$? $(grep -iE 'prefill path|PASS —|FAIL —' $W/validate-3b-$w.log | tr -s ' ' | head -3 | tr '\n' ' ')"
  done
  timeout -k 10 200 atomflow-bench profile llama-3.2-3b --weights fp16 --ctx 128 --prompt-tokens 2048 \
    --json $W/profile-3b-fp16.json >$W/profile-3b-fp16.md 2>$W/profile-3b-fp16.err
  note "profile 3b fp16 rc=$?"; grep -A16 "prefill chunk" $W/profile-3b-fp16.md | tee -a $S
  runr 3b-fp16-ctx512 120 llama-3.2-3b fp16 --ctx 512 --tokens 256 --repeats 5
  runr 3b-fp16-ctx2048 120 llama-3.2-3b fp16 --ctx 2048 --tokens 128 --repeats 5
  runr 3b-fp16-ctx8192 120 llama-3.2-3b fp16 --ctx 8192 --tokens 64 --repeats 3
  runr 3b-fp8-ctx512 120 llama-3.2-3b fp8 --ctx 512 --tokens 256 --repeats 5
  timeout 200 atomflow-bench fetch llama-3.1-8b >/tmp/fetch-8b.log 2>&1
  runr 8b-fp16-ctx2048 150 llama-3.1-8b fp16 --ctx 2048 --tokens 128 --repeats 5
}
if [ "$PH" = A ]; then  # one H100, on branch prefill-tma: the product's sm_90a attention with K/V by TMA through the
  # product's launch path (GPU tests, validate both formats, the 2048 chunk's profile, `run` TTFT), lab v10 against
  # v9, and the regression gate's references re-recorded (they predate the prefill: no TTFT to gate)
  pt prefill 300 tests/test_prefill_attention.py tests/test_prefill_gpu.py tests/test_validate_prefill_gpu.py \
    tests/test_engine_gpu.py -k "prefill or run_record"
  stop_unless_passed $W/prefill.log
  pt lab-att-v10 150 tests/test_lab_prefill_att_gpu.py -k "v10 or v9" -x
  timeout -k 10 100 python3 lab/scripts/prefill_att_ab.py --rounds 3 --variants product,v9,v10 \
    --json $W/att-ab.json >$W/att-ab.log 2>&1; note "attention A/B rc=$?"; cat $W/att-ab.log | tee -a $S
  ttft_runs
  UPDATE_REFERENCE=1 OUT=$W/reference REFERENCE_DIR=$W/reference timeout 150 bash scripts/perf_regression.sh \
    >$W/reference.log 2>&1; note "references rc=$?"; grep -E "TTFT|TPOT \(graph\)" $W/reference.log | tr -s ' ' | tee -a $S
fi
if [ "$PH" = B ]; then  # one H100, the same tree as A: the fp16 reference (A's gate script copied each record onto
  # itself and stopped after the fp8 one), and the TTFT grid of 1B and 8B in both formats (prompts 128..8192)
  mkdir -p $W/reference; OUT=$W/ci REFERENCE_DIR=$W/reference UPDATE_REFERENCE=1 timeout 150 bash scripts/perf_regression.sh \
    >$W/reference.log 2>&1; note "references rc=$?"; grep -E "TTFT|TPOT \(graph\)" $W/reference.log | tr -s ' ' | tee -a $S
  for mw in "llama-3.2-1b fp16" "llama-3.2-1b fp8" "llama-3.1-8b fp16" "llama-3.1-8b fp8"; do ttft $mw 120; done
fi
if [ "$PH" = C ]; then  # one H100: RMSNorm rows held in registers (product) and v9-lpt (lab): the GPU tests, the rows
  # A/B against v0 and the attention A/B against v9, validate 3B fp16 on the prefill path, the 2048 chunk's profile,
  # `run` TTFT at 2048 and 8192
  pt prefill 300 tests/test_prefill_gpu.py tests/test_prefill_attention.py
  stop_unless_passed $W/prefill.log
  pt lab-att-lpt 150 tests/test_lab_prefill_att_gpu.py -k "v9-lpt" -x
  timeout -k 10 100 python3 lab/scripts/prefill_rows_ab.py --rounds 3 --json $W/rows-ab.json >$W/rows-ab.log 2>&1
  note "rows A/B rc=$?"; cat $W/rows-ab.log | tee -a $S
  timeout -k 10 100 python3 lab/scripts/prefill_att_ab.py --rounds 3 --variants v9,v9-lpt \
    --json $W/att-ab.json >$W/att-ab.log 2>&1; note "attention A/B rc=$?"; tail -6 $W/att-ab.log | tee -a $S
  timeout 200 atomflow-bench fetch llama-3.2-3b >/tmp/fetch-3b.log 2>&1
  timeout -k 10 200 atomflow-bench validate llama-3.2-3b --weights fp16 --steps 16 --prefill-chunk 3 --truth /tmp/truth-3b \
    --json $W/validate-3b-fp16.json >$W/validate-3b-fp16.log 2>&1
  note "validate 3b fp16: rc=$? $(grep -iE 'prefill path|PASS —|FAIL —' $W/validate-3b-fp16.log | tr -s ' ' | head -3 | tr '\n' ' ')"
  timeout -k 10 200 atomflow-bench profile llama-3.2-3b --weights fp16 --ctx 128 --prompt-tokens 2048 \
    --json $W/profile-3b-fp16.json >$W/profile-3b-fp16.md 2>$W/profile-3b-fp16.err
  note "profile 3b fp16 rc=$?"; grep -A16 "prefill chunk" $W/profile-3b-fp16.md | tee -a $S
  runr 3b-fp16-ctx2048 120 llama-3.2-3b fp16 --ctx 2048 --tokens 128 --repeats 5
  runr 3b-fp16-ctx8192 120 llama-3.2-3b fp16 --ctx 8192 --tokens 64 --repeats 3
fi
if [ "$PH" = D ]; then  # one H100: v9-lpt's dispatch order in both product kernels: the GPU tests, the mma.sync
  # kernel against v4 (its old order), validate both formats, the 2048 chunk's profile, `run` TTFT (ttft_runs)
  pt prefill 300 tests/test_prefill_attention.py tests/test_prefill_gpu.py tests/test_validate_prefill_gpu.py \
    tests/test_engine_gpu.py -k "prefill or run_record"
  stop_unless_passed $W/prefill.log
  timeout -k 10 100 python3 lab/scripts/prefill_att_ab.py --rounds 3 --variants product,v4 \
    --json $W/att-ab.json >$W/att-ab.log 2>&1; note "attention A/B rc=$?"; tail -6 $W/att-ab.log | tee -a $S
  ttft_runs
fi
if [ "$PH" = E ]; then  # one H100, D's tree: where an 8192-token prompt's last chunk (4096 rows after 4096) spends its time
  timeout 200 atomflow-bench fetch llama-3.2-3b >/tmp/fetch-3b.log 2>&1
  timeout -k 10 150 atomflow-bench profile llama-3.2-3b --weights fp16 --ctx 128 --prompt-tokens 8192 \
    --json $W/profile-3b-fp16-8192.json >$W/profile-3b-fp16-8192.md 2>$W/profile-3b-fp16-8192.err
  note "profile 3b fp16 8192 rc=$?"; grep -A16 "prefill chunk" $W/profile-3b-fp16-8192.md | tee -a $S
fi
tar czf $OUT/v55$PH.tgz -C $OUT v55$PH
