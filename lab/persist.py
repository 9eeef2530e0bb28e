"""The persistent decode step (lab/kernels/decode_persist.cu): its first form (PERF_NOTES v48, static tiles) measured
slower than the product's graph on every shape, so it lives here, runnable against any engine for the next form's
work. Modes (MODES): `static` (v48), `dyn` (whole tiles from a counter: v48.1, slower still), `split` (16 KB split-K
units from a counter, each block's reducer warp adding a tile's parts in part order: v57).

One kernel walks the step's embedding and layers with one block per SM; each op waits on a counter for the op whose
output it reads instead of a kernel boundary, and the producer warp of each block streams the next ops' weights while
the current one runs. The GEMVs are the warp-specialised form's ring (lab/kernels/ws_stream.cuh: the same tiles per
block, the same sums), the attention the product's short-kernel device function (kernels_cu/attention_short.cuh), so
the step's results equal the `ws` form's bit for bit (split: within fp32 rounding). The lm_head stays the product's
launch.

    step = PersistStep(engine)        # the engine's one-GPU step at its short bucket's lengths
    step.install()                    # engine.generate / run / graphs now replay [persistent kernel, lm_head]
    run_eager(step.probe_launches(), taps)   # one op per launch, each with the graph step's probes
"""
from __future__ import annotations

import math

import numpy as np

from atomflow_bench.errors import AtomflowError
from atomflow_bench.gpu.device import SMEM_H100, smem_limits
from atomflow_bench.gpu.launch import NULL, Launch, PdlLauncher, allow_dynamic_smem, i32
from atomflow_bench.gpu.nvrtc import KernelLib
from atomflow_bench.gpu.ops import lm_head
from atomflow_bench.gpu.ops.attention import ATS_CHUNK_MAX, short_smem, short_static
from atomflow_bench.gpu.ops.gemv import GEMV_WARPS, GEMV_WS_MAX, GEMV_WS_SLOT, GEMV_WS_THREADS, TILE_ROWS

from . import KERNELS_DIR

# = the kernel's #defines (tests/test_lab_persist.py reads them from the .cu)
PS_PTRS = 12                # decode_persist.cu PS_PTRS: device addresses per layer in the layer table
PS_OPS_PER_LAYER = 5        # decode_persist.cu PS_OPS_PER_LAYER: QKV, attention, o_proj, gate/up, down
PS_RQ = 8                   # decode_persist.cu PS_RQ: the reducer's queue entries (split)
PS_LL_BATCH = 8             # decode_persist.cu PS_LL_BATCH: parts a reducer asks for at once
CU_DEFINES = {"PS_PTRS": PS_PTRS, "PS_OPS_PER_LAYER": PS_OPS_PER_LAYER, "PS_RQ": PS_RQ, "PS_LL_BATCH": PS_LL_BATCH}
PS_THREADS = GEMV_WS_THREADS + 32  # 8 consumer warps, the producer, the reducer (decode_persist.cu PS_THREADS)
MODES = {"static": 0, "dyn": 1, "split": 2}  # decode_persist.cu `mode`
CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2  # cuda.h

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


def parts_per_tile(fmt: str, k: int) -> int:
    """Ring slots (split-K units) per 16-row tile of a GEMV of `k` inputs: 128-input groups, 8 per fp8 slot, 4 per
    fp16 slot (ws_stream.cuh WsShape)."""
    return -(-(-(-k // 128)) // (8 if fmt == "fp8" else 4))


def ll_words(cfg, fmt: str) -> int:
    """u64 words of the split mode's LL buffer: the epoch, then 16 row sums per unit of the largest GEMV."""
    gemvs = ((cfg.qkv_dim, cfg.hidden_size), (cfg.hidden_size, cfg.q_dim), (2 * cfg.intermediate_size,
             cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size))
    return 1 + max(rows // 16 * parts_per_tile(fmt, k) * 16 for rows, k in gemvs)


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


class CoopLauncher(PdlLauncher):
    """The product's pre-built cuLaunchKernelEx call with the cooperative attribute instead of PDL's: every block
    resident at once, or the launch fails (CUresult 720) instead of hanging in the waits."""

    def __init__(self, fn, grid, block, args, shmem):
        super().__init__(fn, grid, block, args, shmem)
        self._attrs[0].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE


def persist_launch(lib: KernelLib, a, cfg, fmt: str, n_sm: int, layers, counters,
                   ops: tuple[int, int] | None = None, taps=None, trace=None, mode: str = "static",
                   ll=None) -> Launch:
    """The step's ops [ops[0], ops[1]) (default: all of them: the embedding and every layer) in one cooperative
    launch over the arena `a`; `layers`: a device copy of layer_table, `counters`: 2 n_ops + 1 zeroed u32 (the kernel
    leaves them zero). `trace`: a device u32 array of 1 + 2 * n_ops * n_sm (tests: when each block ran each op).
    `mode`: static (grid-stride tiles), dyn (tiles from a counter per op) or split (16 KB split-K units from a
    counter per op, summed by each block's reducer; `ll`: ll_words zeroed u64, the kernel keeps its epoch in [0])
    (decode_persist.cu)."""
    if mode not in MODES or (mode == "split") != (ll is not None):
        raise AtomflowError(f"persistent step: mode {mode!r} with{'out' if ll is None else ''} an LL buffer")
    why = supported(cfg)
    if why:
        raise AtomflowError(why)
    total = n_ops(cfg)
    lo, hi = ops or (0, total)
    if not 0 <= lo < hi <= total:
        raise AtomflowError(f"persistent step: ops [{lo}, {hi}) outside [0, {total})")
    p = plan(cfg, fmt, smem_limits())
    fn = lib[kernel_name(fmt, cfg.head_dim, cfg.group_size)]
    if fn.max_threads_per_block < PS_THREADS:
        raise AtomflowError(f"persistent step: {fn.max_threads_per_block} threads per block at its "
                            f"{fn.num_regs} registers, not {PS_THREADS}")
    allow_dynamic_smem(fn, p["shmem"])
    if trace is not None and trace.size < 1 + 2 * total * n_sm:
        raise AtomflowError("persistent step: trace too small")
    bytes_moved = sum(a[f"L{i}.{r}"].nbytes + (a[f"L{i}.{r}.scale"].nbytes if fmt == "fp8" else 0)
                      for i in range(cfg.num_hidden_layers) for r in LAYER_WEIGHTS) if (lo, hi) == (0, total) else 0
    args = (layers, i32(lo), i32(hi), i32(total), i32(cfg.hidden_size), i32(cfg.q_dim), i32(cfg.qkv_dim),
            i32(cfg.intermediate_size), i32(cfg.num_attention_heads), i32(cfg.num_key_value_heads),
            np.float32(cfg.rms_norm_eps), np.float32(1.0 / math.sqrt(cfg.head_dim)), i32(p["att_cap"]),
            i32(p["a_bytes"]), a["embed"], a["cur_token"], a["pos"], a["rope_cs"], a["h"], a["qkv"], a["attn_out"],
            a["act"], counters, NULL if trace is None else trace, i32(MODES[mode]), NULL if ll is None else ll)
    names = op_names(cfg)
    label = "persistent step" if (lo, hi) == (0, total) else f"persistent {names[lo]}..{names[hi - 1]}"
    label += {"static": "", "dyn": " (dynamic tiles)", "split": " (split-K units)"}[mode]
    grid, block = (n_sm,), (PS_THREADS,)
    return Launch(fn, "decode_persist", grid, block, args, p["shmem"], taps or {}, bytes_moved, label,
                  _pdl_launcher=CoopLauncher(fn, grid, block, args, p["shmem"]))


class PersistStep:
    """The persistent step of a one-GPU engine (sm_90+, a shape with a kernel), with its own kernels, layer table
    and counters; the engine's arena, weights and lm_head."""

    def __init__(self, engine, mode: str = "static"):
        import cupy as cp

        if engine.group is not None or engine.cc < 90:
            raise AtomflowError("the persistent step runs on one sm_90+ GPU")
        why = supported(engine.layer_cfg)
        if why:
            raise AtomflowError(why)
        self.eng, self.cfg, self.fmt, self.n_sm = engine, engine.layer_cfg, engine.fmt, engine.gpu["sms"]
        self.lib = KernelLib(KERNELS, KERNELS_DIR)
        self.layers = cp.asarray(layer_table(engine.arena, self.cfg, self.fmt))
        self.counters = cp.zeros(2 * n_ops(self.cfg) + 1, dtype=cp.uint32)
        if mode not in MODES:
            raise AtomflowError(f"persistent step: no mode {mode!r} ({', '.join(MODES)})")
        self.mode = mode
        self.ll = cp.zeros(ll_words(self.cfg, self.fmt), dtype=cp.uint64) if mode == "split" else None

    def launch(self, ops=None, taps=None, trace=None) -> Launch:
        return persist_launch(self.lib, self.eng.arena, self.cfg, self.fmt, self.n_sm, self.layers, self.counters,
                              ops, taps, trace, self.mode, self.ll)

    def lm_head(self) -> Launch:
        ln = lm_head.lm_head_launch(self.eng.lib, self.eng.arena, self.cfg, self.n_sm)
        if self.eng.pdl:
            ln.enable_pdl()  # it waits for the persistent kernel; the persistent kernel is never launched early
        return ln

    def launches(self) -> list[Launch]:
        """The step: the persistent kernel over every op, then the lm_head."""
        return [self.launch(), self.lm_head()]

    def probe_launches(self) -> list[Launch]:
        """The step one op per launch, each carrying the probes its op leaves (the graph step's probe names), then
        the lm_head (its own probes)."""
        a, cfg = self.eng.arena, self.cfg
        qkv, q_dim, kv_dim = a["qkv"], cfg.q_dim, cfg.kv_dim
        steps = [self.launch((0, 1), taps={"embed": a["h"]})]
        for i in range(cfg.num_hidden_layers):
            p, o = f"layers.{i}.", 1 + PS_OPS_PER_LAYER * i
            taps = [{p + "q": qkv[:q_dim], p + "k": qkv[q_dim:q_dim + kv_dim], p + "v": qkv[q_dim + kv_dim:]},
                    {p + "attn_out": a["attn_out"]}, {p + "attn": a["h"]}, {p + "act": a["act"]}, {p + "mlp": a["h"]}]
            steps += [self.launch((o + k, o + k + 1), taps=t) for k, t in enumerate(taps)]
        return steps + [self.lm_head()]

    def install(self) -> None:
        """The engine's short bucket replays this step from now on (generate, run, graphs; its eager steps too)."""
        cap = self.eng.short_capacity
        if cap not in self.eng.variants:
            raise AtomflowError("the persistent step replaces the short bucket's step: the engine has none")
        self.eng.variants[cap] = self.launches()
        self.eng._graphs.clear()
