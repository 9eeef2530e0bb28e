#!/usr/bin/env bash
# CI performance-regression gate (needs a CUDA GPU): run the reference configs, then compare each results file
# with the committed reference results/reference/<config>.json through `atomflow-bench compare`.
#
#   scripts/perf_regression.sh            exit 0: no regression; 1: a regression; 2: a run failed or a
#                                         comparison was refused (another GPU, model, format or context)
# Environment:
#   MAX_REGRESSION    allowed TPOT (and TTFT) slow-down beyond the runs' p10-p90 bands (default 5%)
#   OUT               where the new results go (default results/ci)
#   REFERENCE_DIR     the committed references (default results/reference)
#   UPDATE_REFERENCE  1: copy the new results over the references instead of comparing (then commit them)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

max_regression=${MAX_REGRESSION:-5%}
out=${OUT:-results/ci}
reference_dir=${REFERENCE_DIR:-results/reference}
# model weights context tokens repeats
configs=(
  "llama-3.2-3b fp8 128 256 5"
  "llama-3.2-3b fp16 128 256 5"
)

mkdir -p "$out"
status=0
for config in "${configs[@]}"; do
  read -r model weights ctx tokens repeats <<<"$config"
  name="$model-$weights-ctx$ctx"
  new="$out/$name.json"
  echo "=== $name"
  rm -f "$new"
  if ! atomflow-bench run "$model" --weights "$weights" --ctx "$ctx" --tokens "$tokens" --repeats "$repeats" \
      --json "$new" || [[ ! -f $new ]]; then
    echo "::error::$name: atomflow-bench run failed or wrote no results (no usable GPU?)"
    status=2
    continue
  fi
  reference="$reference_dir/$name.json"
  if [[ ${UPDATE_REFERENCE:-0} == 1 ]]; then
    mkdir -p "$reference_dir"
    cp "$new" "$reference"
    echo "reference updated: $reference"
  elif [[ ! -f $reference ]]; then
    echo "::warning::$name: no reference $reference yet; run with UPDATE_REFERENCE=1 on the CI GPU and commit it"
  else
    rc=0
    atomflow-bench compare "$reference" "$new" --max-regression "$max_regression" || rc=$?
    if ((rc == 1)); then
      echo "::error::$name: performance regression against $reference"
      ((status == 0)) && status=1
    elif ((rc != 0)); then
      echo "::error::$name: comparison with $reference refused or failed (exit $rc)"
      status=2
    fi
  fi
done
exit "$status"
