#!/usr/bin/env bash
# The lab's device stages (not the product's; scripts/gpu_check.sh runs those): one device call, logs under $OUT.
#   lab/scripts/lab_check.sh [stage ...]    stages: probe dram
#   PROBE_SPECS="model:fmt ..." PROBE_ARGS="..." (probe: the persistent-stream probe, lab/scripts/probe_stream.py)
#   DRAM_SPECS="model:fmt[@DEF=V,...] ..." (dram: HBM throughput over the step from the hardware counters, ncu)
set -uo pipefail
FINAL=${OUT:-/tmp/atomflow-out}; OUT=$(mktemp -d); mkdir -p "$FINAL"
export PYTHONUNBUFFERED=1 ATOMFLOW_HOME=${ATOMFLOW_HOME:-/tmp/atomflow-home}
summary=()
note() { summary+=("$1"); printf '%s\n' "$1" | tee -a "$FINAL/summary-so-far.txt"; }
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
for st in ${*:-probe}; do
  case $st in
    probe)   # PROBE_SPECS="model:fmt ..." PROBE_ARGS="--att-ns N ...": the persistent-stream probe (lab/probe.py)
      for spec in ${PROBE_SPECS:-"llama-3.2-3b:fp8"}; do
        m=${spec%%:*}; w=${spec##*:}; tag="${m#llama-}-$w"
        timeout 240 python3 lab/scripts/probe_stream.py "$m" "$w" ${PROBE_ARGS:-} --json "$OUT/probe-$tag.json" \
          >"$OUT/probe-$tag.log" 2>&1
        note "probe $tag: rc=$? $(python3 -c 'import json, sys
p = json.load(open(sys.argv[1]))
print("floor %.4f ms |" % p["floor_ms"], " | ".join("%s %.4f ms (%.1f%%)" % (v["name"], v["ms"]["median"], v["pct_of_copy"])
                                                   for v in p["variants"]))' "$OUT/probe-$tag.json" 2>&1 | tail -1)"
      done ;;
    dram)   # DRAM_SPECS="model:fmt[@DEF=V,DEF=V] ..." (default 3B fp8): HBM's throughput over 2 graph replays from the
            # hardware counters (Nsight Compute PM sampling; lab/scripts/dram_timeline.py), folded per layer
      NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
      for spec in ${DRAM_SPECS:-"llama-3.2-3b:fp8"}; do
        d=""; [[ $spec == *@* ]] && { d=${spec#*@}; d=${d//,/ }; spec=${spec%%@*}; }
        m=${spec%%:*}; w=${spec##*:}; tag="${m#llama-}-$w"; [ -n "$d" ] && tag="$tag-${d//[= ]/_}"
        ATOMFLOW_KERNEL_DEFINES="$d" timeout 300 "$NCU" --profile-from-start off --graph-profiling graph \
          --section PmSampling --clock-control none --cache-control none -f -o "$OUT/dram-$tag" \
          python3 lab/scripts/dram_timeline.py child "$m" "$w" "${CTX:-128}" 2 >"$OUT/dram-$tag.log" 2>&1
        rc=$?
        "$NCU" -i "$OUT/dram-$tag.ncu-rep" --page raw --csv --print-metric-instances values >"$OUT/dram-$tag.csv" 2>>"$OUT/dram-$tag.log"
        layers=$(python3 -c 'import sys; from atomflow_bench.config import CATALOG; print(CATALOG[sys.argv[1]].config.num_hidden_layers)' "$m")
        python3 lab/scripts/dram_timeline.py summary "$OUT/dram-$tag.csv" "$OUT/dram-$tag.json" "$layers" >"$OUT/dram-$tag.txt" 2>&1
        note "dram $tag: rc=$rc $(grep unprofiled "$OUT/dram-$tag.log" | cut -c1-60) | $(grep -o 'HBM mean.*dips' "$OUT/dram-$tag.txt" | tr '\n' ' ')"
        rm -f "$OUT/dram-$tag.ncu-rep"
      done ;;
    *) note "unknown stage $st" ;;
  esac
done
printf '%s\n' "${summary[@]}" >"$OUT/summary.txt"
tar -czf "$FINAL/lab_check.tar.gz" -C "$OUT" .
echo "================ summary ================"
cat "$OUT/summary.txt"
