"""The persistent decode step (kernels_cu/decode_persist.cu): its constants, shared-memory plan, layer table and
launch factory.

One kernel walks the step's embedding and layers with one block per SM (forms.GemvForm "persist"); each op waits
on a counter for the op whose output it reads instead of a kernel boundary, and the producer warp of each block
streams the next ops' weights while the current one runs. The GEMVs are the warp-specialised form's device functions
(ws_consume: the same tiles per block, the same sums), the attention the short kernel's (attention_short_item), so
the step's results equal the `ws` form's bit for bit. The lm_head stays its own launch (ops/lm_head.py).
"""
from __future__ import annotations

import math

import numpy as np

from ...errors import AtomflowError
from ..device import SMEM_H100, smem_limits
from ..launch import NULL, Launch, allow_dynamic_smem, i32
from ..nvrtc import KernelLib
from .attention import ATS_CHUNK_MAX, short_smem, short_static
from .gemv import GEMV_WARPS, GEMV_WS_MAX, GEMV_WS_SLOT, GEMV_WS_THREADS, TILE_ROWS

# = the kernel's #defines (tests/test_op_constants.py reads them from the .cu)
PS_PTRS = 12                # decode_persist.cu PS_PTRS: device addresses per layer in the layer table
PS_OPS_PER_LAYER = 5        # decode_persist.cu PS_OPS_PER_LAYER: QKV, attention, o_proj, gate/up, down
CU_FILES = ("decode_persist.cu",)
CU_DEFINES = {"PS_PTRS": PS_PTRS, "PS_OPS_PER_LAYER": PS_OPS_PER_LAYER}

HEAD_DIMS = (64, 128)
GROUPS = (1, 2, 3, 4, 8)
# Ring slots the plan gives each block before the attention gets the rest of the SM's shared memory: the
# warp-specialised GEMVs' deepest ring (ops/gemv.py GEMV_WS_SLOTS), about 100 KB of weights in flight per SM.
PS_RING_SLOTS = 6
LAYER_WEIGHTS = ("wqkv", "wo", "wgu", "wd")


def kernel_name(fmt: str, hd: int, group: int) -> str:
    return f"decode_persist_{'f8' if fmt == 'fp8' else 'f16'}_hd{hd}_g{group}"


KERNELS = {"decode_persist.cu": tuple(kernel_name(f, hd, g) for f in ("fp16", "fp8") for hd in HEAD_DIMS
                                      for g in GROUPS)}


def supported(cfg) -> str | None:
    """None when the persistent step has a kernel for `cfg`'s attention shape, else why not (one line)."""
    if cfg.head_dim not in HEAD_DIMS or cfg.group_size not in GROUPS:
        return (f"the persistent step has no kernel for head_dim {cfg.head_dim} with {cfg.group_size} q heads per kv "
                f"head (head_dim {' or '.join(map(str, HEAD_DIMS))}, {', '.join(map(str, GROUPS))} q heads)")
    return None


def n_ops(cfg) -> int:
    """The step's ops: the embedding, then PS_OPS_PER_LAYER per layer."""
    return 1 + PS_OPS_PER_LAYER * cfg.num_hidden_layers


def op_names(cfg) -> list[str]:
    roles = ("wqkv", "attention", "wo", "wgu", "wd")
    return ["embed"] + [f"L{i}.{r}" for i in range(cfg.num_hidden_layers) for r in roles]


def slot_bytes(fmt: str) -> int:
    return GEMV_WS_SLOT + (8 * 64 if fmt == "fp8" else 0)


def plan(cfg, fmt: str, smem: tuple = SMEM_H100) -> dict:
    """The block's shared memory: region A (x staged for a GEMV, or the attention's K/V/P for `att_cap` positions),
    the partial sums, scratch and barriers, PS_RING_SLOTS ring slots (fewer where they do not fit beside the
    largest x), then whatever remains goes to the attention's capacity (a multiple of 16, at most ATS_CHUNK_MAX;
    longer lengths are walked in chunks of it). Keys: a_bytes, att_cap, slots, shmem."""
    kmax = max(cfg.hidden_size, cfg.q_dim, cfg.intermediate_size)
    fixed = (2 * GEMV_WARPS * TILE_ROWS + 32) * 4 + (2 * GEMV_WS_MAX + 2) * 8 + 128
    room = smem[0] - short_static(cfg.head_dim) - fixed
    x_bytes = -(-kmax * 2 // 16) * 16
    slot = slot_bytes(fmt)
    slots = min(PS_RING_SLOTS, (room - x_bytes) // slot)
    if slots < 2:
        raise AtomflowError(f"persistent step: x of {kmax} inputs and 2 ring slots do not fit the {smem[0]} bytes of "
                            "shared memory per block")
    cap = 0
    while cap + 16 <= ATS_CHUNK_MAX and short_smem(cfg.head_dim, cap + 16) <= room - slots * slot:
        cap += 16
    if cap == 0:
        raise AtomflowError("persistent step: no room for the attention beside the ring")
    a_bytes = -(-max(x_bytes, short_smem(cfg.head_dim, cap)) // 16) * 16
    return {"a_bytes": a_bytes, "att_cap": cap, "slots": slots, "shmem": a_bytes + fixed + slots * slot}


def layer_table(a, cfg, fmt: str) -> np.ndarray:
    """The per-layer device addresses the kernel reads (PS_PTRS each, decode_persist.cu's order): each GEMV's tiled
    weights and fp8 scales (0 for fp16), the two norm weights, the layer's K and V cache."""
    fp8 = fmt == "fp8"
    t = np.zeros((cfg.num_hidden_layers, PS_PTRS), np.uint64)
    for i in range(cfg.num_hidden_layers):
        ptr = lambda name: a[name].data.ptr  # noqa: E731
        w = {r: (ptr(f"L{i}.{r}"), ptr(f"L{i}.{r}.scale") if fp8 else 0) for r in LAYER_WEIGHTS}
        t[i] = (*w["wqkv"], ptr(f"L{i}.attn_norm"), *w["wo"], *w["wgu"], ptr(f"L{i}.mlp_norm"), *w["wd"],
                a["k_cache"][i].data.ptr, a["v_cache"][i].data.ptr)
    return t


def persist_launch(lib: KernelLib, a, cfg, fmt: str, n_sm: int, ops: tuple[int, int] | None = None, taps=None,
                   trace=None) -> Launch:
    """The step's ops [ops[0], ops[1]) (default: all of them: the embedding and every layer) in one launch of the
    persistent kernel over `a` (the arena: its ps_layers table must hold layer_table's addresses). `trace`: a
    device u32 array of 1 + 2 * n_ops * n_sm (tests: when each block ran each op), else none."""
    why = supported(cfg)
    if why:
        raise AtomflowError(why)
    total = n_ops(cfg)
    lo, hi = ops or (0, total)
    if not 0 <= lo < hi <= total:
        raise AtomflowError(f"persistent step: ops [{lo}, {hi}) outside [0, {total})")
    p = plan(cfg, fmt, smem_limits())
    fn = lib[kernel_name(fmt, cfg.head_dim, cfg.group_size)]
    if fn.max_threads_per_block < GEMV_WS_THREADS:
        raise AtomflowError(f"persistent step: {fn.max_threads_per_block} threads per block at its "
                            f"{fn.num_regs} registers, not {GEMV_WS_THREADS}")
    allow_dynamic_smem(fn, p["shmem"])
    if trace is not None and trace.size < 1 + 2 * total * n_sm:
        raise AtomflowError("persistent step: trace too small")
    bytes_moved = sum(a[f"L{i}.{r}"].nbytes + (a[f"L{i}.{r}.scale"].nbytes if fmt == "fp8" else 0)
                      for i in range(cfg.num_hidden_layers) for r in LAYER_WEIGHTS) if (lo, hi) == (0, total) else 0
    args = (a["ps_layers"], i32(lo), i32(hi), i32(total), i32(cfg.hidden_size), i32(cfg.q_dim), i32(cfg.qkv_dim),
            i32(cfg.intermediate_size), i32(cfg.num_attention_heads), i32(cfg.num_key_value_heads),
            np.float32(cfg.rms_norm_eps), np.float32(1.0 / math.sqrt(cfg.head_dim)), i32(p["att_cap"]),
            i32(p["a_bytes"]), a["embed"], a["cur_token"], a["pos"], a["rope_cs"], a["h"], a["qkv"], a["attn_out"],
            a["act"], a["ps_counters"], NULL if trace is None else trace)
    names = op_names(cfg)
    label = "persistent step" if (lo, hi) == (0, total) else f"persistent {names[lo]}..{names[hi - 1]}"
    return Launch(fn, "decode_persist", (n_sm,), (GEMV_WS_THREADS,), args, p["shmem"], taps or {}, bytes_moved, label,
                  cooperative=True)


def arena_regions(cfg) -> list[tuple[str, tuple, type]]:
    """What the persistent step keeps in the arena's scratch: the layer table and the counters (n_ops + the
    ticket), zero until the kernel counts (it resets them itself at the end of every launch)."""
    return [("ps_layers", (cfg.num_hidden_layers, PS_PTRS), np.uint64), ("ps_counters", (n_ops(cfg) + 1,), np.uint32)]

