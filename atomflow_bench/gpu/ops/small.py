"""The small kernels: the token embedding (kernels_cu/embedding.cu), the load-time FP8 quantiser
(quantize_fp8.cu) and the timing spin (spin.cu) — their launch factories."""
from __future__ import annotations

import numpy as np

from ..launch import Launch, i32
from ..nvrtc import KernelLib

EMBED_THREADS = 256
QUANT_THREADS = 256
QUANT_GROUPS_PER_BLOCK = 8  # quantize_fp8.cu: a warp per group of 128 inputs
CU_FILES = ("embedding.cu", "quantize_fp8.cu", "spin.cu")
# The kernels this module launches, by the .cu that defines them (as ops/gemv.py KERNELS).
KERNELS = {"embedding.cu": ("embed_lookup",), "quantize_fp8.cu": ("quantize_fp8",), "spin.cu": ("spin_ns",)}


def embed_launch(lib: KernelLib, token, emb, h, taps=None) -> Launch:
    """h (fp32) = emb[*token] (the token id read from device memory)."""
    H = emb.shape[1]
    return Launch(lib["embed_lookup"], "embed_lookup", (-(-H // EMBED_THREADS),), (EMBED_THREADS,),
                  (token, emb, h, i32(H)), 0, taps or {}, H * 2 + H * 4)


def quantize_launch(lib: KernelLib, w16, q, s) -> Launch:
    """fp16 rows [rows, K] -> FP8-E4M3 codes q [rows, K] and fp32 group scales s [rows, ceil(K / 128)] (bit-exact
    with quant.quantize_fp8)."""
    rows, k = w16.shape
    groups = s.shape[1]
    return Launch(lib["quantize_fp8"], "quantize_fp8", (-(-rows * groups // QUANT_GROUPS_PER_BLOCK),),
                  (QUANT_THREADS,), (w16, q, s, i32(rows), i32(k)), 0, {}, w16.nbytes + q.nbytes + s.nbytes)


def spin_launch(lib: KernelLib, ns: int):
    """A callable that queues one thread waiting `ns` ns on the GPU (measure.timing.queued_event_us)."""
    fn = lib["spin_ns"]
    return lambda: fn((1,), (1,), (np.uint64(ns),))
