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
            try:
                h = safe_open(str(f), framework="numpy")
            except Exception as e:  # SafetensorError (truncated, garbage header), OSError (unreadable)
                raise VerifyError(f"{f}: not a readable safetensors file ({self._first_line(e)})") from None
            self._handles[f] = h
            for k in h.keys():
                self._where[k] = f
        missing = [k for k in self.config.tensor_shapes() if k not in self._where]
        if missing:
            raise VerifyError(f"{self.dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[0]!r}")

    @staticmethod
    def _first_line(e: BaseException) -> str:
        lines = str(e).strip().splitlines()
        return lines[0] if lines else type(e).__name__

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
        try:
            t = self._handles[f].get_tensor(name)
        except Exception as e:  # SafetensorError, OSError (file changed or unreadable), TypeError (dtype)
            raise VerifyError(f"{f}: cannot read tensor {name!r} ({self._first_line(e)})") from None
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


# ---- the tiled layout of the layer projections (kernels_cu/gemv_common.cuh, TILED) ----------------------
# Rows are grouped into tiles of 16 (TILE_ROWS) and each tile is stored as 512-byte units whose lane l holds
# its mma.m16n8k16 A fragments: rows l/4 and l/4 + 8, inputs 2(l%4), +1, +8, +9 of a 16-input k-tile (fp8: two
# k-tiles per unit). Which rows share a tile ("pairing") follows the kernel's epilogue:
#   "none"   tile T = rows 16T .. 16T+15 (o_proj, down_proj, plain GEMVs)
#   "halves" rows 0-7 = gate rows 8T.., rows 8-15 = up rows 8T.. of [gate; up] stacked (SwiGLU epilogue)
#   "rope"   rows 0-7 = rows i..i+7 of a head, rows 8-15 = rows i+hd/2.. of the same head (RoPE epilogue)
# Every layout is a reshape + transpose of the row-major matrix, so the same view works on NumPy and CuPy
# arrays (no gather, no temporary on the device: `dst.reshape(view.shape)[...] = view`).
TILE_ROWS = 16
REGION_PAIRING = {"wqkv": "rope", "wo": "none", "wgu": "halves", "wd": "none"}


def check_tiled(rows: int, k: int, pairing: str = "none", half: int = 0) -> None:
    """Raise a one-line error if a [rows, k] weight cannot take the tiled layout."""
    if rows % TILE_ROWS or k % 32:
        raise VerifyError(f"tiled GEMV needs rows % {TILE_ROWS} == 0 and K % 32 == 0, got [{rows}, {k}]")
    if pairing == "rope" and (half % 8 or rows % (2 * half)):
        raise VerifyError(f"RoPE tiles need head_dim/2 % 8 == 0 and whole heads, got [{rows}, {k}], hd/2={half}")
    if pairing not in ("none", "halves", "rope"):
        raise VerifyError(f"unknown tile pairing {pairing!r}")


def _tile_rows(w, pairing: str, half: int):
    """[rows, cols] -> a view (*lead, rh, g, cols): tile = lead, its row rh*8 + g."""
    rows, cols = w.shape
    if pairing == "none":
        return w.reshape(rows // 16, 2, 8, cols)
    if pairing == "halves":
        return w.reshape(2, rows // 16, 8, cols).transpose(1, 0, 2, 3)
    nh = rows // (2 * half)  # rope: row = head*2half + rh*half + 8*i8 + g, tile = (head, i8)
    return w.reshape(nh, 2, half // 8, 8, cols).transpose(0, 2, 1, 3, 4)


def tile_view(w, fmt: str, pairing: str = "none", half: int = 0):
    """A view of row-major weights [rows, K] (fp16, or fp8 codes as uint8) whose C-order contents are the
    tiled layout: `np.ascontiguousarray(v).reshape(rows, K)`, or on the device `dst.reshape(v.shape)[...] = v`."""
    rows, k = w.shape
    check_tiled(rows, k, pairing, half)
    r = _tile_rows(w, pairing, half)
    n = r.ndim - 3  # lead axes; then rh (n), g (n + 1), inputs
    lead = r.shape[:n]
    if fmt == "fp8":  # inputs = (unit, j, kh, t, e): k = 32 unit + 16 j + 8 kh + 2 t + e
        r = r.reshape(*lead, 2, 8, k // 32, 2, 2, 4, 2)
        order = (n + 2, n + 1, n + 5, n + 3, n + 4, n, n + 6)  # unit, g, t | j, kh, rh, e
    else:  # inputs = (unit, kh, t, e): k = 16 unit + 8 kh + 2 t + e
        r = r.reshape(*lead, 2, 8, k // 16, 2, 4, 2)
        order = (n + 2, n + 1, n + 4, n + 3, n, n + 5)  # unit, g, t | kh, rh, e
    return r.transpose(*range(n), *order)


def tile_scale_view(s, pairing: str = "none", half: int = 0):
    """fp8 group scales [rows, groups] -> view whose C-order contents are [tile][group][g][rh] (rows g, g+8
    adjacent)."""
    r = _tile_rows(s, pairing, half)
    n = r.ndim - 3
    return r.transpose(*range(n), n + 2, n + 1, n)


def tiled(w, fmt: str, pairing: str = "none", half: int = 0) -> np.ndarray:
    """Host copy of `w` in the tiled layout, same shape [rows, K] (tests, reference checks)."""
    return np.ascontiguousarray(tile_view(w, fmt, pairing, half)).reshape(w.shape)


def tiled_scales(s, pairing: str = "none", half: int = 0) -> np.ndarray:
    return np.ascontiguousarray(tile_scale_view(s, pairing, half)).reshape(s.shape)


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
    """Fill the arena's weight pool from the checkpoint. Layer projections go row-major into a device staging
    buffer, are quantised there for fp8 (quantize_fp8.cu) unless the model directory holds a
    `model-fp8.safetensors` from `fetch --format fp8` (copied as is), and are then written into the arena in
    the tiled layout (tile_view). Returns {"bytes": host bytes copied, "fp8_source": "gpu-quantized" | "file"
    | None}."""
    import cupy

    from .step import quantize_launch

    cfg = ckpt.config
    up = _PinnedUploader()
    fp8_file = ckpt.dir / "model-fp8.safetensors"
    use_file = fmt == "fp8" and fp8_file.is_file()
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
        pairing = REGION_PAIRING.get(region.split(".", 1)[-1])
        if pairing is None:  # embedding, norms, lm_head: row-major as stored
            up.put(dst, [ckpt.get(n) for n in names])
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
                    up.put(w16, [ckpt.get(n) for n in names])
                    quantize_launch(lib, w16, q, s_rm)()
                sv = tile_scale_view(s_rm, pairing, half)
                arena[region + ".scale"].reshape(sv.shape)[...] = sv
            else:
                q = staging[: rows * k * 2].view(cupy.float16).reshape(rows, k)
                up.put(q, [ckpt.get(n) for n in names])
            v = tile_view(q, fmt, pairing, half)
            dst.reshape(v.shape)[...] = v
        if progress:
            progress.advance(task)
    cupy.cuda.Device().synchronize()
    del staging
    arena["rope_cs"].set(cfg.rope_cos_sin(arena["rope_cs"].shape[0]))
    return {"bytes": up.copied, "fp8_source": ("file" if use_file else "gpu-quantized") if fmt == "fp8" else None}
