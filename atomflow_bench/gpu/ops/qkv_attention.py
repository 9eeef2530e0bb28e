"""The QKV projection with the short attention beside it in one grid: everything the host knows about
kernels_cu/qkv_attention.cu — its plan (which step shapes can run it, the positions its attention holds), its buffers
and its launch factory.

The kernel is the warp-specialised QKV GEMV (ops/gemv.py, variant qkv_rope) whose grid ends in one attention block per
head group (ops/attention.py, the short kernel's block). The GEMV pushes every output pair also as an LL word; the
attention blocks, resident from the start, stage their K/V history while QKV streams and poll those words instead of
waiting for the grid. The step runs it in the `beside` attention bucket (forms.Forms.beside): lengths up to
beside_plan's capacity, which is what fits the GEMV's own shared memory.
"""
from __future__ import annotations

import math

import numpy as np

from ...errors import AtomflowError
from ..device import blocks_fit, smem_limits
from ..launch import Launch, allow_dynamic_smem, i32
from ..nvrtc import KernelLib
from . import attention, gemv

CU_FILES = ("qkv_attention.cu",)
CU_DEFINES = {"ATS_SPLITS_MAX": 4}
SPLITS_MAX = 4         # qkv_attention.cu ATS_SPLITS_MAX: windows per head group (the owner's combine holds them)
MAX_BLOCKS_PER_SM = 2  # qkv_attention.cu __launch_bounds__(GEMV_WS_THREADS, 2): the attention's registers


def seq_size(n_sm: int) -> int:
    """Epochs the arena keeps (one per block): more than any grid of the kernel (<= 2 blocks per SM)."""
    return MAX_BLOCKS_PER_SM * n_sm


def part_words(cfg) -> int:
    """LL words of the windows' partial results (AtsFromLL part): [head group][SPLITS_MAX][G * hd + 2 G]."""
    return cfg.num_attention_heads * (cfg.head_dim + 2) * SPLITS_MAX


def static_smem(hd: int) -> int:
    """The kernel's static shared memory: the attention block's q [8][hd] fp16, per-warp [8][8] fp32, the heads'
    maxima [8] fp32, row L-1's pairs [hd] u32, and 1 KB for the compiler's and the timeline instrument's own."""
    heads = attention.ATS_HEADS
    return heads * hd * 2 + (attention.ATS_THREADS // 32) * heads * 4 + heads * 4 + hd * 4 + 1024


def gather_fits(cap: int, splits: int, group: int, hd: int) -> bool:
    """Whether window 0 can gather the other windows' results (fp32, G * hd + 2 G per window) into the V space its
    own window leaves (cap rounded up to 16 rows of hd fp16): qkv_attention.cu AtsFromLL gather."""
    g = min(group, attention.ATS_HEADS)
    return (splits - 1) * (g * hd + 2 * g) * 4 <= -(-cap // 16) * 16 * hd * 2


def beside_plan(fmt: str, rows: int, k: int, n_kv: int, group: int, hd: int, n_sm: int, smem: tuple | None = None,
                want: int | None = None) -> tuple[int, int, int, int] | None:
    """(GEMV blocks, dynamic shared memory, positions per window, windows per head group) of the kernel over the QKV
    weight [rows, k], or None where it cannot run. Its whole grid (the GEMV's blocks and n_kv x blocks_per_kv(group)
    x windows attention blocks) must be resident at once at <= 2 blocks per SM — the attention blocks poll for the
    GEMV's words from the start; a window is the largest multiple of ATT_CHUNK positions (<= ATS_CHUNK_MAX) that the
    GEMV's own shared memory holds (at least ATT_CHUNK); the windows cover `want` positions (default: the short
    kernel's capacity) as far as SPLITS_MAX, the SMs and window 0's gather (gather_fits) allow. The capacity is
    windows x positions per window; a launch uses as few windows as hold its length, of even sizes."""
    smem = smem or smem_limits()
    _, shmem, blocks = gemv.gemv_grid(fmt, "qkv_rope", rows, k, n_sm, ws=True, smem=smem)
    per_sm = min(MAX_BLOCKS_PER_SM, blocks_fit(shmem + static_smem(hd), smem))
    cap = 0
    while (cap + attention.ATT_CHUNK <= attention.ATS_CHUNK_MAX
           and attention.short_smem(hd, cap + attention.ATT_CHUNK) <= shmem):
        cap += attention.ATT_CHUNK
    want = attention.short_capacity(hd, smem) if want is None else want
    groups = n_kv * attention.blocks_per_kv(group)
    splits = min(SPLITS_MAX, max(1, -(-want // cap) if cap else 1), (per_sm * n_sm - blocks) // groups)
    while splits > 1 and not gather_fits(cap, splits, group, hd):
        splits -= 1
    return (blocks, shmem, cap, splits) if cap and splits >= 1 else None


def beside_capacity(cfg, fmt: str, n_sm: int, smem: tuple | None = None) -> int:
    """Positions the beside bucket serves for a (rank's) config `cfg` (0: the kernel cannot run this shape)."""
    rows, k = gemv.linear_regions(cfg)["wqkv"]
    plan = beside_plan(fmt, rows, k, cfg.num_key_value_heads, cfg.group_size, cfg.head_dim, n_sm, smem)
    return plan[2] * plan[3] if plan else 0


def qkv_attention_launch(lib: KernelLib, fmt: str, w, scales, h, qkv, norm_w, eps: float, rope: tuple, out, ll, seq,
                         part, n_sm: int, cap: int | None = None, splits: int | None = None,
                         ws_pre: int | None = None, head: tuple | None = None, taps=None) -> Launch:
    """qkv = the QKV GEMV of h as gemv_launch(variant="qkv_rope", ws=True) computes it (RMSNorm, RoPE, K/V row
    appended at pos; `rope` = (cos_sin, pos, k_cache, v_cache, n_q, n_kv, hd[, next]), `head` as there), and
    out = the short attention over cache[0 .. pos] (fp16 [n_q * hd]). ll: u64 [qkv rows / 2], seq: u32 [>= the
    grid], part: u64 [part_words], each zeroed once (the kernel's words and epochs). `cap` positions per window and
    `splits` windows per head group: the plan's unless given (lengths beyond cap x splits are walked in chunks by
    the last window: correct, but slower)."""
    cos_sin, pos, k_cache, v_cache, n_q, n_kv, hd, *nxt = rope
    rows, k = w.shape
    group = n_q // n_kv
    attention.check_shape(hd, group)
    plan = beside_plan(fmt, rows, k, n_kv, group, hd, n_sm)
    if plan is None:
        raise AtomflowError(f"QKV with the attention beside it: {rows}x{k} ({n_kv} kv heads) does not fit one "
                            f"resident wave on {n_sm} SMs with room for K/V in shared memory")
    blocks, shmem, plan_cap, plan_splits = plan
    cap = plan_cap if cap is None else cap
    splits = plan_splits if splits is None else splits
    if (not 1 <= cap or attention.short_smem(hd, cap) > shmem or not 1 <= splits <= plan_splits
            or not gather_fits(cap, splits, group, hd)):
        raise AtomflowError(f"QKV with the attention beside it: {splits} windows of {cap} positions do not fit its "
                            f"{shmem} bytes of shared memory or its SMs")
    n_att = n_kv * attention.blocks_per_kv(group) * splits
    if (ll.size < rows // 2 or ll.dtype != np.uint64 or seq.size < blocks + n_att or seq.dtype != np.uint32
            or part.size < n_q * (hd + 2) * splits or part.dtype != np.uint64):
        raise AtomflowError("QKV with the attention beside it: its LL words, epochs or partial results are too small")
    base = gemv.gemv_launch(lib, fmt, "qkv_rope", w, scales, h, qkv, rows // 2, k, n_sm, norm_w=norm_w, eps=eps,
                            rope=rope, ws=True, ws_pre=ws_pre, head=head, role="wqkv")
    if base.grid != (blocks,) or base.shmem != shmem:
        raise AtomflowError("QKV with the attention beside it: the GEMV's plan changed under it")
    fn = lib[f"qkv_attention_f{8 if fmt == 'fp8' else 16}_hd{hd}_g{group}"]
    allow_dynamic_smem(fn, shmem)
    moved = base.bytes_moved + 2 * 8 * (rows // 2)  # + the LL words, written and read (K/V: as attention_short's, 0)
    return Launch(fn, "qkv_attention", (blocks + n_att,), base.block,
                  base.args + (ll, seq, out, part, i32(blocks), i32(cap), i32(splits),
                               np.float32(1.0 / math.sqrt(hd))), shmem,
                  taps or {}, moved, f"gemv {fmt} wqkv {rows}x{k} + attention beside")
