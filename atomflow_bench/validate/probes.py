"""The engine side of validate: which probes are compared, and the engine's values of them, position by position.

Two backends: the GPU `Engine` (its real kernels; each launch's output copied to the host right after it, the same
launches the CUDA graph replays) and, without a usable GPU or when asked, the NumPy `ReferenceDecoder` on the CPU,
labelled as such in every output.
"""
from __future__ import annotations

import platform
from pathlib import Path

import numpy as np

from ..errors import AtomflowError, ConfigError, GpuUnavailable
from ..gpu.device import gpu_info, require_gpu
from ..gpu.engine import Engine
from ..gpu.prefill import Prefill
from ..progress import progress
from ..measure.context import RunContext
from ..reference import ReferenceDecoder
from ..store.checkpoint import Checkpoint

# Above this size the reference keeps the stored fp16 matrices and upcasts them block by block at use, so a CPU run
# of a large model needs 2 bytes per parameter of host memory instead of 4.
REFERENCE_FP32_MAX_BYTES = 4 << 30


def probe_names(n_layers: int) -> list[str]:
    """The compared probes in decode order: embed, per layer attn then mlp, final_norm, logits."""
    return ["embed"] + [f"layers.{i}.{k}" for i in range(n_layers) for k in ("attn", "mlp")] + ["final_norm", "logits"]


def pick_backend(backend: str) -> tuple[str, str]:
    """('gpu' | 'numpy', label) for backend auto | gpu | numpy; auto falls back to the reference without a GPU."""
    if backend not in ("auto", "gpu", "numpy"):
        raise ConfigError(f"unknown backend {backend!r} (expected auto, gpu or numpy)")
    if backend == "numpy":
        return "numpy", "NumPy reference (CPU), as requested — not the GPU engine"
    try:
        require_gpu()
    except GpuUnavailable:
        if backend == "gpu":
            raise
        return "numpy", "NumPy reference (CPU) — no GPU"
    return "gpu", "GPU engine (CuPy kernels; probes copied after each launch of the eager step)"


def backend_info(kind: str) -> dict:
    """What the backend ran on: the GPU's description, or the CPU and NumPy version."""
    if kind == "gpu":
        return {"gpu": gpu_info()}
    return {"cpu": platform.processor() or platform.machine(), "numpy": np.__version__}


def _reference(model_dir: Path, weights: str, max_seq: int, record_taps: bool = False) -> ReferenceDecoder:
    ckpt = Checkpoint(model_dir)
    lazy = ckpt.config.param_count() * 4 > REFERENCE_FP32_MAX_BYTES
    return ReferenceDecoder(ckpt, weights=weights, max_seq=max_seq, record_taps=record_taps, lazy=lazy)


def free_gpu() -> None:
    """Give the memory pool's blocks back, so whatever runs next on the GPU plans its arena with them."""
    try:
        import cupy  # an optional extra: present whenever an Engine was built

        cupy.get_default_memory_pool().free_all_blocks()
    except Exception:  # noqa: BLE001 - best effort
        pass


def engine_probes(model_dir: str | Path, weights: str, sequence: list[int], n_positions: int, names: list[str],
                  backend: str = "auto", forms=None, context: RunContext | None = None, prompt_len: int | None = None,
                  prefill_chunk: int | None = None) -> tuple[dict, list[dict[str, np.ndarray]], dict | None]:
    """Teacher-force `sequence` through the engine for `n_positions` positions; per position the probes `names`.

    GPU: `Engine.reset(sequence)` makes the step's argmax kernel feed the sequence's next token, and
    `step_eager(taps=True)` per position gives the real kernels' buffers. `forms`: the launch forms to check (given,
    else a saved tune, else the defaults; never timed here). `context`: the run context the engine is made in (one
    GPU by default; a tensor-parallel rank's compares the replicated probes and the logits gathered from the
    vocabulary shards: every rank runs this). With `prompt_len` the same engine then takes the prefill path too
    (`prefill_probes`, chunks of `prefill_chunk` tokens, default the product's).
    No GPU (or backend="numpy"): `ReferenceDecoder(record_taps=True)`, labelled as such.
    Returns ({"kind", "label", ...info}, [probes per position], the prefill path's: `prefill_probes`' answer, or
    {"skipped": why} where it cannot be checked, or None without `prompt_len`).
    """
    kind, label = pick_backend(backend)
    info = {"kind": kind, "label": label, **backend_info(kind)}
    out: list[dict[str, np.ndarray]] = []
    if kind == "numpy":
        with progress("NumPy reference: positions", n_positions) as advance:  # about 1 s a position on a 1B model
            dec = _reference(Path(model_dir), weights, len(sequence), record_taps=True)
            for s in range(n_positions):
                dec.step(int(sequence[s]))
                out.append({n: dec.taps[n] for n in names})
                advance()
        why = "the NumPy reference has no batched prefill (the GPU engine's is checked on a GPU)"
        return info, out, None if prompt_len is None else {"skipped": why}

    ctx = context if context is not None else RunContext(Path(model_dir).name, Path(model_dir), "validate")
    eng = ctx.engine(weights, len(sequence), given=forms, tune_missing=False)
    info["forms"] = ctx.forms
    ctx.describe(eng, info)
    eng.reset(sequence)
    for _ in range(n_positions):
        taps = eng.step_eager(taps=True)
        taps["logits"] = ctx.whole_logits(eng, taps["logits"])
        out.append({n: np.asarray(taps[n], np.float32).reshape(-1) for n in names})
    info["fp8_source"] = eng.load_info.get("fp8_source")
    if prompt_len is None:
        pre = None
    elif not eng.prefills:
        pre = {"skipped": "this engine has no batched prefill (tensor parallel): its prompt is walked through the "
                          "decode step checked above"}
    else:
        pre = prefill_probes(eng, ctx, sequence, prompt_len, n_positions, names, prefill_chunk)
    del eng
    free_gpu()
    return info, out, pre


def prefill_probes(eng: Engine, ctx: RunContext, sequence: list[int], prompt_len: int, n_positions: int,
                   names: list[str], chunk: int | None = None) -> dict:
    """The prefill path's probes, position by position: the batched prefill over the prompt as `run` times it, then
    the decode steps that continue from its cache.

    The prefill (gpu/prefill.py, chunks of `chunk` tokens, default the product's) runs positions 0 .. P-1 (P =
    `prompt_len`) and then, on one GPU, the lm_head on the last row; its taps give the fp32 residual rows of each
    chunk after "embed", after each layer's "o_proj" (the probe layers.{i}.attn) and after its "down"
    (layers.{i}.mlp), and the lm_head's final_norm and logits at position P-1. It computes no final_norm or logits
    at positions 0 .. P-2, so those lack them. Tensor parallel (the lm_head is the decode step's there): the prefill
    runs positions 0 .. P-2 and the decode step P-1. The decode steps after it read the prefill's K/V and give every
    probe. The K/V cache is zeroed first, so no row left by an earlier run can stand in for one the prefill fails to
    write. Returns {"chunk": the chunk used, "batched": the positions the prefill ran, "positions": [probes per
    position]}, or {"skipped": why} when the prefill cannot be made here.
    """
    try:
        pf = eng.prefiller() if chunk is None else Prefill(eng, chunk)
    except AtomflowError as e:
        return {"skipped": str(e)}
    probe_of = {"embed": "embed"}
    for i in range(eng.cfg.num_hidden_layers):
        probe_of[f"layers.{i}.o_proj"], probe_of[f"layers.{i}.down"] = f"layers.{i}.attn", f"layers.{i}.mlp"
    probe_of = {op: p for op, p in probe_of.items() if p in names}
    whole = pf.lm_head is not None  # the prefill makes the first token itself
    batched = prompt_len if whole else prompt_len - 1
    out: list[dict[str, np.ndarray]] = [{} for _ in range(batched)]
    starts = [0, 0]  # the first position of the chunk being tapped, and of the next

    def tap(op: str, rows) -> None:
        if op == "embed":  # each chunk's first op
            starts[0], starts[1] = starts[1], starts[1] + rows.shape[0]
        if op in probe_of:
            for r, row in enumerate(np.asarray(rows.get(), np.float32)):
                out[starts[0] + r][probe_of[op]] = row
        if op == "lm_head":
            last = out[prompt_len - 1]
            for name, buf in (("final_norm", eng.arena["xnorm"]), ("logits", eng.arena["logits"])):
                if name in names:
                    last[name] = np.asarray(buf.get(), np.float32).reshape(-1)

    eng.reset(sequence)
    with eng.stream:
        eng.arena["k_cache"].fill(0)
        eng.arena["v_cache"].fill(0)
    pf.fill(sequence[:prompt_len] if whole else sequence, upto=None if whole else prompt_len - 1, taps=tap)
    for _ in range(batched, n_positions):
        taps = eng.step_eager(taps=True)
        taps["logits"] = ctx.whole_logits(eng, taps["logits"])
        out.append({n: np.asarray(taps[n], np.float32).reshape(-1) for n in names})
    return {"chunk": pf.chunk, "batched": batched, "positions": out}


def engine_logits(model_dir: Path, weights: str, ids: list[int], kind: str) -> np.ndarray:
    """float32 logits [len(ids) - 1, vocab] of positions 0..T-2 (each predicting ids[s + 1]), teacher-forced on `ids`
    through the GPU engine (`kind` "gpu") or the NumPy reference ("numpy")."""
    n = len(ids) - 1
    if kind == "numpy":
        with progress(f"NumPy reference {weights}: positions", n) as advance:
            dec = _reference(model_dir, weights, len(ids))
            rows = []
            for t in ids[:-1]:
                rows.append(dec.step(int(t)))
                advance()
        return np.stack(rows)
    eng = Engine(model_dir, weights=weights, max_seq=len(ids))
    eng.reset(ids)
    out = np.empty((n, eng.cfg.vocab_size), np.float32)
    for s in range(n):
        eng.step_eager()
        eng.stream.synchronize()
        out[s] = eng.arena["logits"].get()
    del eng
    free_gpu()
    return out
