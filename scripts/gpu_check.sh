#!/usr/bin/env bash
# One device call: install, GPU tests, benchmarks. Prints a short table last; full logs/JSON under $OUT.
#   scripts/gpu_check.sh [stage ...]    stages: info kernels engine bench bench-ab forms knobs profile gemv
#                                       validate evidence attention att-profile att-alone ab dram probe (default: info kernels engine bench)
#   KERNELS_K / ENGINE_K="pytest -k expression" (kernels / engine stage: a subset)
#   BENCH_SPECS="model:fmt ..."  CTX=128  KNOBS="DEF=V,DEF=V ..." (knobs: compile-time -D variants, 3B fp8)
#   FORMS="model:fmt@<layer-GEMV form> ..." (forms: a run per engine form, ATOMFLOW_GEMV; @auto: the engine's choice;
#                                       TOKENS=256 REPEATS=5 per run)
#   PROFILE_SPECS="model:fmt ..." PROFILE_DEFINES="DEF=V ..." PROFILE_CTX=128 TIMELINE=N (profile stage; N replays of the
#                                       in-kernel timeline instrument, 0 = off)
#   AB_DIR=.ab/<commit> AB_SPEC="model:fmt" AB_ROUNDS=2 (ab stage: the other tree vs this one, same machine;
#                                       att-profile: the other tree's ctx 8192 profile before this one's)
#   DRAM_SPECS="model:fmt[@DEF=V,...] ..." (dram: HBM throughput over the step from the hardware counters, ncu)
#   PROBE_SPECS="model:fmt ..." PROBE_ARGS="..." (probe: the persistent-stream probe, scripts/probe_stream.py)
#   ATT_KNOBS="default DEF=V,DEF=V ..." (attention / att-profile stages: per variant the ctx 8192 profile; att-alone:
#                                       per variant the in-kernel timeline of the attention launches alone)
set -uo pipefail
FINAL=${OUT:-/tmp/atomflow-out}; OUT=$(mktemp -d); mkdir -p "$FINAL"   # logs go to $OUT, bundled into $FINAL
export PYTHONUNBUFFERED=1 ATOMFLOW_HOME=${ATOMFLOW_HOME:-/tmp/atomflow-home}
# offline machine: pinned wheels (the Llama-3.2 tokenizer) carried in .carry/wheels
[ -d .carry/wheels ] && export ATOMFLOW_WHEELHOUSE=$PWD/.carry/wheels
stages=${*:-info kernels engine bench}
summary=()
note() { summary+=("$1"); printf '%s\n' "$1" | tee -a "$FINAL/summary-so-far.txt"; }  # kept if the call is cut short
buckets() {  # per attention bucket of a run record: lengths and median TPOT
  python3 -c 'import json, sys
r = json.load(open(sys.argv[1]))
print(" ".join("[%s L%d-%d %s %.4f ms]" % (b["attention"], *b["lengths"], b.get("gemv", ""), b["tpot_ms"])
               for b in r.get("attention_buckets", [])))' "$1" 2>/dev/null
}

python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >>"$OUT/install.log" 2>&1 && export PYTHONPATH=/tmp/site; fi

for st in $stages; do
  case $st in
    info)
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
      python3 -c "import cupy; print('cupy', cupy.__version__)" ;;
    kernels)
      timeout 400 python3 -m pytest -q -x tests/test_kernels_gpu.py -p no:cacheprovider ${KERNELS_K:+-k "$KERNELS_K"} \
        >"$OUT/kernels.log" 2>&1
      note "kernels: rc=$? $(tail -1 "$OUT/kernels.log")" ;;
    engine)
      timeout 560 python3 -m pytest -q tests/test_engine_gpu.py -p no:cacheprovider -s ${ENGINE_K:+-k "$ENGINE_K"} \
        >"$OUT/engine.log" 2>&1
      note "engine: rc=$? $(tail -1 "$OUT/engine.log")" ;;
    bench|bench-ab)   # bench-ab: also each run with programmatic dependent launch off
      pdls="1"; [ "$st" = bench-ab ] && pdls="0 1"
      for spec in ${BENCH_SPECS:-"llama-3.2-3b:fp8" "llama-3.2-3b:fp16" "llama-3.2-1b:fp16"}; do
        m=${spec%%:*}; w=${spec##*:}
        for p in $pdls; do
          tag="$m-$w-pdl$p"
          ATOMFLOW_PDL=$p atomflow-bench run "$m" --weights "$w" --ctx "${CTX:-128}" --tokens 256 --repeats 5 \
            --json "$OUT/run-$tag.json" >"$OUT/run-$tag.log" 2>&1
          note "run $tag: rc=$? $(grep -E 'TPOT|roofline' "$OUT/run-$tag.log" | tr -s ' ' | head -2 | tr '\n' ' ')"
          note "  $(buckets "$OUT/run-$tag.json")"
        done
      done ;;
    probe)   # PROBE_SPECS="model:fmt ..." PROBE_ARGS="--att-ns N ...": the persistent-stream probe (atomflow_bench/probe.py)
      for spec in ${PROBE_SPECS:-"llama-3.2-3b:fp8"}; do
        m=${spec%%:*}; w=${spec##*:}; tag="${m#llama-}-$w"
        timeout 240 python3 scripts/probe_stream.py "$m" "$w" ${PROBE_ARGS:-} --json "$OUT/probe-$tag.json" \
          >"$OUT/probe-$tag.log" 2>&1
        note "probe $tag: rc=$? $(python3 -c 'import json, sys
p = json.load(open(sys.argv[1]))
print("floor %.4f ms |" % p["floor_ms"], " | ".join("%s %.4f ms (%.1f%%)" % (v["name"], v["ms"]["median"], v["pct_of_copy"])
                                                   for v in p["variants"]))' "$OUT/probe-$tag.json" 2>&1 | tail -1)"
      done ;;
    forms)   # FORMS="model:fmt@<gemv form> ..." (e.g. llama-3.2-3b:fp8@dyn, @auto = the engine's choice): one run each
      for f in ${FORMS:-"llama-3.2-3b:fp8@auto" "llama-3.2-3b:fp8@dyn"}; do
        spec=${f%%@*}; g=${f#*@}; m=${spec%%:*}; w=${spec##*:}; tag="form-${m#llama-}-$w-${g//[^A-Za-z0-9.-]/_}"
        [ -e "$OUT/run-$tag.json" ] && tag="$tag-again"
        ATOMFLOW_GEMV=$g timeout 240 atomflow-bench run "$m" --weights "$w" --ctx "${CTX:-128}" --tokens "${TOKENS:-256}" \
          --repeats "${REPEATS:-5}" \
          --json "$OUT/run-$tag.json" >"$OUT/run-$tag.log" 2>&1
        note "run $tag: rc=$? $(grep -E 'TPOT|roofline|layer GEMVs' "$OUT/run-$tag.log" | tr -s ' ' | head -3 | cut -c1-160 | tr '\n' ' ')"
      done ;;
    knobs)   # compile-time variants (ATOMFLOW_KERNEL_DEFINES), e.g. KNOBS="GEMV_LOADS=16 NAME=V,NAME2=V" on
      for k in ${KNOBS:-}; do   # KNOB_SPEC="model:fmt" (default llama-3.2-3b:fp8); an entry "model:fmt@DEFS" names its
        ks=${KNOB_SPEC:-llama-3.2-3b:fp8}; [[ $k == *@* ]] && { ks=${k%%@*}; k=${k#*@}; }   # own spec; "default": no -D
        ktag=${ks#llama-}; tag="knob-${ktag//:/-}-${k//[=,]/_}"; d="${k//,/ }"; [ "$k" = default ] && d=""
        [ -e "$OUT/run-$tag.json" ] && tag="$tag-again"
        ATOMFLOW_KERNEL_DEFINES="$d" timeout 240 atomflow-bench run "${ks%%:*}" --weights "${ks##*:}" --ctx "${CTX:-128}" \
          --json "$OUT/run-$tag.json" >"$OUT/run-$tag.log" 2>&1
        note "run $tag: rc=$? $(grep -E 'TPOT|roofline' "$OUT/run-$tag.log" | tr -s ' ' | head -2 | tr '\n' ' ')"
        note "  $(buckets "$OUT/run-$tag.json")"
      done ;;
    profile)   # PROFILE_SPECS="model:fmt ..." (default 3B fp8 and fp16); the note: role=adds/floor µs per launch
      for spec in ${PROFILE_SPECS:-"llama-3.2-3b:fp8" "llama-3.2-3b:fp16"}; do
        m=${spec%%:*}; w=${spec##*:}; tag="${m#llama-}-$w"
        [ "${PROFILE_CTX:-128}" != 128 ] && tag="$tag-ctx${PROFILE_CTX}"
        ATOMFLOW_KERNEL_DEFINES="${PROFILE_DEFINES:-}" atomflow-bench profile "$m" --weights $w --ctx "${PROFILE_CTX:-128}" \
          --timeline "${TIMELINE:-0}" --json "$OUT/profile-$tag.json" >"$OUT/profile-$tag.log" 2>&1
        note "profile $tag: rc=$? $(grep -E 'sum of kernels' -A1 "$OUT/profile-$tag.log" | tr -s ' ' | tr '\n' ' ')"
        note "  in graph, role adds/floor µs per launch: $(python3 -c 'import json, sys
m = json.load(open(sys.argv[1]))["role_marginals"]
print(" ".join("%s=%.2f/%.2f" % (r["role"], r["saved_us_per_launch"], r["floor_us"] / r["count"]) for r in m["rows"]),
      "| step %.1f us, floor %.1f" % (m["step_us"]["median"], m["floor_us"]))' "$OUT/profile-$tag.json" 2>&1 | tail -1)"
        [ "${TIMELINE:-0}" != 0 ] && note "  timeline, role span/floor (release, after release) µs per launch: $(python3 -c 'import json, sys
t = json.load(open(sys.argv[1]))["timeline"]
f = lambda v: "-" if v is None else "%.2f" % v
print(" ".join("%s=%.2f/%.2f(%s,%s)[%s]" % (r["role"], r["span_us"], r["floor_us"], f(r["release_us"]), f(r["after_release_us"]),
               "/".join(f(m) for m in r["marks_us"])) for r in t["rows"]), "| replay %.1f us, instrumented %.1f, plain %.1f, clock %.0f ns" % (t["step_us"]["median"],
      t["instrumented_replay_us"], t["plain_replay_us"], t["clock_granularity_ns"]))' "$OUT/profile-$tag.json" 2>&1 | tail -1)"
      done ;;
    dram)   # DRAM_SPECS="model:fmt[@DEF=V,DEF=V] ..." (default 3B fp8): HBM's throughput over 2 graph replays from the
            # hardware counters (Nsight Compute PM sampling; scripts/dram_timeline.py), folded per layer
      NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
      for spec in ${DRAM_SPECS:-"llama-3.2-3b:fp8"}; do
        d=""; [[ $spec == *@* ]] && { d=${spec#*@}; d=${d//,/ }; spec=${spec%%@*}; }
        m=${spec%%:*}; w=${spec##*:}; tag="${m#llama-}-$w"; [ -n "$d" ] && tag="$tag-${d//[= ]/_}"
        ATOMFLOW_KERNEL_DEFINES="$d" timeout 300 "$NCU" --profile-from-start off --graph-profiling graph \
          --section PmSampling --clock-control none --cache-control none -f -o "$OUT/dram-$tag" \
          python3 scripts/dram_timeline.py child "$m" "$w" "${CTX:-128}" 2 >"$OUT/dram-$tag.log" 2>&1
        rc=$?
        "$NCU" -i "$OUT/dram-$tag.ncu-rep" --page raw --csv --print-metric-instances values >"$OUT/dram-$tag.csv" 2>>"$OUT/dram-$tag.log"
        layers=$(python3 -c 'import sys; from atomflow_bench.config import CATALOG; print(CATALOG[sys.argv[1]].config.num_hidden_layers)' "$m")
        python3 scripts/dram_timeline.py summary "$OUT/dram-$tag.csv" "$OUT/dram-$tag.json" "$layers" >"$OUT/dram-$tag.txt" 2>&1
        note "dram $tag: rc=$rc $(grep unprofiled "$OUT/dram-$tag.log" | cut -c1-60) | $(grep -o 'HBM mean.*dips' "$OUT/dram-$tag.txt" | tr '\n' ' ')"
        rm -f "$OUT/dram-$tag.ncu-rep"
      done ;;
    gemv)
      atomflow-bench gemv llama-3.2-3b --json "$OUT/gemv-3b.json" >"$OUT/gemv-3b.log" 2>&1
      note "gemv 3b: rc=$? % of copy BW isolated/chained: $(python3 -c 'import json, sys
g = json.load(open(sys.argv[1]))
print(" ".join("%s-%s=%.0f/%.0f" % (r["role"], r["format"], r["pct_of_copy"], r["chained_pct_of_copy"]) for r in g["rows"]),
      "| empty launch %.2f us; isolated ceilings %s" % (g["empty_launch_us"]["median"],
      " ".join("%.0f" % r["isolated_ceiling_pct"] for r in g["rows"])))' \
        "$OUT/gemv-3b.json" 2>&1 | tail -1)" ;;
    validate)
      for w in fp16 fp8; do
        atomflow-bench validate llama-3.2-3b --weights $w --steps 32 --json "$OUT/validate-3b-$w.json" \
          >"$OUT/validate-3b-$w.log" 2>&1
        note "validate 3b $w: rc=$? $(grep -E 'probes PASS|greedy|KL' "$OUT/validate-3b-$w.log" | tr -s ' ' | head -3 | tr '\n' ' ')"
      done ;;
    evidence)   # comparison table with live HF peers, the 8B shape, attention at ctx 8192
      atomflow-bench run llama-3.2-3b --weights fp8 --peers --json "$OUT/run-3b-fp8-peers.json" >"$OUT/run-3b-fp8-peers.log" 2>&1
      note "run 3b fp8 --peers: rc=$?"
      for w in fp8 fp16; do
        atomflow-bench run llama-3.1-8b --weights $w --json "$OUT/run-8b-$w.json" >"$OUT/run-8b-$w.log" 2>&1
        note "run 8b $w: rc=$? $(grep -E 'TPOT|roofline' "$OUT/run-8b-$w.log" | tr -s ' ' | head -2 | tr '\n' ' ')"
      done
      atomflow-bench profile llama-3.2-3b --weights fp8 --ctx 8192 --steps 8 --json "$OUT/profile-3b-fp8-ctx8192.json" \
        >"$OUT/profile-3b-fp8-ctx8192.log" 2>&1
      note "profile 3b fp8 ctx8192: rc=$? $(grep -E 'attention' "$OUT/profile-3b-fp8-ctx8192.log" | tr -s ' ' | head -1)" ;;
    attention|att-profile)   # attention: the attention kernel tests; both: the ctx 8192 profile per
      if [ "$st" = attention ]; then   # ATT_KNOBS variant ("default" = no -D; e.g. "default ATT_STAGES=2,X=1")
        python3 -m pytest -q tests/test_kernels_gpu.py -k attention -p no:cacheprovider >"$OUT/attention.log" 2>&1
        note "attention tests: rc=$? $(tail -1 "$OUT/attention.log")"
      fi
      for k in ${ATT_KNOBS:-default}; do   # AB_DIR set: the other tree's profile first, same machine
        d=""; [ "$k" != default ] && d="${k//,/ }"; tag="ctx8192-${k//[=,]/_}"
        for side in ${AB_DIR:+old} new; do
          t="$tag"; [ -n "${AB_DIR:-}" ] && t="$tag-$side"
          if [ $side = old ]; then
            (cd "$AB_DIR" && ATOMFLOW_KERNEL_DEFINES="$d" PYTHONPATH=$PWD python3 -c 'from atomflow_bench.cli import cli; cli()' \
              profile llama-3.2-3b --weights fp8 --ctx 8192 --steps 8 --json "$OUT/profile-3b-fp8-$t.json") \
              >"$OUT/profile-3b-fp8-$t.log" 2>&1
          else
            ATOMFLOW_KERNEL_DEFINES="$d" atomflow-bench profile llama-3.2-3b --weights fp8 --ctx 8192 --steps 8 \
              --json "$OUT/profile-3b-fp8-$t.json" >"$OUT/profile-3b-fp8-$t.log" 2>&1
          fi
          note "profile 3b fp8 $t: rc=$? $(grep -E 'graph step|alone in a graph' "$OUT/profile-3b-fp8-$t.log" | tr -s ' ' | tr '\n' ' ')"
        done
      done ;;
    att-alone)   # only the in-kernel timeline of the attention launches alone, per ATT_KNOBS variant (files kept at once)
      for k in ${ATT_KNOBS:-default}; do
        d=""; [ "$k" != default ] && d="${k//,/ }"; t="ctx8192-${k//[=,]/_}"
        ATOMFLOW_ATTENTION=split ATOMFLOW_GEMV=ring ATOMFLOW_KERNEL_DEFINES="$d" timeout 200 \
          python3 scripts/timeline_blocks.py llama-3.2-3b fp8 8192 10 --alone >"$FINAL/alone-3b-fp8-$t.txt" 2>&1
        note "alone timeline $t: rc=$? $(head -1 "$FINAL/alone-3b-fp8-$t.txt" | cut -c1-220)"
      done ;;
    ab)   # same-machine A/B against another commit's tree (AB_DIR, e.g. `git archive C atomflow_bench kernels_cu
      # pyproject.toml | tar -x -C .ab/C`, carried), interleaved AB_ROUNDS times: AB_SPEC="model:fmt"
      spec=${AB_SPEC:-llama-3.2-3b:fp8}; m=${spec%%:*}; w=${spec##*:}; old=${AB_DIR:?AB_DIR not set}
      for r in $(seq 1 "${AB_ROUNDS:-2}"); do
        for side in old new; do
          tag="ab-$side-$r-${m#llama-}-$w"
          if [ $side = old ]; then
            (cd "$old" && PYTHONPATH=$PWD python3 -c 'import sys, atomflow_bench; print("package", atomflow_bench.__file__); from atomflow_bench.cli import cli; cli()' run "$m" --weights "$w" \
              --ctx 128 --tokens 256 --repeats 5 --json "$OUT/run-$tag.json") >"$OUT/run-$tag.log" 2>&1
          else
            atomflow-bench run "$m" --weights "$w" --ctx 128 --tokens 256 --repeats 5 --json "$OUT/run-$tag.json" \
              >"$OUT/run-$tag.log" 2>&1
          fi
          note "run $tag: rc=$? $(grep -E 'TPOT|^package' "$OUT/run-$tag.log" | tr -s ' ' | head -2 | tr '\n' ' ')"
        done
      done ;;
    *) note "unknown stage $st" ;;
  esac
done
printf '%s\n' "${summary[@]}" >"$OUT/summary.txt"
tar -czf "$FINAL/gpu_check.tar.gz" -C "$OUT" .   # one file back (the device returns at most 8)
echo "================ summary ================"
cat "$OUT/summary.txt"
