"""Diagnostic (GPU): one instrumented graph replay, block by block, around one layer's attention launch.

    python3 lab/scripts/timeline_blocks.py MODEL WEIGHTS CONTEXT [LAYER] [--layer | --alone]

Default: for every block of the layer's attention launch, its SM, start / wait return / marks / end (µs, relative
to the attention launch's first wait return), and every block of any other launch that was resident on the same
SM at the same time (role, start, end). Answers "what shares the SM with attention".
MODEL as lab/local.py takes it: a model in the store, or `name/tpN` (a tensor-parallel rank's local
config on one GPU, synthetic weights). The forms: ATOMFLOW_FORMS, else the engine's defaults.
--layer: for each launch of the layer (QKV .. down, then the next QKV), the spread over its blocks (min, p10,
median, p90, max) of start, wait return, marks and end, in µs after the previous launch's last block ended.
Answers "which blocks of a launch are late, and at which stage".
--alone: the step's attention launches alone in one graph (profile's `attention_graph`), one replay recorded; for
launches LAYER .. LAYER + 2 the same spread, the blocks that found no SM until the previous launch ended, and the
last block of each kv head (the combine): its ticket and end. Answers "where the time per launch goes when
attention is chained with itself". Not part of any test or figure;
lab/PERF_NOTES.md quotes what it showed.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

# run as a file (python3 lab/scripts/timeline_blocks.py): the repository root onto the path, where the lab package lives
# beside the product
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    from lab import timeline
    from lab.local import lab_engine
    from atomflow_bench.measure.decode import synthetic_prompt
    from atomflow_bench.measure.profile import step_role

    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    model, weights, context = args[0], args[1], int(args[2])
    layer = int(args[3]) if len(args) > 3 else 10
    eng = lab_engine(model, weights, context + 16, kernel_defines=(timeline.DEFINE,))  # forms: ATOMFLOW_FORMS
    eng.reset(synthetic_prompt(eng.cfg.vocab_size, context))
    eng.run(context - 1)
    bufs = timeline.buffers(eng.lib)
    if "--alone" in sys.argv:
        alone(eng, bufs, model, weights, layer)
        return
    for _ in range(3):  # the last replay is the one read
        launches = eng.launches
        with eng.stream:
            timeline.clear(bufs)
        eng.run(1)
        eng.stream.synchronize()
    rec, sms, _, _ = timeline.read_with_sm(bufs)
    ids = np.unique(rec[:, 0])  # grid ids ascend in launch order (timeline.launch_times relies on the same)
    roles = [step_role(ln) for ln in launches]
    launch_of = {int(g): i for i, g in enumerate(ids)}
    att = [i for i, r in enumerate(roles) if r == "attention_decode"][layer]
    if "--layer" in sys.argv:
        layer_spread(rec, sms, ids, roles, att, model, weights, context, layer)
        return
    mine = rec[:, 0] == ids[att]
    t0 = rec[mine, 2].astype(np.int64).min()

    def us(v) -> float:
        return (int(v) - t0) / 1e3 if v else float("nan")

    print(f"{model} {weights} length {context + 2}: layer {layer} attention = launch {att}; times in µs from its "
          f"first wait return")
    for b in np.flatnonzero(mine):
        r = rec[b]
        print(f"  SM {sms[b]:3d}: start {us(r[1]):7.2f} wait {us(r[2]):6.2f} marks "
              + " ".join(f"{us(m):6.2f}" for m in r[4:]) + f" end {us(r[3]):6.2f}")
        s, e = int(r[1]), int(r[3])
        same = (sms == sms[b]) & ~mine & (rec[:, 1].astype(np.int64) < e) & (rec[:, 3].astype(np.int64) > s)
        for o in np.flatnonzero(same):
            li = launch_of[int(rec[o, 0])]
            print(f"        with {roles[li]:16s} (launch {li:3d}) start {us(rec[o, 1]):7.2f} end {us(rec[o, 3]):7.2f}")


def spread_cols(rec) -> list[tuple[str, int]]:
    """(name, column) of a timeline record's times: start, wait return, each mark, end."""
    return [("start", 1), ("wait", 2)] + [(f"mark{k}", 4 + k) for k in range(rec.shape[1] - 4)] + [("end", 3)]


def print_spread(label: str, times: np.ndarray, t0: int) -> None:
    """One row: min / p10 / median / p90 / max of `times` (GPU ns; 0 = not recorded, left out) in µs after t0."""
    v = times.astype(np.int64)
    v = v[v > 0]
    if len(v):
        q = np.percentile((v - t0) / 1e3, [0, 10, 50, 90, 100])
        print(f"    {label} " + " ".join(f"{x:7.2f}" for x in q))


def layer_spread(rec, sms, ids, roles, att, model, weights, context, layer) -> None:
    """Per launch from the layer's QKV to the next layer's QKV: quantiles over blocks, µs after the previous
    launch's last block end (negative: before it); then, by how many of the launch's blocks an SM ran, the SMs'
    count and the median and latest end of their last block (do the SMs that carry more blocks end last?)."""
    print(f"{model} {weights} length {context + 2}: layer {layer}; µs after the previous launch's last block end; "
          "min / p10 / median / p90 / max over the launch's blocks")
    for li in range(att - 1, att + 5):
        prev = rec[rec[:, 0] == ids[li - 1]]
        sel = rec[:, 0] == ids[li]
        mine = rec[sel]
        t0 = prev[:, 3].astype(np.int64).max()
        print(f"  launch {li} {roles[li]}: {len(mine)} blocks, {int((mine[:, 1].astype(np.int64) < t0).sum())} "
              "started before the previous launch ended")
        for name, c in spread_cols(rec):
            print_spread(f"{name:6s}", mine[:, c], t0)
        last = {}
        for sm, end in zip(sms[sel], mine[:, 3].astype(np.int64)):
            last.setdefault(int(sm), []).append(int(end))
        per = {}
        for ends in last.values():
            per.setdefault(len(ends), []).append((max(ends) - t0) / 1e3)
        print("    blocks per SM -> SMs, last end median / max: " + "; ".join(
            f"{k}: {len(v)} SMs, {np.median(v):.2f} / {max(v):.2f}" for k, v in sorted(per.items())))


def alone(eng, bufs, model, weights, layer) -> None:
    """The attention launches alone in a graph (as profile.attention_graph replays them); one replay read."""
    from lab import timeline
    from atomflow_bench.gpu.graph import StepGraph
    from atomflow_bench.measure.timing import graph_replay_us

    launches = [ln for ln in eng.launches if ln.name == "attention_decode"]
    g = StepGraph(launches, eng.stream)
    for _ in range(3):  # the last replay is the one read
        with eng.stream:
            timeline.clear(bufs)
        g.replay(1)
        eng.stream.synchronize()
    rec, sms, blk, _ = timeline.read_with_sm(bufs)
    timeline.check_blocks(rec, blk, [ln.grid for ln in launches])
    t = graph_replay_us(launches, eng.stream, 30)
    ids = np.unique(rec[:, 0])
    n_kv = launches[0].grid[0]
    length = int(eng.arena["pos"].get()[0]) + 1
    ends = [rec[rec[:, 0] == i, 3].astype(np.int64).max() for i in ids]
    spans = np.diff(np.array(ends)) / 1e3
    print(f"{model} {weights} length {length}: {len(ids)} attention launches alone in one graph, grid {launches[0].grid}; "
          f"span per launch (last end - previous last end) median {np.median(spans):.2f} µs "
          f"(min {spans.min():.2f}, max {spans.max():.2f}); 30 replays (instrumented build, events): "
          f"{t['median'] / len(launches):.2f} µs per launch ({t['p10'] / len(launches):.2f}-{t['p90'] / len(launches):.2f})")
    print("  spans: " + " ".join(f"{x:.2f}" for x in spans))
    for li in range(max(layer, 1), min(layer + 4, len(ids))):
        mine = rec[rec[:, 0] == ids[li]]
        t0 = ends[li - 1]
        st = mine[:, 1].astype(np.int64)
        late = st >= t0
        print(f"  launch {li}: {len(mine)} blocks, span {(ends[li] - t0) / 1e3:.2f} µs; {int(late.sum())} blocks started "
              f"only after the previous launch ended; µs after that end, min / p10 / median / p90 / max:")
        for name, c in spread_cols(rec):
            print_spread(f"{name:6s} all ", mine[:, c], t0)
            if late.any():
                print_spread(f"{name:6s} late", mine[late, c], t0)
        last = np.argsort(mine[:, 3].astype(np.int64))[-n_kv:]  # the combining blocks end last
        print("    last blocks (ticket -> end): " + ", ".join(
            f"{(int(mine[b, 7]) - t0) / 1e3:.2f}->{(int(mine[b, 3]) - t0) / 1e3:.2f}" for b in last))
        stragglers(rec, sms, blk, ids, li, t0)


def stragglers(rec, sms, blk, ids, li, t0) -> None:
    """Per kv head of launch li, the block whose ticket came last (the one that combines): its split, SM, times
    (µs after the previous launch's end), its head's median ticket, and the other blocks on its SM meanwhile."""
    sel = np.flatnonzero(rec[:, 0] == ids[li])
    f = lambda v: f"{(int(v) - t0) / 1e3:6.2f}" if int(v) else "     -"
    print("    per head, the last ticket's block: head split SM | start wait mark0 mark1 mark2 ticket end | head's "
          "median ticket | other blocks on that SM while it ran (launch offset:head/split start-end)")
    for head in np.unique(blk[sel, 0]):
        mine = sel[blk[sel, 0] == head]
        tk = rec[mine, 7].astype(np.int64)
        b = mine[np.argmax(tk)]
        s, e = int(rec[b, 1]), int(rec[b, 3])
        near = np.flatnonzero((sms == sms[b]) & (rec[:, 1].astype(np.int64) < e) & (rec[:, 3].astype(np.int64) > s))
        others = " ".join(f"{int(np.searchsorted(ids, rec[o, 0])) - li:+d}:{blk[o, 0]}/{blk[o, 1]} {f(rec[o, 1]).strip()}-"
                          f"{f(rec[o, 3]).strip()}" for o in near if o != b)
        print(f"      {head:2d} {blk[b, 1]:3d} {sms[b]:3d} | " + " ".join(f(rec[b, c]) for c in (1, 2, 4, 5, 6, 7, 3))
              + f" | {(np.median(tk[tk > 0]) - t0) / 1e3:6.2f} | {others}")


if __name__ == "__main__":
    main()
