"""Prefill attention (causal GQA of a chunk of M query rows over the contiguous KV cache, FlashAttention-2 on the
tensor cores): everything the host knows about its two kernels — constants, the grid, shared memory, the checks and
the launch factory. kernels_cu/attention_prefill_sm90a.cu runs both matrix products on Hopper's warpgroup MMA and is
built for sm_90a only, so it runs where the compute capability is 9.0; kernels_cu/attention_prefill.cu (mma.sync)
runs everywhere else. Same grid and results; the wgmma kernel takes ATP_SMEM_PAD bytes more shared memory (its two
mbarriers, and its tiles aligned to 1 KB) and one more argument: the tensor maps through which the copy engine brings
its K/V tiles, over the cache rows the launch may read (rows past them land as zeros).

The chunk: post-RoPE q rows [M][q_stride] (the stride lets q be the start of the fused qkv buffer
[M][q_dim + 2*kv_dim]); its K/V rows already in the layer's cache slab [max_seq][kv_dim] at positions
start .. start+M-1; query row r is at position start + r and attends to positions 0 .. start + r. out [M][out_stride].
"""
from __future__ import annotations

import math

import numpy as np

from ...errors import AtomflowError
from ..device import SMEM_H100, compute_capability, smem_limits
from ..launch import Launch, allow_dynamic_smem, i32, tensor_maps
from ..nvrtc import KernelLib

# = the kernel's #defines (tests/test_op_constants.py reads them from the .cu file)
ATP_THREADS = 128  # attention_prefill.cu ATP_THREADS: 4 warps of 16 query rows
ATP_ROWS = 64      # attention_prefill.cu ATP_ROWS: stacked query rows (G heads of a kv head) per block
ATP_KV = 64        # attention_prefill.cu ATP_KV: positions per K/V tile
ATP_STAGES = 2     # attention_prefill.cu ATP_STAGES: K/V tiles in shared memory at once
ATP_SMEM_PAD = 2048  # attention_prefill_sm90a.cu ATP_SMEM_PAD: its mbarriers, its base aligned to the 1 KB swizzle
TMA_BOX = (64, 64)   # attention_prefill_sm90a.cu atp_tma_kv: a [64 positions][64 dims] box per copy
CU_FILES = ("attention_prefill.cu", "attention_prefill_sm90a.cu")
CU_DEFINES = {"ATP_THREADS": ATP_THREADS, "ATP_ROWS": ATP_ROWS, "ATP_KV": ATP_KV, "ATP_STAGES": ATP_STAGES,
              "ATP_SMEM_PAD": ATP_SMEM_PAD}
WGMMA_CC = 90  # the compute capability sm_90a code runs on

HEAD_DIMS = (64, 128)         # instances: attention_prefill_hd<HD>_g<G>
GROUPS = (1, 2, 3, 4, 8, 16)  # q heads per kv head
SMEM_HEADROOM = 1024          # static shared memory beside the dynamic (the timeline instrument's, the compiler's)


def prefill_kernel(hd: int, group: int, wgmma: bool = False) -> str:
    """The instance for head_dim `hd` and `group` q heads per kv head (attention_prefill.cu; with `wgmma`,
    attention_prefill_sm90a.cu)."""
    return f"attention_prefill_{'wgmma_' if wgmma else ''}hd{hd}_g{group}"


# The kernels this module launches, by the .cu that defines them (as ops/attention.py KERNELS).
KERNELS = {"attention_prefill.cu": tuple(prefill_kernel(hd, g) for hd in HEAD_DIMS for g in GROUPS),
           "attention_prefill_sm90a.cu": tuple(prefill_kernel(hd, g, True) for hd in HEAD_DIMS for g in GROUPS)}


def wgmma_default(cc: int | None = None) -> bool:
    """Whether the wgmma kernel runs on a GPU of compute capability `cc` (default: the current device's)."""
    return (compute_capability() if cc is None else cc) == WGMMA_CC


def prefill_smem(hd: int, wgmma: bool = False) -> int:
    """Bytes of dynamic shared memory: the q tile [ATP_ROWS][hd] fp16 (the output's staging at the end), then
    ATP_STAGES x (K [ATP_KV][hd], V [ATP_KV][hd]) fp16: 40 KB at hd 64, 80 KB at hd 128; the wgmma kernel's
    ATP_SMEM_PAD more."""
    return ATP_ROWS * hd * 2 + ATP_STAGES * 2 * ATP_KV * hd * 2 + (ATP_SMEM_PAD if wgmma else 0)


def prefill_grid(m: int, n_kv: int, group: int) -> tuple[int, int]:
    """(row tiles, kv heads): a block takes ATP_ROWS of a kv head's m * group stacked query rows (its q heads side by
    side), so that each K/V tile it loads serves all of them."""
    return -(-m * group // ATP_ROWS), n_kv


def prefill_bytes(start: int, m: int, n_kv: int, group: int, hd: int) -> int:
    """The least DRAM traffic: q and out (m x n_heads x hd fp16 each) and K and V rows 0 .. start+m-1 once (the row
    tiles read their causal prefixes again, from L2)."""
    return 2 * m * n_kv * group * hd * 2 + 2 * (start + m) * n_kv * hd * 2


def check_prefill(hd: int, group: int, start: int, m: int, n_kv: int, q_stride: int, out_stride: int,
                  smem: tuple = SMEM_H100, wgmma: bool = False) -> None:
    """Refuses (one line) a shape the kernel does not take: head_dim and group without an instance, an empty chunk, a
    negative start, strides that are not multiples of 8 elements (the 16-byte copies) or narrower than the q heads,
    or a shared memory need above what a block of this GPU (`smem`, as device.smem_limits) may have."""
    if hd not in HEAD_DIMS:
        raise AtomflowError(f"prefill attention: head_dim {hd} unsupported ({' or '.join(map(str, HEAD_DIMS))})")
    if group not in GROUPS:
        raise AtomflowError(f"prefill attention: {group} q heads per kv head unsupported "
                            f"({', '.join(map(str, GROUPS))})")
    if m < 1 or start < 0 or n_kv < 1:
        raise AtomflowError(f"prefill attention: needs m >= 1, start >= 0 and n_kv >= 1 (got m {m}, start {start}, "
                            f"n_kv {n_kv})")
    q_dim = n_kv * group * hd
    for name, stride in (("q_stride", q_stride), ("out_stride", out_stride)):
        if stride % 8 or stride < q_dim:
            raise AtomflowError(f"prefill attention: {name} {stride} must be a multiple of 8 and at least the q heads' "
                                f"{q_dim} elements")
    need = prefill_smem(hd, wgmma) + SMEM_HEADROOM
    if need > smem[0]:
        raise AtomflowError(f"prefill attention at head_dim {hd} needs {need} bytes of shared memory per block "
                            f"(this GPU: {smem[0]})")


def _check_arrays(q, k_cache, v_cache, out, start: int, m: int, kv_dim: int, q_dim: int, q_stride: int,
                  out_stride: int) -> None:
    """The arrays against the shape: fp16; q and out either 2-D views whose rows are `stride` elements apart (the
    q columns of the fused qkv buffer, say) or flat buffers holding m rows of the stride; the cache slabs
    [max_seq][kv_dim] with max_seq >= start + m; device pointers 16-byte aligned (NumPy arrays in the CPU tests have
    none)."""
    for name, a in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if a.dtype != np.float16:
            raise AtomflowError(f"prefill attention: {name} must be fp16, got {a.dtype}")
        ptr = getattr(getattr(a, "data", None), "ptr", None)
        if ptr is not None and ptr % 16:
            raise AtomflowError(f"prefill attention: {name} must start 16-byte aligned")
    for name, a, stride in (("q", q, q_stride), ("out", out, out_stride)):
        if a.ndim == 2:
            ok = a.shape[0] >= m and a.shape[1] >= q_dim and a.strides == (2 * stride, 2)
        else:
            ok = a.ndim == 1 and a.strides == (2,) and a.size >= (m - 1) * stride + q_dim
        if not ok:
            raise AtomflowError(f"prefill attention: {name} {tuple(a.shape)} (strides {tuple(a.strides)} bytes) does "
                                f"not hold {m} rows of {q_dim} fp16 elements {stride} apart")
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        if a.ndim != 2 or a.shape[1] != kv_dim or a.strides != (2 * kv_dim, 2) or a.shape[0] < start + m:
            raise AtomflowError(f"prefill attention: {name} {tuple(a.shape)} is not a contiguous "
                                f"[max_seq >= {start + m}][{kv_dim}] fp16 slab")


def attention_prefill_launch(lib: KernelLib, q, k_cache, v_cache, start: int, m: int, out, n_kv: int, group: int,
                             hd: int, q_stride: int, out_stride: int, scale: float | None = None,
                             smem: tuple | None = None, taps=None, wgmma: bool | None = None) -> Launch:
    """The chunk's causal attention: q rows [m][q_stride] at positions start .. start+m-1 over the layer's cache slabs
    (the chunk's own K/V rows already written), out [m][out_stride]; scale defaults to 1/sqrt(hd). `start` and `m`
    are plain kernel arguments: a captured graph replays the chunk it was captured with. `smem`: this GPU's shared
    memory limits (device.smem_limits, the default). `wgmma`: which kernel (default: the wgmma one where the device
    runs it, `wgmma_default`)."""
    q_dim = n_kv * group * hd
    wgmma = wgmma_default() if wgmma is None else wgmma
    check_prefill(hd, group, start, m, n_kv, q_stride, out_stride, smem_limits() if smem is None else smem, wgmma)
    _check_arrays(q, k_cache, v_cache, out, start, m, n_kv * hd, q_dim, q_stride, out_stride)
    fn = lib[prefill_kernel(hd, group, wgmma)]
    shmem = prefill_smem(hd, wgmma)
    allow_dynamic_smem(fn, shmem)
    # the wgmma kernel's K and V maps: the rows 0 .. start + m - 1 this launch may read (the cache past them may hold
    # anything; a masked score's 0 still multiplies V), held by the Launch as long as its graph
    maps = (tensor_maps((k_cache[:start + m], v_cache[:start + m]), TMA_BOX),) if wgmma else ()
    return Launch(fn, "attention_prefill", prefill_grid(m, n_kv, group), (ATP_THREADS,),
                  (q, k_cache, v_cache, out, i32(start), i32(m), i32(n_kv), i32(q_stride), i32(out_stride),
                   np.float32(1.0 / math.sqrt(hd) if scale is None else scale), *maps), shmem, taps or {},
                  prefill_bytes(start, m, n_kv, group, hd),
                  f"attention prefill{' wgmma' if wgmma else ''} hd{hd} g{group} {m} rows")
