"""First TTFT of the batched prefill (issue 48): 3B fp16 and W8A16, prompts of 128 / 512 / 2048 tokens; TTFT = the
prefill of positions 0 .. n-2 plus the first decode step (graph), CUDA events around both, 1 warm-up then 5 repeats,
median (p10-p90); beside it the prompt walked by the decode step (graph replays), once. Prints one line per case."""
import sys
import time

import cupy as cp
import numpy as np

from atomflow_bench.gpu.engine import Engine
from atomflow_bench.gpu.prefill import Prefill
from atomflow_bench.store.fetch import resolve_model

model = sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-3b"
for fmt in ("fp16", "fp8"):
    eng = Engine(resolve_model(model), weights=fmt, max_seq=2048 + 8)
    t0 = time.perf_counter()
    eng._prefill = Prefill(eng)
    cp.cuda.Device().synchronize()
    print(f"{model} {fmt}: row-major weights made in {time.perf_counter() - t0:.1f} s", flush=True)
    for n in (128, 512, 2048):
        prompt = [int(t) for t in np.random.default_rng(n).integers(0, eng.cfg.vocab_size, n)]
        ts = []
        for r in range(6):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            with eng.stream:
                a.record()
            eng.prefill(prompt)
            eng.run(1)
            with eng.stream:
                b.record()
            b.synchronize()
            if r:
                ts.append(cp.cuda.get_elapsed_time(a, b))
        tok = eng.tokens(n - 1, 1)[0]
        eng.reset(prompt)
        eng.run(n - 1)  # the walked prompt (graph), once warm
        a, b = cp.cuda.Event(), cp.cuda.Event()
        eng.reset(prompt)
        with eng.stream:
            a.record()
        eng.run(n)
        with eng.stream:
            b.record()
        b.synchronize()
        walked = cp.cuda.get_elapsed_time(a, b)
        same = eng.tokens(n - 1, 1)[0] == tok
        print(f"{model} {fmt} prompt {n}: TTFT {np.median(ts):.3f} ms ({np.percentile(ts, 10):.3f}-"
              f"{np.percentile(ts, 90):.3f}), {n / np.median(ts) * 1e3:.0f} prompt tok/s; walked {walked:.3f} ms; "
              f"same first token: {same}", flush=True)
    del eng
    cp.get_default_memory_pool().free_all_blocks()
