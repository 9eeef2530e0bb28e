#!/usr/bin/env bash
# v61/v62 (issue 48), the next session's first call: `bash lab/records/v61/b62.sh` on one H100 (~450 s); logs under
# $OUT/v62 as written, A B C A' on one machine:
#   probe  gemm_lt_probe.py: cuBLASLt's offers against gemmEx's default on 3B's and 8B's layer GEMMs
#   A      main: `run` 3B fp16 TTFT 2048 and 8192
#   B      qrope.patch (q rotated in the attention's staging): the prefill GPU tests, validate 3B fp16 and fp8, runs
#   C      lt.patch on top (each GEMM shape's algorithm timed once, cuBLASLt or gemmEx): its GPU tests, validate fp16,
#          runs (the TTFT line says how many shapes took an Lt algorithm)
#   A'     both reverted: main's 2048 run again
# The call: `timeout -k 5 560 bash lab/records/v61/b62.sh; tar czf $OUT/v62.tgz -C $OUT v62; cat $OUT/v62/summary.txt;
# rm -rf $OUT/v62` (one archive comes back; the folder holds more files than a call returns). NOPROBE=1 skips the
# probe; TAG names the folder (v62b: the rerun after qrope.patch's profile bytes were fixed).
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
W=$OUT/${TAG:-v62}; mkdir -p $W; S=$W/summary.txt
note() { echo "$(date +%T) $*" | tee -a $S; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee -a $S
python3 -m pip install -q --no-deps --no-build-isolation -e . >$W/install.log 2>&1 || { note "install failed"; exit 1; }
runr() {  # runr TAG CTX: 3B fp16, one `run`, its TTFT line
  local n=$([ $2 = 8192 ] && echo 3 || echo 5)
  timeout -k 5 100 atomflow-bench run llama-3.2-3b --weights fp16 --ctx $2 --tokens 64 --repeats $n --json $W/$1.json \
    >$W/$1.log 2>&1; note "run $1: rc=$? $(grep -E 'TTFT' $W/$1.log | tr -s ' ')"; }
ap() { git apply $2 lab/records/v61/$1 2>/dev/null || patch -p1 -s $2 <lab/records/v61/$1; }
val() {  # val TAG FMT
  timeout -k 5 120 atomflow-bench validate llama-3.2-3b --weights $2 --steps 16 --prefill-chunk 3 --truth /tmp/truth-3b \
    --json $W/validate-$1.json >$W/validate-$1.log 2>&1
  note "validate $1: rc=$? $(grep -iE 'prefill path|PASS —|FAIL —' $W/validate-$1.log | tr -s ' ' | head -3 | tr '\n' ' ')"; }
if [ -z "$NOPROBE" ]; then
  timeout -k 5 100 python3 lab/scripts/gemm_lt_probe.py --json $W/gemm-lt.json >$W/gemm-lt.log 2>&1
  note "gemm_lt_probe rc=$?"; grep -E "m [0-9]+:|default" $W/gemm-lt.log | tee -a $S
fi
timeout 60 atomflow-bench fetch llama-3.2-3b >/dev/null 2>&1
runr A-2048 2048; runr A-8192 8192
ap qrope.patch && note "B: qrope.patch applied" || { note "qrope.patch does not apply"; exit 1; }
timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider tests/test_prefill_attention.py tests/test_prefill_gpu.py \
  tests/test_validate_prefill_gpu.py >$W/B-tests.log 2>&1; note "B tests: rc=$? $(tail -1 $W/B-tests.log)"
if grep -qE "^[0-9]+ passed" <(tail -1 $W/B-tests.log); then
  val B-fp16 fp16; val B-fp8 fp8; runr B-2048 2048; runr B-8192 8192
  ap lt.patch && note "C: lt.patch applied" || { note "lt.patch does not apply"; exit 1; }
  timeout -k 5 60 python3 -m pytest -q -p no:cacheprovider tests/test_prefill_gpu.py -k gemm >$W/C-tests.log 2>&1
  note "C tests: rc=$? $(tail -1 $W/C-tests.log)"
  val C-fp16 fp16; runr C-2048 2048; runr C-8192 8192
  ap lt.patch -R; note "lt.patch reverted"
else
  grep -E "FAILED|Error" $W/B-tests.log | head -12 | tee -a $S
fi
ap qrope.patch -R && note "qrope.patch reverted"
runr A2-2048 2048
