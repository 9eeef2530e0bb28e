"""The engine the lab's one-GPU diagnostics run on (lab/scripts/: local_step_ab, dram_timeline, timeline_blocks).

MODEL is a model in the store (by name or path) or `name/tpN`: a tensor-parallel rank's local config of a catalog
model (gpu/tp/plan.py local_config: the rank's heads and MLP share; the embedding and lm_head whole) as a one-GPU model,
with synthetic weights generated on the GPU (gpu/synthetic.py). Its layer kernels are a rank's step without the
exchanges, timed without N GPUs (lab/PERF_NOTES.md v43)."""
from __future__ import annotations

from atomflow_bench.errors import AtomflowError


def lab_engine(model: str, weights: str, max_seq: int, **kw):
    """An Engine for `model` (see the module docstring); `kw` goes to Engine (forms, kernel_defines, ...). Without
    `forms`, the lab takes ATOMFLOW_FORMS (forms.from_env), else the engine's defaults."""
    from atomflow_bench.config import CATALOG
    from atomflow_bench.gpu import tp
    from atomflow_bench.gpu.engine import Engine
    from atomflow_bench.gpu.forms import from_env
    from atomflow_bench.gpu.synthetic import GpuSynthetic
    from atomflow_bench.store.fetch import resolve_model

    kw.setdefault("forms", from_env())
    name, sep, n = model.partition("/tp")
    if not sep:
        return Engine(resolve_model(model), weights=weights, max_seq=max_seq, **kw)
    if name not in CATALOG or not n.isdigit() or int(n) < 1:
        raise AtomflowError(f"{model!r}: expected <catalog model>/tp<N>, e.g. llama-3.1-70b/tp4")
    cfg = CATALOG[name].config
    cfg = tp.local_config(cfg, int(n)) if int(n) > 1 else cfg
    return Engine(None, weights=weights, max_seq=max_seq, source=GpuSynthetic(cfg), **kw)
