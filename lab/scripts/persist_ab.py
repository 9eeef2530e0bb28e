#!/usr/bin/env python3
"""The product's graph step against the lab's persistent step (lab/persist.py), interleaved on one engine and GPU.

    lab/scripts/persist_ab.py MODEL FMT [FORMS ...] [--modes static,split] [--ctx 128] [--tokens 256] [--rounds 2]
                              [--json FILE]

MODEL is a model of the store (lab/local.py lab_engine). Each round times every FORMS (the graph step in those forms,
`engine.use`) and then the persistent step in each of --modes (lab/persist.py MODES; installed over the ws form's
short bucket), with the timing of `run`
(time_decode: ctx, tokens, 3 repeats after a warm-up; median per token). The copy bandwidth is measured in the same
call; the floor is the step's bytes at the run's mean length over it. PERF_NOTES v48 ran the same comparison with
`run --forms short:persist;split:ws` while the form was in the product."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# run as a file: the repository root onto the path, where the lab package lives beside the product
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("fmt", choices=("fp16", "fp8"))
    ap.add_argument("forms", nargs="*", default=["short:ws/l2=0;split:ws/l2=0"])
    ap.add_argument("--modes", default="static,split")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    from atomflow_bench.errors import AtomflowError
    from atomflow_bench.gpu.forms import Forms
    from atomflow_bench.measure.decode import time_decode
    from atomflow_bench.measure.timing import copy_bandwidth
    from atomflow_bench.store.store import write_text_atomic
    from lab.local import lab_engine
    from lab.persist import MODES, PersistStep

    ws = Forms.parse("short:ws;split:ws")
    try:
        modes = a.modes.split(",")
        if not set(modes) <= set(MODES):
            raise AtomflowError(f"--modes: each of {', '.join(MODES)}")
        persist_tags = {f"persist-{m}": m for m in modes}
        configs = [(f, Forms.parse(f)) for f in a.forms] + [(t, ws) for t in persist_tags]
        eng = lab_engine(a.model, a.fmt, a.ctx + a.tokens + 8, forms=configs[0][1])
        if eng.short_capacity < a.ctx + a.tokens:
            raise AtomflowError(f"the run's lengths reach {a.ctx + a.tokens}, past the short bucket "
                                f"({eng.short_capacity}) the persistent step replaces")
    except AtomflowError as e:
        print(f"persist_ab: {e}", file=sys.stderr)
        return 2
    copy = copy_bandwidth()
    floor_ms = eng.streamed_bytes(a.ctx + a.tokens / 2)["total"] / (copy["median"] * 1e9) * 1e3
    runs = []
    for r in range(a.rounds):
        for tag, forms in configs:
            eng.use(forms)
            if tag in persist_tags:
                PersistStep(eng, persist_tags[tag]).install()
            m = time_decode(eng, a.ctx, a.tokens, repeats=3)["tpot_ms"]
            runs.append({"round": r, "form": tag, "tpot_ms": m, "pct_of_floor": 100 * floor_ms / m["median"]})
            print(f"round {r} {tag}: {m['median']:.4f} ms ({m['p10']:.4f}-{m['p90']:.4f}) "
                  f"{100 * floor_ms / m['median']:.1f}% of {floor_ms:.4f} ms", flush=True)
    out = {"model": a.model, "fmt": a.fmt, "ctx": a.ctx, "tokens": a.tokens, "copy_bandwidth_gbs": copy,
           "floor_ms": floor_ms, "runs": runs, "gpu": eng.gpu}
    if a.json:
        write_text_atomic(Path(a.json), json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
