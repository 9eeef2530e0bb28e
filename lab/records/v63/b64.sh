#!/usr/bin/env bash
# v64 (issue 48): lab v13 (one K and one V buffer, three blocks an SM) on one H100, ~80 s: its lab GPU tests (every
# shape against NumPy; v13-b4 too), then the A/B of v9-lpt (the product's sm_90a kernel), v13 and v13-b4, 3
# interleaved rounds. Run it in one call with lt.patch's (`b62c.sh`):
# `timeout -k 5 110 bash lab/records/v63/b64.sh; timeout -k 5 300 bash lab/records/v61/b62c.sh;
#  tar czf $OUT/v64.tgz -C $OUT v64 v62c; cat $OUT/v64/summary.txt $OUT/v62c/summary.txt; rm -rf $OUT/v64 $OUT/v62c`
. lab/scripts/call.sh v64
timeout -k 10 60 python3 -m pytest -q -p no:cacheprovider -rf tests/test_lab_prefill_att_gpu.py -k "v13" -x \
  >$W/lab-att-v13.log 2>&1; note "lab-att-v13: rc=$? $(tail -1 $W/lab-att-v13.log)"
grep -E "FAILED|Error|assert" $W/lab-att-v13.log | head -8 | tee -a $S
timeout -k 10 60 python3 lab/scripts/prefill_att_ab.py --rounds 3 --variants v9-lpt,v13,v13-b4 \
  --json $W/att-ab.json >$W/att-ab.log 2>&1; note "attention A/B rc=$?"; grep -vE "^\s*$" $W/att-ab.log | tail -12 | tee -a $S
