"""Loading: a checkpoint's tensors into the arena's weight pool, in the layouts the kernels read.

Layer projections go row-major into a device staging buffer, are quantised there for fp8 (ops/small.py
quantize_launch) unless the model directory holds a `model-fp8.safetensors` from `fetch --format fp8`, and are
then written into the arena in the tiled layout (ops/gemv.py tile_view): a reshape + transpose view, no gather.
"""
from __future__ import annotations

import numpy as np
from safetensors import safe_open

from ..errors import VerifyError
from ..store.checkpoint import Checkpoint
from .ops.gemv import ROLE_PAIRING, tile_scale_view, tile_view
from .ops.small import quantize_launch


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

    def put(self, dst, parts: list) -> None:
        """Copy `parts` (host NumPy or device CuPy arrays, stacked along axis 0, same dtype as `dst`) into the device
        array `dst`."""
        cupy = self._cupy
        rt = cupy.cuda.runtime
        total = sum(p.nbytes for p in parts)
        if total != dst.nbytes:
            raise VerifyError(f"weights of {total} bytes do not fill a {dst.nbytes}-byte region {dst.shape}")
        off = 0
        for part in parts:
            if isinstance(part, cupy.ndarray):  # generated on the device (gpu/synthetic.py)
                src = cupy.ascontiguousarray(part.astype(dst.dtype, copy=False)).reshape(-1).view(cupy.uint8)
                rt.memcpy(dst.data.ptr + off, src.data.ptr, src.size, rt.memcpyDeviceToDevice)
                off += src.size
                continue
            src = np.ascontiguousarray(part.astype(dst.dtype, copy=False)).reshape(-1).view(np.uint8)
            for o in range(0, src.size, self.buf.size):
                n = min(self.buf.size, src.size - o)
                self.buf[:n] = src[o:o + n]
                rt.memcpy(dst.data.ptr + off, self.buf.ctypes.data, n, rt.memcpyHostToDevice)
                off += n
        self.copied += total


def upload_weights(ckpt: Checkpoint, arena, fmt: str, lib, progress=None, shard=None) -> dict:
    """Fill the arena's weight pool from the checkpoint (see the module docstring), or with a tensor-parallel rank's
    `shard` (gpu/tp/plan.py RankShard) of it: each tensor sliced at load (shard.slice_weight), or generated on the device by
    a source with `get_shard` (gpu/synthetic.py). Returns {"bytes": bytes copied, "fp8_source": "gpu-quantized" |
    "file" | None}."""
    import cupy

    cfg = ckpt.config
    up = _PinnedUploader()
    if hasattr(ckpt, "get_shard"):
        get = lambda n: ckpt.get_shard(n, shard)  # noqa: E731
    elif shard is not None:
        get = lambda n: shard.slice_weight(n, ckpt.get(n))  # noqa: E731
    else:
        get = ckpt.get
    fp8_file = ckpt.dir / "model-fp8.safetensors" if ckpt.dir is not None else None
    use_file = fmt == "fp8" and shard is None and fp8_file is not None and fp8_file.is_file()
    if use_file:
        fp8 = safe_open(str(fp8_file), framework="numpy")
    staging = cupy.empty(arena.plan.staging_bytes, dtype=cupy.uint8)
    half = cfg.head_dim // 2
    jobs = [("embed", ["model.embed_tokens.weight"])]
    for i in range(cfg.num_hidden_layers):
        jobs += list(_layer_parts(ckpt, i).items())
    jobs.append(("final_norm", ["model.norm.weight"]))
    if not cfg.tie_word_embeddings:
        jobs.append(("lm_head", ["lm_head.weight"]))
    task = progress.add_task("weights -> GPU", total=len(jobs)) if progress else None
    for region, names in jobs:
        dst = arena[region]
        pairing = ROLE_PAIRING.get(region.split(".", 1)[-1])
        if pairing is None:  # embedding, norms, lm_head: row-major as stored
            up.put(dst, [get(n) for n in names])
        else:
            rows, k = dst.shape
            if fmt == "fp8":
                q = staging[: rows * k].reshape(rows, k)
                s_shape = arena[region + ".scale"].shape
                s_rm = staging[rows * k * 3: rows * k * 3 + 4 * s_shape[0] * s_shape[1]].view(cupy.float32)
                s_rm = s_rm.reshape(s_shape)
                if use_file:
                    up.put(q, [fp8.get_tensor(n[:-len(".weight")] + ".weight_fp8") for n in names])
                    up.put(s_rm, [fp8.get_tensor(n[:-len(".weight")] + ".weight_scale") for n in names])
                else:
                    w16 = staging[rows * k: rows * k * 3].view(cupy.float16).reshape(rows, k)
                    up.put(w16, [get(n) for n in names])
                    quantize_launch(lib, w16, q, s_rm)()
                sv = tile_scale_view(s_rm, pairing, half)
                arena[region + ".scale"].reshape(sv.shape)[...] = sv
            else:
                q = staging[: rows * k * 2].view(cupy.float16).reshape(rows, k)
                up.put(q, [get(n) for n in names])
            v = tile_view(q, fmt, pairing, half)
            dst.reshape(v.shape)[...] = v
        if progress:
            progress.advance(task)
    cupy.cuda.Device().synchronize()
    del staging
    arena["rope_cs"].set(cfg.rope_cos_sin(arena["rope_cs"].shape[0]))
    return {"bytes": up.copied, "fp8_source": ("file" if use_file else "gpu-quantized") if fmt == "fp8" else None}
