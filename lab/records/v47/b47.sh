#!/usr/bin/env bash
# v47 (issue 45, the house restructured): the GPU tests' loop, validate, and the interleaved A/B of the tree before the
# restructure (bf534f2, carried as .ab/bf534f2 by `git archive bf534f2 atomflow_bench kernels_cu pyproject.toml`)
# against this one. `bash lab/records/v47/b47.sh PHASE`; each phase one device call, records and logs under $OUT.
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1
PH=$1; W=/tmp/v47$PH; mkdir -p $W; S=$W/summary-v47-$PH.txt; OLD=$PWD/.ab/bf534f2
pack() { tar -czf $OUT/v47-$PH.tar.gz -C /tmp v47$PH; }
note() { echo "$(date +%T) $*" | tee -a $S; pack; }
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv,noheader | tee -a $S
python3 -m pip install -q --no-deps --no-build-isolation -e . >$W/install.log 2>&1 || { note "install failed"; cat $W/install.log; exit 1; }
show() { python3 -c 'import json, sys
r = json.load(open(sys.argv[1])); t = r.get("tp"); f = (r.get("forms") or {}).get("forms")
s = "%s TPOT %.4f ms (%.4f-%.4f) %.1f%% of %.0f GB/s | %s" % (sys.argv[2], r["tpot_ms"]["median"], r["tpot_ms"]["p10"], r["tpot_ms"]["p90"], r["roofline"]["pct"], r["copy_bandwidth_gbs"]["median"], f)
if t: c = t["comm"]; s += " | %s in step %.1f us" % (t["allreduce"], c["in_step_us"])
print(s)' "$1" "$2" 2>&1 | tail -1; }
runf() {  # runf TAG TREE(old|new) MODEL FMT [args]: one `run` (ctx 128, 256 tokens, 5 repeats)
  local tag=$1 tree=$2 m=$3 w=$4; shift 4
  if [ "$tree" = old ]; then
    (cd $OLD && PYTHONPATH=$OLD timeout 400 python3 -m atomflow_bench.cli run $m --weights $w --ctx 128 --tokens 256 \
      --repeats 5 --json $W/$tag.json "$@") >$W/$tag.log 2>&1
  else
    timeout 400 atomflow-bench run $m --weights $w --ctx 128 --tokens 256 --repeats 5 --json $W/$tag.json "$@" >$W/$tag.log 2>&1
  fi
  local rc=$?; note "rc=$rc $(show $W/$tag.json $tag) $( [ $rc -ne 0 ] && tail -3 $W/$tag.log | tr '\n' ' ')"
}
ab() {  # ab SHORT MODEL FMT FORMS ROUNDS: old, new, old, new ... with the same forms
  local s=$1 m=$2 w=$3 f=$4 n=$5
  for r in $(seq 1 $n); do runf ab-old-$r-$s $w old $m $w --forms "$f"; runf ab-new-$r-$s $w new $m $w --forms "$f"; done
}
if [ "$PH" = A ]; then  # one H100, cold: the kernel and engine GPU suites (the loop's time), the table of gpu_check.sh
  OUT=$W bash scripts/gpu_check.sh info kernels engine 2>&1 | tail -30 | tee -a $S
  pack
fi
if [ "$PH" = B ]; then  # one H100, warm: validate 3B both formats; 3B W8A16 (twice), 3B fp16, 1B fp16 interleaved
  for m in llama-3.2-3b llama-3.2-1b; do timeout 200 atomflow-bench fetch $m >$W/fetch-$m.log 2>&1; done
  for w in fp16 fp8; do
    timeout 240 atomflow-bench validate llama-3.2-3b --weights $w --steps 32 --json $W/validate-3b-$w.json >$W/validate-3b-$w.log 2>&1
    note "validate 3b $w: rc=$? $(grep -E 'probes PASS|greedy|KL' $W/validate-3b-$w.log | tr -s ' ' | head -3 | tr '\n' ' ')"
  done
  F3="short:ring/l2=4;split:ring/l2=4"
  runf ab-old-1-3b-fp8 old llama-3.2-3b fp8 --forms "$F3"; runf ab-new-1-3b-fp8 new llama-3.2-3b fp8 --forms "$F3"
  runf ab-old-1-3b-fp16 old llama-3.2-3b fp16 --forms "short:ws/l2=24;split:ws/l2=24"
  runf ab-new-1-3b-fp16 new llama-3.2-3b fp16 --forms "short:ws/l2=24;split:ws/l2=24"
  runf ab-old-1-1b-fp16 old llama-3.2-1b fp16 --forms "short:ws/l2=8;split:ws/l2=8"
  runf ab-new-1-1b-fp16 new llama-3.2-1b fp16 --forms "short:ws/l2=8;split:ws/l2=8"
  runf ab-old-2-3b-fp8 old llama-3.2-3b fp8 --forms "$F3"; runf ab-new-2-3b-fp8 new llama-3.2-3b fp8 --forms "$F3"
fi
if [ "$PH" = C ]; then  # one H100, warm: 8B W8A16 and fp16 interleaved; 1B W8A16
  timeout 240 atomflow-bench fetch llama-3.1-8b >$W/fetch-8b.log 2>&1; note "fetch 8b rc=$?"
  F8="short:ws/l2=24/wo-pre=2;split:ws/l2=24/wo-pre=2"
  runf ab-old-1-8b-fp8 old llama-3.1-8b fp8 --forms "$F8"; runf ab-new-1-8b-fp8 new llama-3.1-8b fp8 --forms "$F8"
  runf ab-old-1-8b-fp16 old llama-3.1-8b fp16 --forms "short:ws/l2=4;split:ws/l2=4"
  runf ab-new-1-8b-fp16 new llama-3.1-8b fp16 --forms "short:ws/l2=4;split:ws/l2=4"
  runf ab-old-1-1b-fp8 old llama-3.2-1b fp8 --forms "short:ring/l2=4;split:ring/l2=4"
  runf ab-new-1-1b-fp8 new llama-3.2-1b fp8 --forms "short:ring/l2=4;split:ring/l2=4"
fi
if [ "$PH" = D ]; then  # 2 GPUs: the kernel suite again (A's 12 failures: the TP sum's kernels undeclared), the TP GPU
  # tests; 70B W8A16 TP2 old/new twice (the TP default); validate 8B W8A16 TP2
  timeout 200 python3 -m pytest -q tests/test_kernels_gpu.py -p no:cacheprovider >$W/kernels.log 2>&1
  note "kernels: rc=$? $(tail -1 $W/kernels.log)"
  timeout 300 python3 -m pytest -q tests/test_tp_gpu.py -p no:cacheprovider -x >$W/tptest.log 2>&1
  note "tptest: rc=$? $(tail -1 $W/tptest.log)"
  for r in 1 2; do
    runf ab-old-$r-70b-fp8-tp2 old llama-3.1-70b fp8 --tp 2 --allreduce peer
    runf ab-new-$r-70b-fp8-tp2 new llama-3.1-70b fp8 --tp 2 --allreduce peer
  done
  timeout 200 atomflow-bench fetch llama-3.1-8b >$W/fetch-8b.log 2>&1
  timeout 300 atomflow-bench validate llama-3.1-8b --weights fp8 --tp 2 --steps 8 --json $W/validate-8b-fp8-tp2.json >$W/validate-8b-fp8-tp2.log 2>&1
  note "validate 8b fp8 tp2: rc=$? $(grep -E 'probes PASS|greedy|KL' $W/validate-8b-fp8-tp2.log | tr -s ' ' | head -3 | tr '\n' ' ') $(tail -1 $W/validate-8b-fp8-tp2.log)"
fi
if [ "$PH" = E ]; then  # 2 GPUs (issue 46): TP GPU tests on the new rendezvous; torchrun; a killed rank under our
  # launcher, under torchrun and with no launcher; a rendezvous that cannot complete; run --tp 2 --format json
  M="llama-3.2-1b --weights fp16 --tp 2"
  timeout 200 atomflow-bench fetch llama-3.2-1b >$W/fetch-1b.log 2>&1
  timeout 200 python3 -m pytest -q tests/test_tp_gpu.py -p no:cacheprovider -x >$W/tptest.log 2>&1
  note "tptest: rc=$? $(tail -1 $W/tptest.log)"
  timeout 150 torchrun --nproc-per-node 2 --master-port 29544 -m atomflow_bench.cli run $M --tokens 64 --repeats 2 \
    --json $W/torchrun.json >$W/torchrun.log 2>&1
  note "torchrun run: rc=$? $(show $W/torchrun.json torchrun) | others: $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("other_gpu_processes"))' $W/torchrun.json 2>&1 | tail -1)"
  kill_one() {  # kill_one TAG LAUNCHER_PID: SIGKILL the launcher's second child after 25 s, time the launcher's end
    sleep 25; local c; c=$(ps -o pid= --ppid $2 | sed -n 2p); kill -KILL $c; local t0=$(date +%s)
    timeout 60 tail --pid=$2 -f /dev/null; wait $2; local rc=$?
    note "$1: killed pid $c; rc=$rc in $(( $(date +%s) - t0 )) s | $(tail -3 $W/$1.err | tr '\n' ' ')"
  }
  atomflow-bench run $M --tokens 4000 --repeats 50 --no-json >$W/kill-ours.out 2>$W/kill-ours.err & kill_one kill-ours $!
  torchrun --nproc-per-node 2 --master-port 29545 -m atomflow_bench.cli run $M --tokens 4000 --repeats 50 --no-json \
    >$W/kill-torchrun.out 2>$W/kill-torchrun.err & kill_one kill-torchrun $!
  for r in 0 1; do RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r MASTER_PORT=29600 atomflow-bench run $M --tokens 4000 --repeats 50 \
    --no-json >$W/bare$r.out 2>$W/bare$r.err & eval P$r=\$!; done
  sleep 25; kill -KILL $P1; t0=$(date +%s); timeout 60 tail --pid=$P0 -f /dev/null; wait $P0
  note "no launcher, rank 1 killed: rank 0 rc=$? in $(( $(date +%s) - t0 )) s | $(tail -2 $W/bare0.err | tr '\n' ' ')"
  RANK=1 WORLD_SIZE=2 ATOMFLOW_TP_TIMEOUT=5 timeout 60 atomflow-bench run llama-3.2-1b --tp 2 >$W/rdv.out 2>$W/rdv.err
  note "rendezvous timeout: rc=$? $(cat $W/rdv.err | tr '\n' ' ')"
  timeout 150 atomflow-bench run $M --tokens 64 --repeats 2 --format json --no-json >$W/json.out 2>$W/json.err
  note "run --tp 2 --format json: rc=$? $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print("one JSON document:", type(d).__name__, list(d)[:4] if isinstance(d, dict) else len(d))' $W/json.out 2>&1 | tail -1)"
fi
pack
