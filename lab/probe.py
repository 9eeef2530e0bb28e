"""An instrument beside the decode path: the ceiling of a persistent, dataflow step (lab/kernels/probe_stream.cu).

The decode step is one kernel per op; at each boundary the next kernel's blocks can only ask for weights once
they are resident, and HBM idles for ~11 µs per 3B layer (lab/PERF_NOTES.md v30). `stream_probe` streams the
same bytes, op after op in the step's order (`step_ops`), through ONE grid of persistent blocks whose copies run
ahead across op boundaries while the consumers honour a rule of dependencies (`op_groups`: which blocks' op o-1
each block's op o waits for), plus an optional modelled latency before o_proj (the attention). Variants:

* ``stream``: no dependency at all — what streaming alone reaches;
* ``deps``: every op waits for the whole previous op (a grid-wide counter: a GEMV needs its whole input vector);
* ``deps+att``: and `att_ns` before each o_proj (the attention's latency in the real step);
* ``deps+att-ring2``: the same with a 2-chunk ring — copies that cannot run ahead, as at a kernel boundary;
* (sweep) ``group=G``: every op waits for its group of G blocks only (a dependency on a slice, e.g. split-K);
  ``layer=G``: QKV, gate/up and lm_head wait for the grid (their RMSNorm needs the whole residual), o_proj and
  down for a group of G (split-K by head / by intermediate slice); ``layer1=G``: only QKV and lm_head wait for the
  grid (one grid-wide dependency per layer: the norm's scalar before the attention, split-K everywhere else);
  ``dyn`` / ``dyn-none``: the grid rule / no rule with the chunks taken dynamically (a shared counter per op) instead
  of static shares, so that faster SMs take more of each op and no block is left behind at a wait; ``dyn-grabN``:
  N chunks per grab (a GEMV tile's granularity).

A block announces an op done with a release reduction (``signal`` 1); ``signal`` 0 is v32's full fence + atomicAdd.

Each variant is timed with CUDA events around single launches (warm-up, `reps` repetitions, median and spread);
every launch's checksum is compared with the buffer's (every byte read exactly once) before its time counts. Each
launch also counts cycles per block (clock64): the producer blocked on a full ring, and the consumers waiting for
chunks to land, for the dependency, and at each op's closing sync — as shares of the run ("cycle_shares").
"""
from __future__ import annotations

import numpy as np

from atomflow_bench.gpu.arena import plan_arena
from atomflow_bench.measure.timing import copy_bandwidth, summarize
from atomflow_bench.config import ModelConfig
from atomflow_bench.errors import AtomflowError

PROBE_THREADS = 288      # probe_stream.cu: 8 consumer warps + 1 producer warp
PROBE_BAR_BYTES = 2048   # probe_stream.cu: the barriers and the slots' meta before the ring (64 slots at most)
PROBE_MAX_SLOTS = 64
# probe_stream.cu's per-block cycle counts, as shares of thread 0's run (the 5th count)
STAT_NAMES = ("producer_blocked", "data_wait", "dep_wait", "end_sync")
PROBE_MAX_SMEM = 227 * 1024  # sm_90's dynamic shared memory per block


def step_ops(cfg: ModelConfig, fmt: str) -> list[tuple[str, int]]:
    """(name, bytes) of each weight-streaming op of one decode step, in the step's order: per layer QKV (with its
    norm), o_proj, gate/up (with its norm), down — fp8 with their scales — then the final norm with lm_head. Bytes
    rounded up to 16 (the bulk copies' unit). Their sum is the plan's streamed weight bytes, to that rounding."""
    plan = plan_arena(cfg, fmt, 1)
    r = plan.regions

    def size(*names: str) -> int:
        n = sum(r[x].nbytes for x in names if x in r)
        return -(-n // 16) * 16

    def proj(i: int, w: str) -> tuple[str, ...]:
        return (f"L{i}.{w}", f"L{i}.{w}.scale")

    ops = []
    for i in range(cfg.num_hidden_layers):
        ops += [(f"L{i}.qkv", size(f"L{i}.attn_norm", *proj(i, "wqkv"))), (f"L{i}.o", size(*proj(i, "wo"))),
                (f"L{i}.gu", size(f"L{i}.mlp_norm", *proj(i, "wgu"))), (f"L{i}.d", size(*proj(i, "wd")))]
    ops.append(("lm_head", size("final_norm", "embed" if cfg.tie_word_embeddings else "lm_head")))
    return ops


def probe_variants(att_ns: int, slots: int, chunk: int, sweep: bool = False) -> list[dict]:
    """The four variants of the module doc; `sweep` adds `deps` with other rings (how much the copies' run-ahead
    buys), with the waiting thread sleeping between polls (whether the polling itself costs), with the v32 fence
    signal, the group rules (what a dependency on a slice costs against one on the whole grid), and the dynamic
    rules (chunks from a shared counter: `dyn-none`, `dyn`, `dyn+att`, a finer ring, coarser grabs)."""
    def v(name, deps, att=0, n=slots, c=chunk, **kw):
        return {"name": name, "deps": deps, "att_ns": att, "slots": n, "chunk": c, **kw}

    vs = [v("stream", "none"), v("deps", "grid"), v("deps+att", "grid", att_ns), v("deps+att-ring2", "grid", att_ns, 2)]
    if sweep:
        vs += [v(f"deps-ring{n}x{c // 1024}K", "grid", 0, n, c)
               for n, c in ((2, 16384), (4, 16384), (8, 16384), (13, 16384), (24, 8192), (6, 32768))]
        vs += [v(f"deps-poll{ns}", "grid", poll_ns=ns) for ns in (100, 500)]
        vs += [{**x, "name": f"{x['name']}-fence", "signal": 0} for x in vs[:3]]
        vs += [v(f"group={g}", f"group={g}") for g in (1, 4, 12, 33)]
        vs += [v(f"layer={g}", f"layer={g}") for g in (1, 12, 33)] + [v("layer=12+att", "layer=12", att_ns)]
        vs += [v(f"layer1={g}", f"layer1={g}") for g in (1, 12)] + [v("layer1=12+att", "layer1=12", att_ns)]
        vs += [v("dyn-none", "dyn-none"), v("dyn", "dyn"), v("dyn+att", "dyn", att_ns), v("dyn-ring24x8K", "dyn", 0, 24, 8192)]
        vs += [v(f"dyn-grab{n}", "dyn", grab=n) for n in (3, 8)]  # 48 / 128 KB a grab: a GEMV tile's granularity
    return [{"signal": 1, "poll_ns": 0, **x} for x in vs]  # signal 1: red.release (probe_stream.cu), 0: fence + add


def op_groups(ops: list[tuple[str, int]], rule: str, n_sm: int) -> np.ndarray:
    """Per op, the size of the group of blocks whose previous op it waits for (probe_stream.cu `group`; 0: none;
    op 0 never waits): "none"; "grid"; "group=G" (every op); "layer=G" (the grid before QKV, gate/up and lm_head, G
    before o_proj and down); "layer1=G" (the grid before QKV and lm_head, G before the others); "dyn" (as "grid")
    and "dyn-none" (as "none"), with the chunks taken dynamically (`dynamic`)."""
    kind, _, g = rule.partition("=")
    if kind in ("group", "layer", "layer1") and not (g.isdigit() and 1 <= int(g) <= n_sm):
        raise AtomflowError(f"probe rule {rule!r}: the group size must be 1..{n_sm}")
    kind = {"dyn": "grid", "dyn-none": "none"}.get(kind, kind)
    if kind in ("none", "grid") and rule not in (kind, "dyn", "dyn-none"):
        raise AtomflowError(f"probe rule {rule!r}: {kind} takes no size")
    if kind == "none":
        out = [0] * len(ops)
    elif kind == "grid":
        out = [n_sm] * len(ops)
    elif kind == "group":
        out = [int(g)] * len(ops)
    elif kind == "layer":
        out = [int(g) if name.endswith((".o", ".d")) else n_sm for name, _ in ops]
    elif kind == "layer1":
        out = [int(g) if name.endswith((".o", ".gu", ".d")) else n_sm for name, _ in ops]
    else:
        raise AtomflowError(f"probe rule {rule!r}: none, grid, group=G, layer=G or layer1=G")
    return np.array([0] + out[1:], dtype=np.uint32)


def dynamic(rule: str) -> bool:
    """Whether a rule takes its chunks dynamically (probe_stream.cu dyn = 1)."""
    return rule.startswith("dyn")


def expected_counters(groups: np.ndarray, n_sm: int, launches: int, chunks: list | None = None) -> np.ndarray:
    """probe_stream.cu's counters after `launches` launches: op o's row counts, per group of op o+1's grouping,
    its blocks (x launches); rows whose next op waits for nothing stay 0. `chunks` (dynamic rules: each op's chunk
    count): op o's row holds, in its first column, its chunks consumed (x launches)."""
    out = np.zeros((len(groups), n_sm), dtype=np.uint32)
    for o in range(len(groups) - 1):
        G = int(groups[o + 1])
        if G and chunks is not None:
            out[o, 0] = launches * chunks[o]
        elif G:
            for g in range(-(-n_sm // G)):
                out[o, g] = launches * min(G, n_sm - g * G)
    return out


def sync_ops(n_ops: int, n_sm: int) -> list[tuple[str, int]]:
    """`n_ops` ops of 16 bytes per block: what the dependency waits cost with (almost) no bytes behind them."""
    return [(f"sync{o}", 16 * n_sm) for o in range(n_ops)]


def stream_probe(lib, ops: list[tuple[str, int]], n_sm: int, variants: list[dict], reps: int = 20, warmup: int = 3,
                 copy: dict | None = None, seed: int | None = None) -> dict:
    """Time probe_stream over `ops` for each variant (see the module doc); checks every launch's checksum."""
    import cupy as cp

    if any(b % 16 or b <= 0 for _, b in ops):
        raise AtomflowError("probe ops must be positive multiples of 16 bytes")
    for v in variants:
        if not (1 <= v["slots"] <= PROBE_MAX_SLOTS and v["chunk"] % 16 == 0 and v["chunk"] > 0):
            raise AtomflowError(f"probe variant {v['name']!r}: slots 1..{PROBE_MAX_SLOTS}, chunk a multiple of 16")
        if PROBE_BAR_BYTES + v["slots"] * v["chunk"] > PROBE_MAX_SMEM:
            raise AtomflowError(f"probe variant {v['name']!r}: its ring does not fit {PROBE_MAX_SMEM} bytes")
    copy = copy or copy_bandwidth()
    off = np.concatenate([[0], np.cumsum([b for _, b in ops])]).astype(np.uint64)
    total = int(off[-1])
    w = cp.random.default_rng(seed).integers(0, 255, total, dtype=cp.uint8)  # fresh random bytes (never zeros)
    want = int(w.view(cp.uint32).sum(dtype=cp.uint64).get())  # the kernel's sum of 32-bit words, mod 2^64
    d_off = cp.asarray(off)
    counters = cp.zeros((len(ops), n_sm), dtype=cp.uint32)
    grab = cp.zeros(len(ops), dtype=cp.uint32)
    sink = cp.zeros(1, dtype=cp.uint64)
    stats = cp.zeros((n_sm, len(STAT_NAMES) + 1), dtype=cp.uint64)
    fn = lib["probe_stream"]
    stream = cp.cuda.Stream(non_blocking=True)
    out = []
    for v in variants:
        delay = np.zeros(len(ops), np.uint32)
        for o, (name, _) in enumerate(ops):
            if name.endswith(".o"):
                delay[o] = v["att_ns"]
        d_delay = cp.asarray(delay)
        groups = op_groups(ops, v["deps"], n_sm)
        d_groups = cp.asarray(groups)
        dyn = dynamic(v["deps"])
        shmem = PROBE_BAR_BYTES + v["slots"] * v["chunk"]
        fn.max_dynamic_shared_size_bytes = max(fn.max_dynamic_shared_size_bytes, shmem)
        counters.fill(0)
        ms = []
        with stream:
            for r in range(warmup + reps):
                sink.fill(0)  # an accumulator: any chunk missed or read twice changes the sum
                grab.fill(0)  # dyn: every op's chunks from the first
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record(stream)
                fn((n_sm,), (PROBE_THREADS,), (w, d_off, np.int32(len(ops)), d_delay, d_groups, counters,
                                               np.uint32(r + 1), np.int32(v["poll_ns"]), np.int32(v["slots"]),
                                               np.uint32(v["chunk"]), np.int32(v.get("signal", 1)), np.int32(dyn),
                                               np.uint32(v.get("grab", 1)), grab, sink, stats), shared_mem=shmem)
                e1.record(stream)
                e1.synchronize()
                got = int(sink.get()[0])
                if got != want:
                    raise AtomflowError(f"probe {v['name']}: checksum {got:#x} != {want:#x} (launch {r})")
                if r >= warmup:
                    ms.append(cp.cuda.get_elapsed_time(e0, e1))
        chunks = [-(-b // v["chunk"]) for _, b in ops] if dyn else None
        if not (counters.get() == expected_counters(groups, n_sm, warmup + reps, chunks)).all():
            raise AtomflowError(f"probe {v['name']}: the op counters are not what {warmup + reps} launches give")
        s = summarize(ms)
        gbs = total / (s["median"] * 1e-3) / 1e9
        c = stats.get().astype(np.float64)  # the last launch's cycles per block
        share = {n: {"mean": float((c[:, i] / c[:, -1]).mean()), "max": float((c[:, i] / c[:, -1]).max())}
                 for i, n in enumerate(STAT_NAMES)}
        out.append({**v, "ms": s, "gbs": gbs, "pct_of_copy": 100 * gbs / copy["median"], "cycle_shares": share})
    del w
    return {"ops": len(ops), "bytes": total, "grid": n_sm, "floor_ms": total / (copy["median"] * 1e9) * 1e3,
            "copy_bandwidth_gbs": copy, "variants": out}


def probe_table(p: dict):
    from rich.table import Table

    t = Table(title=f"persistent-stream probe: {p['ops']} ops, {p['bytes'] / 1e9:.3f} GB, grid {p['grid']}, "
                    f"floor {p['floor_ms']:.4f} ms at copy {p['copy_bandwidth_gbs']['median']:.0f} GB/s")
    for c in ("variant", "deps", "ring", "att ns", "median ms", "p10-p90 ms", "GB/s", "% of copy",
              "cycles %: blocked/data/dep/sync"):
        t.add_column(c, justify="left" if c == "variant" else "right")
    for v in p["variants"]:
        t.add_row(v["name"], v["deps"], f"{v['slots']} x {v['chunk'] // 1024} KB", str(v["att_ns"]), f"{v['ms']['median']:.4f}",
                  f"{v['ms']['p10']:.4f}-{v['ms']['p90']:.4f}", f"{v['gbs']:.0f}", f"{v['pct_of_copy']:.1f}%",
                  "/".join(f"{100 * v['cycle_shares'][n]['mean']:.0f}" for n in STAT_NAMES)
                  if "cycle_shares" in v else "-")
    return t
