"""Stage 3 of the decode path: the static arena.

Every byte the engine touches during decode is planned from the `ModelConfig` before the first token:
four pools (weights, kv, activations, scratch), each ONE device allocation, carved into named regions at
256-byte-aligned offsets. `plan_arena` is pure Python (testable without a GPU); `Arena` checks the plan
against free VRAM *before allocating anything* and then allocates the four pools. Nothing is allocated
during decode (tests install an allocator that raises to prove it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .config import GROUP, ModelConfig
from .errors import AtomflowError
from .kernels import knob

ALIGN = 256
POOLS = ("weights", "kv", "activations", "scratch")
ATT_CHUNK = 32          # positions per attention sub-chunk (kernels_cu/attention_common.cuh ATT_CHUNK)
ATT_BLOCKS_PER_SM = 2   # attention splits are capped at ~this many blocks per SM (attention.cu: 96 KB of rings each);
                        # A/B knob ATT_BLOCKS_PER_SM in ATOMFLOW_KERNEL_DEFINES
ARGMAX_THREADS = 1024   # block size of argmax_advance
ROWS_WARPS = 8          # lm_head GEMV (gemv_rows): warps per block, one output row each at a time
ROWS_BLOCKS_PER_SM = 4  # = ROWS_MIN_BLOCKS (lm_head): its grid is at most this many blocks per SM
RESERVE = 512 << 20     # VRAM left free for the CUDA context, CuPy and load-time staging slack


@dataclass(frozen=True)
class Region:
    pool: str
    name: str
    offset: int
    shape: tuple
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape)) * np.dtype(self.dtype).itemsize


class ArenaPlan:
    """Named regions per pool; `streamed` marks weight regions read in full every decode step."""

    def __init__(self):
        self.regions: dict[str, Region] = {}
        self.sizes = {p: 0 for p in POOLS}
        self.streamed: set[str] = set()
        self.staging_bytes = 0  # temporary device buffer used only while loading (row-major -> tiled)

    def add(self, pool: str, name: str, shape, dtype, streamed: bool = False) -> Region:
        assert pool in POOLS and name not in self.regions, (pool, name)
        shape = tuple(int(s) for s in shape)
        off = -(-self.sizes[pool] // ALIGN) * ALIGN
        r = Region(pool, name, off, shape, np.dtype(dtype))
        self.regions[name] = r
        self.sizes[pool] = off + r.nbytes
        if streamed:
            self.streamed.add(name)
        return r

    def total(self) -> int:
        return sum(self.sizes.values())

    def streamed_weight_bytes(self) -> int:
        return sum(self.regions[n].nbytes for n in self.streamed)


def linear_regions(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """The engine's fused projections per layer: [rows, K]. q|k|v stacked; gate|up stacked."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    return {"wqkv": (cfg.qkv_dim, H), "wo": (H, cfg.q_dim), "wgu": (2 * I, H), "wd": (H, I)}


def att_cluster(defines: tuple | None = None) -> int:
    """Splits of a kv head per thread block cluster in attention.cu (A/B knob ATT_CLUSTER; 1 = no clusters)."""
    c = knob("ATT_CLUSTER", 1, defines)
    if c not in (1, 8, 16):  # C divides every G x hd (multiples of 64), a slice is <= 128 threads (G 8, hd 128)
        raise AtomflowError(f"ATT_CLUSTER={c}: attention.cu takes clusters of 8 or 16 splits (or 1: none)")
    return c


def attention_splits(max_seq: int, n_kv: int, n_sm: int, blocks_per_sm: int | None = None,
                     defines: tuple | None = None) -> int:
    """Split capacity per kv head (= the attention launch's grid.y): one split per ATT_CHUNK positions, capped so
    the whole launch is about ATT_BLOCKS_PER_SM blocks per SM; beyond the cap a split walks several sub-chunks.
    With clusters (ATT_CLUSTER = C) rounded down to whole clusters, at least one."""
    per_sm = blocks_per_sm or knob("ATT_BLOCKS_PER_SM", ATT_BLOCKS_PER_SM, defines)
    free = knob("ATT_FREE_SLOTS", 0, defines)  # A/B knob: block slots left free for the previous launch's combining blocks
    n = max(1, min(-(-max_seq // ATT_CHUNK), -(-(per_sm * n_sm - free) // n_kv)))
    c = att_cluster(defines)
    return max(c, n // c * c)


def plan_arena(cfg: ModelConfig, fmt: str, max_seq: int, n_sm: int = 132) -> ArenaPlan:
    if fmt not in ("fp16", "fp8"):
        raise AtomflowError(f"unknown weight format {fmt!r} (expected fp16 or fp8)")
    if cfg.hidden_size % 32 or cfg.intermediate_size % 32 or cfg.q_dim % 32:
        raise AtomflowError("hidden_size, intermediate_size and heads*head_dim must be multiples of 32 "
                            "(tiled GEMV layout, kernels_cu/gemv_common.cuh)")
    if cfg.head_dim not in (64, 128):
        raise AtomflowError(f"head_dim {cfg.head_dim} unsupported by attention.cu (64 or 128)")
    if cfg.group_size not in (1, 2, 3, 4, 8):
        raise AtomflowError(f"{cfg.group_size} q heads per kv head unsupported by attention.cu (1, 2, 3, 4 or 8)")
    if not 1 <= max_seq <= 32768:
        raise AtomflowError(f"max_seq {max_seq} out of range (1..32768)")
    H, L, V = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    p = ArenaPlan()
    # weights
    p.add("weights", "embed", (V, H), np.float16, streamed=cfg.tie_word_embeddings)
    staging = 0
    for i in range(L):
        p.add("weights", f"L{i}.attn_norm", (H,), np.float16, streamed=True)
        p.add("weights", f"L{i}.mlp_norm", (H,), np.float16, streamed=True)
        for name, (rows, k) in linear_regions(cfg).items():
            # tiled layout (weights.py tile_view), loaded through a row-major staging buffer: fp16 rows, or
            # for fp8 the codes + fp16 rows + row-major scales (quantised on the device, then tiled)
            if fmt == "fp16":
                p.add("weights", f"L{i}.{name}", (rows, k), np.float16, streamed=True)
                staging = max(staging, rows * k * 2)
            else:
                p.add("weights", f"L{i}.{name}", (rows, k), np.uint8, streamed=True)
                p.add("weights", f"L{i}.{name}.scale", (rows, -(-k // GROUP)), np.float32, streamed=True)
                staging = max(staging, rows * k * 3 + rows * -(-k // GROUP) * 4)
    p.add("weights", "final_norm", (H,), np.float16, streamed=True)
    if not cfg.tie_word_embeddings:
        p.add("weights", "lm_head", (V, H), np.float16, streamed=True)
    p.staging_bytes = staging
    # KV cache: contiguous [layers][max_seq][kv_dim], arithmetic addressing
    p.add("kv", "k_cache", (L, max_seq, cfg.kv_dim), np.float16)
    p.add("kv", "v_cache", (L, max_seq, cfg.kv_dim), np.float16)
    # activations of one step
    p.add("activations", "h", (H,), np.float32)
    p.add("activations", "qkv", (cfg.qkv_dim,), np.float16)
    p.add("activations", "attn_out", (cfg.q_dim,), np.float16)
    p.add("activations", "act", (cfg.intermediate_size,), np.float16)
    p.add("activations", "xnorm", (H,), np.float16)
    p.add("activations", "logits", (V,), np.float32)
    # scratch: attention split partials, reduction tickets, step state
    splits = attention_splits(max_seq, cfg.num_key_value_heads, n_sm)
    p.add("scratch", "att_ml", (cfg.num_attention_heads, splits, 2), np.float32)
    p.add("scratch", "att_o", (cfg.num_attention_heads, splits, cfg.head_dim), np.float32)
    p.add("scratch", "att_counters", (L, cfg.num_key_value_heads * att_cluster()), np.uint32)  # a ticket per slice
    # argmax partials: one per block of argmax_advance or of the lm_head GEMV that does the argmax itself
    am_blocks = max(min(-(-V // ARGMAX_THREADS), n_sm), min(-(-V // ROWS_WARPS), ROWS_BLOCKS_PER_SM * n_sm))
    p.add("scratch", "am_val", (am_blocks,), np.float32)
    p.add("scratch", "am_idx", (am_blocks,), np.int32)
    p.add("scratch", "am_counter", (1,), np.uint32)
    p.add("scratch", "pos", (1,), np.int32)
    p.add("scratch", "cur_token", (1,), np.int32)
    p.add("scratch", "prompt_len", (1,), np.int32)
    p.add("scratch", "prompt", (max_seq,), np.int32)
    p.add("scratch", "out_tokens", (max_seq,), np.int32)
    p.add("scratch", "rope_cs", (max_seq, cfg.head_dim // 2, 2), np.float32)
    # the DYN layer GEMVs (step.gemv_launch dyn): a unit counter pair per launch, partial sums shared by all
    p.add("scratch", "gemv_dyn_ctr", (L, len(linear_regions(cfg)), 2), np.uint32)
    p.add("scratch", "gemv_dyn_part", (dyn_part_floats(fmt, linear_regions(cfg).values()),), np.float32)
    return p


def gemv_slots_per_tile(fmt: str, k: int) -> int:
    """Ring slots (16 KB of weights: 8 fp8 or 4 fp16 groups of 128 inputs) that one 16-row tile of K inputs fills in
    the warp-specialised GEMVs (gemv_common.cuh); under DYN one slot of one tile is one work unit."""
    return -(-(-(-k // GROUP)) // (8 if fmt == "fp8" else 4))


def dyn_part_floats(fmt: str, rows_k) -> int:
    """Floats of the DYN partial sums that GEMVs of (rows, K) in `rows_k` share: the largest tiles x units per tile x
    16 rows (step.gemv_launch with dyn)."""
    return max((rows // 16) * gemv_slots_per_tile(fmt, k) * 16 for rows, k in rows_k)


class Arena:
    """The four pools on the device and typed views of every region."""

    def __init__(self, plan: ArenaPlan):
        import cupy

        free, total = cupy.cuda.runtime.memGetInfo()
        need = plan.total() + plan.staging_bytes + RESERVE
        if need > free:
            gib = lambda n: f"{n / 2**30:.2f}"  # noqa: E731
            raise AtomflowError(
                f"model does not fit: needs {gib(need)} GiB (weights {gib(plan.sizes['weights'])}, "
                f"KV {gib(plan.sizes['kv'])}, activations+scratch "
                f"{gib(plan.sizes['activations'] + plan.sizes['scratch'])}, load staging "
                f"{gib(plan.staging_bytes)}, reserve {gib(RESERVE)}) but only {gib(free)} of {gib(total)} "
                "GiB are free on the GPU; try --weights fp8 or a smaller --ctx")
        self.plan = plan
        self.pools = {p: cupy.zeros(max(plan.sizes[p], ALIGN), dtype=cupy.uint8) for p in POOLS}
        self._views = {}
        for name, r in plan.regions.items():
            mem = self.pools[r.pool].data + r.offset
            self._views[name] = cupy.ndarray(r.shape, dtype=r.dtype, memptr=mem)

    def __getitem__(self, name: str):
        return self._views[name]

    def vram(self) -> dict[str, int]:
        return {p: int(self.pools[p].nbytes) for p in POOLS}
