#!/usr/bin/env bash
# v62c (issue 48): lt.patch alone after its fix, ~200 s on one H100: lt.patch applied on main (qrope measured neutral), its GPU
# tests, validate 3B fp16, then `run` TTFT with and without it in pairs, 2048's pair first (C A C A); last, the
# 2048 chunk's profile with it (per-op TFLOPS against v59 AB2's main).
# The call: `timeout -k 5 300 bash lab/records/v61/b62c.sh; tar czf $OUT/v62c.tgz -C $OUT v62c; cat $OUT/v62c/summary.txt;
# rm -rf $OUT/v62c`
. lab/scripts/call.sh v62c
timeout 60 atomflow-bench fetch llama-3.2-3b >/dev/null 2>&1
git apply lab/records/v61/lt.patch && note "lt applied" || exit 1
timeout -k 5 60 python3 -m pytest -q -p no:cacheprovider -rf tests/test_prefill_gpu.py -k gemm >$W/C-tests.log 2>&1
note "C tests: rc=$? $(tail -1 $W/C-tests.log)"
val C-fp16 fp16
pairs lab/records/v61/lt.patch
git apply lab/records/v61/lt.patch && note "lt applied for the profile"  # the 2048 chunk's per-op rates with the tuned GEMMs (v59 AB2 has main's)
timeout -k 5 60 atomflow-bench profile llama-3.2-3b --weights fp16 --ctx 128 --prompt-tokens 2048 \
  --json $W/profile-C-2048.json >$W/profile-C-2048.md 2>$W/profile-C-2048.err
note "profile C 2048 rc=$?"; grep -A16 "prefill chunk" $W/profile-C-2048.md | tee -a $S
git apply -R lab/records/v61/lt.patch
