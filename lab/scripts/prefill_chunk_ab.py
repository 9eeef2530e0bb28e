#!/usr/bin/env python3
"""The prefill's chunk length: TTFT of each chunk length at each prompt length, interleaved on one engine and GPU.

    lab/scripts/prefill_chunk_ab.py MODEL FMT [--prompts 512,2048,8192] [--chunks 512,1024,2048,4096] [--rounds 3]
                                    [--json FILE]

MODEL is a model of the store (lab/local.py lab_engine). One Prefill per chunk length (each with its own weight
copies), swapped into the engine in turn; per round, prompt and chunk: the TTFT as `run` times it (reset, events
around Engine.fill), median of 3 after a warm-up pass (the graphs' capture). The tensor-core
peak (cuBLAS fp16 8192^3) is measured in the same call."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("fmt", choices=("fp16", "fp8"))
    ap.add_argument("--prompts", default="512,2048,8192")
    ap.add_argument("--chunks", default="512,1024,2048,4096")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import numpy as np

    from atomflow_bench.gpu.prefill import Prefill, prefill_flops
    from atomflow_bench.measure.decode import synthetic_prompt
    from atomflow_bench.measure.timing import Marks, tensor_core_tflops
    from atomflow_bench.store.store import write_text_atomic
    from lab.local import lab_engine

    prompts = [int(x) for x in a.prompts.split(",")]
    chunks = [int(x) for x in a.chunks.split(",")]
    eng = lab_engine(a.model, a.fmt, max(prompts) + 2)
    peak = tensor_core_tflops()
    pfs = {c: Prefill(eng, chunk=c) for c in chunks}
    ids = {n: synthetic_prompt(eng.cfg.vocab_size, n) for n in prompts}

    def ttft(n: int, c: int, reps: int) -> list[float]:
        eng._prefill = pfs[c]
        out = []
        for _ in range(reps):
            eng.reset(ids[n])
            m = Marks(1, eng.stream)
            with eng.stream:
                m.mark()
                eng.fill()  # the prompt and the first new token
                m.mark()
            out += m.intervals_ms()
        return out

    first = {}
    for n in prompts:
        for c in chunks:
            ttft(n, c, 1)  # capture
            first[n, c] = eng.tokens(n - 1, 1)[0]
    runs = []
    for r in range(a.rounds):
        for n in prompts:
            for c in chunks:
                t = float(np.median(ttft(n, c, 3)))
                tf = prefill_flops(eng.cfg, n) / (t * 1e-3) / 1e12
                runs.append({"round": r, "prompt": n, "chunk": c, "ttft_ms": t, "tflops": tf,
                             "first_token": first[n, c]})
                print(f"round {r} prompt {n} chunk {c}: {t:.3f} ms, {tf:.0f} TFLOPS "
                      f"({100 * tf / peak['median']:.1f}% of {peak['median']:.0f})", flush=True)
    for n in prompts:
        best = {c: min(x["ttft_ms"] for x in runs if x["prompt"] == n and x["chunk"] == c) for c in chunks}
        same = len({first[n, c] for c in chunks}) == 1
        print(f"prompt {n}: best of rounds " + ", ".join(f"chunk {c} {v:.3f} ms" for c, v in best.items())
              + f"; first token the same for every chunk: {same}")
    if a.json:
        write_text_atomic(Path(a.json), json.dumps({"model": a.model, "fmt": a.fmt, "gpu": eng.gpu,
                                                    "tensor_core_tflops": peak, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
