#!/usr/bin/env bash
# A/B of the tp sum's early trigger: old tree (.ab/61eb739) vs this tree, interleaved; then 70B fp8 TP2 forms.
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
mkdir -p $OUT/ab
show() { python3 -c 'import json, sys
r = json.load(open(sys.argv[1])); t = r["tp"]; c = t["comm"]
print("%s TPOT %.4f ms (%.4f-%.4f) %.1f%% | in step %.1f us | %s | %s" % (sys.argv[2], r["tpot_ms"]["median"], r["tpot_ms"]["p10"],
      r["tpot_ms"]["p90"], r["roofline"]["pct"], c["in_step_us"],
      " ".join("%s %.2f us/sum %.1f us/token" % (k, v["sum_us"], v["per_token_us"]) for k, v in c["paths"].items()),
      r["forms"]["forms"]))' "$1" "$2" 2>&1 | tail -1; }
one() {  # one TAG TREE MODEL FMT [extra args]
  local tag=$1 tree=$2 m=$3 w=$4; shift 4
  if [ "$tree" = new ]; then
    timeout 150 atomflow-bench run $m --weights $w --ctx 128 --tokens 256 --repeats 5 --tp 2 --allreduce peer "$@" \
      --json $OUT/ab/$tag.json >$OUT/ab/$tag.log 2>&1
  else
    (cd .ab/61eb739 && PYTHONPATH=$PWD timeout 150 python3 -c 'from atomflow_bench.cli import main; main()' run $m \
      --weights $w --ctx 128 --tokens 256 --repeats 5 --tp 2 --allreduce peer "$@" --json $OUT/ab/$tag.json) \
      >$OUT/ab/$tag.log 2>&1
  fi
  echo "rc=$? $(show $OUT/ab/$tag.json $tag)" | tee -a $OUT/ab/summary.txt
}
nvidia-smi --query-gpu=index,name --format=csv,noheader | tee $OUT/ab/gpus.txt
timeout 120 python3 -m pytest -q tests/test_tp_gpu.py -k engine -p no:cacheprovider >$OUT/ab/tptest.log 2>&1
echo "tptest engine: rc=$? $(tail -1 $OUT/ab/tptest.log)" | tee -a $OUT/ab/summary.txt
one 8b-fp16-new1 new llama-3.1-8b fp16
one 8b-fp16-old1 old llama-3.1-8b fp16
one 8b-fp16-new2 new llama-3.1-8b fp16
one 70b-fp8-new-default new llama-3.1-70b fp8
one 70b-fp8-new-ws new llama-3.1-70b fp8 --forms "short:ws/l2=24;split:ws/l2=24"
