#!/usr/bin/env python3
"""The prefill's residual width, op by op: `profile`'s prefill breakdown (events per op, the chunk's graph) of the
last chunk of one prompt with the residual in fp32 and in fp16, interleaved on one engine and GPU.

    lab/scripts/prefill_resid_profile.py MODEL FMT [--prompt 2048] [--rounds 2] [--json FILE]

Per-op events are steadier than back-to-back TTFTs (lab/scripts/prefill_chunk_ab.py), whose clocks fall as the
prefills run (PERF_NOTES v55, v58)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ROLES = ("embed", "attn_norm", "qkv", "o_proj", "mlp_norm", "gate_up", "down", "attention")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("fmt", choices=("fp16", "fp8"))
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    from atomflow_bench.gpu.prefill import Prefill
    from atomflow_bench.measure.prefill_profile import profile_prefill
    from atomflow_bench.store.store import write_text_atomic
    from lab.local import lab_engine

    eng = lab_engine(a.model, a.fmt, a.prompt + 2)
    pfs = {r: Prefill(eng, chunk=a.prompt, residual=r) for r in ("fp32", "fp16")}
    out = []
    for rnd in range(a.rounds):
        for r, pf in pfs.items():
            eng._prefill = pf
            p = profile_prefill(eng, a.prompt)
            rows = {x["role"]: x for x in p["rows"]}
            out.append({"round": rnd, "residual": r, "prefill": p})
            print(f"round {rnd} {r}: chunk graph {p['chunk_graph_us']['median']:.1f} us | " + " | ".join(
                f"{k} {rows[k]['us']:.1f}" + (f" ({rows[k]['tflops']:.0f} TF)" if rows[k].get("tflops") else "")
                for k in ROLES if k in rows), flush=True)
    if a.json:
        write_text_atomic(Path(a.json), json.dumps({"model": a.model, "fmt": a.fmt, "gpu": eng.gpu, "runs": out},
                                                   indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
