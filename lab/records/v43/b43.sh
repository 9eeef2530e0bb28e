#!/usr/bin/env bash
# Phases A, A2, C, D, T, E, F ran on the trees of commits dfcef9c..744fad5 (the attention beside QKV, the lab switches
# @noroom / @<role><N>; since removed); B1 on commit b2f4819 (o_proj's grid leaving the attention's slots, TP W8A16
# ws-pre3/l2=16; both since removed: no gain at TP4), B3 on the final tree (= 401131e's product code).
# scripts/lab/beside_timeline.py (phases T, E) is in git history at 6d37b1d, local_step_ab.py's @-switches (D, F)
# at 744fad5.
# v43: the attention beside QKV (qkv_attention.cu; forms "beside"). Phase A (one GPU): the kernel and engine tests,
# validate, then interleaved A/B: 1B fp16 (run) and 70B's TP4 rank step without exchanges on one GPU
# (scripts/lab/local_step_ab.py). Phase B (4 GPUs): 70B W8A16 TP4 plain vs beside interleaved, the TP tests,
# validate --tp 4, and the other figures with the chosen default.
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
PH=$1; W=/tmp/v43$PH; mkdir -p $W; S=$OUT/summary-v43-$PH.txt
pack() { tar -czf $OUT/v43-$PH.tar.gz -C /tmp v43$PH; }
note() { echo "$(date +%T) $*" | tee -a $S; pack; }
show() { python3 -c 'import json, sys
r = json.load(open(sys.argv[1])); t = r.get("tp"); b = " ".join("%s %.4f" % (x["attention"], x["tpot_ms"]) for x in r["attention_buckets"])
s = "%s TPOT %.4f ms (%.4f-%.4f) %.1f%% [%s]" % (sys.argv[2], r["tpot_ms"]["median"], r["tpot_ms"]["p10"], r["tpot_ms"]["p90"], r["roofline"]["pct"], b)
if t: c = t["comm"]; s += " | %s in step %.1f us, local %.1f | %s" % (t["allreduce"], c["in_step_us"], c["step_without_exchanges_us"]["median"], " ".join("%s %.2f us/sum %.1f us/token" % (k, v["sum_us"], v["per_token_us"]) for k, v in c["paths"].items()))
print(s)' "$1" "$2" 2>&1 | tail -1; }
P16="short:ws/l2=16;split:ws/l2=16"; B16="beside;$P16"
if [ "$PH" = A ] || [ "$PH" = C ]; then
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a $S
  timeout 240 python3 -m pytest -q tests/test_kernels_gpu.py -k "qkv_attention" -p no:cacheprovider -x >$W/kernels-beside.log 2>&1
  rc=$?; note "kernels qkv_attention: rc=$rc $(tail -1 $W/kernels-beside.log)"
  [ $rc -ne 0 ] && { grep -E "^(FAILED|ERROR)|Error|assert|seed" $W/kernels-beside.log | head -30; exit 1; }
  if [ "$PH" = A ]; then
    timeout 200 python3 -m pytest -q tests/test_kernels_gpu.py -k "attention_short" -p no:cacheprovider -x >$W/kernels.log 2>&1
    rc=$?; note "kernels attention_short: rc=$rc $(tail -1 $W/kernels.log)"
    [ $rc -ne 0 ] && { grep -E "^(FAILED|ERROR)|Error|assert|seed" $W/kernels.log | head -30; exit 1; }
  fi
  timeout 150 python3 -m pytest -q tests/test_engine_gpu.py -k "beside or attention_buckets or graph_bit_identical" -p no:cacheprovider -x >$W/engine.log 2>&1
  rc=$?; note "engine beside/buckets: rc=$rc $(tail -1 $W/engine.log)"
  [ $rc -ne 0 ] && { grep -E "^(FAILED|ERROR)|Error|assert" $W/engine.log | head -30; exit 1; }
fi
if [ "$PH" = A2 ] || [ "$PH" = C ]; then
  timeout 120 atomflow-bench fetch llama-3.2-1b --source synthetic >$W/fetch.log 2>&1; note "fetch 1b rc=$?"
  timeout 100 atomflow-bench validate llama-3.2-1b --weights fp16 --steps 16 --forms "beside;short:ws/l2=8;split:ws/l2=8" --json $W/validate-1b-fp16-beside.json >$W/validate-1b.log 2>&1
  note "validate 1b fp16 beside: rc=$? $(grep -E 'PASS|FAIL|greedy|KL' $W/validate-1b.log | tr -s ' ' | head -3 | tr '\n' ' ')"
  for r in a b; do
    for f in plain beside; do
      F="short:ws/l2=8;split:ws/l2=8"; [ $f = beside ] && F="beside;$F"
      timeout 60 atomflow-bench run llama-3.2-1b --source synthetic --weights fp16 --ctx 128 --tokens 256 --repeats 5 --forms "$F" --json $W/1b-fp16-$f-$r.json >$W/1b-fp16-$f-$r.log 2>&1
      note "rc=$? $(show $W/1b-fp16-$f-$r.json 1b-fp16-$f-$r)"
    done
  done
  timeout 240 python3 scripts/lab/local_step_ab.py llama-3.1-70b fp8 4 "$P16" "$B16" --rounds 2 --json $W/70b-tp4-local-ab.json >$W/70b-tp4-local-ab.log 2>&1
  note "70b tp4 local A/B rc=$? $(cat $W/70b-tp4-local-ab.log | tail -4 | tr '\n' '|')"
fi
if [ "$PH" = D ]; then  # o_proj's grid leaves the attention's slots (step.O_PROJ_ROOM), with and without beside
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a $S
  timeout 150 python3 -m pytest -q tests/test_engine_gpu.py -k "beside or attention_buckets or graph_bit_identical" -p no:cacheprovider -x >$W/engine.log 2>&1
  rc=$?; note "engine beside/buckets: rc=$rc $(tail -1 $W/engine.log)"
  [ $rc -ne 0 ] && { grep -E "^(FAILED|ERROR)|Error|assert" $W/engine.log | head -30; exit 1; }
  timeout 300 python3 scripts/lab/local_step_ab.py llama-3.1-70b fp8 4 "$P16@noroom" "$P16" "$B16" "$B16@noroom" --rounds 2 --json $W/70b-tp4-local-room.json >$W/70b-tp4-local-room.log 2>&1
  note "70b tp4 local rc=$? $(cat $W/70b-tp4-local-room.log | tail -8 | tr '\n' '|')"
  R8="short:ring/l2=8;split:ring/l2=8"
  timeout 150 python3 scripts/lab/local_step_ab.py llama-3.1-8b fp8 1 "$R8@noroom" "$R8" --rounds 2 --json $W/8b-fp8-room.json >$W/8b-fp8-room.log 2>&1
  note "8b fp8 rc=$? $(cat $W/8b-fp8-room.log | tail -4 | tr '\n' '|')"
fi
if [ "$PH" = T ]; then  # the timeline around layer 10: beside at 1 and 2 windows, plain
  timeout 200 python3 scripts/lab/beside_timeline.py llama-3.1-70b fp8 4 10 "$B16" 150 250 >$W/tl-beside.log 2>&1
  note "timeline beside rc=$?"; cat $W/tl-beside.log | tail -30
  timeout 150 python3 scripts/lab/beside_timeline.py llama-3.1-70b fp8 4 10 "$P16" 150 250 >$W/tl-plain.log 2>&1
  note "timeline plain rc=$?"; cat $W/tl-plain.log | tail -14
fi
if [ "$PH" = E ]; then  # the pre-wait prefetch flood around the attention: slots before the wait, the L2 tail
  F() { echo "short:$1;split:$1"; }
  timeout 420 python3 scripts/lab/local_step_ab.py llama-3.1-70b fp8 4 "$P16" "$(F ws-pre1/l2=16)" "$(F ws-pre2/l2=16)" "$(F ws-pre3/l2=16)" "$(F ws/l2=0)" "beside;$(F ws-pre2/l2=16)" --rounds 2 --json $W/70b-tp4-local-pre.json >$W/70b-tp4-local-pre.log 2>&1
  note "70b tp4 local rc=$? $(cat $W/70b-tp4-local-pre.log | tail -12 | tr '\n' '|')"
  timeout 120 python3 scripts/lab/beside_timeline.py llama-3.1-70b fp8 4 10 "$(F ws-pre2/l2=16)" 150 >$W/tl-pre2.log 2>&1
  note "timeline pre2 rc=$?"; cat $W/tl-pre2.log | tail -8
fi
if [ "$PH" = F ]; then  # slots before the wait: 3-5 for every GEMV, or per role
  F() { echo "short:$1;split:$1"; }
  timeout 500 python3 scripts/lab/local_step_ab.py llama-3.1-70b fp8 4 "$P16" "$(F ws-pre3/l2=16)" "$(F ws-pre4/l2=16)" "$(F ws-pre5/l2=16)" "$P16@gu3" "$P16@gu2" "$P16@gu3@d3" --rounds 2 --json $W/70b-tp4-local-pre2.json >$W/70b-tp4-local-pre2.log 2>&1
  note "70b tp4 local rc=$? $(cat $W/70b-tp4-local-pre2.log | tail -14 | tr '\n' '|')"
fi
if [ "$PH" = B1 ] || [ "$PH" = B2 ] || [ "$PH" = B3 ] || [ "$PH" = B4 ]; then  # 4 GPUs: the TP4 figures; old = .ab/401131e (ws/l2=16, o_proj's full grid)
  one() {  # one TAG TREE MODEL FMT TP [extra args]
    local tag=$1 tree=$2 m=$3 w=$4 n=$5; shift 5
    if [ "$tree" = new ]; then
      timeout 150 atomflow-bench run $m --weights $w --ctx 128 --tokens 256 --repeats 5 --tp $n --json $W/$tag.json "$@" >$W/$tag.log 2>&1
    else
      (cd .ab/$tree && PYTHONPATH=$PWD timeout 150 python3 -c 'from atomflow_bench.cli import main; main()' run $m \
        --weights $w --ctx 128 --tokens 256 --repeats 5 --tp $n --json $W/$tag.json "$@") >$W/$tag.log 2>&1
    fi
    note "rc=$? $(show $W/$tag.json $tag)"
  }
fi
if [ "$PH" = B1 ]; then
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  one 70b-fp8-tp4-new-a new llama-3.1-70b fp8 4 --allreduce peer
  one 70b-fp8-tp4-old-a 401131e llama-3.1-70b fp8 4 --allreduce peer
  one 70b-fp8-tp4-room-a new llama-3.1-70b fp8 4 --allreduce peer --forms "$P16"
  one 70b-fp8-tp4-new-b new llama-3.1-70b fp8 4 --allreduce peer
  one 70b-fp8-tp4-old-b 401131e llama-3.1-70b fp8 4 --allreduce peer
  one 70b-fp8-tp4-room-b new llama-3.1-70b fp8 4 --allreduce peer --forms "$P16"
  timeout 200 python3 -m pytest -q tests/test_tp_gpu.py -p no:cacheprovider >$W/tptest.log 2>&1
  note "tptest: rc=$? $(tail -1 $W/tptest.log)"
fi
if [ "$PH" = B2 ]; then
  one 70b-fp8-tp4-nccl new llama-3.1-70b fp8 4 --allreduce nccl
  one 70b-fp16-tp4 new llama-3.1-70b fp16 4 --allreduce peer
  one 8b-fp16-tp4 new llama-3.1-8b fp16 4 --allreduce peer
  one 70b-fp8-tp2 new llama-3.1-70b fp8 2 --allreduce peer
  timeout 150 atomflow-bench validate llama-3.1-8b --weights fp16 --tp 4 --steps 8 --json $W/validate-8b-fp16-tp4.json >$W/validate-8b-fp16-tp4.log 2>&1
  note "validate 8b fp16 tp4: rc=$? $(grep -E 'probes|greedy|KL' $W/validate-8b-fp16-tp4.log | tr -s ' ' | head -3 | tr '\n' ' ')"
  timeout 150 atomflow-bench profile llama-3.1-70b --weights fp8 --tp 4 --json $W/profile-70b-fp8-tp4.json >$W/profile-70b-fp8-tp4.log 2>&1
  note "profile 70b fp8 tp4: rc=$?"; tail -40 $W/profile-70b-fp8-tp4.log
fi
if [ "$PH" = B3 ]; then  # profile --tp 4: rank 0's step without exchanges, role by role (its first 4-GPU run)
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  timeout 300 atomflow-bench profile llama-3.1-70b --weights fp8 --tp 4 --json $W/profile-70b-fp8-tp4.json >$W/profile-70b-fp8-tp4.log 2>&1
  note "profile 70b fp8 tp4: rc=$?"; tail -45 $W/profile-70b-fp8-tp4.log
  one 70b-fp8-tp4 new llama-3.1-70b fp8 4 --allreduce peer
fi
if [ "$PH" = H ]; then  # issue 35 on what is lent: Llama-3.1-405B W8A16 over 4 H200s (~102 GB per GPU), its first run
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee -a $S
  timeout 540 atomflow-bench run llama-3.1-405b --weights fp8 --ctx 128 --tokens 256 --repeats 3 --tp 4 --allreduce peer \
    --json $W/405b-fp8-tp4.json >$W/405b-fp8-tp4.log 2>&1
  note "rc=$? $(show $W/405b-fp8-tp4.json 405b-fp8-tp4)"; tail -25 $W/405b-fp8-tp4.log
fi
if [ "$PH" = G ]; then  # HBM's read throughput over 70B's TP4 rank step (one GPU, Nsight Compute PM sampling)
  NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
  export ATOMFLOW_FORMS="$P16"  # the TP default form (not the one-GPU default ring/l2=8)
  timeout 400 "$NCU" --profile-from-start off --graph-profiling graph --section PmSampling --clock-control none \
    --cache-control none -f -o $W/dram-70b-tp4 python3 scripts/lab/dram_timeline.py child llama-3.1-70b/tp4 fp8 128 2 >$W/dram.log 2>&1
  note "ncu rc=$? $(grep -E 'unprofiled|profiled' $W/dram.log | tr '\n' ' ')"
  "$NCU" -i $W/dram-70b-tp4.ncu-rep --page raw --csv --print-metric-instances values >$W/dram-70b-tp4.csv 2>>$W/dram.log
  python3 scripts/lab/dram_timeline.py summary $W/dram-70b-tp4.csv $W/dram-70b-tp4.json 80 >$W/dram-70b-tp4.txt 2>&1
  rc=$?; rm -f $W/dram-70b-tp4.ncu-rep; gzip -f $W/dram-70b-tp4.csv; note "summary rc=$rc"; head -60 $W/dram-70b-tp4.txt
fi
if [ "$PH" = B4 ]; then  # gate/up at one block per SM (6 slots), room for down's early blocks: .ab/g1 = HEAD + that
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  one 70b-fp8-tp4-a new llama-3.1-70b fp8 4 --allreduce peer
  one 70b-fp8-tp4-g1-a g1 llama-3.1-70b fp8 4 --allreduce peer
  one 70b-fp8-tp4-b new llama-3.1-70b fp8 4 --allreduce peer
  one 70b-fp8-tp4-g1-b g1 llama-3.1-70b fp8 4 --allreduce peer
fi
tail -30 $S
