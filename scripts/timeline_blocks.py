"""Diagnostic (GPU): one instrumented graph replay, block by block, around one layer's attention launch.

    python3 scripts/timeline_blocks.py MODEL WEIGHTS CONTEXT [LAYER]

For every block of the layer's attention launch: its SM, start / wait return / marks / end (µs, relative to
the attention launch's first wait return), and every block of any other launch that was resident on the same
SM at the same time (role, start, end). Answers "what shares the SM with attention". Not part of any test or
figure; results/PERF_NOTES.md quotes what it showed.
"""
from __future__ import annotations

import sys

import numpy as np


def main() -> None:
    from atomflow_bench import timeline
    from atomflow_bench.bench import synthetic_prompt
    from atomflow_bench.engine import Engine
    from atomflow_bench.fetch import resolve_model
    from atomflow_bench.profile import step_role

    model, weights, context = sys.argv[1], sys.argv[2], int(sys.argv[3])
    layer = int(sys.argv[4]) if len(sys.argv) > 4 else 10
    eng = Engine(resolve_model(model), weights=weights, max_seq=context + 16, kernel_defines=(timeline.DEFINE,))
    eng.reset(synthetic_prompt(eng.cfg.vocab_size, context))
    eng.run(context - 1)
    bufs = timeline.buffers(eng.lib)
    for _ in range(3):  # the last replay is the one read
        launches = eng.launches
        with eng.stream:
            timeline.clear(bufs)
        eng.run(1)
        eng.stream.synchronize()
    rows, sms = [], []
    for rec, nxt in bufs:
        n = nxt.get().astype(np.int64)
        r = rec.get()
        for sm in np.flatnonzero(n):
            k = min(int(n[sm]), timeline.SLOTS)
            rows.append(r[sm * timeline.SLOTS: sm * timeline.SLOTS + k])
            sms += [int(sm)] * k
    rec, sms = np.concatenate(rows), np.array(sms)
    ids = np.unique(rec[:, 0])  # grid ids ascend in launch order (timeline.launch_times relies on the same)
    roles = [step_role(ln) for ln in launches]
    launch_of = {int(g): i for i, g in enumerate(ids)}
    att = [i for i, r in enumerate(roles) if r == "attention_decode"][layer]
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


if __name__ == "__main__":
    main()
