#!/usr/bin/env bash
# v57 (issue 47): the persistent step with split-K units of 16 KB and a reducer warp per block (lab/persist.py mode
# `split`) against the product's graph forms and the static persistent step, interleaved on one GPU.
# `bash lab/records/v57/b57.sh PHASE`; each phase one device call. Phase C is the one that ran; its residual A/B needs
# the tree it ran on (ec295df: Prefill(residual=...), prefill_chunk_ab.py --residuals), whose fp16 residual measured
# neutral and left the product (PERF_NOTES v58.2). Logs go under $OUT/v57PHASE as they are written.
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
tar czf $OUT/v57$PH.tgz -C $OUT v57$PH
