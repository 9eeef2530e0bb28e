#!/usr/bin/env bash
# v48 (issue 47, the persistent step): its GPU tests, validate on it, and the interleaved A/B of the graph forms (the
# tunes' choices, pinned) against `short:persist`. `bash lab/records/v48/b48.sh PHASE`; each phase one device call.
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1
PH=$1; W=/tmp/v48$PH; mkdir -p $W; S=$W/summary-v48-$PH.txt; OLD=$PWD/.ab/bf72ae8
pack() { tar -czf $OUT/v48-$PH.tar.gz -C /tmp v48$PH; }
note() { echo "$(date +%T) $*" | tee -a $S; pack; }
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv,noheader | tee -a $S
python3 -m pip install -q --no-deps --no-build-isolation -e . >$W/install.log 2>&1 || { note "install failed"; cat $W/install.log; exit 1; }
show() { python3 -c 'import json, sys
r = json.load(open(sys.argv[1])); f = (r.get("forms") or {}).get("forms")
print("%s TPOT %.4f ms (%.4f-%.4f) %.1f%% of %.0f GB/s | %s" % (sys.argv[2], r["tpot_ms"]["median"], r["tpot_ms"]["p10"], r["tpot_ms"]["p90"], r["roofline"]["pct"], r["copy_bandwidth_gbs"]["median"], f))' "$1" "$2" 2>&1 | tail -1; }
runf() {  # runf TAG TREE(old|new) MODEL FMT [args]: one `run` (ctx 128, 256 tokens, 5 repeats)
  local tag=$1 tree=$2 m=$3 w=$4; shift 4
  if [ "$tree" = old ]; then
    (cd $OLD && PYTHONPATH=$OLD timeout 300 python3 -m atomflow_bench.cli run $m --weights $w --ctx 128 --tokens 256 \
      --repeats 5 --json $W/$tag.json "$@") >$W/$tag.log 2>&1
  else
    timeout 300 atomflow-bench run $m --weights $w --ctx 128 --tokens 256 --repeats 5 --json $W/$tag.json "$@" >$W/$tag.log 2>&1
  fi
  local rc=$?; note "rc=$rc $(show $W/$tag.json $tag) $( [ $rc -ne 0 ] && tail -3 $W/$tag.log | tr '\n' ' ')"
}
pt() {  # pt NAME TIMEOUT pytest-args: one GPU test run, its tail in the summary
  local name=$1 t=$2; shift 2
  timeout $t python3 -m pytest -q -p no:cacheprovider --durations=15 "$@" >$W/$name.log 2>&1
  note "$name: rc=$? $(tail -1 $W/$name.log)"
}
val() {  # val MODEL FMT FORMS
  timeout 240 atomflow-bench validate $1 --weights $2 --steps 32 --forms "$3" --json $W/validate-$1-$2.json >$W/validate-$1-$2.log 2>&1
  note "validate $1 $2 ($3): rc=$? $(grep -E 'probes PASS|probes FAIL|greedy|KL' $W/validate-$1-$2.log | tr -s ' ' | head -3 | tr '\n' ' ')"
}
P="short:persist;split:ws"
if [ "$PH" = A ] || [ "$PH" = C ]; then  # one H100: the scheduler test first (a hang ends at its timeout), then the rest, then timings
  pt persist-order 180 tests/test_persist_gpu.py -x -k "every_op_once"
  pt persist-all 300 tests/test_persist_gpu.py
  pt ws-short-kernels 240 tests/test_kernels_gpu.py -k "ws or short"
  for m in llama-3.2-1b llama-3.2-3b; do timeout 200 atomflow-bench fetch $m >$W/fetch-$m.log 2>&1; done
  runf g-1-1b-fp8 new llama-3.2-1b fp8 --forms "short:ring/l2=4;split:ring/l2=4"; runf p-1-1b-fp8 new llama-3.2-1b fp8 --forms "$P"
  runf g-1-3b-fp8 new llama-3.2-3b fp8 --forms "short:ring/l2=4;split:ring/l2=4"; runf p-1-3b-fp8 new llama-3.2-3b fp8 --forms "$P"
  runf g-1-1b-fp16 new llama-3.2-1b fp16 --forms "short:ws/l2=8;split:ws/l2=8"; runf p-1-1b-fp16 new llama-3.2-1b fp16 --forms "$P"
  runf g-2-1b-fp8 new llama-3.2-1b fp8 --forms "short:ring/l2=4;split:ring/l2=4"; runf p-2-1b-fp8 new llama-3.2-1b fp8 --forms "$P"
  val llama-3.2-3b fp8 "$P"
  val llama-3.2-3b fp16 "$P"
  runf ws-old-3b-fp16 old llama-3.2-3b fp16 --forms "short:ws/l2=24;split:ws/l2=24"
  runf ws-new-3b-fp16 new llama-3.2-3b fp16 --forms "short:ws/l2=24;split:ws/l2=24"
  runf g-1-3b-fp16 new llama-3.2-3b fp16 --forms "short:ws/l2=24;split:ws/l2=24"; runf p-1-3b-fp16 new llama-3.2-3b fp16 --forms "$P"
  runf ws-old-2-3b-fp16 old llama-3.2-3b fp16 --forms "short:ws/l2=24;split:ws/l2=24"
  runf ws-new-2-3b-fp16 new llama-3.2-3b fp16 --forms "short:ws/l2=24;split:ws/l2=24"
fi
if [ "$PH" = B ]; then  # why the cooperative launch is refused; then the GPU tests again
  timeout 120 python3 lab/records/v48/occupancy.py >$W/occupancy.log 2>&1; note "occupancy rc=$?"; cat $W/occupancy.log | tee -a $S
fi
if [ "$PH" = D ]; then  # the tests after the barrier change; the tune choosing among the forms with persist; 8B pairs
  pt persist-all 300 tests/test_persist_gpu.py
  pt engine-forms 300 tests/test_engine_gpu.py -k "every_gemv_form or tune_chooses or graph_bit or resolve_saves"
  for m in llama-3.2-1b llama-3.1-8b; do timeout 200 atomflow-bench fetch $m >$W/fetch-$m.log 2>&1; done
  runf g-1-8b-fp8 new llama-3.1-8b fp8 --forms "short:ws/l2=24/wo-pre=2;split:ws/l2=24/wo-pre=2"; runf p-1-8b-fp8 new llama-3.1-8b fp8 --forms "$P"
  runf g-1-8b-fp16 new llama-3.1-8b fp16 --forms "short:ws/l2=4;split:ws/l2=4"; runf p-1-8b-fp16 new llama-3.1-8b fp16 --forms "$P"
  timeout 300 atomflow-bench tune llama-3.2-1b --weights fp8 --ctx 128 --tokens 256 --format md >$W/tune-1b-fp8.md 2>$W/tune-1b-fp8.log
  note "tune 1b fp8: rc=$? $(grep -i 'chosen\|forms' $W/tune-1b-fp8.md | head -3 | tr '\n' ' ')"
  runf tuned-1b-fp8 new llama-3.2-1b fp8
fi
if [ "$PH" = E ]; then  # after the layer table moved to load time: the tune tests, tune 1B W8A16 and a run on its choice
  pt persist-all 300 tests/test_persist_gpu.py
  pt engine-forms 300 tests/test_engine_gpu.py -k "every_gemv_form or tune_chooses or graph_bit or resolve_saves"
  timeout 200 atomflow-bench fetch llama-3.2-1b >$W/fetch-1b.log 2>&1
  timeout 300 atomflow-bench tune llama-3.2-1b --weights fp8 --ctx 128 --tokens 256 --format md >$W/tune-1b-fp8.md 2>$W/tune-1b-fp8.log
  note "tune 1b fp8: rc=$? $(tail -3 $W/tune-1b-fp8.log | tr '\n' ' ')"; cat $W/tune-1b-fp8.md | tee -a $S
  runf tuned-1b-fp8 new llama-3.2-1b fp8
  runf g-3-1b-fp8 new llama-3.2-1b fp8 --forms "short:ring/l2=4;split:ring/l2=4"
fi
if [ "$PH" = F ]; then  # after the move to the lab: its GPU tests (static and dynamic tiles), the prefill attention's
  # kernel tests, and the A/B of the graph against both persistent steps (lab/scripts/persist_ab.py), 1B and 3B W8A16
  pt lab-persist 300 tests/test_lab_persist_gpu.py -x
  pt prefill-attention 200 tests/test_prefill_attention.py
  timeout 120 python3 lab/records/v48/prefill_att_time.py >$W/prefill-att-time.log 2>&1; note "prefill attention timing rc=$?"; cat $W/prefill-att-time.log | tee -a $S
  for m in llama-3.2-1b llama-3.2-3b; do timeout 200 atomflow-bench fetch $m >$W/fetch-$m.log 2>&1; done
  timeout 200 python3 lab/scripts/persist_ab.py llama-3.2-1b fp8 "short:ws/l2=0;split:ws/l2=0" --rounds 2 \
    --json $W/persist-ab-1b-fp8.json >$W/persist-ab-1b-fp8.log 2>&1; note "persist_ab 1b fp8 rc=$?"; cat $W/persist-ab-1b-fp8.log | tee -a $S
  timeout 200 python3 lab/scripts/persist_ab.py llama-3.2-3b fp8 "short:ring/l2=4;split:ring/l2=4" "short:ws/l2=0;split:ws/l2=0" \
    --json $W/persist-ab-3b-fp8.json >$W/persist-ab-3b-fp8.log 2>&1; note "persist_ab 3b fp8 rc=$?"; cat $W/persist-ab-3b-fp8.log | tee -a $S
fi
if [ "$PH" = G ]; then  # prefill: the path's tests, the tiled GEMM's tests, first TTFT and GEMM timings
  pt prefill-path 150 tests/test_prefill_gpu.py
  timeout 200 atomflow-bench fetch llama-3.2-3b >$W/fetch-3b.log 2>&1
  timeout 120 python3 lab/records/v48/prefill_time.py llama-3.2-3b >$W/prefill-time.log 2>&1; note "prefill timing rc=$?"; cat $W/prefill-time.log | tail -8 | tee -a $S
  pt prefill-gemm 100 tests/test_prefill_gemm.py -x
  timeout 90 python3 lab/records/v48/prefill_gemm_time.py >$W/prefill-gemm-time.log 2>&1; note "gemm timing rc=$?"; cat $W/prefill-gemm-time.log | tail -20 | tee -a $S
fi
if [ "$PH" = H ]; then  # the prefill's chunks as graph replays: its tests, then the TTFT again
  pt prefill-path 150 tests/test_prefill_gpu.py
  timeout 200 atomflow-bench fetch llama-3.2-3b >$W/fetch-3b.log 2>&1
  timeout 120 python3 lab/records/v48/prefill_time.py llama-3.2-3b >$W/prefill-time.log 2>&1; note "prefill timing rc=$?"; cat $W/prefill-time.log | tail -8 | tee -a $S
fi
