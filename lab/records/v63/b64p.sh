#!/usr/bin/env bash
# v64 (issue 48), the product side of v13, ~250 s on one H100 (the follow-up call on b64's warm machine, run when
# v13 won its A/B): v13.patch (branch prefill-v13: the product's sm_90a kernel as lab v13, three blocks an SM)
# applied, the prefill GPU tests, validate 3B fp16 and fp8 on the prefill path, then `run` 3B fp16 TTFT with and
# without it in pairs (2048's first).
# The call: `timeout -k 5 290 bash lab/records/v63/b64p.sh; tar czf $OUT/v64p.tgz -C $OUT v64p;
# cat $OUT/v64p/summary.txt; rm -rf $OUT/v64p`
. lab/scripts/call.sh v64p
timeout 60 atomflow-bench fetch llama-3.2-3b >/dev/null 2>&1
git apply lab/records/v63/v13.patch && note "v13.patch applied" || exit 1
timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider -rf tests/test_prefill_attention.py tests/test_prefill_gpu.py \
  tests/test_validate_prefill_gpu.py >$W/tests.log 2>&1; note "tests: rc=$? $(tail -1 $W/tests.log)"
grep -qE "^[0-9]+ passed" <(tail -1 $W/tests.log) || { grep -E "FAILED|Error" $W/tests.log | head -8 | tee -a $S; git apply -R lab/records/v63/v13.patch; exit 1; }
val fp16 fp16; val fp8 fp8
pairs lab/records/v63/v13.patch
