#!/usr/bin/env python3
"""Where the LL hand-over (forms' /ll: the attention -> o_proj through LL words) costs on one GPU: the step's graph at
one position, four launch lists interleaved (docs/PERF_NOTES.md v44.4).

    scripts/lab/ll_ab.py MODEL FMT GEMV_FORM [--ctx 128] [--rounds 3] [--replays 50] [--json FILE]

MODEL as in atomflow_bench/lab/local.py (a model in the store, or name/tpN: a TP rank's local config); GEMV_FORM a
ws form without /ll (e.g. ws/l2=16). The lists, all of the short bucket at length ctx (position held, as `profile`):
  plain     the form without /ll
  ll        with /ll: the attention writes LL words, o_proj polls them (no grid wait)
  unpolled  /ll with o_proj waiting for the attention's grid, then reading the words (ops/gemv.py ll_unpolled): the
            attention's side of the hand-over alone
  late      /ll with o_proj's producer warp also waiting for the attention's grid before it leaves (base bit 31, a
            lab switch in gemv_common.cuh): whether a completion that leaves the predecessor's implicit is the cost
Prints each list's median step (µs) per round and the medians over rounds."""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("fmt", choices=("fp16", "fp8"))
    ap.add_argument("form")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    from atomflow_bench.errors import AtomflowError
    from atomflow_bench.gpu.forms import Forms, GemvForm
    from atomflow_bench.gpu.launch import with_last_arg
    from atomflow_bench.gpu.ops.gemv import ll_unpolled
    from atomflow_bench.gpu.step import hold_position
    from atomflow_bench.lab.local import lab_engine
    from atomflow_bench.measure.bench import synthetic_prompt
    from atomflow_bench.measure.timing import graph_replay_us

    try:
        g = GemvForm.parse(a.form)
        if not g.ws or g.ll:
            raise AtomflowError(f"ll_ab: {a.form!r}: a ws form without /ll")
        gl = replace(g, ll=True)
        eng = lab_engine(a.model, a.fmt, a.ctx + 8, forms=Forms(True, gl, g))
    except AtomflowError as e:
        print(f"ll_ab: {e}", file=sys.stderr)
        return 2
    cap = eng.short_capacity
    if not cap or a.ctx > cap:
        print(f"ll_ab: ctx {a.ctx} is not in the short bucket (capacity {cap})", file=sys.stderr)
        return 2
    eng.reset(synthetic_prompt(eng.cfg.vocab_size, a.ctx))
    eng.run(a.ctx - 1)
    ll = eng.bucket_launches(cap, gl)
    lists = {
        "plain": eng.bucket_launches(cap, g),
        "ll": ll,
        "unpolled": [ll_unpolled(ln) for ln in ll],
        "late": [with_last_arg(ln, np.uint32(int(ln.args[-1]) | 1 << 31)) if ln.name.endswith("_ll") else ln
                 for ln in ll],
    }
    lists = {k: hold_position(v) for k, v in lists.items()}
    runs = {k: [] for k in lists}
    for r in range(a.rounds):
        for k, v in lists.items():
            t = graph_replay_us(v, eng.stream, a.replays)
            runs[k].append(t)
            print(f"round {r} {k}: {t['median']:.1f} us ({t['p10']:.1f}-{t['p90']:.1f})", flush=True)
    summary = {k: float(np.median([t["median"] for t in v])) for k, v in runs.items()}
    print("medians over rounds (us): " + ", ".join(f"{k} {v:.1f} ({v - summary['plain']:+.1f})"
                                                  for k, v in summary.items()))
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"model": a.model, "fmt": a.fmt, "form": a.form, "ctx": a.ctx, "runs": runs,
                       "median_us": summary, "gpu": eng.gpu}, f, indent=1, default=str)
        os.replace(tmp, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
