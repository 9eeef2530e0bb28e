#!/usr/bin/env bash
# v46 (session 21): the H200 question of v45.6, asked again; the call stops at once unless every GPU is a $WANT (H200 unless set).
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1
PH=$1; W=/tmp/v46$PH; mkdir -p $W; S=$OUT/summary-v46-$PH.txt
pack() { tar -czf $OUT/v46-$PH.tar.gz -C /tmp v46$PH; }
note() { echo "$(date +%T) $*" | tee -a $S; pack; }
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv,noheader | tee -a $S
WANT=${WANT:-H200}  # the chip this call is for; any other stops it at once
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -qv "$WANT"; then note "not an $WANT: nothing run"; exit 0; fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
show() { python3 -c 'import json, sys
r = json.load(open(sys.argv[1])); t = r.get("tp"); f = (r.get("forms") or {}).get("forms")
s = "%s TPOT %.4f ms (%.4f-%.4f) %.1f%% | %s" % (sys.argv[2], r["tpot_ms"]["median"], r["tpot_ms"]["p10"], r["tpot_ms"]["p90"], r["roofline"]["pct"], f)
if t: c = t["comm"]; s += " | %s in step %.1f us, local %.1f" % (t["allreduce"], c["in_step_us"], c["step_without_exchanges_us"]["median"])
print(s)' "$1" "$2" 2>&1 | tail -1; }
runf() {  # runf TAG MODEL FMT [args]: one `run` of the product tree (ctx 128, 256 tokens, 5 repeats)
  local tag=$1 m=$2 w=$3; shift 3
  timeout 300 atomflow-bench run $m --weights $w --ctx 128 --tokens 256 --repeats 5 --json $W/$tag.json "$@" >$W/$tag.log 2>&1
  note "rc=$? $(show $W/$tag.json $tag)"
}
if [ "$PH" = A ]; then  # one H200: 8B W8A16 old tune against o_proj at 2 (interleaved twice); the TP4 rank step (lab tree .ab/pre)
  timeout 200 atomflow-bench fetch llama-3.1-8b --source synthetic >$W/fetch.log 2>&1
  for r in 1 2; do
    runf 8b-fp8-old-$r llama-3.1-8b fp8 --forms "short:ws/l2=24;split:ws/l2=24"
    runf 8b-fp8-new-$r llama-3.1-8b fp8 --forms "short:ws/l2=24/wo-pre=2;split:ws/l2=24/wo-pre=2"
  done
  (cd .ab/pre && PYTHONPATH=$PWD timeout 240 python3 scripts/lab/pre_ab.py llama-3.1-70b/tp4 fp8 128 ws/l2=16 \
     qkvhead=1 pre=wo:1+qkvhead=1 pre=wo:2+qkvhead=1 pre=wo:3+qkvhead=1 form=ws/l2=24/wo-pre=2+qkvhead=1 form=ws/l2=8/wo-pre=2+qkvhead=1) >$W/pre-ab-70b-tp4.log 2>&1
  note "70b/tp4 rank step rc=$? $(tail -1 $W/pre-ab-70b-tp4.log)"
fi
if [ "$PH" = B ]; then  # 2x H200: 70B W8A16 TP2, the old default against o_proj at 2 (interleaved twice); 8B W8A16 on one of them
  for r in 1 2; do
    runf 70b-fp8-tp2-old-$r llama-3.1-70b fp8 --tp 2 --allreduce peer --forms "short:ws/l2=16;split:ws/l2=16"
    runf 70b-fp8-tp2-new-$r llama-3.1-70b fp8 --tp 2 --allreduce peer
  done
  timeout 200 atomflow-bench fetch llama-3.1-8b --source synthetic >$W/fetch.log 2>&1
  for r in 1 2; do
    runf 8b-fp8-old-$r llama-3.1-8b fp8 --forms "short:ws/l2=24;split:ws/l2=24"
    runf 8b-fp8-new-$r llama-3.1-8b fp8 --forms "short:ws/l2=24/wo-pre=2;split:ws/l2=24/wo-pre=2"
  done
fi
if [ "$PH" = C ]; then  # 2 GPUs (WANT=H200, then WANT=H100): 70B W8A16 TP2, the TP default against its l2=8 (the rank step's -155 on the H200, -23 on the H100)
  for r in 1 2; do
    runf 70b-fp8-tp2-l2-16-$r llama-3.1-70b fp8 --tp 2 --allreduce peer
    runf 70b-fp8-tp2-l2-8-$r llama-3.1-70b fp8 --tp 2 --allreduce peer --forms "short:ws/l2=8/wo-pre=2;split:ws/l2=8/wo-pre=2"
  done
fi
if [ "$PH" = H ]; then  # issue 34 on 4 GPUs (WANT=H100): 70B W8A16 TP4, the forms before (given) against the default, then the other runs on the same machine
  V42="short:ws/l2=16;split:ws/l2=16"; V45="short:ws/l2=16/wo-pre=2;split:ws/l2=16/wo-pre=2"
  runf 70b-fp8-tp4-v42-1 llama-3.1-70b fp8 --tp 4 --allreduce peer --forms "$V42"
  runf 70b-fp8-tp4-v45-1 llama-3.1-70b fp8 --tp 4 --allreduce peer --forms "$V45"
  runf 70b-fp8-tp4-new-1 llama-3.1-70b fp8 --tp 4 --allreduce peer
  runf 70b-fp8-tp4-new-2 llama-3.1-70b fp8 --tp 4 --allreduce peer
  runf 70b-fp8-tp4-v45-2 llama-3.1-70b fp8 --tp 4 --allreduce peer --forms "$V45"
  timeout 200 atomflow-bench fetch llama-3.1-8b --source synthetic >$W/fetch.log 2>&1
  timeout 300 atomflow-bench validate llama-3.1-8b --weights fp8 --tp 4 --steps 8 --json $W/validate-8b-fp8-tp4.json >$W/validate-8b-fp8-tp4.log 2>&1
  note "validate 8b fp8 tp4: rc=$? $(grep -E 'probes PASS|greedy|KL' $W/validate-8b-fp8-tp4.log | tr -s ' ' | head -3 | tr '\n' ' ')"
  runf 70b-fp8-tp4-nccl llama-3.1-70b fp8 --tp 4 --allreduce nccl
  runf 70b-fp8-tp2 llama-3.1-70b fp8 --tp 2 --allreduce peer
fi
if [ "$PH" = H2 ]; then  # the rest of issue 34's runs (their path unchanged since v42's records), same kind
  runf 70b-fp16-tp4 llama-3.1-70b fp16 --tp 4 --allreduce peer
  runf 70b-fp16-tp4-nccl llama-3.1-70b fp16 --tp 4 --allreduce nccl
  runf 8b-fp16-tp4 llama-3.1-8b fp16 --tp 4 --allreduce peer
  runf 8b-fp16-tp2 llama-3.1-8b fp16 --tp 2 --allreduce peer
  runf 8b-fp16-tp1 llama-3.1-8b fp16
fi
if [ "$PH" = X ]; then  # issue 35 on 8 GPUs (WANT=H100): 405B W8A16 TP8 (the default and v45's l2=16: v46.4's rank step), both paths; 70B fp16 TP8 and TP4; validate 8B TP8
  runf 405b-fp8-tp8-peer llama-3.1-405b fp8 --tp 8 --allreduce peer
  runf 405b-fp8-tp8-peer-l2-16 llama-3.1-405b fp8 --tp 8 --allreduce peer --forms "short:ws/l2=16/wo-pre=2;split:ws/l2=16/wo-pre=2"  # v46.4: its rank step prefers the larger tail
  runf 405b-fp8-tp8-nccl llama-3.1-405b fp8 --tp 8 --allreduce nccl
  runf 70b-fp16-tp8 llama-3.1-70b fp16 --tp 8 --allreduce peer
  runf 70b-fp16-tp4 llama-3.1-70b fp16 --tp 4 --allreduce peer
  timeout 200 atomflow-bench fetch llama-3.1-8b --source synthetic >$W/fetch.log 2>&1
  timeout 300 atomflow-bench validate llama-3.1-8b --weights fp16 --tp 8 --steps 8 --json $W/validate-8b-fp16-tp8.json >$W/validate-8b-fp16-tp8.log 2>&1
  note "validate 8b fp16 tp8: rc=$? $(grep -E 'probes PASS|greedy|KL' $W/validate-8b-fp16-tp8.log | tr -s ' ' | head -3 | tr '\n' ' ')"
fi
if [ "$PH" = V ]; then  # 2 GPUs (WANT=H100): the TP GPU tests and validate 8B W8A16 TP2 with the new TP default
  timeout 300 python3 -m pytest -q tests/test_tp_gpu.py -p no:cacheprovider -x >$W/tptest.log 2>&1
  rc=$?; note "tptest: rc=$rc $(tail -1 $W/tptest.log)"
  [ $rc -ne 0 ] && grep -vE "^\s*$" $W/tptest.log | tail -30
  timeout 200 atomflow-bench fetch llama-3.1-8b --source synthetic >$W/fetch.log 2>&1
  timeout 300 atomflow-bench validate llama-3.1-8b --weights fp8 --tp 2 --steps 8 --json $W/validate-8b-fp8-tp2.json >$W/validate-8b-fp8-tp2.log 2>&1
  note "validate 8b fp8 tp2: rc=$? $(grep -E 'probes PASS|greedy|KL' $W/validate-8b-fp8-tp2.log | tr -s ' ' | head -3 | tr '\n' ' ')"
fi
if [ "$PH" = T ]; then  # one GPU (WANT=H100): the L2 tail around the new TP default on the rank steps (lab tree .ab/pre; QKV's head as under TP)
  for m in "llama-3.1-70b/tp4" "llama-3.1-70b/tp2" "llama-3.1-405b/tp8"; do
    (cd .ab/pre && PYTHONPATH=$PWD timeout 200 python3 scripts/lab/pre_ab.py $m fp8 128 ws/l2=8/wo-pre=2 \
       qkvhead=1 form=ws/l2=0/wo-pre=2+qkvhead=1 form=ws/l2=4/wo-pre=2+qkvhead=1 form=ws/l2=6/wo-pre=2+qkvhead=1 \
       form=ws/l2=12/wo-pre=2+qkvhead=1) >$W/tail-${m/\//-}.log 2>&1
    note "$m rc=$? $(tail -1 $W/tail-${m/\//-}.log)"
  done
fi
if [ "$PH" = H3 ]; then  # what H2 runs that the budget allowed after H, same warm machine
  runf 70b-fp16-tp4 llama-3.1-70b fp16 --tp 4 --allreduce peer
  runf 8b-fp16-tp4 llama-3.1-8b fp16 --tp 4 --allreduce peer
  runf 8b-fp16-tp2 llama-3.1-8b fp16 --tp 2 --allreduce peer
  runf 8b-fp16-tp1 llama-3.1-8b fp16
fi
