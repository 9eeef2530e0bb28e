#!/usr/bin/env bash
# v62.1 (issue 48): why v11's turns lose (v59); issue 47's flaky lab test. One device call on one H100 (~150 s),
# after b62.sh on the warm machine:
# ncu's stall reasons, issue and occupancy for the product's attention (v9-lpt), v11 and v11-free on 3B's 4096-row
# chunk after 4096 (the 8192 prompt's last chunk). The call: `timeout -k 5 300 bash lab/records/v61/b62ncu.sh; tar czf
# $OUT/v62ncu.tgz -C $OUT v62ncu; cat $OUT/v62ncu/summary.txt; rm -rf $OUT/v62ncu`.
export PYTHONUNBUFFERED=1
W=$OUT/v62ncu; mkdir -p $W; S=$W/summary.txt
note() { echo "$(date +%T) $*" | tee -a $S; }
python3 -m pip install -q --no-deps --no-build-isolation -e . >$W/install.log 2>&1 || { note "install failed"; exit 1; }
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
timeout -k 5 240 "$NCU" -k regex:attention_prefill -c 6 --section SpeedOfLight --section WarpStateStats \
  --section SchedulerStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
  --section InstructionStats -o $W/att python3 lab/scripts/prefill_att_ab.py --variants v9-lpt,v11,v11-free \
  --once 3b,4096,4096 >$W/ncu.log 2>&1
note "ncu rc=$? $(grep -cE '==PROF== Profiling' $W/ncu.log) kernels profiled"
"$NCU" -i $W/att.ncu-rep --page details >$W/att-details.txt 2>>$W/ncu.log
grep -E "attention_prefill|Duration|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|Achieved Occupancy|Registers Per|Stall" \
  $W/att-details.txt | head -80 | tee -a $S
# issue 47's lab test that failed once in session 30 (v59 status): five runs, whole logs kept
for i in 1 2 3 4 5; do
  timeout -k 5 60 python3 -m pytest -q -p no:cacheprovider -rA tests/test_lab_persist_gpu.py -k beyond_the_attention_capacity \
    >$W/persist-beyond-$i.log 2>&1; note "persist beyond capacity run $i: rc=$? $(tail -1 $W/persist-beyond-$i.log)"
done
