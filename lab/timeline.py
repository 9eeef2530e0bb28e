"""`profile --timeline`: when each launch of the graph step starts, is released and ends, on the GPU's clock.

The step's kernels compiled with -DAF_TIMELINE=<slots per SM> (kernels_cu/common.cuh) have thread 0 of every
block record (%gridid, start, return of its PDL wait, end) in %globaltimer nanoseconds. One graph replay (one
token) is recorded at a time. The records are grouped by grid id, and the grids in increasing id order are the
step's launches in order — checked: each group must hold exactly its launch's block count. Per launch, with its
predecessor's last block end as time 0:

* start    its first block's start (negative: resident and prefetching before the predecessor finished — PDL);
* release  its first block's return from the PDL wait (the predecessor's completion reaching it);
* span     its last block's end: what the launch adds to the step's critical path (the spans of a replay add up
           to the replay, first block start to last block end);
* tail     its last block's end minus its median block end (stragglers);
* marks    the kernel's own stages (AF_TL_MARK k in kernels_cu: GEMV 0 x staged, 1 dot products done, 2 epilogue
           done; split attention 0 q loaded, 1 passes done, 2 partials stored, 3 ticket back; short attention 0 q
           and K/V in shared memory, 1 scores and maxima, 2 probabilities stored, 3 P.V done), each block's time
           from its own wait return, median over the blocks that reach the mark.

Per role (wqkv, attention_decode, ...) the medians over layers and replays, and the role's share of the step
against its bytes at the copy bandwidth. The instrument costs one atomic and four stores per block: its step
time is reported next to the uninstrumented one.
"""
from __future__ import annotations

import numpy as np

from atomflow_bench.errors import AtomflowError

SLOTS = 1024  # record slots per SM and module (-DAF_TIMELINE=SLOTS)
TL_SMS = 256  # kernels_cu/common.cuh AF_TL_SMS: SM ids covered
MARKS = 4     # kernels_cu/common.cuh AF_TL_MARKS: stage marks per record
WORDS = 5 + MARKS  # a record: grid id, start, wait, end, the marks, the block's index (x | y << 21 | z << 42)
DEFINE = f"AF_TIMELINE={SLOTS}"


# ---- device side: the records of one replay ---------------------------------------------------------------
def buffers(lib) -> list[tuple]:
    """(records [TL_SMS * SLOTS, WORDS] uint64, next-slot counters [TL_SMS] uint32) of every loaded module."""
    import cupy as cp

    out = []
    for path, mod in lib._modules.items():
        try:
            rec, nxt = mod.get_global("af_tl_rec"), mod.get_global("af_tl_next")
        except Exception as e:  # noqa: BLE001 — CuPy raises a driver error for a missing symbol
            raise AtomflowError(f"{path.name} was not compiled with the timeline instrument ({e})") from None
        out.append((cp.ndarray((TL_SMS * SLOTS, WORDS), cp.uint64, rec), cp.ndarray((TL_SMS,), cp.uint32, nxt)))
    return out


def clear(bufs) -> None:
    for _, nxt in bufs:
        nxt.fill(0)


def read_with_sm(bufs) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """All records written since `clear` ([N, 4 + MARKS]: grid id, start, wait, end, marks), the SM of every record
    ([N] int), its block's index ([N, 3] int: x, y, z) and how many records did not fit."""
    rows, sms, dropped = [], [], 0
    for rec, nxt in bufs:
        n = nxt.get().astype(np.int64)
        if not n.any():
            continue
        dropped += int(np.maximum(n - SLOTS, 0).sum())
        r = rec.get()
        for sm in np.flatnonzero(n):
            k = min(int(n[sm]), SLOTS)
            rows.append(r[sm * SLOTS: sm * SLOTS + k])
            sms += [int(sm)] * k
    if not rows:
        return np.zeros((0, 4 + MARKS), np.uint64), np.zeros(0, np.int64), np.zeros((0, 3), np.int64), dropped
    rec = np.concatenate(rows)
    idx = rec[:, 4 + MARKS].astype(np.int64)
    block = np.stack([idx & 0x1FFFFF, (idx >> 21) & 0x1FFFFF, idx >> 42], axis=1)
    return rec[:, :4 + MARKS], np.array(sms), block, dropped


# ---- analysis (CPU) ------------------------------------------------------------------------------------------
def launch_times(rec: np.ndarray, blocks: list[int]) -> np.ndarray:
    """Per launch of one replay, in ns: [start_min, wait_min (nan: no block waited), end_median, end_max, then per
    mark the median over its blocks of mark - own wait (nan: no block has both)]."""
    ids, inv = np.unique(rec[:, 0], return_inverse=True)
    counts = np.bincount(inv.reshape(-1), minlength=len(ids))
    if len(ids) != len(blocks) or list(counts) != list(blocks):
        raise AtomflowError(f"timeline: {len(ids)} grids with {counts.tolist()[:8]}... blocks, expected the step's "
                            f"{len(blocks)} launches with {list(blocks)[:8]}... blocks")
    inv = inv.reshape(-1)
    t = rec[:, 1:4].astype(np.int64)
    marks = rec[:, 4:].astype(np.int64)
    t0 = t[:, 0].min()
    out = np.full((len(ids), 4 + marks.shape[1]), np.nan)
    for i in range(len(ids)):
        start, wait, end = (t[inv == i] - np.array([t0, 0, t0])).T
        mine = marks[inv == i]
        for k in range(mine.shape[1]):
            ok = (mine[:, k] > 0) & (wait > 0)
            if ok.any():
                out[i, 4 + k] = np.median(mine[ok, k] - wait[ok])
        wait = wait[wait > 0] - t0  # 0: the block exited before waiting
        out[i, :4] = (start.min(), wait.min() if wait.size else np.nan, np.median(end), end.max())
    return out


def check_blocks(rec: np.ndarray, block: np.ndarray, grids: list[tuple]) -> None:
    """Every launch's records (grid ids in launch order) hold each block of its grid exactly once (`block`: the
    records' [x, y, z] indices, read_with_sm)."""
    ids, inv = np.unique(rec[:, 0], return_inverse=True)
    if len(ids) != len(grids):
        raise AtomflowError(f"timeline: {len(ids)} grids recorded, the step has {len(grids)} launches")
    inv = inv.reshape(-1)
    for i, grid in enumerate(grids):
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        x, y, z = block[inv == i].T
        lin = np.sort(x + gx * (y + gy * z))
        if len(lin) != gx * gy * gz or (lin != np.arange(gx * gy * gz)).any() or (x >= gx).any() or (y >= gy).any():
            raise AtomflowError(f"timeline: launch {i} (grid {tuple(grid)}) recorded blocks are not its grid's, "
                                f"each once ({len(lin)} records)")


def relative(times: np.ndarray) -> np.ndarray:
    """Per launch [start, release, span, tail] in ns relative to the predecessor's last block end (the first
    launch: to its own first block start), then the marks as they are."""
    prev = np.concatenate([[times[0, 0]], times[:-1, 3]])
    rel = np.empty((len(times), 4))
    rel[:, 0] = times[:, 0] - prev
    rel[:, 1] = times[:, 1] - prev
    rel[:, 2] = times[:, 3] - prev
    rel[:, 3] = times[:, 3] - times[:, 2]
    return np.concatenate([rel, times[:, 4:]], axis=1)  # the marks are already relative to each block's wait


def granularity_ns(rec: np.ndarray) -> float:
    """Smallest step between distinct timestamps of a replay (the clock's resolution, or finer)."""
    ts = np.unique(rec[:, [1, 3]].astype(np.int64))
    d = np.diff(ts)
    return float(d[d > 0].min()) if (d > 0).any() else float("nan")


def summarize_roles(rels: list[np.ndarray], roles: list[str], nbytes: list[int], bw_gbs: float) -> dict:
    """Per role: medians over its launches and the replays; µs per step = the role's spans summed per replay."""
    R = np.stack(rels) / 1e3  # [replays, launches, 4 + marks] in µs
    step = R[:, :, 2].sum(axis=1)
    rows = []
    for role in dict.fromkeys(roles):
        idx = [i for i, r in enumerate(roles) if r == role]
        sub = R[:, idx, :].reshape(-1, R.shape[2])
        marks = [float(np.median(m[~np.isnan(m)])) if (~np.isnan(m)).any() else None for m in sub[:, 4:].T]
        per_step = float(np.median(R[:, idx, 2].sum(axis=1)))
        floor = sum(nbytes[i] for i in idx) / (bw_gbs * 1e9) * 1e6
        rel = sub[:, 1][~np.isnan(sub[:, 1])]
        rows.append({"role": role, "count": len(idx), "us_per_step": per_step,
                     "pct_of_step": 100 * per_step / float(np.median(step)),
                     "span_us": float(np.median(sub[:, 2])), "floor_us": floor / len(idx),
                     "start_us": float(np.median(sub[:, 0])),
                     "release_us": float(np.median(rel)) if rel.size else None,
                     "after_release_us": float(np.median(sub[:, 2] - sub[:, 1])) if rel.size else None,
                     "tail_us": float(np.median(sub[:, 3])), "marks_us": marks,
                     "pct_of_copy": 100 * floor / per_step if per_step > 0 else None})
    return {"step_us": {"median": float(np.median(step)), "min": float(step.min()), "max": float(step.max()),
                        "n": int(step.size)}, "rows": rows}


# ---- the measurement (GPU) -----------------------------------------------------------------------------------
def record(model_dir, weights: str, context: int, replays: int, copy: dict, plain_step_us: float | None = None,
           forms=None) -> dict:
    """Build an instrumented engine, feed a `context`-token prompt, record `replays` single-token replays.
    `forms`: the launch forms (gpu/forms.Forms) — pass the ones the plain engine ran."""
    import cupy as cp

    from atomflow_bench.measure.decode import synthetic_prompt
    from atomflow_bench.gpu.engine import Engine
    from atomflow_bench.measure.profile import _kv_bytes, step_role

    timed = 20
    eng = Engine(model_dir, weights=weights, max_seq=context + replays + timed + 8, kernel_defines=(DEFINE,),
                 forms=forms)
    prompt = synthetic_prompt(eng.cfg.vocab_size, context)
    eng.reset(prompt)
    eng.run(len(prompt) - 1)
    eng.stream.synchronize()  # the graph runs on the engine's stream: pos is final only after it
    launches = eng.launches
    roles = [step_role(ln) for ln in launches]
    bufs = buffers(eng.lib)
    rels, gran = [], []
    length0 = int(eng.arena["pos"].get()[0]) + 1
    for r in range(replays + 1):  # the first replay warms up
        blocks = [int(np.prod(ln.grid)) for ln in eng.launches]  # this replay's attention bucket
        if [step_role(ln) for ln in eng.launches] != roles:
            raise AtomflowError("timeline: the step's launches changed between replays")
        with eng.stream:
            clear(bufs)
        eng.run(1)
        eng.stream.synchronize()
        rec, _, block, lost = read_with_sm(bufs)
        if r == 0:
            continue
        if lost:
            raise AtomflowError(f"timeline: {lost} block records did not fit {SLOTS} slots per SM")
        check_blocks(rec, block, [ln.grid for ln in eng.launches])
        rels.append(relative(launch_times(rec, blocks)))
        gran.append(granularity_ns(rec))
    length = length0 + 1 + (replays - 1) // 2  # the recorded replays run at length0 + 1 ... length0 + replays
    nbytes = [_kv_bytes(eng.cfg, length) if ln.name == "attention_decode" else ln.bytes_moved for ln in launches]
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
    with eng.stream as s:
        ev0.record(s)
        eng.run(timed)
        ev1.record(s)
    ev1.synchronize()
    inst_us = cp.cuda.get_elapsed_time(ev0, ev1) * 1e3 / timed
    out = summarize_roles(rels, roles, nbytes, copy["median"])
    out.update({"attention": "short" if eng.att_caps else "split", "length": length, "max_seq": eng.max_seq,
                "replays": replays, "launches": len(launches), "blocks_per_step": sum(blocks),
                "clock_granularity_ns": float(np.nanmin(gran)), "instrumented_replay_us": inst_us,
                "plain_replay_us": plain_step_us, "floor_us": sum(nbytes) / (copy["median"] * 1e9) * 1e6,
                "per_launch": [{"role": ro, "start_us": float(np.median([x[i, 0] for x in rels]) / 1e3),
                                "span_us": float(np.median([x[i, 2] for x in rels]) / 1e3)}
                               for i, ro in enumerate(roles)]})
    del eng
    return out


def timeline_table(t: dict):
    from rich.table import Table

    tab = Table(title=f"graph step timeline (GPU clock, thread 0 of every block; length {t['length']}, "
                      f"{t['replays']} replays; times relative to the predecessor's last block end)")
    for c in ("role", "launches", "µs/step", "% step", "span µs", "bytes floor µs", "first start", "release",
              "after release", "tail", "marks after own release"):
        tab.add_column(c, justify="left" if c == "role" else "right")

    def f(v):
        return "-" if v is None else f"{v:.2f}"

    for r in t["rows"]:
        tab.add_row(r["role"], str(r["count"]), f"{r['us_per_step']:.1f}", f"{r['pct_of_step']:.1f}", f(r["span_us"]),
                    f(r["floor_us"]), f(r["start_us"]), f(r["release_us"]), f(r["after_release_us"]), f(r["tail_us"]),
                    " ".join(f(m) for m in r.get("marks_us", [])))
    s = t["step_us"]
    plain = f"{t['plain_replay_us']:.1f}" if t.get("plain_replay_us") else "-"
    tab.caption = (f"replay first start -> last end {s['median']:.1f} µs ({s['min']:.1f}-{s['max']:.1f}); bytes floor "
                   f"{t['floor_us']:.1f} µs; replay with events: instrumented {t['instrumented_replay_us']:.1f} µs, "
                   f"plain {plain} µs; clock steps >= {t['clock_granularity_ns']:.0f} ns")
    return tab
