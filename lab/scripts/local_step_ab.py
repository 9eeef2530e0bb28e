#!/usr/bin/env python3
"""A tensor-parallel rank's step without its exchanges, on ONE GPU: several forms interleaved on the same weights.

    lab/scripts/local_step_ab.py MODEL FMT TP FORMS [FORMS ...] [--ctx 128] [--tokens 256] [--rounds 2] [--json FILE]

(PERF_NOTES v43 also ran it with lab-only switches in gpu/step.py, since removed: o_proj's grid ignoring the
attention's blocks, and slots before the wait per role; they are in git history at commit 744fad5.)

The engine holds the rank's local config as a one-GPU model with synthetic weights (lab/local.py:
a quarter of 70B's heads and MLP at TP 4, the embedding and lm_head whole), so what it times is the
layer kernels of a rank's step — the part of `run --tp N` that `profile --tp N` calls "the step without exchanges" —
without needing N GPUs. Each round times the forms in the order given (`engine.use`, no reload) with the timing of
`run` (ctx, tokens, 3 repeats after a warm-up; median per token). The copy bandwidth is measured in the same call;
the floor is the step's bytes (engine.streamed_bytes at the run's mean length) over it. Prints medians per quarter
of the lengths."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

# run as a file (python3 lab/scripts/local_step_ab.py): the repository root onto the path, where the lab package lives
# beside the product
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("fmt", choices=("fp16", "fp8"))
    ap.add_argument("tp", type=int)
    ap.add_argument("forms", nargs="+")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    from atomflow_bench.errors import AtomflowError
    from atomflow_bench.gpu.forms import Forms
    from lab.local import lab_engine
    from atomflow_bench.measure.decode import by_bucket, time_decode
    from atomflow_bench.measure.timing import copy_bandwidth
    from atomflow_bench.store.store import write_text_atomic

    configs = [(f, Forms.parse(f)) for f in a.forms]
    try:
        eng = lab_engine(f"{a.model}/tp{a.tp}", a.fmt, a.ctx + a.tokens + 8, forms=configs[0][1])
    except AtomflowError as e:
        print(f"local_step_ab: {e}", file=sys.stderr)
        return 2
    copy = copy_bandwidth()
    floor_ms = eng.streamed_bytes(a.ctx + a.tokens / 2)["total"] / (copy["median"] * 1e9) * 1e3
    runs = []
    for r in range(a.rounds):
        for tag, forms in configs:
            eng.use(forms)
            t = time_decode(eng, a.ctx, a.tokens, repeats=3)
            m = t["tpot_ms"]
            per = t["per_token_ms"]  # token i at length ctx + i: medians over quarters of the lengths
            q = len(per) // 4
            quarters = [(a.ctx + k * q, a.ctx + (k + 1) * q - 1, float(np.median(per[k * q:(k + 1) * q])))
                        for k in range(4)]
            runs.append({"round": r, "form": tag, "forms": forms.text, "tpot_ms": m,
                         "pct_of_floor": 100 * floor_ms / m["median"], "per_token_ms": per, "quarters": quarters,
                         "buckets": by_bucket(eng, t["prompt_len"], per)})
            print(f"round {r} {tag}: {m['median']:.4f} ms ({m['p10']:.4f}-{m['p90']:.4f}) "
                  f"{100 * floor_ms / m['median']:.1f}% of {floor_ms:.4f} ms; "
                  + " ".join(f"L{lo}-{hi} {v:.4f}" for lo, hi, v in quarters), flush=True)
    out = {"model": a.model, "fmt": a.fmt, "tp": a.tp, "local_config": eng.cfg.to_hf_dict(), "ctx": a.ctx,
           "tokens": a.tokens, "copy_bandwidth_gbs": copy, "floor_ms": floor_ms, "runs": runs,
           "gpu": eng.gpu}
    if a.json:
        write_text_atomic(Path(a.json), json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
