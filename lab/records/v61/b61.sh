#!/usr/bin/env bash
# v61 (issue 48): `[LIGHT=1 [MIN=1]] bash lab/records/v61/b61.sh`, one device call on one H100/H200; logs under $OUT/v61
# as written. LIGHT: no profile, no 512 runs; MIN as well: main's 8192 run after the patch's only, no fp8 validate.
#   1. cuBLASLt's heuristic algorithms against cublasGemmEx's default on the prefill's layer GEMMs (gemm_lt_probe.py)
#   2. `run` TTFT on main (A), then qrope.patch (q rotated in the attention kernels' staging, rope_kv_rows k only)
#      applied: the product's prefill GPU tests, validate 3B fp16 and fp8, the 2048 chunk's profile, `run` TTFT (B),
#      then the patch reverted and main's 2048 run again (A'): A B A' on one machine
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
W=$OUT/v61; mkdir -p $W; S=$W/summary.txt
note() { echo "$(date +%T) $*" | tee -a $S; }
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv,noheader | tee -a $S
python3 -m pip install -q --no-deps --no-build-isolation -e . >$W/install.log 2>&1 || { note "install failed"; exit 1; }
runr() {  # runr TAG TIMEOUT MODEL FMT [args]
  local tag=$1 t=$2 m=$3 w=$4; shift 4; local t0=$(date +%s)
  timeout -k 10 $t atomflow-bench run $m --weights $w --json $W/$tag.json "$@" >$W/$tag.log 2>&1; local rc=$?
  note "run $tag: rc=$rc wall $(( $(date +%s) - t0 )) s | $(grep -E 'TTFT' $W/$tag.log | tr -s ' ' | tr '\n' ' ')"
  [ $rc -ne 0 ] && tail -5 $W/$tag.log | tee -a $S
}
timeout -k 10 100 python3 lab/scripts/gemm_lt_probe.py --json $W/gemm-lt.json >$W/gemm-lt.log 2>&1
note "gemm_lt_probe rc=$?"; grep -E "m [0-9]+:|default" $W/gemm-lt.log | tee -a $S
timeout 100 atomflow-bench fetch llama-3.2-3b >/tmp/fetch-3b.log 2>&1
runr A-3b-fp16-ctx2048 120 llama-3.2-3b fp16 --ctx 2048 --tokens 128 --repeats 5
[ -z "$MIN" ] && runr A-3b-fp16-ctx8192 120 llama-3.2-3b fp16 --ctx 8192 --tokens 64 --repeats 3
{ git apply lab/records/v61/qrope.patch 2>/dev/null || patch -p1 -s <lab/records/v61/qrope.patch; } && note "qrope.patch applied: $(grep -c atp_rope_pair kernels_cu/attention_prefill_sm90a.cu) rope calls" ||
  { note "qrope.patch does not apply"; exit 1; }
timeout -k 10 200 python3 -m pytest -q -p no:cacheprovider tests/test_prefill_attention.py tests/test_prefill_gpu.py \
  tests/test_validate_prefill_gpu.py tests/test_engine_gpu.py -k "prefill or run_record" >$W/prefill.log 2>&1
note "prefill GPU tests: rc=$? $(tail -1 $W/prefill.log)"
if grep -qE "^[0-9]+ passed" <(tail -1 $W/prefill.log); then
  for w in fp16 $([ -z "$MIN" ] && echo fp8); do
    timeout -k 10 150 atomflow-bench validate llama-3.2-3b --weights $w --steps 16 --prefill-chunk 3 --truth /tmp/truth-3b \
      --json $W/validate-3b-$w.json >$W/validate-3b-$w.log 2>&1
    note "validate 3b $w: rc=$? $(grep -iE 'prefill path|PASS —|FAIL —' $W/validate-3b-$w.log | tr -s ' ' | head -3 | tr '\n' ' ')"
  done
  [ -z "$LIGHT" ] && timeout -k 10 100 atomflow-bench profile llama-3.2-3b --weights fp16 --ctx 128 --prompt-tokens 2048 \
    --json $W/profile-3b-fp16.json >$W/profile-3b-fp16.md 2>$W/profile-3b-fp16.err
  [ -z "$LIGHT" ] && note "profile 3b fp16 rc=$?" && grep -E "rope_kv|attention \|" $W/profile-3b-fp16.md | tee -a $S
  runr B-3b-fp16-ctx2048 120 llama-3.2-3b fp16 --ctx 2048 --tokens 128 --repeats 5
  runr B-3b-fp16-ctx8192 120 llama-3.2-3b fp16 --ctx 8192 --tokens 64 --repeats 3
  [ -z "$LIGHT" ] && runr B-3b-fp16-ctx512 100 llama-3.2-3b fp16 --ctx 512 --tokens 256 --repeats 5
  [ -z "$LIGHT" ] && runr B-3b-fp8-ctx512 100 llama-3.2-3b fp8 --ctx 512 --tokens 256 --repeats 5
else
  grep -E "FAILED|Error" $W/prefill.log | head -20 | tee -a $S
fi
{ git apply -R lab/records/v61/qrope.patch 2>/dev/null || patch -p1 -R -s <lab/records/v61/qrope.patch; } && note "qrope.patch reverted"
runr A2-3b-fp16-ctx2048 120 llama-3.2-3b fp16 --ctx 2048 --tokens 128 --repeats 5
[ -n "$MIN" ] && runr A2-3b-fp16-ctx8192 120 llama-3.2-3b fp16 --ctx 8192 --tokens 64 --repeats 3
