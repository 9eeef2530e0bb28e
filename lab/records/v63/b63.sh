#!/usr/bin/env bash
# v63 (issue 48): lab v12 (q in registers for the scores) on one H100, ~100 s, best on the machine b62.sh left warm:
# v12's lab GPU tests (every shape against NumPy), then the A/B of v9-lpt (the product's sm_90a kernel), v12 and
# v12-smem (v12's source with q from shared memory: the control), 3 interleaved rounds.
# The call: `timeout -k 5 280 bash lab/records/v63/b63.sh; tar czf $OUT/v63.tgz -C $OUT v63; cat $OUT/v63/summary.txt;
# rm -rf $OUT/v63`
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
W=$OUT/v63; mkdir -p $W; S=$W/summary.txt
note() { echo "$(date +%T) $*" | tee -a $S; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee -a $S
python3 -m pip install -q --no-deps --no-build-isolation -e . >$W/install.log 2>&1 || { note "install failed"; exit 1; }
timeout -k 10 150 python3 -m pytest -q -p no:cacheprovider -rf tests/test_lab_prefill_att_gpu.py -k "v12" -x \
  >$W/lab-att-v12.log 2>&1; note "lab-att-v12: rc=$? $(tail -1 $W/lab-att-v12.log)"
grep -E "FAILED|Error|assert" $W/lab-att-v12.log | head -8 | tee -a $S
timeout -k 10 100 python3 lab/scripts/prefill_att_ab.py --rounds 3 --variants v9-lpt,v12,v12-smem \
  --json $W/att-ab.json >$W/att-ab.log 2>&1; note "attention A/B rc=$?"; grep -vE "^\s*$" $W/att-ab.log | tail -12 | tee -a $S
