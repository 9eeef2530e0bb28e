#!/usr/bin/env bash
# v64 (issue 48), the product side of v13, ~250 s on one H100 (the follow-up call on b64's warm machine, run when
# v13 won its A/B): v13.patch (branch prefill-v13: the product's sm_90a kernel as lab v13, three blocks an SM)
# applied, the prefill GPU tests, validate 3B fp16 and fp8 on the prefill path, then `run` 3B fp16 TTFT with and
# without it in pairs (2048's first).
# The call: `timeout -k 5 290 bash lab/records/v63/b64p.sh; tar czf $OUT/v64p.tgz -C $OUT v64p;
# cat $OUT/v64p/summary.txt; rm -rf $OUT/v64p`
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
W=$OUT/v64p; mkdir -p $W; S=$W/summary.txt
note() { echo "$(date +%T) $*" | tee -a $S; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee -a $S
python3 -m pip install -q --no-deps --no-build-isolation -e . >$W/install.log 2>&1 || { note "install failed"; exit 1; }
runr() {  # runr TAG CTX: 3B fp16, one `run`, its TTFT line
  local n=$([ $2 = 8192 ] && echo 3 || echo 5)
  timeout -k 5 100 atomflow-bench run llama-3.2-3b --weights fp16 --ctx $2 --tokens 64 --repeats $n --json $W/$1.json \
    >$W/$1.log 2>&1; note "run $1: rc=$? $(grep -E 'TTFT' $W/$1.log | tr -s ' ')"; }
val() {  # val TAG FMT
  timeout -k 5 120 atomflow-bench validate llama-3.2-3b --weights $2 --steps 16 --prefill-chunk 3 --truth /tmp/truth-3b \
    --json $W/validate-$1.json >$W/validate-$1.log 2>&1
  note "validate $1: rc=$? $(grep -iE 'prefill path|PASS —|FAIL —' $W/validate-$1.log | tr -s ' ' | head -3 | tr '\n' ' ')"; }
timeout 60 atomflow-bench fetch llama-3.2-3b >/dev/null 2>&1
git apply lab/records/v63/v13.patch && note "v13.patch applied" || exit 1
timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider -rf tests/test_prefill_attention.py tests/test_prefill_gpu.py \
  tests/test_validate_prefill_gpu.py >$W/tests.log 2>&1; note "tests: rc=$? $(tail -1 $W/tests.log)"
grep -qE "^[0-9]+ passed" <(tail -1 $W/tests.log) || { grep -E "FAILED|Error" $W/tests.log | head -8 | tee -a $S; git apply -R lab/records/v63/v13.patch; exit 1; }
val fp16 fp16; val fp8 fp8
off() { git apply -R lab/records/v63/v13.patch; }
on() { git apply lab/records/v63/v13.patch; }
runr C-2048 2048; off; runr A-2048 2048; on; runr C-8192 8192; off; runr A-8192 8192
