#!/usr/bin/env bash
# The one device command: install, GPU tests, benchmarks; a short table last, full logs and JSON under $OUT.
#   scripts/gpu_check.sh [stage ...]    stages: info kernels engine prefill bench validate gemv profile ab
#                                       (default: info kernels engine prefill bench)
#   KERNELS_K / ENGINE_K / PREFILL_K="pytest -k expression" (kernels / engine / prefill stage: a subset); each test stage logs its 25
#                                       slowest tests (--durations) and adds a row (passed, failed, wall seconds) to
#                                       the table printed last
#   BENCH_SPECS="model:fmt ..."  CTX=128 (bench: `run` per spec, ctx CTX, 256 tokens, 5 repeats)
#   PROFILE_SPECS="model:fmt ..." PROFILE_CTX=128 (profile stage)
#   engines: llama.cpp built and measured here (scripts/peer_llama_cpp.sh $LLAMA_STAGES, default all; carry
#            .carry/llama.cpp), then ours swept over the same grid (ENGINES_MODELS, ENGINES_CTX, both formats) into
#            SWEEP_DIR (default /tmp/atomflow-sweep: resumable on a warm machine), then compare-peers per model and ctx
#   tptest / tp / tpvalidate: tensor parallel (2+ GPUs): the TP GPU tests; `run` per TP_SPECS entry
#            "model:fmt:tp[:path]" (ctx $CTX, 256 tokens, 5 repeats; path peer|nccl|auto); `validate --tp` per
#            TPV_SPECS entry "model:fmt:tp" (--steps ${TPV_STEPS:-8})
#   AB_DIR=.ab/<commit> AB_SPECS="model:fmt ..." AB_ROUNDS=2 (ab: another commit's tree against this one on the
#                                       same machine, interleaved old, new, old, new per spec; the old tree as carried
#                                       by `git archive C atomflow_bench kernels_cu pyproject.toml | tar -x -C .ab/C`)
# The lab's stages (probe, dram) are in lab/scripts/lab_check.sh.
set -uo pipefail
FINAL=${OUT:-/tmp/atomflow-out}; OUT=$(mktemp -d); mkdir -p "$FINAL"   # logs go to $OUT, bundled into $FINAL
export PYTHONUNBUFFERED=1 ATOMFLOW_HOME=${ATOMFLOW_HOME:-/tmp/atomflow-home}
# offline machine: pinned wheels (the Llama-3.2 tokenizer) carried in .carry/wheels
[ -d .carry/wheels ] && export ATOMFLOW_WHEELHOUSE=$PWD/.carry/wheels
stages=${*:-info kernels engine prefill bench}
summary=()
note() { summary+=("$1"); printf '%s\n' "$1" | tee -a "$FINAL/summary-so-far.txt"; }  # kept if the call is cut short
line() {  # one run record in a line: TPOT median (p10-p90), % of roofline, forms and where they came from
  python3 -c 'import json, sys
r = json.load(open(sys.argv[1])); t = r["tpot_ms"]; f = r.get("forms") or {}
fo = f.get("forms") or "(engine-chosen: %s)" % (r.get("gemv_choice") or {}).get("chosen", "?")
ft, pf = r.get("ttft_ms"), r.get("prefill") or {}
first = " | TTFT %.3f ms (%s, %.0f prompt tok/s, %.1f%% of tensor-core peak)" % (ft["median"], pf["path"], pf["tok_per_s"], pf["pct_of_peak"]) if ft else ""
print("TPOT %.4f ms (%.4f-%.4f) %.1f%% of %.0f GB/s%s | %s %s | src %s" % (t["median"], t["p10"], t["p90"], r["roofline"]["pct"],
      r["copy_bandwidth_gbs"]["median"], first, fo, f.get("origin", ""), r["tool"].get("source_sha256")))' "$1" 2>&1 | tail -1
}
run_one() {  # run_one TAG MODEL FMT [tree]: one `run` (ctx $CTX, 256 tokens, 5 repeats) of this tree or another
  local tag=$1 m=$2 w=$3 tree=${4:-}
  if [ -n "$tree" ]; then
    (cd "$tree" && PYTHONPATH=$PWD timeout 400 python3 -c 'from atomflow_bench.cli import main; main()' run "$m" \
      --weights "$w" --ctx "${CTX:-128}" --tokens 256 --repeats 5 --json "$OUT/run-$tag.json") >"$OUT/run-$tag.log" 2>&1
  else
    timeout 400 atomflow-bench run "$m" --weights "$w" --ctx "${CTX:-128}" --tokens 256 --repeats 5 \
      --json "$OUT/run-$tag.json" >"$OUT/run-$tag.log" 2>&1
  fi
  note "run $tag: rc=$? $(line "$OUT/run-$tag.json")"
}

suites=()  # "name passed failed seconds" per pytest stage, for the table at the end
suite() {  # suite NAME FILES TIMEOUT K [pytest args]: GPU test files (space-separated), its 25 slowest tests in its log, wall seconds
  local name=$1 file=$2 limit=$3 k=$4; shift 4
  local t0 rc last
  t0=$(date +%s)
  timeout "$limit" python3 -m pytest -q $file -p no:cacheprovider --durations=25 ${k:+-k "$k"} "$@" \
    >"$OUT/$name.log" 2>&1
  rc=$?
  local secs=$(( $(date +%s) - t0 ))
  last=$(grep -E "[0-9]+ (passed|failed|error)" "$OUT/$name.log" | tail -1)
  [ $rc -eq 124 ] && last="timed out after ${limit}s; last summary: ${last:-none}"
  note "$name: rc=$rc ${secs}s $last"
  count() { local n; n=$(printf '%s' "$last" | grep -oE "[0-9]+ $1" | grep -oE "^[0-9]+"); echo "${n:-0}"; }
  local failed=$(( $(count failed) + $(count error) ))  # "error" counts "2 errors" too
  [ $rc -eq 124 ] && failed="$failed+timeout"
  suites+=("$name $(count passed) $failed $secs")
  [ $rc -ne 0 ] && grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/$name.log" | head -40
  return 0
}

python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >>"$OUT/install.log" 2>&1 && export PYTHONPATH=/tmp/site; fi

for st in $stages; do
  case $st in
    info)
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
      atomflow-bench doctor --format md >"$OUT/doctor.md" 2>&1
      note "doctor: rc=$? $(grep -c '| ok |' "$OUT/doctor.md") ok, $(grep -c '| FAIL |' "$OUT/doctor.md") FAIL" ;;
    kernels)
      suite kernels tests/test_kernels_gpu.py "${KERNELS_TIMEOUT:-400}" "${KERNELS_K:-}" ;;
    engine)
      suite engine tests/test_engine_gpu.py "${ENGINE_TIMEOUT:-560}" "${ENGINE_K:-}" -s ;;
    prefill)  # the batched prefill: its kernels, its path in the engine, profile and validate on it
      suite prefill "tests/test_prefill_gpu.py tests/test_validate_prefill_gpu.py tests/test_prefill_attention.py" \
        "${PREFILL_TIMEOUT:-400}" "${PREFILL_K:-}" ;;
    bench)
      for spec in ${BENCH_SPECS:-"llama-3.2-3b:fp8" "llama-3.2-3b:fp16" "llama-3.2-1b:fp16"}; do
        run_one "${spec%%:*}-${spec##*:}" "${spec%%:*}" "${spec##*:}"
      done ;;
    validate)
      for w in fp16 fp8; do
        atomflow-bench validate llama-3.2-3b --weights $w --steps 32 --json "$OUT/validate-3b-$w.json" \
          >"$OUT/validate-3b-$w.log" 2>&1
        note "validate 3b $w: rc=$? $(grep -E 'probes PASS|greedy|KL' "$OUT/validate-3b-$w.log" | tr -s ' ' | head -3 | tr '\n' ' ')"
      done ;;
    gemv)
      atomflow-bench gemv llama-3.2-3b --json "$OUT/gemv-3b.json" >"$OUT/gemv-3b.log" 2>&1
      note "gemv 3b: rc=$? % of copy BW isolated/chained: $(python3 -c 'import json, sys
g = json.load(open(sys.argv[1]))
print(" ".join("%s-%s=%.0f/%.0f" % (r["role"], r["format"], r["pct_of_copy"], r["chained_pct_of_copy"]) for r in g["rows"]))' \
        "$OUT/gemv-3b.json" 2>&1 | tail -1)" ;;
    profile)
      for spec in ${PROFILE_SPECS:-"llama-3.2-3b:fp8"}; do
        m=${spec%%:*}; w=${spec##*:}; tag="${m#llama-}-$w-ctx${PROFILE_CTX:-128}"
        atomflow-bench profile "$m" --weights $w --ctx "${PROFILE_CTX:-128}" --json "$OUT/profile-$tag.json" \
          >"$OUT/profile-$tag.log" 2>&1
        note "profile $tag: rc=$? $(grep -E 'sum of kernels' -A1 "$OUT/profile-$tag.log" | tr -s ' ' | tr '\n' ' ')"
      done ;;
    engines)
      M=${ENGINES_MODELS:-"llama-3.2-1b llama-3.2-3b llama-3.1-8b"}; C=${ENGINES_CTX:-"128 2048"}
      SW=${SWEEP_DIR:-/tmp/atomflow-sweep}; LW=${LLAMA_WORK:-/tmp/llama-cpp-work}
      OUT=$OUT/llama-cpp WORK=$LW MODELS="$M" CONTEXTS="$C" STAGE_TIMEOUT=${LLAMA_TIMEOUT:-480} \
        bash scripts/peer_llama_cpp.sh ${LLAMA_STAGES:-all} >"$OUT/llama-cpp.log" 2>&1
      note "llama.cpp: rc=$? $(grep -cE '^(bench|server).*rc=0' "$LW/results/summary.txt" 2>/dev/null) bench/server steps ok so far"
      timeout ${SWEEP_TIMEOUT:-560} atomflow-bench sweep --models "$(echo $M | tr ' ' ',')" --weights fp16,fp8 \
        --ctx "$(echo $C | tr ' ' ',')" --out "$SW" >"$OUT/sweep.log" 2>&1
      note "sweep: rc=$? $(grep -m1 -oE '[0-9]+ done.*' "$OUT/sweep.log")"
      mkdir -p "$OUT/compare"
      for m in $M; do for c in $C; do
        ours=$(ls "$SW/$m-fp16-ctx$c-tp1.json" "$SW/$m-fp8-ctx$c-tp1.json" 2>/dev/null)
        [ -n "$ours" ] || continue
        atomflow-bench compare-peers $ours $(ls "$LW"/results/records/llama.cpp-*-"$m"-*ctx$c.json 2>/dev/null) \
          $(ls "$LW"/results/records/llama.cpp-server-*-"$m"-*.json 2>/dev/null) --format md \
          >"$OUT/compare/$m-ctx$c.md" 2>&1
        note "compare $m ctx $c: rc=$? $(grep -c '^|' "$OUT/compare/$m-ctx$c.md") table lines"
      done; done
      cp -r "$SW" "$OUT/sweep" 2>/dev/null
      mkdir -p "$OUT/llama-cpp-records" && cp "$LW"/results/records/*.json "$OUT/llama-cpp-records/" 2>/dev/null ;;
    tptest)
      suite tptest tests/test_tp_gpu.py "${TPTEST_TIMEOUT:-300}" "" -x ;;
    tp)
      for spec in ${TP_SPECS:-"llama-3.2-3b:fp16:2:peer"}; do
        IFS=: read -r m w n path <<<"$spec"; path=${path:-auto}
        tag="${m#llama-}-$w-tp$n-$path"
        args=(); [ "$n" -gt 1 ] && args=(--tp "$n" --allreduce "$path")
        timeout ${TP_RUN_TIMEOUT:-300} atomflow-bench run "$m" --weights "$w" --ctx "${CTX:-128}" --tokens 256 --repeats 5 \
          "${args[@]}" --json "$OUT/run-$tag.json" >"$OUT/run-$tag.log" 2>&1
        rc=$?
        note "run $tag: rc=$rc $(line "$OUT/run-$tag.json") $(python3 -c 'import json, sys
t = json.load(open(sys.argv[1])).get("tp")
if t:
    c = t["comm"]
    print("| sums:", t["allreduce"], "in step %.1f us/token;" % c["in_step_us"],
          " ".join("%s %.2f us/sum, %.1f us/token alone" % (k, v["sum_us"], v["per_token_us"]) for k, v in c["paths"].items()))' \
          "$OUT/run-$tag.json" 2>/dev/null) $( [ $rc -ne 0 ] && tail -2 "$OUT/run-$tag.log" | tr '\n' ' ')"
      done ;;
    tpvalidate)
      for spec in ${TPV_SPECS:-"llama-3.2-3b:fp16:2"}; do
        IFS=: read -r m w n <<<"$spec"; tag="${m#llama-}-$w-tp$n"
        timeout ${TPV_TIMEOUT:-400} atomflow-bench validate "$m" --weights "$w" --tp "$n" --steps "${TPV_STEPS:-8}" \
          --json "$OUT/validate-$tag.json" >"$OUT/validate-$tag.log" 2>&1
        note "validate $tag: rc=$? $(grep -E 'probes PASS|greedy|KL' "$OUT/validate-$tag.log" | tr -s ' ' | head -3 | tr '\n' ' ') $(tail -1 "$OUT/validate-$tag.log")"
      done ;;
    ab)
      old=${AB_DIR:?AB_DIR not set}
      for spec in ${AB_SPECS:-"llama-3.2-3b:fp8"}; do
        m=${spec%%:*}; w=${spec##*:}
        for r in $(seq 1 "${AB_ROUNDS:-2}"); do
          run_one "ab-old-$r-${m#llama-}-$w" "$m" "$w" "$old"
          run_one "ab-new-$r-${m#llama-}-$w" "$m" "$w"
        done
      done ;;
    *) note "unknown stage $st" ;;
  esac
done
if [ ${#suites[@]} -gt 0 ]; then
  summary+=("" "| suite | passed | failed | seconds |" "|---|---:|---:|---:|")
  for row in "${suites[@]}"; do set -- $row; summary+=("| $1 | $2 | $3 | $4 |"); done
fi
printf '%s\n' "${summary[@]}" >"$OUT/summary.txt"
tag=$(echo "$stages" | tr ' ' '-')
tar -czf "$FINAL/gpu_check-$tag.tar.gz" -C "$OUT" .   # one file per invocation back (the device returns at most 8)
echo "================ summary ================"
cat "$OUT/summary.txt"
