#!/usr/bin/env bash
# v42.3 (one GPU): the single-GPU step after v42's kernel changes (QKV: o_proj-head arguments, count 0 off tensor
# parallel) against .ab/3e8a271, interleaved, 3B W8A16 at its reference form; forms given, so nothing is tuned.
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
W=/tmp/v42e; mkdir -p $W; S=$OUT/summary-v42-E.txt
F="short:ring/l2=4;split:ring/l2=4"
pack() { tar -czf $OUT/v42-E.tar.gz -C /tmp v42e; }
show() { python3 -c 'import json, sys
r = json.load(open(sys.argv[1]))
print("%s TPOT %.4f ms (%.4f-%.4f) %.1f%%" % (sys.argv[2], r["tpot_ms"]["median"], r["tpot_ms"]["p10"], r["tpot_ms"]["p90"], r["roofline"]["pct"]))' "$1" "$2" 2>&1 | tail -1; }
one() {  # one TAG TREE
  if [ "$2" = new ]; then
    timeout 100 atomflow-bench run llama-3.2-3b --source synthetic --weights fp8 --ctx 128 --tokens 256 --repeats 5 \
      --forms "$F" --json $W/$1.json >$W/$1.log 2>&1
  else
    (cd .ab/$2 && PYTHONPATH=$PWD timeout 100 python3 -c 'from atomflow_bench.cli import main; main()' run llama-3.2-3b \
      --source synthetic --weights fp8 --ctx 128 --tokens 256 --repeats 5 --forms "$F" --json $W/$1.json) >$W/$1.log 2>&1
  fi
  local rc=$?; echo "$(date +%T) rc=$rc $(show $W/$1.json $1)" | tee -a $S; pack
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a $S
timeout 120 atomflow-bench fetch llama-3.2-3b --source synthetic >$W/fetch.log 2>&1; echo "$(date +%T) fetch rc=$?" | tee -a $S
one 3b-fp8-new1 new
one 3b-fp8-old 3e8a271
one 3b-fp8-new2 new
