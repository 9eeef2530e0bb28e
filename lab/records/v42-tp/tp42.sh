#!/usr/bin/env bash
# v42 (4 GPUs): the summing GEMVs ask the next GEMV's head into L2 while they wait for the other ranks
# (HEAD_L2_SLOTS: 1 = working tree, 2 = .ab/s2, 4 = .ab/s4; 0 = .ab/3e8a271, the tree before). Kernel tests first
# (stop if they fail), then 70B W8A16 TP4 interleaved, the split-attention form, 70B W8A16 TP2 new/old.
# Part C: QKV also asks o_proj's head (QKV_HEAD_SLOTS: 1 = working tree, 0 = .ab/q0, 2 = .ab/q2), the L2 tail at 16
# and 32 MB, then the figures on the working tree (validate, 70B fp16, 8B fp16, NCCL) and TP2.
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
W=/tmp/v42; mkdir -p $W; S=$OUT/summary-v42-$1.txt
pack() { tar -czf $OUT/v42-$1.tar.gz -C /tmp v42; }
show() { python3 -c 'import json, sys
r = json.load(open(sys.argv[1])); t = r["tp"]; c = t["comm"]
print("%s TPOT %.4f ms (%.4f-%.4f) %.1f%% | %s in step %.1f us, local %.1f | %s" % (sys.argv[2], r["tpot_ms"]["median"], r["tpot_ms"]["p10"], r["tpot_ms"]["p90"], r["roofline"]["pct"], t["allreduce"], c["in_step_us"], c["step_without_exchanges_us"]["median"], " ".join("%s %.2f us/sum %.1f us/token" % (k, v["sum_us"], v["per_token_us"]) for k, v in c["paths"].items())))' "$1" "$2" 2>&1 | tail -1; }
one() {  # one TAG TREE MODEL FMT TP [extra args]
  local tag=$1 tree=$2 m=$3 w=$4 n=$5; shift 5
  if [ "$tree" = new ]; then
    timeout 150 atomflow-bench run $m --weights $w --ctx 128 --tokens 256 --repeats 5 --tp $n --allreduce peer \
      --json $W/$tag.json "$@" >$W/$tag.log 2>&1
  else
    (cd .ab/$tree && PYTHONPATH=$PWD timeout 150 python3 -c 'from atomflow_bench.cli import main; main()' run $m \
      --weights $w --ctx 128 --tokens 256 --repeats 5 --tp $n --allreduce peer --json $W/$tag.json "$@") >$W/$tag.log 2>&1
  fi
  local rc=$?; echo "$(date +%T) rc=$rc $(show $W/$tag.json $tag)" | tee -a $S; pack $PH
}
PH=$1
if [ "$1" = A ]; then
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  timeout 200 python3 -m pytest -q tests/test_kernels_gpu.py -k "resid_tp or tp_allreduce or 405b or g16" -p no:cacheprovider >$W/kernels.log 2>&1
  rc=$?; echo "$(date +%T) kernels resid_tp/tp_allreduce/g16: rc=$rc $(tail -1 $W/kernels.log)" | tee -a $S; pack $PH
  [ $rc -ne 0 ] && { grep -E "^(FAILED|ERROR)|Error|assert" $W/kernels.log | head -30; }
fi
if [ "$1" = A ] || [ "$1" = B ]; then
  one 70b-fp8-tp4-s1a new llama-3.1-70b fp8 4
  one 70b-fp8-tp4-s0a 3e8a271 llama-3.1-70b fp8 4
  one 70b-fp8-tp4-s2 s2 llama-3.1-70b fp8 4
  one 70b-fp8-tp4-s4 s4 llama-3.1-70b fp8 4
  one 70b-fp8-tp4-s1-split new llama-3.1-70b fp8 4 --forms "split:ws/l2=24"
  one 70b-fp8-tp4-s1b new llama-3.1-70b fp8 4
  one 70b-fp8-tp2-s1 new llama-3.1-70b fp8 2
  one 70b-fp8-tp2-s0 3e8a271 llama-3.1-70b fp8 2
  timeout 120 python3 -m pytest -q tests/test_tp_gpu.py -p no:cacheprovider -x >$W/tptest.log 2>&1
  rc=$?; echo "$(date +%T) tptest: rc=$rc $(tail -1 $W/tptest.log)" | tee -a $S; pack $PH
fi
if [ "$1" = C ]; then
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  timeout 200 python3 -m pytest -q tests/test_kernels_gpu.py -k "resid_tp or qkv_rope" -p no:cacheprovider >$W/kernels.log 2>&1
  rc=$?; echo "$(date +%T) kernels resid_tp/qkv_rope: rc=$rc $(tail -1 $W/kernels.log)" | tee -a $S; pack $PH
  [ $rc -ne 0 ] && { grep -E "^(FAILED|ERROR)|Error|assert" $W/kernels.log | head -30; exit 1; }
  one 70b-fp8-tp4-q1a new llama-3.1-70b fp8 4
  one 70b-fp8-tp4-q0a q0 llama-3.1-70b fp8 4
  one 70b-fp8-tp4-q2 q2 llama-3.1-70b fp8 4
  one 70b-fp8-tp4-q1-l2-16 new llama-3.1-70b fp8 4 --forms "short:ws/l2=16;split:ws/l2=16"
  one 70b-fp8-tp4-q1-l2-32 new llama-3.1-70b fp8 4 --forms "short:ws/l2=32;split:ws/l2=32"
  one 70b-fp8-tp4-q0b q0 llama-3.1-70b fp8 4
  one 70b-fp8-tp4-q1b new llama-3.1-70b fp8 4
  timeout 120 python3 -m pytest -q tests/test_tp_gpu.py -p no:cacheprovider -x >$W/tptest.log 2>&1
  rc=$?; echo "$(date +%T) tptest: rc=$rc $(tail -1 $W/tptest.log)" | tee -a $S; pack $PH
  timeout 150 atomflow-bench validate llama-3.1-8b --weights fp16 --tp 4 --steps 8 --json $W/validate-8b-fp16-tp4.json >$W/validate-8b-fp16-tp4.log 2>&1
  rc=$?; echo "$(date +%T) validate 8b fp16 tp4: rc=$rc $(grep -E 'probes PASS|greedy|KL' $W/validate-8b-fp16-tp4.log | tr -s ' ' | head -3 | tr '\n' ' ')" | tee -a $S; pack $PH
  one 70b-fp16-tp4 new llama-3.1-70b fp16 4
  one 8b-fp16-tp4 new llama-3.1-8b fp16 4
  one 70b-fp8-tp4-nccl new llama-3.1-70b fp8 4 --allreduce nccl
  one 70b-fp8-tp2-q1 new llama-3.1-70b fp8 2
  one 70b-fp8-tp2-q0 q0 llama-3.1-70b fp8 2
fi
if [ "$1" = D ]; then  # the L2 tail under TP at 16 / 24 / 8 MB, interleaved; then NCCL and TP2 at 16
  F() { echo "short:ws/l2=$1;split:ws/l2=$1"; }
  one 70b-fp8-tp4-l2-16a new llama-3.1-70b fp8 4 --forms "$(F 16)"
  one 70b-fp8-tp4-l2-24 new llama-3.1-70b fp8 4 --forms "$(F 24)"
  one 70b-fp8-tp4-l2-8 new llama-3.1-70b fp8 4 --forms "$(F 8)"
  one 70b-fp8-tp4-l2-16b new llama-3.1-70b fp8 4 --forms "$(F 16)"
  one 70b-fp8-tp4-nccl-l2-16 new llama-3.1-70b fp8 4 --forms "$(F 16)" --allreduce nccl
  one 70b-fp8-tp2-l2-16 new llama-3.1-70b fp8 2 --forms "$(F 16)"
fi
tail -40 $S
