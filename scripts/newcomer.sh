#!/usr/bin/env bash
# The newcomer's path, replayed in fresh virtual environments: each step's command, exit code, seconds and the first
# line of its stderr, as a markdown table (stdout). On a machine without a GPU the GPU commands must refuse at once
# with exit 3; on a GPU machine they run. Needs network access to PyPI (pip).
#   scripts/newcomer.sh [WORKDIR]        (default: a new temporary directory; removed at the end)
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=${1:-$(mktemp -d)}
mkdir -p "$work"; cd "$work" || exit 1
export ATOMFLOW_HOME=$work/home PIP_DISABLE_PIP_VERSION_CHECK=1
echo "| step | command | exit | seconds | stderr (first line) |"
echo "|---|---|---|---|---|"
n=0
step() {  # step "what" cmd...  (runs in $work; output kept under $work/logs)
  local what=$1; shift
  n=$((n + 1)); mkdir -p logs
  local t0=$SECONDS
  "$@" >"logs/$n.out" 2>"logs/$n.err"
  local rc=$?
  local first; first=$(grep -v '^\s*$' "logs/$n.err" | grep -v 'WARNING: Running pip as\|WARNING: Location' | head -1 | cut -c1-160 | tr '|' '/')
  local shown="$*"; [[ $1 == python3 && $2 == -c ]] && shown="python3 -c <a few lines>"
  printf '| %s | `%s` | %s | %s | %s |\n' "$what" "$(echo "$shown" | sed "s|$repo|<repo>|g; s|$work|<work>|g" | head -1 | cut -c1-110)" \
    "$rc" "$((SECONDS - t0))" "$first"
  return $rc
}

python3 -m venv user && . user/bin/activate
step "install (README, first command)" python3 -m pip install -q -e "$repo[cuda13]"
step "the main job" atomflow-bench run
step "run with options and --json" atomflow-bench run llama-3.2-1b --ctx 64 --tokens 16 --repeats 2 --json out.json
step "no file written" test ! -e out.json
step "profile" atomflow-bench profile
step "nothing fetched so far" bash -c "test ! -d '$ATOMFLOW_HOME/models' || test -z \"\$(ls -A '$ATOMFLOW_HOME/models')\""
step "doctor" atomflow-bench doctor --no-bandwidth
step "catalog and store" atomflow-bench models
step "tiny local model" python3 -c "
from pathlib import Path
from atomflow_bench.config import ModelConfig
from atomflow_bench.store.sources.synthetic import make_synthetic
cfg = ModelConfig.from_hf_dict(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=True, model_type='llama'))
make_synthetic(cfg, Path('good'), seed=0)"
step "fetch a local directory" atomflow-bench fetch ./good
step "the name fetch printed" atomflow-bench fetch local--good --verify
step "CPU reference, explicitly" atomflow-bench generate local--good --prompt "hello" --tokens 4
step "truncated safetensors" bash -c "mkdir -p bad && cp good/config.json bad/ && head -c 100 good/model.safetensors > bad/model.safetensors && atomflow-bench fetch ./bad"
step "a record for compare" python3 -c "
import json, sys
sys.path.insert(0, '$repo/tests')
from helpers_runs import make_run
json.dump(make_run(1.5), open('base.json', 'w'))
r = make_run(1.5); r['tpot_ms']['median'] = float('nan'); json.dump(r, open('nan.json', 'w'))"
step "compare: a NaN median" atomflow-bench compare base.json nan.json
step "compare: itself" atomflow-bench compare base.json base.json
step "tables into a pipe (markdown)" bash -c "atomflow-bench baseline list | head -4"
step "tables as csv" atomflow-bench baseline list --format csv
deactivate

python3 -m venv wheel && . wheel/bin/activate
step "build the wheel" python3 -m pip wheel -q --no-deps -w dist "$repo"
step "install the wheel" bash -c "python3 -m pip install -q dist/*.whl"
step "kernels inside the package" python3 -c "
from atomflow_bench.gpu.nvrtc import KERNELS_DIR
import atomflow_bench, pathlib
assert str(KERNELS_DIR).startswith(str(pathlib.Path(atomflow_bench.__file__).parent)), KERNELS_DIR
assert len(list(KERNELS_DIR.glob('*.cu'))) >= 7
print(KERNELS_DIR)"
step "baselines from the wheel" bash -c "atomflow-bench baseline list --format json | python3 -c 'import json,sys; d=json.load(sys.stdin); assert len(d) >= 2, d; print(len(d))'"
deactivate
[ -z "${1:-}" ] && rm -rf "$work"
exit 0
