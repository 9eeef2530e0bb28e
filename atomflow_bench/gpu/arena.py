"""Stage 3 of the decode path: the static arena.

Every byte the engine touches during decode is planned from the `ModelConfig` before the first token:
four pools (weights, kv, activations, scratch), each ONE device allocation, carved into named regions at
256-byte-aligned offsets. `plan_arena` is pure Python (testable without a GPU); `Arena` checks the plan
against free VRAM *before allocating anything* (`fit`) and then allocates the four pools. Nothing is allocated
during decode (tests install an allocator that raises to prove it).

An engine that will prefill has the batched prefill's bytes planned too (gpu/prefill.py form_bytes, per weights
form): `fit` takes the first form that fits beside the model (fp16 weight copies, else the staged scratch), and the
Prefill allocates it on first use, after loading has freed its staging buffer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..config import GROUP, ModelConfig
from ..errors import AtomflowError
from .ops import attention, gemv, lm_head
from .prefill import form_bytes

ALIGN = 256
POOLS = ("weights", "kv", "activations", "scratch")
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
        self.prefill: dict[str, int] = {}  # the batched prefill's bytes per weights form, in the order tried

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


def plan_arena(cfg: ModelConfig, fmt: str, max_seq: int, n_sm: int = 132, lm_head_rows: int | None = None,
               prefill_chunk: int | None = None) -> ArenaPlan:
    """The regions of `cfg` (tensor parallel: the rank's local_config, with `lm_head_rows` its vocabulary rows; the
    embedding stays whole, replicated), and with `prefill_chunk` the batched prefill's bytes at that chunk."""
    if fmt not in ("fp16", "fp8"):
        raise AtomflowError(f"unknown weight format {fmt!r} (expected fp16 or fp8)")
    if cfg.hidden_size % 32 or cfg.intermediate_size % 32 or cfg.q_dim % 32:
        raise AtomflowError("hidden_size, intermediate_size and heads*head_dim must be multiples of 32 "
                            "(tiled GEMV layout, kernels_cu/gemv_tiled.cuh)")
    attention.check_shape(cfg.head_dim, cfg.group_size)
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
        for name, (rows, k) in gemv.linear_regions(cfg).items():
            # tiled layout (ops/gemv.py tile_view), loaded through a row-major staging buffer: fp16 rows, or
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
        p.add("weights", "lm_head", (lm_head_rows or V, H), np.float16, streamed=True)
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
    splits = attention.attention_splits(max_seq, cfg.num_key_value_heads, n_sm, group=cfg.group_size)
    p.add("scratch", "att_ml", (cfg.num_attention_heads, splits, 2), np.float32)
    p.add("scratch", "att_o", (cfg.num_attention_heads, splits, cfg.head_dim), np.float32)
    p.add("scratch", "att_counters", (L, cfg.num_key_value_heads * attention.blocks_per_kv(cfg.group_size)),
          np.uint32)  # a ticket per head group
    am_blocks = lm_head.partial_blocks(V, n_sm)  # argmax partials: one per block of the lm_head launch
    p.add("scratch", "am_val", (am_blocks,), np.float32)
    p.add("scratch", "am_idx", (am_blocks,), np.int32)
    p.add("scratch", "am_counter", (1,), np.uint32)
    p.add("scratch", "pos", (1,), np.int32)
    p.add("scratch", "cur_token", (1,), np.int32)
    p.add("scratch", "prompt_len", (1,), np.int32)
    p.add("scratch", "prompt", (max_seq,), np.int32)
    p.add("scratch", "out_tokens", (max_seq,), np.int32)
    p.add("scratch", "rope_cs", (max_seq, cfg.head_dim // 2, 2), np.float32)
    if prefill_chunk is not None:
        p.prefill = form_bytes(cfg, fmt, prefill_chunk)
    return p


def fit(plan: ArenaPlan, free: int, total: int) -> str | None:
    """The check before anything is allocated, against `free` of `total` device bytes: the model (its regions, the
    load staging, RESERVE) must fit, and where the plan has a prefill, the first of its forms that fits beside the
    model (in the room the load staging leaves when it is freed). Returns that form (None: no prefill planned);
    what does not fit is refused in one line."""
    gib = lambda n: f"{n / 2**30:.2f}"  # noqa: E731
    need = plan.total() + plan.staging_bytes + RESERVE
    if need > free:
        raise AtomflowError(
            f"model does not fit: needs {gib(need)} GiB (weights {gib(plan.sizes['weights'])}, "
            f"KV {gib(plan.sizes['kv'])}, activations+scratch "
            f"{gib(plan.sizes['activations'] + plan.sizes['scratch'])}, load staging "
            f"{gib(plan.staging_bytes)}, reserve {gib(RESERVE)}) but only {gib(free)} of {gib(total)} "
            "GiB are free on the GPU; try --weights fp8 or a smaller --ctx")
    if not plan.prefill:
        return None
    model = plan.total() + RESERVE
    for form, nbytes in plan.prefill.items():
        if model + max(plan.staging_bytes, nbytes) <= free:
            return form
    first, smallest = next(iter(plan.prefill)), list(plan.prefill)[-1]
    raise AtomflowError(
        f"the batched prefill does not fit beside the model: {gib(plan.prefill[smallest])} GiB in its smallest form "
        f"({smallest}; {first}: {gib(plan.prefill[first])}) beyond the model's {gib(model)} GiB (reserve included), "
        f"{gib(free)} of {gib(total)} GiB are free on the GPU; try a smaller --ctx, --weights fp8 or more GPUs (--tp)")


class Arena:
    """The four pools on the device and typed views of every region."""

    def __init__(self, plan: ArenaPlan):
        import cupy

        self.prefill_form = fit(plan, *cupy.cuda.runtime.memGetInfo())  # the batched prefill's weights form, if any
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
