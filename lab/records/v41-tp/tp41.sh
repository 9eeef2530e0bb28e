#!/usr/bin/env bash
# v41: the fused cross-rank sum (resid_tp) against the tree before it (.ab/213398c), interleaved, plus both paths and
# the shapes issue 33 asks; part B: tensor parallel on 4 GPUs and validate --tp. Usage: bash .ab/tp41.sh A|B
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
W=/tmp/v41; mkdir -p $W
S=$OUT/summary-$1.txt
pack() { tar -czf $OUT/v41-$PART.tar.gz -C /tmp v41; }  # after every run: what a cut call leaves still comes back
PART=$1
show() { python3 -c 'import json, sys
r = json.load(open(sys.argv[1])); t = r.get("tp")
s = "%s TPOT %.4f ms (%.4f-%.4f) %.1f%%" % (sys.argv[2], r["tpot_ms"]["median"], r["tpot_ms"]["p10"], r["tpot_ms"]["p90"], r["roofline"]["pct"])
if t:
    c = t["comm"]
    s += " | %s in step %.1f us | %s" % (t["allreduce"], c["in_step_us"], " ".join("%s %.2f us/sum %.1f us/token" % (k, v["sum_us"], v["per_token_us"]) for k, v in c["paths"].items()))
print(s + " | " + str((r.get("forms") or {}).get("forms")))' "$1" "$2" 2>&1 | tail -1; }
one() {  # one TAG TREE MODEL FMT TP PATH
  local tag=$1 tree=$2 m=$3 w=$4 n=$5 p=$6 args=()
  [ "$n" -gt 1 ] && args=(--tp $n --allreduce $p)
  if [ "$tree" = new ]; then
    timeout ${T:-150} atomflow-bench run $m --weights $w --ctx 128 --tokens 256 --repeats 5 "${args[@]}" \
      --json $W/$tag.json >$W/$tag.log 2>&1
  else
    (cd .ab/$tree && PYTHONPATH=$PWD timeout ${T:-150} python3 -c 'from atomflow_bench.cli import main; main()' run $m \
      --weights $w --ctx 128 --tokens 256 --repeats 5 "${args[@]}" --json $W/$tag.json) >$W/$tag.log 2>&1
  fi
  local rc=$?
  echo "rc=$rc $(show $W/$tag.json $tag) $( [ $rc -ne 0 ] && tail -2 $W/$tag.log | tr '\n' ' ')" | tee -a $S
  pack
}
val() {  # val MODEL FMT TP
  timeout ${TV:-200} atomflow-bench validate $1 --weights $2 --tp $3 --steps 8 --json $W/validate-$1-$2-tp$3.json \
    >$W/validate-$1-$2-tp$3.log 2>&1
  echo "validate $1 $2 tp$3: rc=$? $(grep -E 'probes PASS|greedy|KL' $W/validate-$1-$2-tp$3.log | tr -s ' ' | head -3 | tr '\n' ' ') $(tail -1 $W/validate-$1-$2-tp$3.log)" | tee -a $S
  pack
}
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
if [ "$1" = A ]; then
  timeout 240 python3 -m pytest -q tests/test_tp_gpu.py -p no:cacheprovider -x >$W/tptest.log 2>&1
  rc=$?; echo "tptest: rc=$rc $(tail -1 $W/tptest.log)" | tee -a $S
  [ $rc -ne 0 ] && { grep -E "^(FAILED|ERROR)|Error|assert" $W/tptest.log | head -30; }
  one 8b-fp16-tp1 new llama-3.1-8b fp16 1 -
  one 8b-fp16-tp2-peer-new1 new llama-3.1-8b fp16 2 peer
  one 8b-fp16-tp2-peer-old 213398c llama-3.1-8b fp16 2 peer
  one 8b-fp16-tp2-peer-new2 new llama-3.1-8b fp16 2 peer
  one 8b-fp16-tp2-nccl new llama-3.1-8b fp16 2 nccl
  T=200 one 70b-fp8-tp2-peer new llama-3.1-70b fp8 2 peer
  T=200 one 70b-fp8-tp2-nccl new llama-3.1-70b fp8 2 nccl
  one 8b-fp8-tp1 new llama-3.1-8b fp8 1 -
  one 8b-fp8-tp2-peer new llama-3.1-8b fp8 2 peer
  one 3b-fp16-tp1 new llama-3.2-3b fp16 1 -
  one 3b-fp16-tp2-peer new llama-3.2-3b fp16 2 peer
else
  T=200 one 70b-fp8-tp4-peer new llama-3.1-70b fp8 4 peer
  T=200 one 70b-fp8-tp4-nccl new llama-3.1-70b fp8 4 nccl
  T=200 one 70b-fp16-tp4-peer new llama-3.1-70b fp16 4 peer
  one 8b-fp16-tp4-peer new llama-3.1-8b fp16 4 peer
  one 8b-fp16-tp4-nccl new llama-3.1-8b fp16 4 nccl
  one 8b-fp16-tp2-peer new llama-3.1-8b fp16 2 peer
  val llama-3.2-3b fp16 2
  val llama-3.1-8b fp16 2
  val llama-3.1-8b fp16 4
fi
pack
