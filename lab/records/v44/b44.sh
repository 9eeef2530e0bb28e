#!/usr/bin/env bash
# v44: where 70B W8A16 TP4's kernel boundaries cost (phase W: the AF_NO_WAIT timing instrument on 4 GPUs, `run --tp 4`),
# then the LL hand-over from the attention to o_proj (later phases).
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
PH=$1; W=/tmp/v44$PH; mkdir -p $W; S=$OUT/summary-v44-$PH.txt
pack() { tar -czf $OUT/v44-$PH.tar.gz -C /tmp v44$PH; }
note() { echo "$(date +%T) $*" | tee -a $S; pack; }
show() { python3 -c 'import json, sys
r = json.load(open(sys.argv[1])); t = r.get("tp")
s = "%s TPOT %.4f ms (%.4f-%.4f) %.1f%%" % (sys.argv[2], r["tpot_ms"]["median"], r["tpot_ms"]["p10"], r["tpot_ms"]["p90"], r["roofline"]["pct"])
if t: c = t["comm"]; s += " | %s in step %.1f us, local %.1f" % (t["allreduce"], c["in_step_us"], c["step_without_exchanges_us"]["median"])
print(s)' "$1" "$2" 2>&1 | tail -1; }
one() {  # one TAG TREE MODEL FMT TP [extra args]; env DEF = ATOMFLOW_KERNEL_DEFINES
  local tag=$1 tree=$2 m=$3 w=$4 n=$5; shift 5
  if [ "$tree" = new ]; then
    ATOMFLOW_KERNEL_DEFINES="${DEF:-}" timeout 150 atomflow-bench run $m --weights $w --ctx 128 --tokens 256 --repeats 5 --tp $n --json $W/$tag.json "$@" >$W/$tag.log 2>&1
  else
    (cd .ab/$tree && ATOMFLOW_KERNEL_DEFINES="${DEF:-}" PYTHONPATH=$PWD timeout 150 python3 -c 'from atomflow_bench.cli import main; main()' run $m \
      --weights $w --ctx 128 --tokens 256 --repeats 5 --tp $n --json $W/$tag.json "$@") >$W/$tag.log 2>&1
  fi
  note "rc=$? $(show $W/$tag.json $tag)"
}
if [ "$PH" = W ]; then  # the boundaries' bound at TP4: AF_NO_WAIT 0, 4 (o_proj, down), 2 (attention), 6, 15, 0
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  for d in 0 4 2 6 15 0; do
    DEF="AF_NO_WAIT=$d"; [ $d = 0 ] && DEF=""
    DEF="$DEF" one 70b-fp8-tp4-nowait$d-$RANDOM new llama-3.1-70b fp8 4 --allreduce peer
  done
fi
if [ "$PH" = L ] || [ "$PH" = L2 ]; then  # the LL hand-over attention -> o_proj: its GPU tests, then A/B on 4 GPUs and on one
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  timeout 200 python3 -m pytest -q tests/test_kernels_gpu.py -k "_ll" -p no:cacheprovider >$W/kernels-ll.log 2>&1
  rc=$?; note "kernels ll: rc=$rc $(tail -1 $W/kernels-ll.log)"
  [ $rc -ne 0 ] && { grep -E "^(FAILED|ERROR)|Error|assert|seed" $W/kernels-ll.log | head -30; exit 1; }
  timeout 200 python3 -m pytest -q tests/test_engine_gpu.py -k "ll_hand_over" -p no:cacheprovider >$W/engine-ll.log 2>&1
  rc=$?; note "engine ll: rc=$rc $(tail -1 $W/engine-ll.log)"
  [ $rc -ne 0 ] && { grep -E "^(FAILED|ERROR)|Error|assert" $W/engine-ll.log | head -30; exit 1; }
  P16="short:ws/l2=16;split:ws/l2=16"; L16="short:ws/l2=16/ll;split:ws/l2=16"
  N=${TPN:-4}  # TPN=2 on a 2-GPU machine (call L2, when no 4-GPU kind was lent)
  for r in a b; do
    one 70b-fp8-tp$N-plain-$r new llama-3.1-70b fp8 $N --allreduce peer --forms "$P16"
    one 70b-fp8-tp$N-ll-$r new llama-3.1-70b fp8 $N --allreduce peer --forms "$L16"
  done
  timeout 120 atomflow-bench fetch llama-3.2-1b --source synthetic >$W/fetch.log 2>&1; note "fetch 1b rc=$?"
  for r in a b; do
    for f in plain ll; do
      F="short:ws/l2=8;split:ws/l2=8"; [ $f = ll ] && F="short:ws/l2=8/ll;split:ws/l2=8"
      timeout 90 atomflow-bench run llama-3.2-1b --weights fp16 --ctx 128 --tokens 256 --repeats 5 --forms "$F" --json $W/1b-fp16-$f-$r.json >$W/1b-fp16-$f-$r.log 2>&1
      note "rc=$? $(show $W/1b-fp16-$f-$r.json 1b-fp16-$f-$r)"
    done
  done
  timeout 100 atomflow-bench validate llama-3.2-1b --weights fp16 --steps 16 --forms "short:ws/l2=8/ll;split:ws/l2=8" --json $W/validate-1b-fp16-ll.json >$W/validate-1b.log 2>&1
  note "validate 1b fp16 ll: rc=$? $(grep -E 'PASS|FAIL|greedy|KL' $W/validate-1b.log | tr -s ' ' | head -3 | tr '\n' ' ')"
fi
if [ "$PH" = M ]; then  # v44.2: the LL consumer polls with its first warp only (32 sampled words), A/B at TP$TPN
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  timeout 200 python3 -m pytest -q tests/test_kernels_gpu.py -k "_ll" -p no:cacheprovider >$W/kernels-ll.log 2>&1
  rc=$?; note "kernels ll: rc=$rc $(tail -1 $W/kernels-ll.log)"
  [ $rc -ne 0 ] && { grep -E "^(FAILED|ERROR)|Error|assert|seed" $W/kernels-ll.log | head -30; exit 1; }
  timeout 200 python3 -m pytest -q tests/test_engine_gpu.py -k "ll_hand_over" -p no:cacheprovider >$W/engine-ll.log 2>&1
  rc=$?; note "engine ll: rc=$rc $(tail -1 $W/engine-ll.log)"
  [ $rc -ne 0 ] && { grep -E "^(FAILED|ERROR)|Error|assert" $W/engine-ll.log | head -30; exit 1; }
  P16="short:ws/l2=16;split:ws/l2=16"; L16="short:ws/l2=16/ll;split:ws/l2=16"; N=${TPN:-4}
  for r in a b; do
    one 70b-fp8-tp$N-plain-$r new llama-3.1-70b fp8 $N --allreduce peer --forms "$P16"
    one 70b-fp8-tp$N-ll-$r new llama-3.1-70b fp8 $N --allreduce peer --forms "$L16"
  done
  timeout 120 atomflow-bench fetch llama-3.2-1b --source synthetic >$W/fetch.log 2>&1
  for f in plain ll; do
    F="short:ws/l2=8;split:ws/l2=8"; [ $f = ll ] && F="short:ws/l2=8/ll;split:ws/l2=8"
    timeout 90 atomflow-bench run llama-3.2-1b --weights fp16 --ctx 128 --tokens 256 --repeats 5 --forms "$F" --json $W/1b-fp16-$f.json >$W/1b-fp16-$f.log 2>&1
    note "rc=$? $(show $W/1b-fp16-$f.json 1b-fp16-$f)"
  done
fi
if [ "$PH" = N ]; then  # v44.3 (one GPU): the pollers spread over x's lines; tests, then 1B / 8B fp16 A/B
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  timeout 200 python3 -m pytest -q tests/test_kernels_gpu.py -k "_ll" -p no:cacheprovider >$W/kernels-ll.log 2>&1
  rc=$?; note "kernels ll: rc=$rc $(tail -1 $W/kernels-ll.log)"
  [ $rc -ne 0 ] && { grep -E "^(FAILED|ERROR)|Error|assert|seed" $W/kernels-ll.log | head -30; exit 1; }
  timeout 200 python3 -m pytest -q tests/test_engine_gpu.py -k "ll_hand_over" -p no:cacheprovider >$W/engine-ll.log 2>&1
  rc=$?; note "engine ll: rc=$rc $(tail -1 $W/engine-ll.log)"
  [ $rc -ne 0 ] && { grep -E "^(FAILED|ERROR)|Error|assert" $W/engine-ll.log | head -30; exit 1; }
  for m in llama-3.2-1b llama-3.1-8b; do timeout 200 atomflow-bench fetch $m --source synthetic >$W/fetch-$m.log 2>&1; done
  for r in a b; do
    for m in llama-3.2-1b llama-3.1-8b; do
      [ $m = llama-3.1-8b ] && [ $r = b ] && continue
      for f in plain ll; do
        F="short:ws/l2=8;split:ws/l2=8"; [ $f = ll ] && F="short:ws/l2=8/ll;split:ws/l2=8"
        timeout 120 atomflow-bench run $m --weights fp16 --ctx 128 --tokens 256 --repeats 5 --forms "$F" --json $W/$m-fp16-$f-$r.json >$W/$m-fp16-$f-$r.log 2>&1
        note "rc=$? $(show $W/$m-fp16-$f-$r.json $m-fp16-$f-$r)"
      done
    done
  done
fi
if [ "$PH" = O ]; then  # v44.4 (one GPU): where the hand-over costs: plain, ll, unpolled, late (scripts/lab/ll_ab.py)
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  timeout 100 python3 -m pytest -q tests/test_kernels_gpu.py -k "gemv_ll" -p no:cacheprovider >$W/kernels-ll.log 2>&1
  rc=$?; note "kernels gemv_ll: rc=$rc $(tail -1 $W/kernels-ll.log)"
  timeout 200 atomflow-bench fetch llama-3.1-8b --source synthetic >$W/fetch.log 2>&1
  timeout 200 python3 scripts/lab/ll_ab.py llama-3.1-8b fp16 ws/l2=8 --json $W/ll-ab-8b-fp16.json >$W/ll-ab-8b.log 2>&1
  note "8b fp16 rc=$? $(tail -1 $W/ll-ab-8b.log)"
  timeout 240 python3 scripts/lab/ll_ab.py llama-3.1-70b/tp4 fp8 ws/l2=16 --json $W/ll-ab-70b-tp4.json >$W/ll-ab-70b.log 2>&1
  note "70b/tp4 fp8 rc=$? $(tail -1 $W/ll-ab-70b.log)"
  tail -14 $W/ll-ab-70b.log
fi
if [ "$PH" = P ]; then  # v44.5 (one GPU): LL + o_proj's grid leaving the attention's SMs; lab tree .ab/lab44 = 339c9c6 + results/v44/P/lab-v44.5-ll-room.patch
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  timeout 200 atomflow-bench fetch llama-3.1-8b --source synthetic >$W/fetch.log 2>&1
  (cd .ab/lab44 && PYTHONPATH=$PWD timeout 200 python3 scripts/lab/ll_ab.py llama-3.1-8b fp16 ws/l2=8 --json $W/ll-room-8b-fp16.json) >$W/ll-room-8b.log 2>&1
  note "8b fp16 rc=$? $(grep grids $W/ll-room-8b.log) | $(tail -1 $W/ll-room-8b.log)"
  (cd .ab/lab44 && PYTHONPATH=$PWD timeout 240 python3 scripts/lab/ll_ab.py llama-3.1-70b/tp4 fp8 ws/l2=16 --json $W/ll-room-70b-tp4.json) >$W/ll-room-70b.log 2>&1
  note "70b/tp4 fp8 rc=$? $(grep grids $W/ll-room-70b.log) | $(tail -1 $W/ll-room-70b.log)"
  tail -14 $W/ll-room-70b.log
fi
if [ "$PH" = Q ]; then  # v44.6 (one GPU): the layer timeline with and without /ll (lab tree .ab/ll339 = 339c9c6, timeline_blocks.py taking ATOMFLOW_FORMS)
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  for f in plain ll; do
    F="short:ws/l2=16;split:ws/l2=16"; [ $f = ll ] && F="short:ws/l2=16/ll;split:ws/l2=16"
    (cd .ab/ll339 && ATOMFLOW_FORMS="$F" PYTHONPATH=$PWD timeout 200 python3 scripts/lab/timeline_blocks.py llama-3.1-70b/tp4 fp8 150 10 --layer) >$W/tl-$f.log 2>&1
    note "timeline $f rc=$?"; tail -40 $W/tl-$f.log
  done
fi
if [ "$PH" = R ]; then  # v44.7 (one GPU): the LL polls with a 500 ns pause (lab tree .ab/ll339 + __nanosleep in stage_x_ll's sampling loop)
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  (cd .ab/ll339 && PYTHONPATH=$PWD timeout 240 python3 scripts/lab/ll_ab.py llama-3.1-70b/tp4 fp8 ws/l2=16 --rounds 2 --json $W/ll-sleep-70b-tp4.json) >$W/ll-sleep-70b.log 2>&1
  note "70b/tp4 fp8 rc=$? $(tail -1 $W/ll-sleep-70b.log)"
  (cd .ab/ll339 && ATOMFLOW_FORMS="short:ws/l2=16/ll;split:ws/l2=16" PYTHONPATH=$PWD timeout 200 python3 scripts/lab/timeline_blocks.py llama-3.1-70b/tp4 fp8 150 10 --layer) >$W/tl-ll-sleep.log 2>&1
  note "timeline ll+sleep rc=$?"; grep -A 10 "attention_decode\|launch 53" $W/tl-ll-sleep.log | head -24
fi
if [ "$PH" = S ]; then  # v44.8 (one GPU): the plain step's timeline with QKV's L2 tail 16 MB, 0 and 4 (TP4 rank step)
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  for t in 16 0 4; do
    ATOMFLOW_FORMS="short:ws/l2=$t;split:ws/l2=$t" timeout 200 python3 scripts/lab/timeline_blocks.py llama-3.1-70b/tp4 fp8 150 10 --layer >$W/tl-l2-$t.log 2>&1
    note "timeline l2=$t rc=$?"; grep -A 7 "attention_decode\|launch 53" $W/tl-l2-$t.log | grep -E "launch|wait|mark0|mark3|end" | head -10
  done
fi
if [ "$PH" = T ]; then  # v44.9 (one GPU): QKV asks all of o_proj into L2 (lab tree .ab/qo = c95f7c5 + results/v44/T/lab-v44.9-qkv-oproj.diff)
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  (cd .ab/qo && PYTHONPATH=$PWD timeout 240 python3 scripts/lab/qo_ab.py llama-3.1-70b/tp4 fp8 128) >$W/qo-ab.log 2>&1
  note "qo_ab rc=$? $(tail -1 $W/qo-ab.log)"; tail -14 $W/qo-ab.log
  (cd .ab/qo && LAB_QKV_OPROJ_ALL=1 ATOMFLOW_FORMS="short:ws/l2=0;split:ws/l2=0" PYTHONPATH=$PWD timeout 200 python3 scripts/lab/timeline_blocks.py llama-3.1-70b/tp4 fp8 150 10 --layer) >$W/tl-all.log 2>&1
  note "timeline all rc=$?"; grep -A 7 "attention_decode\|launch 53" $W/tl-all.log | grep -E "launch|wait|mark0|mark3|end" | head -10
fi
