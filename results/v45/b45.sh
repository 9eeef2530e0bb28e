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
