"""Decode attention (GQA, one query token over the contiguous KV cache): everything the host knows about
kernels_cu/attention_short.cu and attention.cu — constants, the split plan, shared memory and the launch factories.

Two kernels, one per attention bucket of the step:
  short  (attention_short.cu) one block per kv head holding up to `cap` positions of K and V in shared memory; the
         engine's short bucket serves every length up to short_capacity();
  split  (attention.cu) split over the sequence (flash-decoding) with the combine fused into the same launch; the
         long-context form (and the only one when the forms say so, or no capacity fits).
Whether the short bucket runs at all is launch policy (forms.Forms.short_attention, measured by tune.py).
"""
from __future__ import annotations

import math

import numpy as np

from ...errors import AtomflowError
from ..device import SMEM_H100, smem_limits
from ..launch import Launch, allow_dynamic_smem, i32, tensor_maps
from ..nvrtc import KernelLib, knob

# = the kernels' #defines (tests/test_op_constants.py reads them from the .cu files)
ATT_CHUNK = 32              # attention.cu ATT_CHUNK: positions per sub-chunk, the unit splits are cut in
ATT_THREADS = 128           # attention.cu ATT_THREADS
ATT_GROUP = 16              # attention.cu ATT_GROUP: positions per group (a warp's unit; ATT_TMA's box rows)
ATT_RING_BYTES = 24 * 1024  # attention.cu ATT_RING_BYTES: each warp's K/V ring (3 groups at hd 128, 6 at hd 64)
ATS_THREADS = 256           # attention_short.cu ATS_THREADS
ATS_HEADS = 8               # attention_short.cu ATS_HEADS: q heads per kv head padded to the mma's N
ATS_CHUNK_MAX = 512         # attention_short.cu ATS_CHUNK_MAX: positions its scores cover per chunk (largest capacity)
CU_FILES = ("attention.cu", "attention_short.cuh", "attention_short.cu")
CU_DEFINES = {"ATT_CHUNK": ATT_CHUNK, "ATT_THREADS": ATT_THREADS, "ATT_GROUP": ATT_GROUP,
              "ATT_RING_BYTES": ATT_RING_BYTES, "ATS_THREADS": ATS_THREADS, "ATS_HEADS": ATS_HEADS}

ATT_BLOCKS_PER_SM = 2       # the split launch is capped at ~this many blocks per SM (96 KB of rings each)
HEAD_DIMS = (64, 128)       # instances: attention_{decode,short}_hd<HD>_g<G>
GROUPS = (1, 2, 3, 4, 8, 16)  # q heads per kv head
BLOCK_HEADS = ATS_HEADS     # attention.cu ATT_BLOCK_HEADS: the most q heads one block takes (both kernels)


def split_kernel(hd: int, group: int) -> str:
    """The split kernel's instance for head_dim `hd` and `group` q heads per kv head (attention.cu)."""
    return f"attention_decode_hd{hd}_g{group}"


def short_kernel(hd: int, group: int) -> str:
    """The short kernel's instance (attention_short.cu)."""
    return f"attention_short_hd{hd}_g{group}"


# The kernels this module launches, by the .cu that defines them (as ops/gemv.py KERNELS): one per head_dim and group.
KERNELS = {"attention.cu": tuple(split_kernel(hd, g) for hd in HEAD_DIMS for g in GROUPS),
           "attention_short.cu": tuple(short_kernel(hd, g) for hd in HEAD_DIMS for g in GROUPS)}


def blocks_per_kv(group: int) -> int:
    """Blocks that share one kv head (its q heads split between them, each reading the head's K/V): 2 for 16."""
    return max(1, group // BLOCK_HEADS)


def check_shape(head_dim: int, group: int) -> None:
    if head_dim not in HEAD_DIMS:
        raise AtomflowError(f"head_dim {head_dim} unsupported by attention.cu ({' or '.join(map(str, HEAD_DIMS))})")
    if group not in GROUPS:
        raise AtomflowError(f"{group} q heads per kv head unsupported by attention.cu ({', '.join(map(str, GROUPS))})")


def attention_splits(max_seq: int, n_kv: int, n_sm: int, blocks_per_sm: int = ATT_BLOCKS_PER_SM, group: int = 1) -> int:
    """Split capacity per head group (= the split launch's grid.y): one split per ATT_CHUNK positions, capped so the
    whole launch (n_kv x blocks_per_kv(group) head groups) is about ATT_BLOCKS_PER_SM blocks per SM; beyond the cap
    a split walks several sub-chunks."""
    return max(1, min(-(-max_seq // ATT_CHUNK), -(-(blocks_per_sm * n_sm) // (n_kv * blocks_per_kv(group)))))


def att_tma(defines: tuple | None = None) -> int:
    """1 when attention.cu stages K/V by 2D tensor copies (ATT_TMA, which a KernelLib's defines carry on sm_90+:
    nvrtc.arch_defines): the launch then carries the layer's tensor maps."""
    return knob("ATT_TMA", 0, defines)


def attention_smem(group: int, hd: int, splits: int, defines: tuple | None = None) -> int:
    """Bytes of dynamic shared memory of attention.cu: the warps' K/V rings (ATT_RING_BYTES each). The kernel reuses
    them at its end for the warps' O ([warps][G][hd] fp32) and for the split combine (fp32 m and l [2][G][splits]
    rounded to 4, the float4 sums [G*hd/4], then the partial o of as many splits as fit, at least one); a plan where
    those do not fit is refused."""
    warps = ATT_THREADS // 32
    group = min(group, BLOCK_HEADS)  # a block's heads
    rings = warps * ATT_RING_BYTES + 1024 * att_tma(defines)  # TMA: the swizzle's 1 KB alignment
    merge = 4 * warps * group * hd
    combine = 4 * (-(-2 * group * splits // 4) * 4 + 2 * group * hd)
    if max(merge, combine) > rings:
        raise AtomflowError(f"attention: {splits} splits of {group} heads x {hd} do not fit the kernel's "
                            f"{rings} bytes of shared memory")
    return rings


def attention_launch(lib: KernelLib, q, k_cache, v_cache, pos, part_ml, part_o, counters, out, n_kv: int,
                     group: int, hd: int, taps=None) -> Launch:
    """The split kernel. k_cache/v_cache: one layer's [max_seq, kv_dim] slab; part_*: [n_heads, splits, ...] scratch,
    whose split count is the launch's grid.y (attention_splits: at long contexts a split walks several sub-chunks);
    counters: a ticket per head group (n_kv x blocks_per_kv(group))."""
    splits = part_ml.shape[1]
    if part_o.shape[1] != splits or splits < 1:
        raise AtomflowError("attention partials: att_ml and att_o disagree on the split count")
    heads = n_kv * blocks_per_kv(group)
    if counters.size < heads:
        raise AtomflowError(f"attention: {counters.size} tickets for {heads} head groups")
    fn = lib[split_kernel(hd, group)]
    shmem = attention_smem(group, hd, splits, lib.defines)
    if shmem > SMEM_H100[0]:
        raise AtomflowError(f"{splits} attention splits need {shmem} bytes of shared memory (> {SMEM_H100[0]})")
    allow_dynamic_smem(fn, shmem)
    # ATT_TMA: the K and V slabs' tensor maps (boxes of 16 rows x 64 dims), kept alive by the launch's arguments
    maps = (tensor_maps((k_cache, v_cache), (64, ATT_GROUP)),) if att_tma(lib.defines) else ()
    return Launch(fn, "attention_decode", (heads, splits), (ATT_THREADS,),
                  (q, k_cache, v_cache, pos, part_ml, part_o, counters, out, i32(n_kv), i32(splits),
                   np.float32(1.0 / math.sqrt(hd))) + maps, shmem, taps or {}, 0)


def short_smem(hd: int, cap: int) -> int:
    """Bytes of dynamic shared memory of attention_short.cu at capacity `cap` positions (rounded up to 16): K
    [cap][hd] fp16 (at least the final reduction scratch [warps][16][8] fp32), V [cap][hd] fp16, P fp16
    [8 heads][cap + 8]."""
    cap16 = -(-cap // 16) * 16
    return max(cap16 * hd * 2, (ATS_THREADS // 32) * 16 * ATS_HEADS * 4) + cap16 * hd * 2 + ATS_HEADS * (cap16 + 8) * 2


def short_static(hd: int) -> int:
    """Static shared memory of attention_short.cu (q fp16 [8][hd], the per-warp [warps][8] fp32 scratch) plus 1 KB
    for the timeline instrument's and the compiler's own."""
    return ATS_HEADS * hd * 2 + (ATS_THREADS // 32) * ATS_HEADS * 4 + 1024


def short_capacity(hd: int, smem: tuple = SMEM_H100) -> int:
    """Positions the short kernel holds (the engine's short bucket serves every length up to it): the largest
    multiple of ATT_CHUNK that one block's shared memory holds, at most ATS_CHUNK_MAX; 0 when not even ATT_CHUNK
    positions fit (the split kernel always)."""
    room = smem[0] - short_static(hd)
    top = 0
    while short_smem(hd, top + ATT_CHUNK) <= room and top + ATT_CHUNK <= ATS_CHUNK_MAX:
        top += ATT_CHUNK
    return top


def attention_short_launch(lib: KernelLib, q, k_cache, v_cache, pos, out, n_kv: int, group: int, hd: int, cap: int,
                           taps=None) -> Launch:
    """One block per kv head holding up to `cap` positions of K and V in shared memory (longer contexts are walked
    in chunks of `cap`: correct, but the engine switches to attention_launch there). The block asks for all the
    shared memory a block may have, whatever `cap` needs: nothing else (the next GEMV's early blocks) can share its
    SM, whose weight loads would stall this block's shared-memory traffic (measured slower when they share it)."""
    fn = lib[short_kernel(hd, group)]
    need, room = short_smem(hd, cap), smem_limits()[0] - short_static(hd)
    if cap < 1 or need > room:
        raise AtomflowError(f"short attention of {cap} positions needs {need} bytes of shared memory per block "
                            f"(this GPU: {smem_limits()[0]})")
    allow_dynamic_smem(fn, room)
    return Launch(fn, "attention_decode", (n_kv * blocks_per_kv(group),), (ATS_THREADS,),
                  (q, k_cache, v_cache, pos, out, i32(n_kv), i32(cap), np.float32(1.0 / math.sqrt(hd))), room,
                  taps or {}, 0)
