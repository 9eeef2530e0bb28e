"""Stage 2 of the decode path: a model directory's tensors, by HF name, memory-mapped.

`Checkpoint(dir)` opens config.json and every `*.safetensors` file (single or sharded) lazily; tensors are
read on demand as NumPy arrays (safetensors memory-maps the files). Both the NumPy reference decoder
and the GPU loader read weights only through this class.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from .config import ModelConfig
from .errors import ConfigError, VerifyError


class Checkpoint:
    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise ConfigError(f"{self.dir}: not a model directory")
        self.config = ModelConfig.from_file(self.dir / "config.json")
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise VerifyError(f"{self.dir}: no *.safetensors files")
        self._where: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        for f in files:
            h = safe_open(str(f), framework="numpy")
            self._handles[f] = h
            for k in h.keys():
                self._where[k] = f
        missing = [k for k in self.config.tensor_shapes() if k not in self._where]
        if missing:
            raise VerifyError(f"{self.dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[0]!r}")

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def keys(self):
        return self._where.keys()

    def get(self, name: str) -> np.ndarray:
        """Tensor `name` as stored (usually float16), shape-checked against the config."""
        try:
            f = self._where[name]
        except KeyError:
            raise VerifyError(f"{self.dir}: no tensor {name!r}") from None
        t = self._handles[f].get_tensor(name)
        want = self.config.tensor_shapes().get(name)
        if want is not None and tuple(t.shape) != want:
            raise VerifyError(f"{self.dir}: tensor {name!r} has shape {tuple(t.shape)}, config says {want}")
        return t

    def lm_head(self) -> np.ndarray:
        name = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        return self.get(name)

    def tokenizer_path(self) -> Path | None:
        p = self.dir / "tokenizer.json"
        return p if p.is_file() else None

    def manifest(self) -> dict | None:
        p = self.dir / "manifest.json"
        return json.loads(p.read_text()) if p.is_file() else None


# ---- placing weights into the arena (GPU) -------------------------------------------------------------

def _layer_parts(ckpt: Checkpoint, i: int) -> dict[str, list[str]]:
    """Engine region -> the HF tensors stacked (along rows) into it."""
    p = f"model.layers.{i}."
    return {
        f"L{i}.wqkv": [p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"],
        f"L{i}.wo": [p + "self_attn.o_proj.weight"],
        f"L{i}.wgu": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
        f"L{i}.wd": [p + "mlp.down_proj.weight"],
        f"L{i}.attn_norm": [p + "input_layernorm.weight"],
        f"L{i}.mlp_norm": [p + "post_attention_layernorm.weight"],
    }


class _PinnedUploader:
    """Host -> device copies in bulk through one pinned staging buffer (full-speed DMA)."""

    def __init__(self, nbytes: int = 256 << 20):
        import cupy

        self._cupy = cupy
        self.mem = cupy.cuda.alloc_pinned_memory(nbytes)
        self.buf = np.frombuffer(self.mem, dtype=np.uint8, count=nbytes)
        self.copied = 0

    def put(self, dst, parts: list[np.ndarray]) -> None:
        """Copy `parts` (stacked along axis 0, same dtype as `dst`) into the device array `dst`."""
        rt = self._cupy.cuda.runtime
        total = sum(p.nbytes for p in parts)
        if total != dst.nbytes:
            raise VerifyError(f"weights of {total} bytes do not fill a {dst.nbytes}-byte region {dst.shape}")
        off = 0
        for part in parts:
            src = np.ascontiguousarray(part.astype(dst.dtype, copy=False)).reshape(-1).view(np.uint8)
            for o in range(0, src.size, self.buf.size):
                n = min(self.buf.size, src.size - o)
                self.buf[:n] = src[o:o + n]
                rt.memcpy(dst.data.ptr + off, self.buf.ctypes.data, n, rt.memcpyHostToDevice)
                off += n
        self.copied += total


def upload_weights(ckpt: Checkpoint, arena, fmt: str, lib, progress=None) -> dict:
    """Fill the arena's weight pool from the checkpoint; fp8 is quantised on the GPU (quantize_fp8.cu) unless
    the model directory holds a `model-fp8.safetensors` from `fetch --format fp8`, which is copied as is.
    Returns {"bytes": host bytes copied, "fp8_source": "gpu-quantized" | "file" | None}."""
    import cupy

    from .step import quantize_launch

    cfg = ckpt.config
    up = _PinnedUploader()
    fp8_file = ckpt.dir / "model-fp8.safetensors"
    use_file = fmt == "fp8" and fp8_file.is_file()
    if use_file:
        fp8 = safe_open(str(fp8_file), framework="numpy")
    staging = None
    if fmt == "fp8" and not use_file:
        staging = cupy.empty(arena.plan.staging_bytes // 2, dtype=cupy.float16)
    jobs = [("embed", ["model.embed_tokens.weight"])]
    for i in range(cfg.num_hidden_layers):
        jobs += list(_layer_parts(ckpt, i).items())
    jobs.append(("final_norm", ["model.norm.weight"]))
    if not cfg.tie_word_embeddings:
        jobs.append(("lm_head", ["lm_head.weight"]))
    task = progress.add_task("weights -> GPU", total=len(jobs)) if progress else None
    for region, names in jobs:
        dst = arena[region]
        if dst.dtype == np.uint8:  # fp8 projection
            scale = arena[region + ".scale"]
            if use_file:
                up.put(dst, [fp8.get_tensor(n[:-len(".weight")] + ".weight_fp8") for n in names])
                up.put(scale, [fp8.get_tensor(n[:-len(".weight")] + ".weight_scale") for n in names])
            else:
                rows, k = dst.shape
                tmp = staging[: rows * k].reshape(rows, k)
                up.put(tmp, [ckpt.get(n) for n in names])
                quantize_launch(lib, tmp, dst, scale)()
        else:
            up.put(dst, [ckpt.get(n) for n in names])
        if progress:
            progress.advance(task)
    cupy.cuda.Device().synchronize()
    del staging
    arena["rope_cs"].set(cfg.rope_cos_sin(arena["rope_cs"].shape[0]))
    return {"bytes": up.copied, "fp8_source": ("file" if use_file else "gpu-quantized") if fmt == "fp8" else None}
