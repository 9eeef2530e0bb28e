#!/usr/bin/env bash
# v52 (issues 48/47): the prefill attention's lab versions (GPU test, A/B), the TTFT grid, the TP2 hang's diagnosis.
# `bash lab/records/v52/b52.sh PHASE`; each phase one device call. Logs go under $OUT/v52PHASE as they are written
# (a call cut short still returns them); large scratch (ground truth, stores) stays under /tmp.
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
PH=$1; W=$OUT/v52$PH; mkdir -p $W; S=$W/summary.txt
note() { echo "$(date +%T) $*" | tee -a $S; }
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv,noheader | tee -a $S
python3 -m pip install -q --no-deps --no-build-isolation -e . >$W/install.log 2>&1 || { note "install failed"; cat $W/install.log; exit 1; }
pt() {  # pt NAME TIMEOUT pytest-args
  local name=$1 t=$2; shift 2
  timeout -k 10 $t python3 -m pytest -q -p no:cacheprovider --durations=10 "$@" >$W/$name.log 2>&1
  note "$name: rc=$? $(tail -1 $W/$name.log)"
}
runr() {  # runr TAG TIMEOUT MODEL FMT [args]: one `run`, its wall time and its TTFT/TPOT line
  local tag=$1 t=$2 m=$3 w=$4; shift 4; local t0=$(date +%s)
  timeout -k 10 $t atomflow-bench run $m --weights $w --json $W/$tag.json "$@" >$W/$tag.log 2>&1; local rc=$?
  note "run $tag: rc=$rc wall $(( $(date +%s) - t0 )) s | $(grep -E 'TTFT|TPOT \(graph\)' $W/$tag.log | tr -s ' ' | tr '\n' ' ')"
  [ $rc -ne 0 ] && tail -5 $W/$tag.log | tee -a $S
}
ttft() {  # ttft MODEL FMT TIMEOUT: the TTFT grid at prompts 128..8192, chunks of 4096
  timeout -k 10 $3 python3 lab/scripts/prefill_chunk_ab.py $1 $2 --prompts 128,512,2048,8192 --chunks 4096 --rounds 2 \
    --json $W/ttft-$1-$2.json >$W/ttft-$1-$2.log 2>&1; note "ttft $1 $2 rc=$?"; tail -4 $W/ttft-$1-$2.log | tee -a $S
}
if [ "$PH" = A ]; then  # one GPU: the lab attention versions' GPU test and A/B; the TTFT grid of 1B and 8B
  pt lab-att 300 tests/test_lab_prefill_att_gpu.py -x
  timeout -k 10 200 python3 lab/scripts/prefill_att_ab.py --rounds 3 --variants product,v2-s2,v2-s3,v3-s3 \
    --json $W/att-ab.json >$W/att-ab.log 2>&1; note "attention A/B rc=$?"; cat $W/att-ab.log | tee -a $S
  for m in llama-3.2-1b llama-3.1-8b; do timeout 200 atomflow-bench fetch $m >$W/fetch-$m.log 2>&1; done
  ttft llama-3.2-1b fp16 100; ttft llama-3.2-1b fp8 100; ttft llama-3.1-8b fp16 150; ttft llama-3.1-8b fp8 150
fi
if [ "$PH" = B ]; then  # two GPUs: the TP tests (a hang now fails with every rank's stacks), then whether a TP2
  # W8A16 run exits after its record (a watchdog sends SIGABRT, which PYTHONFAULTHANDLER turns into stacks)
  pt tp-gpu 420 tests/test_tp_gpu.py
  watch_exit() {  # watch_exit TAG: once the record exists, 45 s for the ranks to exit, else their stacks
    local tag=$1
    for i in $(seq 1 400); do [ -s $W/$tag.json ] && break; sleep 1; done
    sleep 45
    if pgrep -f "atomflow_bench.cli run" >/dev/null; then
      note "$tag: ranks still running 45 s after the record; SIGABRT for stacks"
      nvidia-smi >$W/$tag-smi.txt 2>&1; pgrep -af "atomflow_bench" >>$W/$tag-smi.txt
      pkill -ABRT -f "atomflow_bench.cli run"
    fi
  }
  for tag in 8b-fp8-tp2 70b-fp8-tp2; do
    m=llama-3.1-8b; [ $tag = 70b-fp8-tp2 ] && m=llama-3.1-70b
    watch_exit $tag & wp=$!
    runr $tag 400 $m fp8 --tp 2 --ctx 2048 --tokens 64 --repeats 3
    kill $wp 2>/dev/null
  done
fi
if [ "$PH" = C ]; then  # two GPUs, after the exit fix: the TP tests (stop at the first failure, so its report
  # prints), the 70B W8A16 TP2 run that hung at exit; then on GPU 0 the attention's v4 (lab GPU test, A/B against
  # the product) and, where v4 wins, v4 in the product's place: the product's GPU tests and the TTFT runs
  pt tp-gpu 330 tests/test_tp_gpu.py -x
  watch_exit() {
    local tag=$1
    for i in $(seq 1 400); do [ -s $W/$tag.json ] && break; sleep 1; done
    sleep 45
    if pgrep -f "atomflow_bench.cli run" >/dev/null; then
      note "$tag: ranks still running 45 s after the record; SIGABRT for stacks"; pkill -ABRT -f "atomflow_bench.cli run"
    fi
  }
  watch_exit 70b-fp8-tp2 & wp=$!
  runr 70b-fp8-tp2 200 llama-3.1-70b fp8 --tp 2 --ctx 2048 --tokens 64 --repeats 3
  kill $wp 2>/dev/null
  export CUDA_VISIBLE_DEVICES=0
  pt lab-att-v4 200 tests/test_lab_prefill_att_gpu.py -k v4
  timeout -k 10 150 python3 lab/scripts/prefill_att_ab.py --rounds 3 --variants product,v4 \
    --json $W/att-ab.json >$W/att-ab.log 2>&1; note "attention A/B rc=$?"; cat $W/att-ab.log | tee -a $S
  if python3 - $W/att-ab.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
best = lambda v, s, st: min(x["ms"] for x in r["runs"] if x["variant"] == v and (x["shape"], x["start"]) == (s, st) and x["m"] in (2048, 4096))
ok = r["ok"]["v4"] and all(best("v4", s, st) < 0.97 * best("product", s, st) for s, st in (("3b", 0), ("3b", 4096)))
sys.exit(0 if ok else 1)
PY
  then
    note "v4 wins by >= 3% at 3B: in the product's place"
    sed 's|#include "../../kernels_cu/common.cuh"|#include "common.cuh"|' lab/kernels/attention_prefill_v4.cu > kernels_cu/attention_prefill.cu
    pt prefill-att 200 tests/test_prefill_attention.py
    pt prefill 400 tests/test_prefill_gpu.py
    timeout 200 atomflow-bench fetch llama-3.2-3b >$W/fetch-3b.log 2>&1
    timeout -k 10 200 atomflow-bench validate llama-3.2-3b --weights fp16 --steps 16 --prefill-chunk 3 --truth /tmp/truth-3b \
      --json $W/validate-3b-fp16.json >$W/validate-3b-fp16.log 2>&1
    note "validate 3b fp16: rc=$? $(grep -iE 'prefill path|PASS —|FAIL —' $W/validate-3b-fp16.log | tr -s ' ' | head -3 | tr '\n' ' ')"
    runr 3b-fp16-ctx2048 120 llama-3.2-3b fp16 --ctx 2048 --tokens 128 --repeats 5
    runr 3b-fp16-ctx8192 150 llama-3.2-3b fp16 --ctx 8192 --tokens 64 --repeats 3
  else
    note "v4 does not win by 3% at 3B: the product stays"
  fi
fi
if [ "$PH" = D ]; then  # one GPU: v5 (two m-tiles a warp) against the product (v4's code)
  pt lab-att-v5 200 tests/test_lab_prefill_att_gpu.py -k v5
  timeout -k 10 150 python3 lab/scripts/prefill_att_ab.py --rounds 3 --variants product,v5 \
    --json $W/att-ab.json >$W/att-ab.log 2>&1; note "attention A/B rc=$?"; cat $W/att-ab.log | tee -a $S
fi
if [ "$PH" = E ]; then  # one GPU: v5's whole lab GPU test (its own grid now), the 3B prefill chunk's profile with
  # the product's new attention
  pt lab-att-v5 200 tests/test_lab_prefill_att_gpu.py -k v5
  timeout 200 atomflow-bench fetch llama-3.2-3b >/tmp/fetch-3b.log 2>&1
  timeout -k 10 200 atomflow-bench profile llama-3.2-3b --weights fp16 --ctx 128 --prompt-tokens 2048 \
    --json $W/profile-3b-fp16.json >$W/profile-3b-fp16.md 2>$W/profile-3b-fp16.err
  note "profile 3b fp16 rc=$?"; grep -A16 "prefill chunk" $W/profile-3b-fp16.md | tee -a $S
fi
if [ "$PH" = F ]; then  # one GPU: v5 over 32-position K/V tiles (no spills on sm_90) against the product and v5
  pt lab-att-v5kv32 200 tests/test_lab_prefill_att_gpu.py -k v5-kv32
  timeout -k 10 150 python3 lab/scripts/prefill_att_ab.py --rounds 3 --variants product,v5,v5-kv32 \
    --json $W/att-ab.json >$W/att-ab.log 2>&1; note "attention A/B rc=$?"; cat $W/att-ab.log | tee -a $S
fi
if [ "$PH" = G ]; then  # one GPU: the row kernels (the norm's row in registers, RoPE two pairs a thread): their GPU
  # tests, validate, the 2048-token 3B chunk's profile, `run` TTFT at 512 and 2048
  pt prefill 300 tests/test_prefill_gpu.py tests/test_prefill_attention.py
  timeout 200 atomflow-bench fetch llama-3.2-3b >/tmp/fetch-3b.log 2>&1
  timeout -k 10 200 atomflow-bench validate llama-3.2-3b --weights fp16 --steps 16 --prefill-chunk 3 --truth /tmp/truth-3b \
    --json $W/validate-3b-fp16.json >$W/validate-3b-fp16.log 2>&1
  note "validate 3b fp16: rc=$? $(grep -iE 'prefill path|PASS —|FAIL —' $W/validate-3b-fp16.log | tr -s ' ' | head -3 | tr '\n' ' ')"
  timeout -k 10 200 atomflow-bench profile llama-3.2-3b --weights fp16 --ctx 128 --prompt-tokens 2048 \
    --json $W/profile-3b-fp16.json >$W/profile-3b-fp16.md 2>$W/profile-3b-fp16.err
  note "profile 3b fp16 rc=$?"; grep -A16 "prefill chunk" $W/profile-3b-fp16.md | tee -a $S
  runr 3b-fp16-ctx512 120 llama-3.2-3b fp16 --ctx 512 --tokens 256 --repeats 5
  runr 3b-fp16-ctx2048 120 llama-3.2-3b fp16 --ctx 2048 --tokens 128 --repeats 5
fi
if [ "$PH" = H ]; then  # one H100/H200 (sm_90): v6 (S = Q K^T on wgmma) against the product; not run in session 25
  pt lab-att-v6 200 tests/test_lab_prefill_att_gpu.py -k v6 -x
  timeout -k 10 150 python3 lab/scripts/prefill_att_ab.py --rounds 3 --variants product,v6 \
    --json $W/att-ab.json >$W/att-ab.log 2>&1; note "attention A/B rc=$?"; cat $W/att-ab.log | tee -a $S
fi
