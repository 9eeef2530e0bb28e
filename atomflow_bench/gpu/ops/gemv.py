"""The layer GEMVs (QKV, o_proj, gate/up, down): everything the host knows about kernels_cu/gemv_fp16.cu,
gemv_fp8.cu and their headers gemv_args.cuh, gemv_prologue.cuh, gemv_epilogue.cuh, gemv_tiled.cuh and gemv_ws.cuh:
constants, the kernels by name, the tiled weight layout, the launch plans and the launch factory.

Two forms per format, both y = W . x over weights pre-tiled at load time (tile_view):
  ring  the per-warp path: fp8 through a cp.async ring in shared memory (one kernel per ring depth, `_r<N>`), fp16
        through registers (gemv_plan);
  ws    warp-specialised, sm_90+: a producer warp fills a ring of 16 KB slots with bulk copies for 8 consumer warps
        (gemv_ws_plan); `ws_pre` slots are requested before the PDL wait.
Which form a step runs is launch policy (forms.GemvForm, measured by tune.py); this module builds either.
Variants (the epilogue, gemv_epilogue.cuh): qkv_rope (RMSNorm prologue; RoPE + KV-cache append; optionally asks L2
for later weights: next_l2), norm_swiglu (RMSNorm prologue, SwiGLU), resid (h += W.x), store (plain fp16: the
`gemv` microbenchmark's QKV), partial (plain fp32: a tensor-parallel rank's share of o_proj / down for the NCCL path),
resid_tp (tensor parallel with peer memory: h += the sum over ranks of their shares, summed in the epilogue through
the LL slots of tp_ll.cuh; gpu/tp/sums.py holds the buffers).
"""
from __future__ import annotations

import numpy as np

from ...config import GROUP
from ...errors import AtomflowError, VerifyError
from ..device import SMEM_H100, blocks_fit, compute_capability, smem_limits
from ..launch import NULL, Launch, allow_dynamic_smem, i32
from ..nvrtc import KernelLib

# = the kernels' #defines (tests/test_op_constants.py reads them from the .cu files)
GEMV_THREADS = 256          # gemv_args.cuh GEMV_THREADS
GEMV_MIN_BLOCKS = 2         # gemv_tiled.cuh GEMV_MIN_BLOCKS: the grid never exceeds one resident wave of these
GEMV_WS_SLOT = 16384        # gemv_ws.cuh GEMV_WS_SLOT: weight bytes per ring slot (fp8: 8 groups of 128, fp16: 4)
GEMV_WS_MAX = 16            # gemv_ws.cuh GEMV_WS_MAX: the most slots a ring may have
GEMV_RING_DEPTHS = (2, 3, 4, 5)  # fp8 ring depths with a kernel each (gemv_fp8.cu gemv_f8_<variant>_r<depth>)
TILE_ROWS = 16              # gemv_args.cuh GEMV_TILE: weight rows per tile (the mma's M)
CU_FILES = ("gemv_args.cuh", "gemv_prologue.cuh", "gemv_epilogue.cuh", "gemv_tiled.cuh", "gemv_ws.cuh", "tp_ll.cuh",
            "gemv_fp16.cu", "gemv_fp8.cu")
CU_DEFINES = {"GEMV_THREADS": GEMV_THREADS, "GEMV_MIN_BLOCKS": GEMV_MIN_BLOCKS, "GEMV_WS_SLOT": GEMV_WS_SLOT,
              "GEMV_WS_MAX": GEMV_WS_MAX, "GEMV_TILE": TILE_ROWS}

GEMV_WARPS = GEMV_THREADS // 32
GEMV_WS_THREADS = GEMV_THREADS + 32  # 8 consumer warps + the producer (gemv_tiled_ws)
# The plans' limits, each the fastest value measured on the catalog shapes (H100): deeper rings take shared memory
# that a second block per SM needs, and more bytes requested before the wait delay the previous kernel's completion.
GEMV_STAGES = 5             # fp8 ring: the deepest ring (groups of 128 inputs per warp) a launch gets
GEMV_WS_SLOTS = 6           # warp-specialised: the deepest ring a launch gets (~96 KB in flight per block)
GEMV_WS_PRE = {"fp16": 3, "fp8": 0}  # default ring slots filled before the PDL wait (0: all)
ROLE_VARIANT = {"wqkv": "qkv_rope", "wo": "resid", "wgu": "norm_swiglu", "wd": "resid"}
# Which rows share a tile ("pairing") follows the kernel's epilogue:
#   "none"   tile T = rows 16T .. 16T+15 (o_proj, down_proj, plain GEMVs)
#   "halves" rows 0-7 = gate rows 8T.., rows 8-15 = up rows 8T.. of [gate; up] stacked (SwiGLU epilogue)
#   "rope"   rows 0-7 = rows i..i+7 of a head, rows 8-15 = rows i+hd/2.. of the same head (RoPE epilogue)
VARIANT_PAIRING = {"qkv_rope": "rope", "norm_swiglu": "halves", "resid": "none", "store": "none", "partial": "none",
                   "resid_tp": "none"}
ROLE_PAIRING = {role: VARIANT_PAIRING[v] for role, v in ROLE_VARIANT.items()}


def kernel_name(fmt: str, variant: str, ws: bool, depth: int = 0) -> str:
    """The kernel of a launch: gemv_f16_<variant> (the register path), gemv_f8_<variant>_r<depth> (the ring at that
    depth) or gemv_{f16,f8}_<variant>_ws (warp-specialised)."""
    name = f"gemv_{'f8' if fmt == 'fp8' else 'f16'}_{variant}"
    return f"{name}_ws" if ws else f"{name}_r{depth}" if fmt == "fp8" else name


# The kernels this module launches, by the .cu that defines them (nvrtc.KernelLib compiles a file for its kernels;
# tests/test_op_constants.py checks the lists against the entries nvcc finds in each file).
KERNELS = {
    "gemv_fp16.cu": tuple(kernel_name("fp16", v, ws) for v in VARIANT_PAIRING for ws in (False, True)),
    "gemv_fp8.cu": tuple(kernel_name("fp8", v, False, d) for v in VARIANT_PAIRING for d in GEMV_RING_DEPTHS)
    + tuple(kernel_name("fp8", v, True) for v in VARIANT_PAIRING),
}


def linear_regions(cfg) -> dict[str, tuple[int, int]]:
    """The engine's fused projections per layer: [rows, K]. q|k|v stacked; gate|up stacked."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    return {"wqkv": (cfg.qkv_dim, H), "wo": (H, cfg.q_dim), "wgu": (2 * I, H), "wd": (H, I)}


# ---- the tiled layout (gemv_tiled.cuh) --------------------------------------------------------------------------
# Each tile is stored as 512-byte units whose lane l holds its mma.m16n8k16 A fragments: rows l/4 and l/4 + 8,
# inputs 2(l%4), +1, +8, +9 of a 16-input k-tile (fp8: two k-tiles per unit). Every layout is a reshape + transpose
# of the row-major matrix, so the same view works on NumPy and CuPy arrays (no gather, no temporary on the device:
# `dst.reshape(view.shape)[...] = view`).

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


# ---- launch plans -----------------------------------------------------------------------------------------------

def slots_per_tile(fmt: str, k: int) -> int:
    """Ring slots (16 KB of weights: 8 fp8 or 4 fp16 groups of 128 inputs) that one 16-row tile of K inputs fills in
    the warp-specialised GEMVs."""
    return -(-(-(-k // GROUP)) // (8 if fmt == "fp8" else 4))


def gemv_plan(fmt: str, tiles: int, k: int, n_sm: int, smem: tuple = SMEM_H100, depth: int | None = None,
              norm: bool = False) -> tuple[int, int, int]:
    """(ring depth, blocks per SM, dynamic shared memory) of a ring-form launch of `tiles` 16-row tiles.

    fp16 (register path): no ring (depth 0), 2 blocks per SM. fp8 (cp.async ring): the deepest ring <= GEMV_STAGES at
    which 2 blocks fit an SM (5 groups per warp at K <= ~11k, 4 above: 8B's down projection); but a launch of
    more tiles than 2 per SM and at most 3 per SM (3B/8B QKV) runs one tile per block at 3 blocks per SM (ring >= 3:
    a warp's whole share of the tile is requested before the wait) instead of a partial second round.
    The launch runs gemv_f8_<variant>_r<depth>. `depth` forces that ring depth at 1 block per SM (tests: every
    depth, several tiles per block). `norm`: an RMSNorm prologue (fp16: h and norm_w parked in shared memory,
    k * 6 bytes more; gemv_prologue.cuh STAGE_SMEM)."""
    base = k * 2 + (2 * GEMV_WARPS * 16 + 32) * 4  # x in fragment order + partial sums + block_sum scratch
    per_sm = GEMV_MIN_BLOCKS
    if fmt != "fp8":
        base += k * 6 if norm else 0
        return 0, min(per_sm, blocks_fit(base, smem)), base
    slot = GEMV_WARPS * (2048 + 256)  # one ring slot of every warp: a group's 16 rows x 128 fp8 + its scales
    if depth is not None:
        if depth not in GEMV_RING_DEPTHS:
            raise AtomflowError(f"GEMV ring depth {depth} has no kernel instance (one of {GEMV_RING_DEPTHS})")
        return depth, 1, base + depth * slot
    depths = sorted((d for d in GEMV_RING_DEPTHS if d <= GEMV_STAGES), reverse=True)
    plans = [(b, d) for b in sorted({per_sm, 1}, reverse=True) for d in depths]  # 1 block/SM: small-smem GPUs
    if per_sm * n_sm < tiles <= (per_sm + 1) * n_sm:
        plans = [(per_sm + 1, d) for d in depths if d >= 3] + plans  # one wave needs >= 3 groups per warp in flight
    for b, d in plans:
        if blocks_fit(base + d * slot, smem) >= b:
            return d, b, base + d * slot
    raise AtomflowError(f"GEMV with K={k}: no ring of {depths} fits the {smem[0]} bytes of shared memory per block")


def ws_smem(fmt: str, k: int) -> tuple[int, int]:
    """(fixed bytes, bytes per ring slot) of gemv_tiled_ws's dynamic shared memory: x, the partial sums and block_sum
    scratch, the full/empty/go mbarriers and up to 128 bytes of ring alignment; a slot is 16 KB of weights (fp8: + 8
    groups' scales)."""
    base = k * 2 + (2 * GEMV_WARPS * 16 + 32) * 4 + (2 * GEMV_WS_MAX + 2) * 8 + 128
    return base, GEMV_WS_SLOT + (8 * 64 if fmt == "fp8" else 0)


def gemv_ws_plan(fmt: str, tiles: int, k: int, n_sm: int, smem: tuple = SMEM_H100,
                 depth: int | None = None) -> tuple[int, int, int]:
    """(ring slots, blocks per SM, dynamic shared memory) of a warp-specialised launch (gemv_tiled_ws).

    2 blocks per SM (3 for more than 2 and at most 3 tiles per SM: one tile per block, one wave), each with the
    deepest ring <= GEMV_WS_SLOTS that fits, but no deeper than the slots its tiles fill; fewer blocks per SM if not
    even 2 slots fit. A grid of at most one block per SM gets up to GEMV_WS_MAX slots (the whole SM's shared memory:
    measured faster on 1B's down projection). The
    kernel reads its ring depth back from the dynamic shared memory size. `depth` forces that many slots at 1 block
    per SM (tests)."""
    base, slot = ws_smem(fmt, k)
    if depth is not None:
        if not 1 <= depth <= GEMV_WS_MAX:
            raise AtomflowError(f"GEMV ring of {depth} slots: 1 to {GEMV_WS_MAX}")
        return depth, 1, base + depth * slot
    per_sm = GEMV_MIN_BLOCKS
    if per_sm * n_sm < tiles <= (per_sm + 1) * n_sm:
        per_sm += 1
    per_tile = slots_per_tile(fmt, k)
    cap = GEMV_WS_SLOTS
    if tiles <= n_sm:  # <= 1 block per SM anyway: the SM's ring
        per_sm, cap = 1, GEMV_WS_MAX
    for b in range(per_sm, 0, -1):
        need = -(-tiles // min(tiles, b * n_sm)) * per_tile  # slots the busiest block fills
        want = min(cap, GEMV_WS_MAX, need)
        fits = [ns for ns in range(want, 0, -1) if blocks_fit(base + ns * slot, smem) >= b]
        if fits and (fits[0] >= 2 or need == 1):
            return fits[0], b, base + fits[0] * slot
    raise AtomflowError(f"GEMV with K={k}: not even a ring of 2 slots fits the {smem[0]} bytes of shared memory")


def gemv_grid(fmt: str, variant: str, rows: int, k: int, n_sm: int, ws: bool, ring_depth: int | None = None,
              smem: tuple | None = None) -> tuple[int, int, int]:
    """(ring depth, dynamic shared memory, blocks) of a launch over a [rows, k] weight in the ws or ring form
    (`smem`: the GPU's shared memory limits, default this device's)."""
    smem = smem or smem_limits()
    tiles = rows // TILE_ROWS  # a block per 16-row tile at a time
    if ws:
        depth, per_sm, shmem = gemv_ws_plan(fmt, tiles, k, n_sm, smem, ring_depth)
    else:
        depth, per_sm, shmem = gemv_plan(fmt, tiles, k, n_sm, smem, ring_depth,
                                         norm=variant in ("norm_swiglu", "qkv_rope"))
    per_sm = max(1, min(per_sm, blocks_fit(shmem, smem)))
    return depth, shmem, min(tiles, n_sm * per_sm)


def head_l2(fmt: str, variant: str, w, scales, n_sm: int, ws: bool, slots: int,
            smem: tuple | None = None) -> tuple | None:
    """A later GEMV's head, for an earlier kernel to ask into L2 (gemv_args.cuh L2Head: resid_tp while it waits
    for the other ranks, QKV after its epilogue): the first `slots` ring slots' worth (GEMV_WS_SLOT bytes each, and
    their fp8 scales) of every tile in the first round of that GEMV (variant over weights `w` [rows, K], tiled, in the
    ws or ring form): what each of its blocks reads first. Kernel arguments (w, scales, w_stride, w_chunk, s_stride,
    s_chunk, tiles), or None for 0 slots."""
    if slots <= 0:
        return None
    rows, k = w.shape
    fp8 = fmt == "fp8"
    tile_w = TILE_ROWS * k * (1 if fp8 else 2)
    w_chunk = min(slots * GEMV_WS_SLOT, tile_w)
    groups = -(-k // GROUP)  # fp8 scales: [tile][group][16 rows] fp32
    tile_s = groups * TILE_ROWS * 4
    s_chunk = min(-(-w_chunk * groups // tile_w) * TILE_ROWS * 4, tile_s) if fp8 else 0
    blocks = gemv_grid(fmt, variant, rows, k, n_sm, ws, smem=smem)[2]
    return (w, scales if fp8 else NULL, tile_w, w_chunk, tile_s if fp8 else 0, s_chunk, blocks)


def _head_args(head: tuple | None) -> tuple:
    """An L2Head's seven kernel arguments (gemv_args.cuh L2HEAD_PARAMS); None: count 0."""
    w, sc, w_stride, w_chunk, s_stride, s_chunk, count = head or (NULL, NULL, 0, 0, 0, 0, 0)
    return (w, sc, *(np.uint32(v) for v in (w_stride, w_chunk, s_stride, s_chunk)), i32(count))


# ---- the launch factory -----------------------------------------------------------------------------------------

def gemv_launch(lib: KernelLib, fmt: str, variant: str, w, scales, x, y, n_out: int, k: int, n_sm: int,
                norm_w=None, eps: float = 1e-5, taps=None, role: str = "", rope: tuple = (),
                ring_depth: int | None = None, ws: bool = False, ws_pre: int | None = None, tp: tuple | None = None,
                head: tuple | None = None) -> Launch:
    """y = W.x in `fmt` (fp16 | fp8) with `variant` in qkv_rope | norm_swiglu | resid | store (weights, and fp8
    scales, in the tiled layout with the variant's VARIANT_PAIRING).

    qkv_rope: n_out = qkv_dim / 2 (one output per rotation pair); `rope` = (cos_sin, pos, k_cache, v_cache,
    n_q_heads, n_kv_heads, head_dim[, next]) for this layer; next: (array, bytes from its start) the kernel asks into
    L2 after its epilogue (next_l2), or None. `ws`: the warp-specialised form (sm_90+), else the ring form;
    `ws_pre`: the slots it fills before its wait (None: GEMV_WS_PRE). `ring_depth`: forces a ring depth (tests).
    resid_tp: y = h (fp32) and `tp` = (slots, seq, rank, ranks): the device array of the ranks' LL buffer addresses
    for this role, this buffer's epochs (one uint32 per block; gpu/tp/sums.py TpComm.gemv_target).
    `head` (qkv_rope, resid_tp): a later GEMV's head (head_l2) asked into L2: by qkv_rope after its epilogue (before
    `next`), by resid_tp while it waits for the other ranks; None: nothing."""
    fp8 = fmt == "fp8"
    rows = 2 * n_out if variant in ("norm_swiglu", "qkv_rope") else n_out
    if tuple(w.shape) != (rows, k):
        raise AtomflowError(f"GEMV weight shape {tuple(w.shape)} != ({rows}, {k})")
    if variant not in VARIANT_PAIRING:
        raise AtomflowError(f"GEMV variant {variant!r}: one of {', '.join(VARIANT_PAIRING)}")
    try:
        check_tiled(rows, k, VARIANT_PAIRING[variant], rope[6] // 2 if rope else 0)
    except VerifyError as e:
        raise AtomflowError(f"GEMV {role or variant}: {e}") from None
    if ws and compute_capability() < 90:
        raise AtomflowError("warp-specialised GEMVs need sm_90+ (bulk copies)")
    depth, shmem, blocks = gemv_grid(fmt, variant, rows, k, n_sm, ws, ring_depth)
    fn = lib[kernel_name(fmt, variant, ws, depth)]
    allow_dynamic_smem(fn, shmem)
    grid = (blocks,)
    moved = w.nbytes + (scales.nbytes if fp8 else 0) + x.nbytes + y.nbytes
    extra = ()
    if variant == "qkv_rope":
        cos_sin, pos, k_cache, v_cache, n_q, n_kv, hd, *nxt = rope
        nxt = nxt[0] if nxt else None
        extra = (cos_sin, pos, k_cache, v_cache, i32(n_q), i32(n_kv), i32(hd),
                 NULL if nxt is None else nxt[0], np.uint64(0 if nxt is None else nxt[1]), *_head_args(head))
        moved += 2 * n_kv * hd * 2  # the K and V rows appended to the cache
    if (variant == "resid_tp") != (tp is not None):
        raise AtomflowError(f"GEMV {role or variant}: the cross-rank arguments go with variant resid_tp only")
    if head is not None and variant not in ("qkv_rope", "resid_tp"):
        raise AtomflowError(f"GEMV {role or variant}: only qkv_rope and resid_tp ask a later GEMV's head into L2")
    if ws:
        pre = GEMV_WS_PRE[fmt] if ws_pre is None else ws_pre
        if not 0 <= pre <= GEMV_WS_MAX:
            raise AtomflowError(f"GEMV ring slots before the wait: 0 to {GEMV_WS_MAX}, not {pre}")
        extra += (i32(pre),)
    if tp is not None:
        slots, seq, rank, n_ranks = tp
        if seq.size < grid[0]:
            raise AtomflowError(f"GEMV {role or variant}: {grid[0]} blocks, more than the {seq.size} epochs kept")
        extra += (slots, seq, i32(rank), i32(n_ranks), *_head_args(head))
        moved += n_out * 8 * n_ranks * 2  # the LL slots: written to every rank, every rank's read back
    return Launch(fn, f"gemv_{fmt}_{variant}", grid, (GEMV_WS_THREADS if ws else GEMV_THREADS,),
                  (w, scales if fp8 else NULL, x, NULL if norm_w is None else norm_w, np.float32(eps), y,
                   i32(n_out), i32(k)) + extra, shmem, taps or {}, moved,
                  f"gemv {fmt} {role or variant} {rows}x{k}")


def next_l2(wgu, tail_mb: int) -> tuple | None:
    """What a layer's QKV kernel asks into L2 after its epilogue (gemv_epilogue.cuh next_weights_l2): the last
    `tail_mb` MB of that layer's gate/up weights `wgu` (the tiles its blocks stream last), or None for 0. HBM idles
    for ~4.5 µs per layer between QKV's last weights and o_proj's blocks; this fills it (the size that pays differs
    per shape, so it is part of the tuned form)."""
    tail = min(tail_mb << 20, wgu.nbytes) & ~15
    return (wgu.view(np.uint8).reshape(-1)[wgu.nbytes - tail:], tail) if tail else None
