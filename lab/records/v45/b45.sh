#!/usr/bin/env bash
# v45: o_proj's pre-wait ring fill paced (lab tree .ab/pace = HEAD + results/v45/A/lab-v45-pace.diff), TP4 rank step on one GPU.
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
PH=$1; W=/tmp/v45$PH; mkdir -p $W; S=$OUT/summary-v45-$PH.txt
pack() { tar -czf $OUT/v45-$PH.tar.gz -C /tmp v45$PH; }
note() { echo "$(date +%T) $*" | tee -a $S; pack; }
if [ "$PH" = A ]; then
  nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv,noheader | tee -a $S
  (cd .ab/pace && PYTHONPATH=$PWD timeout 300 python3 scripts/lab/pace_ab.py llama-3.1-70b/tp4 fp8 128 ws/l2=16 \
     wo:66 wo:131 wo:262 wgu:131 wo:131,wgu:131 wqkv:131,wo:131,wgu:131,wd:131) >$W/pace-ab.log 2>&1
  note "pace_ab rc=$? $(tail -1 $W/pace-ab.log)"; tail -24 $W/pace-ab.log
  for v in "" wo:131; do
    (cd .ab/pace && LAB_PACE="$v" ATOMFLOW_FORMS="short:ws/l2=16;split:ws/l2=16" PYTHONPATH=$PWD timeout 150 python3 scripts/lab/timeline_blocks.py llama-3.1-70b/tp4 fp8 150 10 --layer) >$W/tl-pace${v/:/}.log 2>&1
    note "timeline pace='$v' rc=$?"; grep -A 7 "attention_decode\|launch 53" $W/tl-pace${v/:/}.log | grep -E "launch|wait|mark0|mark3|end" | head -10
  done
fi
if [ "$PH" = B ]; then  # (run inline in the call, recorded here) longer paces and combinations, TP4 rank step
  (cd .ab/pace && PYTHONPATH=$PWD timeout 300 python3 scripts/lab/pace_ab.py llama-3.1-70b/tp4 fp8 128 ws/l2=16 wo:262 wo:393 wo:524 wo:786 wo:1048 wo:262,wgu:262 wqkv:262,wo:262,wgu:262,wd:262 wo:524,wgu:131 2>&1 | tail -3 | tee $OUT/pace-ab-B.log)
fi
if [ "$PH" = C ]; then  # o_proj's slots before the wait (LAB_PRE) against its pace, the TP4 / TP2 rank steps and one-GPU shapes
  nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv,noheader | tee -a $S
  ab() { local tag=$1; shift; (cd .ab/pace && PYTHONPATH=$PWD timeout 200 python3 scripts/lab/pace_ab.py "$@") >$W/ab-$tag.log 2>&1
         note "$tag rc=$? $(tail -1 $W/ab-$tag.log)"; }
  ab 70b-tp4 llama-3.1-70b/tp4 fp8 128 ws/l2=16 pace=wo:262 pre=wo:1 pre=wo:2 pre=wo:3 pre=wo:1+pace=wgu:131
  ab 3b-fp8 llama-3.2-3b/tp1 fp8 128 ws/l2=8 form=ring/l2=8 pre=wo:1 pre=wo:2 pace=wo:262
  ab 8b-fp8 llama-3.1-8b/tp1 fp8 128 ws/l2=8 form=ring/l2=8 pre=wo:1 pace=wo:262
  ab 8b-fp16 llama-3.1-8b/tp1 fp16 128 ws/l2=8 pre=wo:1 pre=wo:2 pace=wo:262
  ab 1b-fp16 llama-3.2-1b/tp1 fp16 128 ws/l2=8 pre=wo:1 pre=wo:2 pace=wo:262
  ab 70b-tp2 llama-3.1-70b/tp2 fp8 128 ws/l2=16 pace=wo:262 pre=wo:1 pre=wo:2
fi
if [ "$PH" = D ]; then  # (run inline in the call, recorded here) 8B fp8, 3B fp8 against the ring, 70B TP4 with other L2 tails, 405B TP8 rank step
  cd .ab/pace && for m in "llama-3.1-8b/tp1 fp8 128 ws/l2=8 pace=wo:262 pre=wo:2 pre=wo:3 pre=wo:2+pace=wo:262" "llama-3.2-3b/tp1 fp8 128 ring/l2=8 form=ws/l2=8+pre=wo:2 form=ws/l2=4+pre=wo:2 form=ws/l2=16+pre=wo:2" "llama-3.1-70b/tp4 fp8 128 ws/l2=16 pre=wo:2 form=ws/l2=8+pre=wo:2 form=ws/l2=24+pre=wo:2" "llama-3.1-405b/tp8 fp8 128 ws/l2=16 pre=wo:1 pre=wo:2 pre=wo:3"; do PYTHONPATH=$PWD timeout 250 python3 scripts/lab/pace_ab.py $m 2>&1 | tail -1; done | tee $OUT/ab-D.log
fi
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
if [ "$PH" = E ]; then  # one GPU: the engine tests of every form (o_proj's count included), 8B W8A16 tuned anew, A/B against the old tune
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  timeout 300 python3 -m pytest -q tests/test_engine_gpu.py -k "every_gemv_form" -p no:cacheprovider >$W/engine-forms.log 2>&1
  rc=$?; note "engine every_gemv_form: rc=$rc $(tail -1 $W/engine-forms.log)"
  [ $rc -ne 0 ] && grep -E "^(FAILED|ERROR)|Error|assert" $W/engine-forms.log | head -30
  timeout 200 atomflow-bench fetch llama-3.1-8b --source synthetic >$W/fetch.log 2>&1
  runf 8b-fp8-tuned llama-3.1-8b fp8
  OLD="short:ws/l2=24;split:ws/l2=24"
  NEW=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["forms"]["forms"])' $W/8b-fp8-tuned.json)
  for r in 1 2; do
    runf 8b-fp8-old-$r llama-3.1-8b fp8 --forms "$OLD"
    runf 8b-fp8-new-$r llama-3.1-8b fp8 --forms "$NEW"
  done
  timeout 300 atomflow-bench validate llama-3.2-1b --weights fp8 --steps 16 --forms "short:ws/l2=8/wo-pre=2;split:ws/l2=8/wo-pre=2" --json $W/validate-1b-fp8-wo2.json >$W/validate-1b-fp8-wo2.log 2>&1
  note "validate 1b fp8 ws/l2=8/wo-pre=2: rc=$? $(grep -E 'probes PASS|greedy|KL' $W/validate-1b-fp8-wo2.log | tr -s ' ' | head -3 | tr '\n' ' ')"
fi
if [ "$PH" = F ]; then  # two GPUs: the TP GPU tests, 70B W8A16 TP2 old default vs new (o_proj 2 slots before its wait), validate 8B W8A16 TP2
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  timeout 300 python3 -m pytest -q tests/test_tp_gpu.py -p no:cacheprovider -x >$W/tptest.log 2>&1
  rc=$?; note "tptest: rc=$rc $(tail -1 $W/tptest.log)"
  [ $rc -ne 0 ] && grep -vE "^\s*$" $W/tptest.log | tail -30
  OLD="short:ws/l2=16;split:ws/l2=16"
  for r in 1 2; do
    runf 70b-fp8-tp2-old-$r llama-3.1-70b fp8 --tp 2 --allreduce peer --forms "$OLD"
    runf 70b-fp8-tp2-new-$r llama-3.1-70b fp8 --tp 2 --allreduce peer
  done
  timeout 200 atomflow-bench fetch llama-3.1-8b --source synthetic >$W/fetch.log 2>&1
  timeout 400 atomflow-bench validate llama-3.1-8b --weights fp8 --tp 2 --steps 8 --json $W/validate-8b-fp8-tp2.json >$W/validate-8b-fp8-tp2.log 2>&1
  note "validate 8b fp8 tp2: rc=$? $(grep -E 'probes PASS|greedy|KL' $W/validate-8b-fp8-tp2.log | tr -s ' ' | head -3 | tr '\n' ' ') $(tail -1 $W/validate-8b-fp8-tp2.log)"
fi
if [ "$PH" = G ]; then  # v45.2 (one GPU): the other roles' slots before the wait with o_proj at 2 (lab tree .ab/pre = 092b29f + results/v45/G/lab-v45.2-pre.diff)
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  (cd .ab/pre && PYTHONPATH=$PWD timeout 300 python3 scripts/lab/pre_ab.py llama-3.1-70b/tp4 fp8 128 ws/l2=16/wo-pre=2 \
     pre=wd:1 pre=wd:2 pre=wd:3 pre=wqkv:1 pre=wqkv:2 pre=wgu:3 pre=wo:1 form=ws/l2=8/wo-pre=2) >$W/pre-ab-70b-tp4.log 2>&1
  note "70b/tp4 rc=$? $(tail -1 $W/pre-ab-70b-tp4.log)"
  (cd .ab/pre && PYTHONPATH=$PWD timeout 200 python3 scripts/lab/pre_ab.py llama-3.1-8b/tp1 fp8 128 ws/l2=24/wo-pre=2 \
     pre=wd:1 pre=wd:2 pre=wqkv:1 pre=wqkv:2 pre=wo:1) >$W/pre-ab-8b.log 2>&1
  note "8b fp8 rc=$? $(tail -1 $W/pre-ab-8b.log)"
fi
if [ "$PH" = H ]; then  # issue 34 on 4 GPUs: 70B W8A16 TP4, the tree before (forms given) against the new default, then the other runs on the same machine
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  OLD="short:ws/l2=16;split:ws/l2=16"
  for r in 1 2; do
    runf 70b-fp8-tp4-old-$r llama-3.1-70b fp8 --tp 4 --allreduce peer --forms "$OLD"
    runf 70b-fp8-tp4-new-$r llama-3.1-70b fp8 --tp 4 --allreduce peer
  done
  timeout 200 atomflow-bench fetch llama-3.1-8b --source synthetic >$W/fetch.log 2>&1
  timeout 300 atomflow-bench validate llama-3.1-8b --weights fp8 --tp 4 --steps 8 --json $W/validate-8b-fp8-tp4.json >$W/validate-8b-fp8-tp4.log 2>&1
  note "validate 8b fp8 tp4: rc=$? $(grep -E 'probes PASS|greedy|KL' $W/validate-8b-fp8-tp4.log | tr -s ' ' | head -3 | tr '\n' ' ')"
  runf 70b-fp8-tp4-nccl llama-3.1-70b fp8 --tp 4 --allreduce nccl
  runf 70b-fp8-tp2 llama-3.1-70b fp8 --tp 2 --allreduce peer
  runf 70b-fp8-tp4-l2-8 llama-3.1-70b fp8 --tp 4 --allreduce peer --forms "short:ws/l2=8/wo-pre=2;split:ws/l2=8/wo-pre=2"  # v45.2: -23 us on the rank step
  if [ -n "${FP16:-}" ]; then  # the fp16 runs (their path unchanged since v42's records): only with device time to spare
    runf 70b-fp16-tp4 llama-3.1-70b fp16 --tp 4 --allreduce peer
    runf 8b-fp16-tp4 llama-3.1-8b fp16 --tp 4 --allreduce peer
  fi
fi
if [ "$PH" = X ]; then  # issue 35 on 8 GPUs: 405B W8A16 TP8 (o_proj at 2, the default, and at 1: v45's rank step), both paths; 70B fp16 TP8 and TP4; validate 8B TP8
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  runf 405b-fp8-tp8-peer llama-3.1-405b fp8 --tp 8 --allreduce peer
  runf 405b-fp8-tp8-peer-wo1 llama-3.1-405b fp8 --tp 8 --allreduce peer --forms "short:ws/l2=16/wo-pre=1;split:ws/l2=16/wo-pre=1"
  runf 405b-fp8-tp8-nccl llama-3.1-405b fp8 --tp 8 --allreduce nccl
  runf 70b-fp16-tp8 llama-3.1-70b fp16 --tp 8 --allreduce peer
  runf 70b-fp16-tp4 llama-3.1-70b fp16 --tp 4 --allreduce peer
  timeout 200 atomflow-bench fetch llama-3.1-8b --source synthetic >$W/fetch.log 2>&1
  timeout 300 atomflow-bench validate llama-3.1-8b --weights fp16 --tp 8 --steps 8 --json $W/validate-8b-fp16-tp8.json >$W/validate-8b-fp16-tp8.log 2>&1
  note "validate 8b fp16 tp8: rc=$? $(grep -E 'probes PASS|greedy|KL' $W/validate-8b-fp16-tp8.log | tr -s ' ' | head -3 | tr '\n' ' ')"
fi
if [ "$PH" = I ]; then  # v45.3 (one GPU): o_proj warp-specialised inside a ring step (lab tree .ab/pre = 092b29f + results/v45/I/lab-v45.3-ws-role.diff)
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  (cd .ab/pre && PYTHONPATH=$PWD timeout 200 python3 scripts/lab/pre_ab.py llama-3.2-3b/tp1 fp8 128 ring/l2=8 \
     ws=wo:0 ws=wo:1 ws=wo:2 ws=wo:3) >$W/ws-role-3b.log 2>&1
  note "3b fp8 rc=$? $(tail -1 $W/ws-role-3b.log)"
  (cd .ab/pre && PYTHONPATH=$PWD timeout 200 python3 scripts/lab/pre_ab.py llama-3.1-8b/tp1 fp8 128 ws/l2=24/wo-pre=2 \
     form=ring/l2=24 form=ring/l2=24+ws=wo:2) >$W/ws-role-8b.log 2>&1
  note "8b fp8 rc=$? $(tail -1 $W/ws-role-8b.log)"
fi
if [ "$PH" = J ]; then  # v45.4 (2 GPUs): gate/up's and QKV's early fills in front of the exchanges, 70B W8A16 TP2 (lab tree .ab/pre)
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  labrun() {  # labrun TAG LAB_PRE
    (cd .ab/pre && LAB_PRE="$2" PYTHONPATH=$PWD timeout 300 python3 -c 'from atomflow_bench.cli import main; main()' run llama-3.1-70b \
      --weights fp8 --ctx 128 --tokens 256 --repeats 5 --tp 2 --allreduce peer --json $W/$1.json) >$W/$1.log 2>&1
    note "rc=$? LAB_PRE='$2' $(show $W/$1.json $1)"
  }
  labrun 70b-fp8-tp2-base1 ""
  labrun 70b-fp8-tp2-wgu3 "wgu:3"
  labrun 70b-fp8-tp2-wqkv2 "wqkv:2"
  labrun 70b-fp8-tp2-both "wgu:3,wqkv:2"
  labrun 70b-fp8-tp2-base2 ""
fi
if [ "$PH" = K ]; then  # v45.5 (one GPU): QKV's head of o_proj with o_proj at 2 (lab tree .ab/pre = 092b29f + results/v45/K/lab-v45.5-qkv-head.diff)
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  (cd .ab/pre && PYTHONPATH=$PWD timeout 200 python3 scripts/lab/pre_ab.py llama-3.1-70b/tp4 fp8 128 ws/l2=16/wo-pre=2 \
     qkvhead=1 qkvhead=2) >$W/qkv-head-70b-tp4.log 2>&1
  note "70b/tp4 rc=$? $(tail -1 $W/qkv-head-70b-tp4.log)"
  (cd .ab/pre && PYTHONPATH=$PWD timeout 250 python3 scripts/lab/pre_ab.py llama-3.1-405b/tp8 fp8 128 ws/l2=16/wo-pre=2 \
     qkvhead=1 qkvhead=2 pre=wo:1+qkvhead=1) >$W/qkv-head-405b-tp8.log 2>&1
  note "405b/tp8 rc=$? $(tail -1 $W/qkv-head-405b-tp8.log)"
fi
if [ "$PH" = L ]; then  # v45.6 (one H200): 8B W8A16 old tune against o_proj at 2, the TP4 rank step
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  timeout 200 atomflow-bench fetch llama-3.1-8b --source synthetic >$W/fetch.log 2>&1
  for r in 1 2; do
    runf 8b-fp8-h200-old-$r llama-3.1-8b fp8 --forms "short:ws/l2=24;split:ws/l2=24"
    runf 8b-fp8-h200-new-$r llama-3.1-8b fp8 --forms "short:ws/l2=24/wo-pre=2;split:ws/l2=24/wo-pre=2"
  done
  (cd .ab/pre && PYTHONPATH=$PWD timeout 200 python3 scripts/lab/pre_ab.py llama-3.1-70b/tp4 fp8 128 ws/l2=16 \
     pre=wo:1 pre=wo:2) >$W/pre-ab-70b-tp4-h200.log 2>&1
  note "70b/tp4 h200 rc=$? $(tail -1 $W/pre-ab-70b-tp4-h200.log)"
fi
