#!/usr/bin/env bash
# v59/v60 (issue 48; issue 47's unrun review in A): the prefill attention in FlashAttention-3's shape. `bash
# lab/records/v59/b59.sh PHASE`, each phase one device call on one H100/H200; logs under $OUT/v59PHASE as written.
#   AB  the call to run first: lab v11's GPU test, the attention A/B (v9-lpt = the product's sm_90a kernel, v11,
#       v11-kv64, v11-free, v11-ia, torch's flash SDPA); then, v11 passing, fa3.patch applied (v11 as the product's
#       sm_90a kernel) and B's set, light (validate fp16, the 2048 chunk's profile, `run` TTFT 2048/8192/512)
#   C   on the machine AB leaves warm: fa3.patch and qrope.patch (q rotated in the attention's staging), B's full set
#   A   AB's lab part with the lab persistent step's GPU tests (3f5cb47's review) and the 8192 prompt's profile
#   B   B's full set on a tree with branch prefill-fa3 checked out
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
PH=$1; TAG=$1; W=$OUT/v59$PH; mkdir -p $W; S=$W/summary.txt
note() { echo "$(date +%T) $*" | tee -a $S; }
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv,noheader | tee -a $S
python3 -m pip install -q --no-deps --no-build-isolation -e . >$W/install.log 2>&1 || { note "install failed"; cat $W/install.log; exit 1; }
runr() {  # runr TAG TIMEOUT MODEL FMT [args]: one `run`, its wall time and its TTFT/TPOT line
  local tag=$1 t=$2 m=$3 w=$4; shift 4; local t0=$(date +%s)
  timeout -k 10 $t atomflow-bench run $m --weights $w --json $W/$tag.json "$@" >$W/$tag.log 2>&1; local rc=$?
  note "run $tag: rc=$rc wall $(( $(date +%s) - t0 )) s | $(grep -E 'TTFT|TPOT \(graph\)' $W/$tag.log | tr -s ' ' | tr '\n' ' ')"
  [ $rc -ne 0 ] && tail -5 $W/$tag.log | tee -a $S
}
pt() {  # pt NAME TIMEOUT pytest-args
  local name=$1 t=$2; shift 2
  timeout -k 10 $t python3 -m pytest -q -p no:cacheprovider --durations=10 "$@" >$W/$name.log 2>&1
  note "$name: rc=$? $(tail -1 $W/$name.log)"
}
if [ "$PH" = A ]; then  # one H100/H200: v11's GPU tests (a hang ends at the timeout), the attention A/B, the persist
  # tests, the 8192 prompt's profile
  pt lab-att-v11 200 tests/test_lab_prefill_att_gpu.py -k "v11" -x
  grep -E "FAILED|Error|assert" $W/lab-att-v11.log | head -8 | tee -a $S
  timeout -k 10 120 python3 lab/scripts/prefill_att_ab.py --rounds 3 --variants v9-lpt,v11,v11-kv64,v11-free,v11-ia --torch \
    --json $W/att-ab.json >$W/att-ab.log 2>&1; note "attention A/B rc=$?"; grep -vE "^\s*$" $W/att-ab.log | tail -12 | tee -a $S
  pt persist-all 130 tests/test_lab_persist_gpu.py -x
  timeout 100 atomflow-bench fetch llama-3.2-3b >/tmp/fetch-3b.log 2>&1
  timeout -k 10 120 atomflow-bench profile llama-3.2-3b --weights fp16 --ctx 128 --prompt-tokens 8192 \
    --json $W/profile-3b-fp16-8192.json >$W/profile-3b-fp16-8192.md 2>$W/profile-3b-fp16-8192.err
  note "profile 3b fp16 8192 rc=$?"; grep -A16 "prefill chunk" $W/profile-3b-fp16-8192.md | tee -a $S
fi
if [ "$PH" = AB ]; then  # one H100/H200: A's lab test and A/B, then (v11 passing) B with branch prefill-fa3's changes
  # (fa3.patch: git diff main prefill-fa3 -- kernels_cu atomflow_bench tests) applied to this tree
  pt lab-att-v11 150 tests/test_lab_prefill_att_gpu.py -k "v11 and not kv64 and not free and not v11-ia" -x
  grep -E "FAILED|Error|assert" $W/lab-att-v11.log | head -8 | tee -a $S
  timeout -k 10 100 python3 lab/scripts/prefill_att_ab.py --rounds 3 --variants v9-lpt,v11,v11-kv64,v11-free,v11-ia --torch \
    --json $W/att-ab.json >$W/att-ab.log 2>&1; note "attention A/B rc=$?"; grep -vE "^\s*$" $W/att-ab.log | tail -12 | tee -a $S
  grep -qE "^[0-9]+ passed" <(tail -1 $W/lab-att-v11.log) || { note "v11 fails: B not run"; tar czf $OUT/v59$TAG.tgz -C $OUT v59$TAG; exit 1; }
  { git apply lab/records/v59/fa3.patch 2>/dev/null || patch -p1 -s <lab/records/v59/fa3.patch; } &&
    note "fa3.patch applied: $(grep -c ATPW kernels_cu/attention_prefill_sm90a.cu) ATPW lines in the sm_90a kernel" ||
    { note "fa3.patch does not apply"; tar czf $OUT/v59$TAG.tgz -C $OUT v59$TAG; exit 1; }
  PH=B; LIGHT=1  # within one call's 600 s: validate fp16 only, no fp8 or 8B runs (phase C has them)
fi
if [ "$PH" = C ]; then  # one H100/H200 (warm after AB): fa3.patch and then qrope.patch (q rotated by the attention
  # kernels, rope_kv_rows for k only) applied to this tree, then B's set
  pt lab-att-v11ia 120 tests/test_lab_prefill_att_gpu.py -k "v11-ia" -x  # AB's A/B checked it on 4 chunks only
  grep -E "FAILED|Error|assert" $W/lab-att-v11ia.log | head -8 | tee -a $S
  { git apply lab/records/v59/fa3.patch 2>/dev/null || patch -p1 -s <lab/records/v59/fa3.patch; } &&
    { git apply lab/records/v59/qrope.patch 2>/dev/null || patch -p1 -s <lab/records/v59/qrope.patch; } &&
    note "fa3.patch and qrope.patch applied: $(grep -c atp_rope_pair kernels_cu/attention_prefill_sm90a.cu) rope calls" ||
    { note "the patches do not apply"; tar czf $OUT/v59$TAG.tgz -C $OUT v59$TAG; exit 1; }
  PH=B
fi
if [ "$PH" = B ]; then  # one H100/H200, branch prefill-fa3 or fa3.patch applied (v11 as the product's sm_90a kernel): the product's prefill
  # GPU tests, validate both formats on the prefill path, the 2048 chunk's profile, `run` TTFT (v55 D's set)
  pt prefill 300 tests/test_prefill_attention.py tests/test_prefill_gpu.py tests/test_validate_prefill_gpu.py \
    tests/test_engine_gpu.py -k "prefill or run_record"
  grep -qE "^[0-9]+ passed" <(tail -1 $W/prefill.log) || { note "the GPU tests fail: the rest is not run"
    grep -E "FAILED|Error" $W/prefill.log | head -20 | tee -a $S; tar czf $OUT/v59$TAG.tgz -C $OUT v59$TAG; exit 1; }
  timeout 100 atomflow-bench fetch llama-3.2-3b >/tmp/fetch-3b.log 2>&1
  for w in fp16 $([ -z "$LIGHT" ] && echo fp8); do
    timeout -k 10 200 atomflow-bench validate llama-3.2-3b --weights $w --steps 16 --prefill-chunk 3 --truth /tmp/truth-3b \
      --json $W/validate-3b-$w.json >$W/validate-3b-$w.log 2>&1
    note "validate 3b $w: rc=$? $(grep -iE 'prefill path|PASS —|FAIL —' $W/validate-3b-$w.log | tr -s ' ' | head -3 | tr '\n' ' ')"
  done
  timeout -k 10 200 atomflow-bench profile llama-3.2-3b --weights fp16 --ctx 128 --prompt-tokens 2048 \
    --json $W/profile-3b-fp16.json >$W/profile-3b-fp16.md 2>$W/profile-3b-fp16.err
  note "profile 3b fp16 rc=$?"; grep -A16 "prefill chunk" $W/profile-3b-fp16.md | tee -a $S
  if [ -z "$LIGHT" ]; then  # the 8192 prompt's last chunk (4096 rows after 4096): its GEMMs against its attention
    timeout -k 10 120 atomflow-bench profile llama-3.2-3b --weights fp16 --ctx 128 --prompt-tokens 8192 \
      --json $W/profile-3b-fp16-8192.json >$W/profile-3b-fp16-8192.md 2>$W/profile-3b-fp16-8192.err
    note "profile 3b fp16 8192 rc=$?"; grep -A16 "prefill chunk" $W/profile-3b-fp16-8192.md | tee -a $S
  fi
  runr 3b-fp16-ctx2048 120 llama-3.2-3b fp16 --ctx 2048 --tokens 128 --repeats 5
  runr 3b-fp16-ctx8192 120 llama-3.2-3b fp16 --ctx 8192 --tokens 64 --repeats 3
  runr 3b-fp16-ctx512 120 llama-3.2-3b fp16 --ctx 512 --tokens 256 --repeats 5
  if [ -z "$LIGHT" ]; then
    runr 3b-fp8-ctx512 120 llama-3.2-3b fp8 --ctx 512 --tokens 256 --repeats 5
    timeout 100 atomflow-bench fetch llama-3.1-8b >/tmp/fetch-8b.log 2>&1
    runr 8b-fp16-ctx2048 150 llama-3.1-8b fp16 --ctx 2048 --tokens 128 --repeats 5
  fi
fi
tar czf $OUT/v59$TAG.tgz -C $OUT v59$TAG
