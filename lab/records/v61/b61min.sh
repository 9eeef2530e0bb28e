#!/usr/bin/env bash
# v61's smallest call (under 200 s of device time): main's 3B fp16 2048 TTFT (A), qrope.patch applied with its kernel
# test, `run` (B) and validate fp16, reverted, main again (A'), then gemm_lt_probe.py on 3B at M 2048 only.
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1
W=$OUT/v61; mkdir -p $W; S=$W/summary.txt
note() { echo "$(date +%T) $*" | tee -a $S; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee -a $S
python3 -m pip install -q --no-deps --no-build-isolation -e . >$W/install.log 2>&1 || { note "install failed"; exit 1; }
runr() { timeout -k 5 60 atomflow-bench run llama-3.2-3b --weights fp16 --ctx 2048 --tokens 64 --repeats 5 --json $W/$1.json \
  >$W/$1.log 2>&1; note "run $1: rc=$? $(grep -E 'TTFT' $W/$1.log | tr -s ' ')"; }
timeout 60 atomflow-bench fetch llama-3.2-3b >/dev/null 2>&1
runr A-3b-fp16-ctx2048
{ git apply lab/records/v61/qrope.patch 2>/dev/null || patch -p1 -s <lab/records/v61/qrope.patch; } || { note "no patch"; exit 1; }
timeout -k 5 60 python3 -m pytest -q -p no:cacheprovider tests/test_prefill_attention.py >$W/kernel-test.log 2>&1
note "qrope kernel test: rc=$? $(tail -1 $W/kernel-test.log)"
runr B-3b-fp16-ctx2048
timeout -k 5 70 atomflow-bench validate llama-3.2-3b --weights fp16 --steps 16 --prefill-chunk 3 --truth /tmp/truth-3b \
  --json $W/validate-3b-fp16.json >$W/validate-3b-fp16.log 2>&1
note "validate 3b fp16: rc=$? $(grep -iE 'prefill path|PASS —|FAIL —' $W/validate-3b-fp16.log | tr -s ' ' | head -3 | tr '\n' ' ')"
{ git apply -R lab/records/v61/qrope.patch 2>/dev/null || patch -p1 -R -s <lab/records/v61/qrope.patch; }
runr A2-3b-fp16-ctx2048
timeout 30 python3 lab/scripts/gemm_lt_probe.py --models llama-3.2-3b --rows 2048 --algos 8 --json $W/gemm-lt.json >$W/gemm-lt.log 2>&1
note "gemm_lt_probe rc=$?"; grep -E "m [0-9]+:|default" $W/gemm-lt.log | tee -a $S
