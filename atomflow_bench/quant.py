"""W8A16 FP8-E4M3 weight quantization, one float32 scale per GROUP=128 inputs of a weight row.

A weight matrix `w` [N, K] (HF layout: [out_features, in_features]) is cut along K into groups of
GROUP = 128 consecutive elements per row (the last group of a row is shorter when K % 128 != 0). For each
group, in float32 arithmetic throughout:

    amax  = max(|w_f32|) over the group          (w_f32 = w.astype(float32); exact for fp16 weights)
    scale = amax / 448.0f                        (correctly rounded float32 division)
    scale = 1.0f                 if scale == 0   (an all-zero group: every code is then ±0 anyway)
    x     = w_f32 / scale                        (correctly rounded float32 division, per element)
    q     = E4M3(x)                              (round to nearest, ties to even, saturate to ±448)

E4M3 here is the "fn" variant (OCP FP8 / NVIDIA `__NV_E4M3`): 1 sign, 4 exponent (bias 7), 3 mantissa bits;
no infinities; 0x7F / 0xFF are NaN and never produced. Finite values above 448 in magnitude (possible
when `amax / (amax / 448)` rounds to a hair above 448) saturate to ±448 = 0x7E / 0xFE, and -0.0 or a tiny
negative that rounds to zero gives 0x80 (negative zero), exactly as

    __nv_cvt_float_to_fp8(w_f32 / scale, __NV_SATFINITE, __NV_E4M3)

does with `scale = amax / 448.0f` on the GPU. A GPU quantizer is checked bit-exact against this module, so
it must use IEEE division (no `--use_fast_math`, `-prec-div=true`) and the same zero-group rule.

Dequantization is `q_value * scale` in float32. Error bound per element (3 mantissa bits, round to nearest):
|w - dq| <= 2^-4 * |w| where w / scale is in E4M3's normal range (|x| >= 2^-6), and |w - dq| <= 2^-10 * scale
in the subnormal range, up to float32 rounding of the division and the product (a few 2^-24 relative).
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from .config import GROUP

E4M3_MAX = 448.0
_E4M3 = ml_dtypes.float8_e4m3fn
_CHUNK_ELEMS = 1 << 23  # rows are processed in chunks of about this many float32 elements (32 MiB)


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> E4M3 codes (uint8): round to nearest even, finite values saturate to ±448, NaN-free input.

    ml_dtypes rounds correctly but maps magnitudes above 464 to NaN (0x7F) rather than saturating, so the
    input is clipped to ±448 first; clipping never changes a value inside the range, so rounding is intact.
    """
    x = np.asarray(x, dtype=np.float32)
    return np.clip(x, -E4M3_MAX, E4M3_MAX).astype(_E4M3).view(np.uint8)


def e4m3_decode(q: np.ndarray) -> np.ndarray:
    """E4M3 codes (uint8) -> float32 values (exact)."""
    return np.asarray(q, dtype=np.uint8).view(_E4M3).astype(np.float32)


def _group_view(w: np.ndarray, k: int) -> np.ndarray:
    """Rows of `w` [n, k] as float32 [n, groups, GROUP], zero-padded at the end (zeros never change amax)."""
    groups = math.ceil(k / GROUP)
    out = np.zeros((w.shape[0], groups * GROUP), dtype=np.float32)
    out[:, :k] = w
    return out.reshape(w.shape[0], groups, GROUP)


def quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize `w` [N, K] (fp16 or float32) to (codes uint8 [N, K], scales float32 [N, ceil(K/128)]).

    Algorithm (float32 throughout) as in the module docstring. Raises ValueError on non-finite weights.
    """
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"quantize_fp8 expects a 2-D [N, K] matrix, got shape {w.shape}")
    n, k = w.shape
    groups = math.ceil(k / GROUP)
    q = np.empty((n, k), dtype=np.uint8)
    scales = np.empty((n, groups), dtype=np.float32)
    rows = max(1, _CHUNK_ELEMS // max(1, groups * GROUP))
    for r0 in range(0, n, rows):
        g = _group_view(w[r0:r0 + rows], k)
        if not np.isfinite(g).all():
            raise ValueError("quantize_fp8: weights contain inf or NaN")
        amax = np.abs(g).max(axis=2)
        scale = amax / np.float32(E4M3_MAX)
        scale[scale == 0] = np.float32(1.0)
        x = g / scale[:, :, None]
        q[r0:r0 + rows] = e4m3_encode(x).reshape(g.shape[0], -1)[:, :k]
        scales[r0:r0 + rows] = scale
    return q, scales


def dequantize_fp8(q: np.ndarray, scales: np.ndarray, k: int | None = None) -> np.ndarray:
    """Codes [N, K'] and scales [N, ceil(K'/128)] -> float32 [N, k] (k defaults to K'; k <= K' trims padding)."""
    q = np.asarray(q, dtype=np.uint8)
    scales = np.asarray(scales, dtype=np.float32)
    if q.ndim != 2:
        raise ValueError(f"dequantize_fp8 expects 2-D codes, got shape {q.shape}")
    n, kq = q.shape
    k = kq if k is None else k
    if not 0 < k <= kq:
        raise ValueError(f"dequantize_fp8: k={k} out of range for codes with {kq} columns")
    if scales.shape != (n, math.ceil(kq / GROUP)):
        raise ValueError(f"dequantize_fp8: scales shape {scales.shape} does not match codes {q.shape} "
                         f"(expected {(n, math.ceil(kq / GROUP))})")
    out = np.empty((n, k), dtype=np.float32)
    rows = max(1, _CHUNK_ELEMS // max(1, kq))
    for r0 in range(0, n, rows):
        vals = e4m3_decode(q[r0:r0 + rows, :k])
        out[r0:r0 + rows] = vals * np.repeat(scales[r0:r0 + rows], GROUP, axis=1)[:, :k]
    return out
