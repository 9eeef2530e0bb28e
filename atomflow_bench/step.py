"""Stage 5 of the decode path: one decode step as a fixed list of kernel launches.

The step reads the current token and position from device memory and leaves the next ones there, so the
same list runs eagerly (`run_eager`, optionally copying probes out after each launch) or is captured once
into a CUDA Graph (graph.py). Per layer 5 launches:

    gemv  QKV      RMSNorm prologue (input_layernorm), q|k|v rows stacked; epilogue: RoPE on q and k,
                   k and v appended to the cache at pos                        -> qkv (fp16)
    attention      GQA over cache[0..pos] -> attn_out (fp16): at short contexts one block per kv head with
                   the whole K/V range in shared memory (attention_short.cu, `att_cap` = the positions it
                   holds), beyond that split over the sequence with the combine fused (attention.cu)
    gemv  o_proj   residual epilogue                                           h += Wo . attn_out
    gemv  gate/up  RMSNorm prologue (post_attention_layernorm), SwiGLU epilogue -> act (fp16)
    gemv  down     residual epilogue                                           h += Wd . act

plus the embedding lookup before the layers, then lm_head (fp16, fp32 logits) with the final RMSNorm in its
prologue and the greedy argmax and the step's bookkeeping in its epilogue (knobs LMHEAD_NORM=0 / LMHEAD_ARGMAX=0:
separate rmsnorm / argmax kernels).
(A second form, one persistent kernel for all layers, was built, measured slower and removed:
results/PERF_NOTES.md v5-v7.)

Each op has one launch factory below (`*_launch`), shared by the step, the kernel tests and the
microbenchmarks: grid/block/shared-memory rules live in exactly one place.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from .arena import (ARGMAX_THREADS, ATT_CHUNK, att_cluster, ROWS_BLOCKS_PER_SM, ROWS_WARPS, Arena, dyn_part_floats,
                    gemv_slots_per_tile, linear_regions)
from .config import ModelConfig
from .errors import AtomflowError, VerifyError
from .kernels import GEMV_RING_DEPTHS, KernelLib, Launch, allow_dynamic_smem, compute_capability, knob, tensor_maps
from .weights import check_tiled

GEMV_THREADS = 256
GEMV_WARPS = GEMV_THREADS // 32
GEMV_BLOCKS_PER_SM = 2  # = GEMV_MIN_BLOCKS in gemv_common.cuh (tiled GEMVs): the grid never exceeds one resident wave
LMHEAD_ARGMAX = 1          # knob: the argmax in the lm_head GEMV's epilogue (0: argmax_advance after it)
LMHEAD_NORM = 1            # knob: the final RMSNorm in the lm_head GEMV's prologue (0: rmsnorm_f32_f16 before it)
GEMV_STAGES = 5            # fp8: deepest cp.async ring (groups of 128 inputs per warp) a launch may get; knob
GEMV_ONE_WAVE = 1          # knob: tile counts in (2, 3] x SMs run one tile per block at 3 blocks per SM
GEMV_WS = 1                # knob: warp-specialised GEMVs (producer warp + bulk copies, sm_90+) for 1 = fp16 only,
                           # 2 = fp16 and fp8, 0 = none (measured: fp16 -53 µs on 3B, fp8 +32 µs: PERF_NOTES v13) —
                           # the rule for launches built outside the engine (tests, `atomflow-bench gemv`); the engine
                           # measures both forms (Engine gemv="auto")
GEMV_WS_SOLO = 1           # knob: a warp-specialised grid of <= 1 block per SM gets the whole SM's ring (1B down: -47 µs)
GEMV_WS_THREADS = GEMV_THREADS + 32  # 8 consumer warps + the producer (gemv_common.cuh gemv_tiled_ws)
GEMV_WS_SLOT = 16384       # = GEMV_WS_SLOT: weight bytes per ring slot (fp8: 8 groups of 128 inputs, fp16: 4)
GEMV_WS_MAX = 16           # = GEMV_WS_MAX: most slots a ring may have
GEMV_WS_SLOTS = 6          # knob: the deepest ring a launch gets (~96 KB in flight per block, as the fp16 batch was)
GEMV_WS_PRE = {"fp16": 3, "fp8": 0}  # ring slots the producer fills before the consumers passed their PDL wait
                           # (0: all; a kernel argument; knobs GEMV_WS_PRE_F16 / _F8): PERF_NOTES v13.2, v16
GEMV_WS_PRE_TRY = {"fp16": (2,), "fp8": ()}  # other counts the engine times per shape (1B fp16 is faster at 2: v16)
GEMV_MIXED_TRY = {"fp16": (), "fp8": ()}  # ring steps with these roles warp-specialised, timed by the engine (none:
                           # 3B W8A16 ring+wd measured -14 µs in one call, +13 µs forced in another: PERF_NOTES v17.3)
GEMV_ROLES = ("wqkv", "wo", "wgu", "wd")
GEMV_DYN_THREADS = GEMV_THREADS + 96  # DYN (gemv_common.cuh): 8 consumer warps, the producer, 2 reducer warps
GEMV_DYN_PER_SM = 2        # knob: blocks per SM of a DYN launch (its launch bounds: 2 x 352 threads)
GEMV_DYN_SENTINEL = 0xFFFFFFFF  # = GEMV_DYN_SENTINEL: an unpublished partial sum in the DYN scratch
GEMV_NEXT_L2 = 1           # knob: QKV's blocks ask L2 for later weights (1: after their epilogue, 2: after their
                           # own pre-wait requests; gemv_common.cuh next_weights_l2, PERF_NOTES v30.1)
GEMV_NEXT_L2_GU = 0        # knob (MB): ... and for the first this many MB of gate/up's weights (arena order: o_proj's
                           # weights and scales, then gate/up's; one range), PERF_NOTES v30.2
GEMV_NEXT_L2_TAIL = -1     # knob (MB): instead, for the LAST this many MB of gate/up's weights (the tiles its blocks
                           # stream last), PERF_NOTES v30.3; -1: the engine measures GEMV_NEXT_L2_TRY (v30.4: the size
                           # that pays differs per shape) as part of its GEMV form (engine.l2_suffix)
GEMV_NEXT_L2_TRY = (0, 4, 8, 16, 24)  # MB; 0: nothing asked
ATT_THREADS = 128             # attention.cu block size (A/B knob ATT_THREADS)
ATT_GROUP = 16                # attention.cu: positions per group (a warp's unit of the walk; ATT_TMA's box rows)
ATT_RING_BYTES = 24 * 1024  # attention.cu: each warp's K/V ring (3 groups at hd 128, 6 at hd 64)
ATT_RING_BYTES_BULK = 26112  # the same with ATT_BULK (rows padded to 2*hd + 16 bytes: 3 groups at hd 128, 5 at hd 64)
ATS_THREADS = 256          # attention_short.cu
ATS_HEADS = 8              # attention_short.cu: q heads per kv head padded to the mma's N
ATS_CHUNK_MAX = 512        # attention_short.cu: positions its scores cover per chunk (the largest useful capacity)
SMEM_PER_SM = 227 * 1024  # usable shared memory per block on sm_90 (sm_89: 99 KB; only limits residency)
SMEM_H100 = (SMEM_PER_SM, 228 * 1024, 1024)  # (per block, per SM, reserved per resident block): sm_90
NULL = np.uint64(0)


def i32(v) -> np.int32:
    return np.int32(v)


# ---- launch factories, one per op ----------------------------------------------------------------------

VARIANT_PAIRING = {"qkv_rope": "rope", "norm_swiglu": "halves", "resid": "none", "store": "none"}  # weights.py


@functools.lru_cache(maxsize=None)
def smem_limits() -> tuple[int, int, int]:
    """(per block with opt-in, per SM, reserved per block) shared memory bytes of the current device."""
    import cupy as cp

    rt, dev = cp.cuda.runtime, cp.cuda.Device().id
    return tuple(rt.deviceGetAttribute(a, dev) for a in (rt.cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                                          rt.cudaDevAttrMaxSharedMemoryPerMultiprocessor,
                                                          rt.cudaDevAttrReservedSharedMemoryPerBlock))


def blocks_fit(shmem: int, smem: tuple = SMEM_H100) -> int:
    """Blocks of `shmem` dynamic shared memory bytes that one SM holds at once (0: not even one)."""
    per_block, per_sm, reserved = smem
    return 0 if shmem > per_block else per_sm // (shmem + reserved)


def gemv_plan(fmt: str, tiles: int, k: int, n_sm: int, defines: tuple = (), smem: tuple = SMEM_H100,
              depth: int | None = None, norm: bool = False) -> tuple[int, int, int]:
    """(ring depth, blocks per SM, dynamic shared memory) of a tiled GEMV launch of `tiles` 16-row tiles.

    fp16 (register path): no ring (depth 0), 2 blocks per SM. fp8 (cp.async ring): the deepest ring <= GEMV_STAGES at
    which 2 blocks fit an SM (5 groups per warp at K <= ~11k, 4 above: 8B's down projection); but a launch of
    more tiles than 2 per SM and at most 3 per SM (3B/8B QKV) runs one tile per block at 3 blocks per SM (ring 3:
    a warp's whole share of the tile is requested before the wait) instead of a partial second round.
    The launch runs gemv_f8_<variant>_r<depth>. `depth` forces that ring depth at 1 block per SM (tests: every
    depth, several tiles per block). `norm`: an RMSNorm prologue (fp16: h and norm_w parked in shared memory,
    k * 6 bytes more; gemv_common.cuh STAGE_SMEM)."""
    fp8 = fmt == "fp8"
    base = k * 2 + (2 * GEMV_WARPS * 16 + 32) * 4  # x in fragment order + partial sums + block_sum scratch
    per_sm = knob("GEMV_GRID_PER_SM", GEMV_BLOCKS_PER_SM, defines)
    if not fp8:
        base += k * 6 if norm else 0
        return 0, min(per_sm, blocks_fit(base, smem)), base
    slot = GEMV_WARPS * (2048 + 256)  # one ring slot of every warp: a group's 16 rows x 128 fp8 + its scales
    if depth is not None:
        if depth not in GEMV_RING_DEPTHS:
            raise AtomflowError(f"GEMV ring depth {depth} has no kernel instance (one of {GEMV_RING_DEPTHS})")
        return depth, 1, base + depth * slot
    depths = sorted((d for d in GEMV_RING_DEPTHS if d <= knob("GEMV_STAGES", GEMV_STAGES, defines)), reverse=True)
    plans = [(b, d) for b in sorted({per_sm, 1}, reverse=True) for d in depths]  # 1 block/SM: small-smem GPUs
    if knob("GEMV_ONE_WAVE", GEMV_ONE_WAVE, defines) and per_sm * n_sm < tiles <= (per_sm + 1) * n_sm:
        plans = [(per_sm + 1, d) for d in depths if d >= 3] + plans  # one wave needs >= 3 groups per warp in flight
    for b, depth in plans:
        if blocks_fit(base + depth * slot, smem) >= b:
            return depth, b, base + depth * slot
    raise AtomflowError(f"GEMV with K={k}: no ring of {depths} fits the {smem[0]} bytes of shared memory per block")


def gemv_ws(fmt: str, defines: tuple = (), cc: int | None = None) -> bool:
    """Whether the tiled GEMVs of `fmt` run warp-specialised: sm_90+ (bulk copies) and knob GEMV_WS (1: fp16 only,
    the default; 2: fp8 too; 0: neither)."""
    level = knob("GEMV_WS", GEMV_WS, defines)
    return level >= (2 if fmt == "fp8" else 1) and (compute_capability() if cc is None else cc) >= 90


def gemv_ws_pre(fmt: str, defines: tuple = ()) -> int:
    """The default count of ring slots a warp-specialised GEMV of `fmt` fills before its PDL wait (GEMV_WS_PRE, knobs
    GEMV_WS_PRE_F16 / GEMV_WS_PRE_F8)."""
    return knob("GEMV_WS_PRE_F8" if fmt == "fp8" else "GEMV_WS_PRE_F16", GEMV_WS_PRE[fmt], defines)


def ws_smem(fmt: str, k: int, dyn: bool = False) -> tuple[int, int]:
    """(fixed bytes, bytes per ring slot) of gemv_tiled_ws's dynamic shared memory: x, the partial sums and block_sum
    scratch, the full/empty/go mbarriers and up to 128 bytes of ring alignment; a slot is 16 KB of weights (fp8: + 8
    groups' scales). DYN adds a `done` mbarrier and a unit id per GEMV_WS_MAX slot, and per slot its partial sums
    [8 warps][16] f32."""
    base = k * 2 + (2 * GEMV_WARPS * 16 + 32) * 4 + (2 * GEMV_WS_MAX + 2) * 8 + 128
    slot = GEMV_WS_SLOT + (8 * 64 if fmt == "fp8" else 0)
    return (base + GEMV_WS_MAX * 12, slot + GEMV_WARPS * 16 * 4) if dyn else (base, slot)


def gemv_ws_plan(fmt: str, tiles: int, k: int, n_sm: int, defines: tuple = (), smem: tuple = SMEM_H100,
                 depth: int | None = None) -> tuple[int, int, int]:
    """(ring slots, blocks per SM, dynamic shared memory) of a warp-specialised tiled GEMV (gemv_tiled_ws).

    2 blocks per SM (3 for more than 2 and at most 3 tiles per SM: one tile per block, one wave), each with the
    deepest ring <= GEMV_WS_SLOTS that fits, but no deeper than the slots its tiles fill; fewer blocks per SM if not
    even 2 slots fit. A grid of at most one block per SM (GEMV_WS_SOLO) gets up to GEMV_WS_MAX slots. The kernel
    reads its ring depth back from the dynamic shared memory size. `depth` forces that many slots at 1 block per SM
    (tests)."""
    base, slot = ws_smem(fmt, k)
    if depth is not None:
        if not 1 <= depth <= GEMV_WS_MAX:
            raise AtomflowError(f"GEMV ring of {depth} slots: 1 to {GEMV_WS_MAX}")
        return depth, 1, base + depth * slot
    per_sm = knob("GEMV_GRID_PER_SM", GEMV_BLOCKS_PER_SM, defines)
    if knob("GEMV_ONE_WAVE", GEMV_ONE_WAVE, defines) and per_sm * n_sm < tiles <= (per_sm + 1) * n_sm:
        per_sm += 1
    per_tile = gemv_slots_per_tile(fmt, k)
    cap = knob("GEMV_WS_SLOTS", GEMV_WS_SLOTS, defines)
    if knob("GEMV_WS_SOLO", GEMV_WS_SOLO, defines) and tiles <= n_sm:  # <= 1 block per SM anyway: the SM's ring
        per_sm, cap = 1, GEMV_WS_MAX
    for b in range(per_sm, 0, -1):
        need = -(-tiles // min(tiles, b * n_sm)) * per_tile  # slots the busiest block fills
        want = min(cap, GEMV_WS_MAX, need)
        fits = [ns for ns in range(want, 0, -1) if blocks_fit(base + ns * slot, smem) >= b]
        if fits and (fits[0] >= 2 or need == 1):
            return fits[0], b, base + fits[0] * slot
    raise AtomflowError(f"GEMV with K={k}: not even a ring of 2 slots fits the {smem[0]} bytes of shared memory")


def gemv_dyn_plan(fmt: str, tiles: int, k: int, n_sm: int, defines: tuple = (), smem: tuple = SMEM_H100
                  ) -> tuple[int, int, int, int]:
    """(ring slots, blocks per SM, dynamic shared memory, grid) of a DYN launch (gemv_common.cuh: dynamic split-K
    units, one ring slot of one tile each). GEMV_DYN_PER_SM blocks per SM (fewer if not even 2 slots fit), each with
    the deepest ring <= GEMV_WS_SLOTS that fits (a slot carries its 512 bytes of partial sums); the grid is every
    block that fits, or the unit count if that is smaller."""
    base, slot = ws_smem(fmt, k, dyn=True)
    units = tiles * gemv_slots_per_tile(fmt, k)
    cap = min(knob("GEMV_WS_SLOTS", GEMV_WS_SLOTS, defines), GEMV_WS_MAX)
    for b in range(knob("GEMV_DYN_PER_SM", GEMV_DYN_PER_SM, defines), 0, -1):
        fits = [ns for ns in range(cap, 0, -1) if blocks_fit(base + ns * slot, smem) >= b]
        if fits and fits[0] >= 2:
            return fits[0], b, base + fits[0] * slot, min(units, b * n_sm)
    raise AtomflowError(f"GEMV with K={k}: not even a ring of 2 slots fits the {smem[0]} bytes of shared memory")


def gemv_dyn_clear(ctr, part) -> None:
    """The DYN state between launches: counters 0, partial sums SENTINEL (what every launch leaves behind; set once
    before the first launch, and again after an aborted one)."""
    import cupy as cp

    ctr.fill(0)
    part.view(np.uint32).fill(GEMV_DYN_SENTINEL)
    cp.cuda.Device().synchronize()  # the fills run on the current stream; the engine's own stream does not wait


def gemv_launch(lib: KernelLib, fmt: str, variant: str, w, scales, x, y, n_out: int, k: int, n_sm: int,
                norm_w=None, eps: float = 1e-5, taps=None, role: str = "", rope: tuple = (),
                ring_depth: int | None = None, ws: bool | None = None, ws_pre: int | None = None,
                x_out=None, dyn: tuple | None = None) -> Launch:
    """y = W.x in `fmt` (fp16 | fp8) with `variant` in qkv_rope | norm_swiglu | resid | store (weights, and fp8
    scales, in the tiled layout of weights.tile_view with the variant's VARIANT_PAIRING) or f32 (lm_head: fp16
    row-major weights).

    qkv_rope: n_out = qkv_dim / 2 (one output per rotation pair); `rope` = (cos_sin, pos, k_cache, v_cache,
    n_q_heads, n_kv_heads, head_dim[, next]) for this layer; next: (array, bytes from its start) the kernel asks into
    L2 (gemv_common.cuh next_weights_l2; step.next_l2 decides), or None.
    `ring_depth`: see gemv_ws_plan / gemv_plan (tests). `ws`:
    the tiled variants warp-specialised (sm_90+) or not; None: the rule of gemv_ws (knob GEMV_WS). `ws_pre`: the
    ring slots a warp-specialised launch fills before its wait (None: gemv_ws_pre). The engine passes the form it
    measured fastest (Engine gemv="auto"). `dyn` = (counter, partials): the DYN kernel (dynamic split-K units,
    sm_90+; counter: 2 uint32 of this launch's own — no other launch may use them until this one is complete;
    partials: float32 scratch of arena.dyn_part_floats, both as gemv_dyn_clear leaves them).
    f32 (lm_head): with `norm_w`, x is the fp32 residual and the kernel's prologue is the final RMSNorm; `x_out`
    (fp16 [k]) receives the normalised x (block 0).
    """
    fp8 = fmt == "fp8"
    rows = 2 * n_out if variant in ("norm_swiglu", "qkv_rope") else n_out
    if tuple(w.shape) != (rows, k):
        raise AtomflowError(f"GEMV weight shape {tuple(w.shape)} != ({rows}, {k})")
    if variant == "f32":
        if fp8 or k % 8:
            raise AtomflowError(f"lm_head GEMV needs fp16 weights with K % 8 == 0, got {fmt} K={k}")
        shmem, depth, ws = (k * 2 if norm_w is None else k * 8 + 128), 0, False  # gemv_common.cuh gemv_rows
        grid_units = -(-n_out // ROWS_WARPS)  # a warp per output row
        per_sm = ROWS_BLOCKS_PER_SM
    else:
        try:
            check_tiled(rows, k, VARIANT_PAIRING[variant], rope[6] // 2 if rope else 0)
        except VerifyError as e:
            raise AtomflowError(f"GEMV {role or variant}: {e}") from None
        grid_units = rows // 16  # a block per 16-row tile
        ws = gemv_ws(fmt, lib.defines) if ws is None else ws
        ws = ws or dyn is not None
        if ws and compute_capability() < 90:
            raise AtomflowError("warp-specialised GEMVs need sm_90+ (bulk copies)")
        if dyn is not None:
            depth, per_sm, shmem, grid_units = gemv_dyn_plan(fmt, grid_units, k, n_sm, lib.defines, smem_limits())
            ctr, part = dyn
            need = dyn_part_floats(fmt, [(rows, k)])
            if ctr.dtype != np.uint32 or ctr.size < 2 or part.dtype != np.float32 or part.size < need:
                raise AtomflowError(f"GEMV {role or variant} (DYN): needs 2 uint32 counters and {need} float32 "
                                    f"partials, got {ctr.dtype} x {ctr.size} and {part.dtype} x {part.size}")
        elif ws:
            depth, per_sm, shmem = gemv_ws_plan(fmt, grid_units, k, n_sm, lib.defines, smem_limits(), ring_depth)
        else:
            depth, per_sm, shmem = gemv_plan(fmt, grid_units, k, n_sm, lib.defines, smem_limits(), ring_depth,
                                             norm=variant in ("norm_swiglu", "qkv_rope"))
    name = f"gemv_f8_{variant}" if fp8 else f"gemv_f16_{variant}"
    fn = lib[f"{name}_dyn" if dyn is not None else f"{name}_ws" if ws else f"{name}_r{depth}" if fp8 else name]
    allow_dynamic_smem(fn, shmem)
    per_sm = max(1, min(per_sm, blocks_fit(shmem, smem_limits())))
    grid = (min(grid_units, n_sm * per_sm),)
    moved = w.nbytes + (scales.nbytes if fp8 else 0) + x.nbytes + y.nbytes
    extra = ()
    if variant == "qkv_rope":
        cos_sin, pos, k_cache, v_cache, n_q, n_kv, hd, *nxt = rope
        nxt = nxt[0] if nxt else None
        extra = (cos_sin, pos, k_cache, v_cache, i32(n_q), i32(n_kv), i32(hd),
                 NULL if nxt is None else nxt[0], np.uint64(0 if nxt is None else nxt[1]))
        moved += 2 * n_kv * hd * 2  # the K and V rows appended to the cache
    if variant == "f32":
        extra = (NULL if x_out is None else x_out,)
        moved += 0 if norm_w is None else norm_w.nbytes + (0 if x_out is None else x_out.nbytes)
    if ws:
        pre = gemv_ws_pre(fmt, lib.defines) if ws_pre is None else ws_pre
        if not 0 <= pre <= GEMV_WS_MAX:
            raise AtomflowError(f"GEMV ring slots before the wait: 0 to {GEMV_WS_MAX}, not {pre}")
        extra += (i32(pre),)
    if dyn is not None:
        extra += dyn
    threads = GEMV_DYN_THREADS if dyn is not None else GEMV_WS_THREADS if ws else GEMV_THREADS
    return Launch(fn, f"gemv_{fmt}_{variant}", grid, (threads,),
                  (w, scales if fp8 else NULL, x, NULL if norm_w is None else norm_w, np.float32(eps), y,
                   i32(n_out), i32(k)) + extra, shmem, taps or {}, moved,
                  f"gemv {fmt} {role or variant} {rows}x{k}")


def quantize_launch(lib: KernelLib, w16, q, s) -> Launch:
    rows, k = w16.shape
    groups = s.shape[1]
    return Launch(lib["quantize_fp8"], "quantize_fp8", (-(-rows * groups // 8),), (256,),
                  (w16, q, s, i32(rows), i32(k)), 0, {}, w16.nbytes + q.nbytes + s.nbytes)


def embed_launch(lib: KernelLib, token, emb, h, taps=None) -> Launch:
    H = emb.shape[1]
    return Launch(lib["embed_lookup"], "embed_lookup", (-(-H // 256),), (256,), (token, emb, h, i32(H)), 0,
                  taps or {}, H * 2 + H * 4)


def att_threads(defines: tuple | None = None) -> int:
    """Block size of attention.cu (A/B knob ATT_THREADS)."""
    return knob("ATT_THREADS", ATT_THREADS, defines)


def att_ring_bytes(defines: tuple | None = None) -> int:
    """Each warp's K/V ring in attention.cu (knob ATT_RING_BYTES; with ATT_BULK's padded rows 26112: 3 groups at hd
    128 still)."""
    return knob("ATT_RING_BYTES", ATT_RING_BYTES_BULK if knob("ATT_BULK", 0, defines) else ATT_RING_BYTES, defines)


def att_tma(defines: tuple | None = None) -> int:
    """1 when attention.cu stages K/V by 2D tensor copies (knob ATT_TMA, which a KernelLib's defines carry on sm_90+:
    kernels.arch_defines): the launch then carries the layer's tensor maps."""
    return knob("ATT_TMA", 0, defines)


def attention_smem(group: int, hd: int, splits: int, defines: tuple | None = None) -> int:
    """Bytes of dynamic shared memory of attention.cu: the warps' K/V rings (ATT_RING_BYTES each, knob). The kernel
    reuses them at its end for the warps' O ([warps][G][hd] fp32; with clusters then the block's o) and for the split combine (fp32 m and l
    [2][G][splits] rounded to 4, the float4 sums [G*hd/4], then the partial o of as many splits as fit, at least
    one); a plan where those do not fit is refused."""
    warps = att_threads(defines) // 32
    rings = warps * att_ring_bytes(defines) + 1024 * att_tma(defines)  # TMA: the swizzle's 1 KB alignment
    merge = 4 * (warps + (att_cluster(defines) > 1)) * group * hd  # with clusters also the block's o [G][hd]
    combine = 4 * (-(-2 * group * splits // 4) * 4 + 2 * group * hd)
    if max(merge, combine) > rings:
        raise AtomflowError(f"attention: {splits} splits of {group} heads x {hd} do not fit the kernel's "
                            f"{rings} bytes of shared memory")
    return rings


def attention_launch(lib: KernelLib, q, k_cache, v_cache, pos, part_ml, part_o, counters, out, n_kv: int,
                     group: int, hd: int, taps=None) -> Launch:
    """k_cache/v_cache: one layer's [max_seq, kv_dim] slab; part_*: [n_heads, splits, ...] scratch, whose split
    count is the launch's grid.y (arena.attention_splits: at long contexts a split walks several sub-chunks; whole
    clusters of ATT_CLUSTER splits); counters: n_kv x ATT_CLUSTER tickets."""
    splits = part_ml.shape[1]
    if part_o.shape[1] != splits or splits < 1:
        raise AtomflowError("attention partials: att_ml and att_o disagree on the split count")
    cluster = att_cluster(lib.defines)
    if splits % cluster:
        raise AtomflowError(f"{splits} attention splits are not whole clusters of {cluster} (arena.attention_splits)")
    if counters.size < n_kv * cluster:
        raise AtomflowError(f"attention: {counters.size} tickets for {n_kv} kv heads x {cluster} cluster slices")
    fn = lib[f"attention_decode_hd{hd}_g{group}"]
    shmem = attention_smem(group, hd, splits, lib.defines)
    if shmem > SMEM_PER_SM:
        raise AtomflowError(f"{splits} attention splits need {shmem} bytes of shared memory (> {SMEM_PER_SM})")
    allow_dynamic_smem(fn, shmem)
    # ATT_TMA: the K and V slabs' tensor maps (boxes of 16 rows x 64 dims), kept alive by the launch's arguments
    maps = (tensor_maps((k_cache, v_cache), (64, ATT_GROUP)),) if att_tma(lib.defines) else ()
    return Launch(fn, "attention_decode", (n_kv, splits), (att_threads(lib.defines),),
                  (q, k_cache, v_cache, pos, part_ml, part_o, counters, out, i32(n_kv), i32(splits),
                   np.float32(1.0 / math.sqrt(hd))) + maps, shmem, taps or {}, 0, cluster=cluster)


def attention_short_smem(hd: int, cap: int) -> int:
    """Bytes of dynamic shared memory of attention_short.cu at capacity `cap` positions (rounded up to 16): K
    [cap][hd] fp16 (at least the final reduction scratch [warps][16][8] fp32), V [cap][hd] fp16, P fp16
    [8 heads][cap + 8]."""
    cap16 = -(-cap // 16) * 16
    return max(cap16 * hd * 2, (ATS_THREADS // 32) * 16 * ATS_HEADS * 4) + cap16 * hd * 2 + ATS_HEADS * (cap16 + 8) * 2


def attention_short_static(hd: int) -> int:
    """Static shared memory of attention_short.cu (q fp16 [8][hd], the per-warp [warps][8] fp32 scratch) plus 1 KB
    for the timeline instrument's and the compiler's own."""
    return ATS_HEADS * hd * 2 + (ATS_THREADS // 32) * ATS_HEADS * 4 + 1024


def attention_short_cap(hd: int, defines: tuple | None = None, smem: tuple = SMEM_H100) -> int:
    """Positions the short-attention kernel holds (the engine's short graph serves every length up to it): the
    largest multiple of ATT_CHUNK that one block's shared memory holds, at most ATS_CHUNK_MAX (knob ATT_SHORT_MAX
    lowers it). 0 when the knob ATT_SHORT=0 or not even ATT_CHUNK positions fit (the split kernel always)."""
    if not knob("ATT_SHORT", 1, defines):
        return 0
    room = smem[0] - attention_short_static(hd)
    limit = min(ATS_CHUNK_MAX, knob("ATT_SHORT_MAX", 1 << 30, defines))  # A/B knob: the largest capacity used
    top = 0
    while attention_short_smem(hd, top + ATT_CHUNK) <= room and top + ATT_CHUNK <= limit:
        top += ATT_CHUNK
    return top


def attention_short_launch(lib: KernelLib, q, k_cache, v_cache, pos, out, n_kv: int, group: int, hd: int, cap: int,
                           taps=None) -> Launch:
    """One block per kv head holding up to `cap` positions of K and V in shared memory (longer contexts are
    walked in chunks of `cap`: correct, but the engine switches to attention_launch there). The block asks for
    all the shared memory a block may have, whatever `cap` needs: nothing else (the next GEMV's early blocks)
    can share its SM, whose weight loads would stall this block's shared-memory traffic (PERF_NOTES v11.2)."""
    fn = lib[f"attention_short_hd{hd}_g{group}"]
    need, room = attention_short_smem(hd, cap), smem_limits()[0] - attention_short_static(hd)
    if cap < 1 or need > room:
        raise AtomflowError(f"short attention of {cap} positions needs {need} bytes of shared memory per block "
                            f"(this GPU: {smem_limits()[0]})")
    shmem = room if knob("ATT_SHORT_EXCLUSIVE", 1, lib.defines) else need  # A/B knob: 0 = only what cap needs
    allow_dynamic_smem(fn, shmem)
    return Launch(fn, "attention_decode", (n_kv,), (ATS_THREADS,),
                  (q, k_cache, v_cache, pos, out, i32(n_kv), i32(cap), np.float32(1.0 / math.sqrt(hd))), shmem,
                  taps or {}, 0)


def rmsnorm_launch(lib: KernelLib, h, w, eps: float, out, taps=None) -> Launch:
    """256 threads: the sums in the order of the lm_head's norm prologue (gemv_rows), so that both give the same x."""
    K = h.shape[0]
    return Launch(lib["rmsnorm_f32_f16"], "rmsnorm_f32_f16", (1,), (GEMV_THREADS,),
                  (h, w, np.float32(eps), out, i32(K)), 0, taps or {}, K * 8)


def argmax_launch(lib: KernelLib, logits, part_val, part_idx, counter, pos, cur_token, prompt, prompt_len,
                  out_tokens) -> Launch:
    V = logits.shape[0]
    return Launch(lib["argmax_advance"], "argmax_advance", (part_val.shape[0],), (ARGMAX_THREADS,),
                  (logits, i32(V), part_val, part_idx, counter, pos, cur_token, prompt, prompt_len, out_tokens),
                  0, {}, logits.nbytes)


def lm_head_norm(lib: KernelLib) -> bool:
    """Whether the final RMSNorm runs as the lm_head GEMV's prologue (knob LMHEAD_NORM)."""
    return bool(knob("LMHEAD_NORM", LMHEAD_NORM, lib.defines))


def lm_head_launches(lib: KernelLib, a: Arena, cfg: ModelConfig, n_sm: int) -> list[Launch]:
    """The step's tail after the last layer: xnorm = RMSNorm(h) * final_norm, logits = lm_head . xnorm (fp32), the
    greedy token and the step state (argmax.cu's contract) — one launch: the norm in the GEMV's prologue (block 0
    also stores xnorm, the `final_norm` probe) and the argmax in its epilogue. The knob LMHEAD_NORM=0 reads xnorm
    written by rmsnorm_f32_f16 before it (build_step), LMHEAD_ARGMAX=0 adds argmax_advance after it."""
    head = a["embed" if cfg.tie_word_embeddings else "lm_head"]
    norm = lm_head_norm(lib)
    kw = dict(norm_w=a["final_norm"], eps=cfg.rms_norm_eps, x_out=a["xnorm"]) if norm else {}
    gemv = gemv_launch(lib, "fp16", "f32", head, None, a["h" if norm else "xnorm"], a["logits"], cfg.vocab_size,
                       cfg.hidden_size, n_sm, taps={**({"final_norm": a["xnorm"]} if norm else {}),
                                                    "logits": a["logits"]}, role="lm_head", **kw)
    state = (a["pos"], a["cur_token"], a["prompt"], a["prompt_len"], a["out_tokens"])
    if not knob("LMHEAD_ARGMAX", LMHEAD_ARGMAX, lib.defines):
        return [gemv, argmax_launch(lib, a["logits"], a["am_val"], a["am_idx"], a["am_counter"], *state)]
    if a["am_val"].shape[0] < gemv.grid[0]:
        raise AtomflowError(f"argmax partials for {a['am_val'].shape[0]} blocks, lm_head has {gemv.grid[0]}")
    fn = lib["gemv_f16_f32_argmax"]
    allow_dynamic_smem(fn, gemv.shmem)
    return [dataclasses.replace(gemv, fn=fn, name="gemv_fp16_f32_argmax",
                                args=gemv.args + (a["am_val"], a["am_idx"], a["am_counter"], *state, i32(1)))]


def hold_position(launches: list[Launch]) -> list[Launch]:
    """The step without advancing the position, for timing runs that replay it many times at one length:
    argmax_advance left out, or the fused lm_head launched with advance = 0 (it still finds the token, so the
    time includes the argmax)."""
    out = []
    for ln in launches:
        if ln.name == "argmax_advance":
            continue
        if ln.name == "gemv_fp16_f32_argmax":
            ln = dataclasses.replace(ln, args=ln.args[:-1] + (i32(0),), _ex=None)
            if ln.pdl:
                ln.enable_pdl()
        out.append(ln)
    return out


# ---- the step --------------------------------------------------------------------------------------------

def build_step(cfg: ModelConfig, fmt: str, a: Arena, lib: KernelLib, n_sm: int, att_cap: int | None = None,
               gemv_ws: bool | None = None, ws_pre: int | None = None, ws_roles: tuple = (),
               dyn_roles: tuple = (), l2_tail: int | None = None) -> list[Launch]:
    """The step's launches, each with its probes as taps (validation copies them after each launch). `att_cap`:
    the short attention kernel holding that many positions (lengths up to it), else the split kernel. `gemv_ws`:
    the layer GEMVs warp-specialised or not (None: gemv_launch's rule); `ws_pre`: their slots before the wait;
    `ws_roles`: roles (wqkv, wo, wgu, wd) warp-specialised whatever `gemv_ws` says; `dyn_roles`: roles run by the
    DYN kernels (dynamic split-K units; each launch its own counter, gemv_dyn_ctr[layer][role]); `l2_tail`: MB of gate/up's last
    weights the QKV kernels ask into L2 under GEMV_NEXT_L2 (None: the knobs; next_l2)."""
    tail = lm_head_launches(lib, a, cfg, n_sm)
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_dim, kv_dim, eps = cfg.q_dim, cfg.kv_dim, cfg.rms_norm_eps
    h, qkv, attn_out, act, xnorm = (a[n] for n in ("h", "qkv", "attn_out", "act", "xnorm"))
    rows = linear_regions(cfg)

    def gemv(weight, variant, x, y, n_out, k, **kw):
        layer, role = weight.split(".", 1)
        scales = a[weight + ".scale"] if fmt == "fp8" else None
        dyn = ((a["gemv_dyn_ctr"][int(layer[1:]), GEMV_ROLES.index(role)], a["gemv_dyn_part"])
               if role in dyn_roles else None)
        return gemv_launch(lib, fmt, variant, a[weight], scales, x, y, n_out, k, n_sm, eps=eps,
                           role=role, ws=True if role in ws_roles else gemv_ws, ws_pre=ws_pre, dyn=dyn, **kw)

    steps = [embed_launch(lib, a["cur_token"], a["embed"], h, taps={"embed": h})]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        steps += [
            gemv(f"L{i}.wqkv", "qkv_rope", h, qkv, rows["wqkv"][0] // 2, H, norm_w=a[f"L{i}.attn_norm"],
                 rope=(a["rope_cs"], a["pos"], a["k_cache"][i], a["v_cache"][i], cfg.num_attention_heads,
                       cfg.num_key_value_heads, hd, next_l2(a, i, lib.defines, l2_tail)),
                 taps={p + "q": qkv[:q_dim], p + "k": qkv[q_dim:q_dim + kv_dim], p + "v": qkv[q_dim + kv_dim:]}),
            attention_short_launch(lib, qkv, a["k_cache"][i], a["v_cache"][i], a["pos"], attn_out,
                                   cfg.num_key_value_heads, cfg.group_size, hd, att_cap, taps={p + "attn_out": attn_out})
            if att_cap else
            attention_launch(lib, qkv, a["k_cache"][i], a["v_cache"][i], a["pos"], a["att_ml"], a["att_o"],
                             a["att_counters"][i], attn_out, cfg.num_key_value_heads, cfg.group_size, hd,
                             taps={p + "attn_out": attn_out}),
            gemv(f"L{i}.wo", "resid", attn_out, h, H, q_dim, taps={p + "attn": h}),
            gemv(f"L{i}.wgu", "norm_swiglu", h, act, I, H, norm_w=a[f"L{i}.mlp_norm"], taps={p + "act": act}),
            gemv(f"L{i}.wd", "resid", act, h, H, I, taps={p + "mlp": h}),
        ]
    if not lm_head_norm(lib):
        steps.append(rmsnorm_launch(lib, h, a["final_norm"], eps, xnorm, taps={"final_norm": xnorm}))
    check_residual_order([ln.name for ln in steps + tail])
    return steps + tail


def l2_tails(defines: tuple) -> tuple:
    """The gate/up tail sizes (MB) the engine times with each GEMV form: GEMV_NEXT_L2_TRY when GEMV_NEXT_L2=1 and
    GEMV_NEXT_L2_TAIL=-1, else none (the knobs fix what is asked)."""
    on = knob("GEMV_NEXT_L2", GEMV_NEXT_L2, defines) == 1
    return GEMV_NEXT_L2_TRY if on and knob("GEMV_NEXT_L2_TAIL", GEMV_NEXT_L2_TAIL, defines) < 0 else ()


def next_l2(a: Arena, i: int, defines: tuple, tail_mb: int | None = None) -> tuple | None:
    """What layer i's QKV kernel asks into L2 under GEMV_NEXT_L2: o_proj's weights, and with GEMV_NEXT_L2_GU = N the
    first N MB of gate/up's too — one range from o_proj's start, which the arena's order (wo, wo.scale, wgu) makes
    contiguous (checked); with GEMV_NEXT_L2_TAIL = N only the last N MB of gate/up's weights. `tail_mb` (the engine's
    measured choice, engine.l2_suffix) overrides the knob's N; 0, GEMV_NEXT_L2 off, or the knob's "measure" (-1) with
    no measured size, asks nothing (None)."""
    knob_mb = knob("GEMV_NEXT_L2_TAIL", GEMV_NEXT_L2_TAIL, defines)
    if tail_mb == 0 or not knob("GEMV_NEXT_L2", GEMV_NEXT_L2, defines) or (tail_mb is None and knob_mb < 0):
        return None
    wo, wgu = a[f"L{i}.wo"], a[f"L{i}.wgu"]
    mb = tail_mb if tail_mb is not None else knob_mb
    tail = min(mb << 20, wgu.nbytes) & ~15
    if tail:
        return wgu.view(np.uint8).reshape(-1)[wgu.nbytes - tail:], tail
    gu = min(knob("GEMV_NEXT_L2_GU", GEMV_NEXT_L2_GU, defines) << 20, wgu.nbytes)
    if not gu:
        return wo, wo.nbytes
    gap = wgu.data.ptr - wo.data.ptr
    if not wo.nbytes <= gap <= wo.nbytes + (wo.nbytes // 16 + 4096):  # only o_proj's scales and padding between
        raise AtomflowError(f"layer {i}: gate/up's weights do not follow o_proj's in the arena")
    return wo, gap + gu


def check_residual_order(names: list[str]) -> None:
    """A residual GEMV reads h[o] before its PDL wait (gemv_common.cuh epilogue_operand): that is safe only when
    the last writer of h is not its direct predecessor (a kernel starts once its predecessor passed its own wait,
    so everything before the predecessor is complete). Writers of h: the embedding and the residual GEMVs. The
    residual GEMVs themselves trigger their successor before their wait (GEMV_EARLY_RESID), so that guarantee holds
    for kernels after any other kernel — which is why a residual GEMV must not follow one."""
    for prev, name in zip(names, names[1:]):
        if "_resid" in name and (prev == "embed_lookup" or "_resid" in prev):
            raise AtomflowError(f"step order: {name} right after {prev}, which writes h (read before the wait)")


def run_eager(launches: list[Launch], taps: dict | None = None) -> None:
    """Run one step launch by launch on the current stream; with `taps`, copy every probe to the host."""
    for ln in launches:
        ln()
        if taps is not None:
            for name, view in ln.taps.items():
                taps[name] = view.get().astype(np.float32)
