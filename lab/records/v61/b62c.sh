#!/usr/bin/env bash
# v62c (issue 48): lt.patch alone after its fix, ~200 s on one H100: lt.patch applied on main (qrope measured neutral), its GPU
# tests, validate 3B fp16, then `run` TTFT with and without it in pairs, 2048's pair first (C A C A); last, the
# 2048 chunk's profile with it (per-op TFLOPS against v59 AB2's main).
# The call: `timeout -k 5 300 bash lab/records/v61/b62c.sh; tar czf $OUT/v62c.tgz -C $OUT v62c; cat $OUT/v62c/summary.txt;
# rm -rf $OUT/v62c`
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
W=$OUT/v62c; mkdir -p $W; S=$W/summary.txt
note() { echo "$(date +%T) $*" | tee -a $S; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee -a $S
python3 -m pip install -q --no-deps --no-build-isolation -e . >$W/install.log 2>&1 || { note "install failed"; exit 1; }
runr() {  # runr TAG CTX: 3B fp16, one `run`, its TTFT line
  local n=$([ $2 = 8192 ] && echo 3 || echo 5)
  timeout -k 5 100 atomflow-bench run llama-3.2-3b --weights fp16 --ctx $2 --tokens 64 --repeats $n --json $W/$1.json \
    >$W/$1.log 2>&1; note "run $1: rc=$? $(grep -E 'TTFT' $W/$1.log | tr -s ' ')"; }
timeout 60 atomflow-bench fetch llama-3.2-3b >/dev/null 2>&1
git apply lab/records/v61/lt.patch && note "lt applied" || exit 1
timeout -k 5 60 python3 -m pytest -q -p no:cacheprovider -rf tests/test_prefill_gpu.py -k gemm >$W/C-tests.log 2>&1
note "C tests: rc=$? $(tail -1 $W/C-tests.log)"
timeout -k 5 120 atomflow-bench validate llama-3.2-3b --weights fp16 --steps 16 --prefill-chunk 3 --truth /tmp/truth-3b \
  --json $W/validate-C-fp16.json >$W/validate-C-fp16.log 2>&1
note "validate C-fp16: rc=$? $(grep -iE 'prefill path|PASS —|FAIL —' $W/validate-C-fp16.log | tr -s ' ' | head -3 | tr '\n' ' ')"
off() { git apply -R lab/records/v61/lt.patch; }
on() { git apply lab/records/v61/lt.patch; }
runr C-2048 2048; off; runr A-2048 2048; on; runr C-8192 8192; off; runr A-8192 8192  # the 2048 pair first
on && note "lt applied for the profile"  # the 2048 chunk's per-op rates with the tuned GEMMs (v59 AB2 has main's)
timeout -k 5 60 atomflow-bench profile llama-3.2-3b --weights fp16 --ctx 128 --prompt-tokens 2048 \
  --json $W/profile-C-2048.json >$W/profile-C-2048.md 2>$W/profile-C-2048.err
note "profile C 2048 rc=$?"; grep -A16 "prefill chunk" $W/profile-C-2048.md | tee -a $S
off
