#!/usr/bin/env bash
# v41, call C (2 GPUs): the profile --tp GPU test, `profile --tp 2` on the 8B shape, a sweep over --tp 1,2.
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
W=/tmp/v41c; mkdir -p $W; S=$OUT/summary-C.txt
pack() { tar -czf $OUT/v41-C.tar.gz -C /tmp v41c; }
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
timeout 200 python3 -m pytest -q tests/test_tp_gpu.py -k profile -p no:cacheprovider >$W/tptest-profile.log 2>&1
rc=$?; echo "tptest -k profile: rc=$rc $(tail -1 $W/tptest-profile.log)" | tee -a $S
[ $rc -ne 0 ] && grep -E "^(FAILED|ERROR)|Error|assert" $W/tptest-profile.log | head -30
pack
timeout 150 atomflow-bench profile llama-3.1-8b --weights fp16 --tp 2 --json $W/profile-8b-fp16-tp2.json >$W/profile-8b-fp16-tp2.log 2>&1
echo "profile 8b fp16 tp2: rc=$?" | tee -a $S; grep -E "^\|" $W/profile-8b-fp16-tp2.log | head -12 | tee -a $S
pack
timeout 240 atomflow-bench sweep --models llama-3.2-1b --weights fp16 --ctx 128 --tp 1,2 --tokens 128 --repeats 3 \
  --out $W/sweep-1b-tp >$W/sweep.log 2>&1
echo "sweep 1b fp16 tp 1,2: rc=$?" | tee -a $S; tail -12 $W/sweep.log | tee -a $S
pack
