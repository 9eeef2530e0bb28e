#!/usr/bin/env bash
# v41.1 (4 GPUs): the LL readers load every rank's slot at once. Kernel tests first (stop if they fail), the TP GPU
# tests, then 70B W8A16 TP4 against .ab/35efb41 interleaved (new, old, new), 70B W8A16 TP2 and 8B fp16 TP2, validate.
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
W=/tmp/v41d; mkdir -p $W; S=$OUT/summary-D.txt
pack() { tar -czf $OUT/v41-D.tar.gz -C /tmp v41d; }
show() { python3 -c 'import json, sys
r = json.load(open(sys.argv[1])); t = r["tp"]; c = t["comm"]
print("%s TPOT %.4f ms (%.4f-%.4f) %.1f%% | %s in step %.1f us, local %.1f | %s" % (sys.argv[2], r["tpot_ms"]["median"], r["tpot_ms"]["p10"], r["tpot_ms"]["p90"], r["roofline"]["pct"], t["allreduce"], c["in_step_us"], c["step_without_exchanges_us"]["median"], " ".join("%s %.2f us/sum %.1f us/token" % (k, v["sum_us"], v["per_token_us"]) for k, v in c["paths"].items())))' "$1" "$2" 2>&1 | tail -1; }
one() {  # one TAG TREE MODEL FMT TP
  local tag=$1 tree=$2 m=$3 w=$4 n=$5
  if [ "$tree" = new ]; then
    timeout 150 atomflow-bench run $m --weights $w --ctx 128 --tokens 256 --repeats 5 --tp $n --allreduce peer \
      --json $W/$tag.json >$W/$tag.log 2>&1
  else
    (cd .ab/$tree && PYTHONPATH=$PWD timeout 150 python3 -c 'from atomflow_bench.cli import main; main()' run $m \
      --weights $w --ctx 128 --tokens 256 --repeats 5 --tp $n --allreduce peer --json $W/$tag.json) >$W/$tag.log 2>&1
  fi
  echo "rc=$? $(show $W/$tag.json $tag)" | tee -a $S; pack
}
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
timeout 150 python3 -m pytest -q tests/test_kernels_gpu.py -k "resid_tp or tp_allreduce" -p no:cacheprovider >$W/kernels.log 2>&1
rc=$?; echo "kernels resid_tp/tp_allreduce: rc=$rc $(tail -1 $W/kernels.log)" | tee -a $S; pack
[ $rc -ne 0 ] && { grep -E "^(FAILED|ERROR)|Error|assert" $W/kernels.log | head -30; exit 1; }
timeout 200 python3 -m pytest -q tests/test_tp_gpu.py -p no:cacheprovider -x >$W/tptest.log 2>&1
rc=$?; echo "tptest: rc=$rc $(tail -1 $W/tptest.log)" | tee -a $S; pack
[ $rc -ne 0 ] && { grep -E "^(FAILED|ERROR)|Error|assert" $W/tptest.log | head -30; exit 1; }
one 70b-fp8-tp4-new1 new llama-3.1-70b fp8 4
one 70b-fp8-tp4-old 35efb41 llama-3.1-70b fp8 4
one 70b-fp8-tp2 new llama-3.1-70b fp8 2
timeout 150 atomflow-bench validate llama-3.1-8b --weights fp16 --tp 4 --steps 8 --json $W/validate-8b-fp16-tp4.json >$W/validate-8b-fp16-tp4.log 2>&1
echo "validate 8b fp16 tp4: rc=$? $(grep -E 'probes PASS|greedy|KL' $W/validate-8b-fp16-tp4.log | tr -s ' ' | head -3 | tr '\n' ' ')" | tee -a $S
pack
one 8b-fp16-tp2 new llama-3.1-8b fp16 2
pack
