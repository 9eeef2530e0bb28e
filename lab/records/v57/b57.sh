#!/usr/bin/env bash
# v57 (issue 47): the persistent step with split-K units of 16 KB and a reducer warp per block (lab/persist.py mode
# `split`) against the product's graph forms and the static persistent step, interleaved on one GPU.
# `bash lab/records/v57/b57.sh PHASE`; each phase one device call. Logs go under $OUT/v57PHASE as they are written.
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
PH=$1; W=$OUT/v57$PH; mkdir -p $W; S=$W/summary.txt
note() { echo "$(date +%T) $*" | tee -a $S; }
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv,noheader | tee -a $S
python3 -m pip install -q --no-deps --no-build-isolation -e . >$W/install.log 2>&1 || { note "install failed"; cat $W/install.log; exit 1; }
pt() {  # pt NAME TIMEOUT pytest-args
  local name=$1 t=$2; shift 2
  timeout -k 10 $t python3 -m pytest -q -p no:cacheprovider --durations=10 "$@" >$W/$name.log 2>&1
  note "$name: rc=$? $(tail -1 $W/$name.log)"
}
stop_unless_passed() {  # stop_unless_passed LOG: a phase whose GPU tests fail runs nothing else
  grep -qE "^[0-9]+ passed" <(tail -1 $1) || { note "the GPU tests fail: the rest is not run"; tail -40 $1 | tee -a $S
    tar czf $OUT/v57$PH.tgz -C $OUT v57$PH; exit 1; }
}
ab() {  # ab MODEL FMT TIMEOUT FORMS...: the graph forms, then the persistent step static and split, 2 rounds
  local m=$1 w=$2 t=$3; shift 3
  timeout -k 10 $t python3 lab/scripts/persist_ab.py $m $w "$@" --modes static,split --rounds 2 \
    --json $W/ab-$m-$w.json >$W/ab-$m-$w.log 2>&1; note "ab $m $w rc=$?"; grep round $W/ab-$m-$w.log | tee -a $S
}
if [ "$PH" = A ]; then  # one H100: the scheduler test first (a hang ends at its timeout), the rest, then the A/Bs
  pt persist-order 200 tests/test_lab_persist_gpu.py -x -k "every_op_once"
  stop_unless_passed $W/persist-order.log
  pt persist-all 300 tests/test_lab_persist_gpu.py -x
  stop_unless_passed $W/persist-all.log
  for m in llama-3.2-1b llama-3.2-3b; do timeout 200 atomflow-bench fetch $m >$W/fetch-$m.log 2>&1; done
  ab llama-3.2-1b fp8 150 "short:ring/l2=4;split:ring/l2=4" "short:ws/l2=0;split:ws/l2=0"
  ab llama-3.2-3b fp8 150 "short:ring/l2=4;split:ring/l2=4" "short:ws/l2=0;split:ws/l2=0"
  ab llama-3.2-1b fp16 120 "short:ws/l2=8;split:ws/l2=8"
  ab llama-3.2-3b fp16 120 "short:ws/l2=24;split:ws/l2=24"
fi
if [ "$PH" = B ]; then  # one GPU: the prefill's residual in fp16 (v58): kernel tests, the interleaved A/B against
  # fp32, validate 3B on the prefill path in both formats, `run` TTFT at 2048
  pt prefill 240 tests/test_prefill_gpu.py tests/test_validate_prefill_gpu.py
  stop_unless_passed $W/prefill.log
  timeout 200 atomflow-bench fetch llama-3.2-3b >$W/fetch-3b.log 2>&1
  timeout -k 10 150 python3 lab/scripts/prefill_chunk_ab.py llama-3.2-3b fp16 --prompts 512,2048,8192 --chunks 4096 \
    --residuals fp32,fp16 --rounds 3 --json $W/resid-ab.json >$W/resid-ab.log 2>&1; note "residual A/B rc=$?"
  tail -4 $W/resid-ab.log | tee -a $S
  for w in fp16 fp8; do
    timeout -k 10 150 atomflow-bench validate llama-3.2-3b --weights $w --steps 16 --prefill-chunk 3 --truth /tmp/truth-3b \
      --json $W/validate-3b-$w.json >$W/validate-3b-$w.log 2>&1
    note "validate 3b $w: rc=$? $(grep -iE 'prefill path|PASS —|FAIL —' $W/validate-3b-$w.log | tr -s ' ' | head -3 | tr '\n' ' ')"
  done
  timeout -k 10 100 atomflow-bench run llama-3.2-3b --weights fp16 --ctx 2048 --tokens 128 --repeats 5 \
    --json $W/3b-fp16-ctx2048.json >$W/3b-fp16-ctx2048.log 2>&1
  note "run 3b fp16 ctx 2048: rc=$? $(grep -E 'TTFT|TPOT \(graph\)' $W/3b-fp16-ctx2048.log | tr -s ' ' | tr '\n' ' ')"
fi
if [ "$PH" = C ]; then  # A and B in one call (machines were scarce): a part whose tests fail skips its timings only
  passed() { grep -qE "^[0-9]+ passed" <(tail -1 $1) || { note "$1: tests fail, its timings skipped"; tail -30 $1 | tee -a $S; return 1; }; }
  pt persist-all 150 tests/test_lab_persist_gpu.py -x
  for m in llama-3.2-1b llama-3.2-3b; do timeout 100 atomflow-bench fetch $m >$W/fetch-$m.log 2>&1; done
  if passed $W/persist-all.log; then
    ab llama-3.2-1b fp8 70 "short:ring/l2=4;split:ring/l2=4" "short:ws/l2=0;split:ws/l2=0"
    ab llama-3.2-3b fp8 70 "short:ring/l2=4;split:ring/l2=4"
    ab llama-3.2-1b fp16 50 "short:ws/l2=8;split:ws/l2=8"
  fi
  pt prefill 120 tests/test_prefill_gpu.py tests/test_validate_prefill_gpu.py
  if passed $W/prefill.log; then
    timeout -k 10 90 python3 lab/scripts/prefill_chunk_ab.py llama-3.2-3b fp16 --prompts 2048,8192 --chunks 4096 \
      --residuals fp32,fp16 --rounds 2 --json $W/resid-ab.json >$W/resid-ab.log 2>&1; note "residual A/B rc=$?"
    tail -3 $W/resid-ab.log | tee -a $S
    timeout -k 10 100 atomflow-bench validate llama-3.2-3b --weights fp16 --steps 16 --prefill-chunk 3 --truth /tmp/truth-3b \
      --json $W/validate-3b-fp16.json >$W/validate-3b-fp16.log 2>&1
    note "validate 3b fp16: rc=$? $(grep -iE 'prefill path|PASS —|FAIL —' $W/validate-3b-fp16.log | tr -s ' ' | head -3 | tr '\n' ' ')"
  fi
fi
if [ "$PH" = D ]; then  # the fp16 residual, op by op (interleaved with fp32), validate 3B W8A16 on the prefill path,
  # `run` TTFT of 3B at 512 (both formats) and 2048 on the new default
  timeout 100 atomflow-bench fetch llama-3.2-3b >$W/fetch-3b.log 2>&1
  timeout -k 10 120 python3 lab/scripts/prefill_resid_profile.py llama-3.2-3b fp16 --prompt 2048 --rounds 2 \
    --json $W/resid-profile.json >$W/resid-profile.log 2>&1; note "residual profile rc=$?"; cat $W/resid-profile.log | tee -a $S
  timeout -k 10 100 atomflow-bench validate llama-3.2-3b --weights fp8 --steps 16 --prefill-chunk 3 --truth /tmp/truth-3b \
    --json $W/validate-3b-fp8.json >$W/validate-3b-fp8.log 2>&1
  note "validate 3b fp8: rc=$? $(grep -iE 'prefill path|PASS —|FAIL —' $W/validate-3b-fp8.log | tr -s ' ' | head -3 | tr '\n' ' ')"
  for cw in "fp16 2048 128" "fp16 512 256" "fp8 512 256"; do set -- $cw
    timeout -k 10 60 atomflow-bench run llama-3.2-3b --weights $1 --ctx $2 --tokens $3 --repeats 5 \
      --json $W/3b-$1-ctx$2.json >$W/3b-$1-ctx$2.log 2>&1
    note "run 3b $1 ctx $2: rc=$? $(grep -E 'TTFT' $W/3b-$1-ctx$2.log | tr -s ' ' | tr '\n' ' ')"
  done
fi
if [ "$PH" = E ]; then  # D cut to what the last minutes allow: validate 3B W8A16 on the prefill path (the fp16 residual is
  # the default now), then the residual's per-op profile, one round
  timeout 100 atomflow-bench fetch llama-3.2-3b >$W/fetch-3b.log 2>&1
  timeout -k 10 100 atomflow-bench validate llama-3.2-3b --weights fp8 --steps 16 --prefill-chunk 3 --truth /tmp/truth-3b \
    --json $W/validate-3b-fp8.json >$W/validate-3b-fp8.log 2>&1
  note "validate 3b fp8: rc=$? $(grep -iE 'prefill path|PASS —|FAIL —' $W/validate-3b-fp8.log | tr -s ' ' | head -3 | tr '\n' ' ')"
  timeout -k 10 70 python3 lab/scripts/prefill_resid_profile.py llama-3.2-3b fp16 --prompt 2048 --rounds 1 \
    --json $W/resid-profile.json >$W/resid-profile.log 2>&1; note "residual profile rc=$?"; cat $W/resid-profile.log | tee -a $S
fi
tar czf $OUT/v57$PH.tgz -C $OUT v57$PH
