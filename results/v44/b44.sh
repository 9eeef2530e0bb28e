#!/usr/bin/env bash
# v44: where 70B W8A16 TP4's kernel boundaries cost (phase W: the AF_NO_WAIT timing instrument on 4 GPUs, `run --tp 4`),
# then the LL hand-over from the attention to o_proj (later phases).
export ATOMFLOW_HOME=/tmp/atomflow-home PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
PH=$1; W=/tmp/v44$PH; mkdir -p $W; S=$OUT/summary-v44-$PH.txt
pack() { tar -czf $OUT/v44-$PH.tar.gz -C /tmp v44$PH; }
note() { echo "$(date +%T) $*" | tee -a $S; pack; }
show() { python3 -c 'import json, sys
r = json.load(open(sys.argv[1])); t = r.get("tp")
s = "%s TPOT %.4f ms (%.4f-%.4f) %.1f%%" % (sys.argv[2], r["tpot_ms"]["median"], r["tpot_ms"]["p10"], r["tpot_ms"]["p90"], r["roofline"]["pct"])
if t: c = t["comm"]; s += " | %s in step %.1f us, local %.1f" % (t["allreduce"], c["in_step_us"], c["step_without_exchanges_us"]["median"])
print(s)' "$1" "$2" 2>&1 | tail -1; }
one() {  # one TAG TREE MODEL FMT TP [extra args]; env DEF = ATOMFLOW_KERNEL_DEFINES
  local tag=$1 tree=$2 m=$3 w=$4 n=$5; shift 5
  if [ "$tree" = new ]; then
    ATOMFLOW_KERNEL_DEFINES="${DEF:-}" timeout 150 atomflow-bench run $m --weights $w --ctx 128 --tokens 256 --repeats 5 --tp $n --json $W/$tag.json "$@" >$W/$tag.log 2>&1
  else
    (cd .ab/$tree && ATOMFLOW_KERNEL_DEFINES="${DEF:-}" PYTHONPATH=$PWD timeout 150 python3 -c 'from atomflow_bench.cli import main; main()' run $m \
      --weights $w --ctx 128 --tokens 256 --repeats 5 --tp $n --json $W/$tag.json "$@") >$W/$tag.log 2>&1
  fi
  note "rc=$? $(show $W/$tag.json $tag)"
}
if [ "$PH" = W ]; then  # the boundaries' bound at TP4: AF_NO_WAIT 0, 4 (o_proj, down), 2 (attention), 6, 15, 0
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee -a $S
  for d in 0 4 2 6 15 0; do
    DEF="AF_NO_WAIT=$d"; [ $d = 0 ] && DEF=""
    DEF="$DEF" one 70b-fp8-tp4-nowait$d-$RANDOM new llama-3.1-70b fp8 4 --allreduce peer
  done
fi
