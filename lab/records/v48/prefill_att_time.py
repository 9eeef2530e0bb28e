"""The prefill attention kernel's first timings (issue 48's brick): causal GQA over a chunk at start 0, 3B and 8B
shapes, M = 512 / 2048 / 8192; CUDA events over 20 launches after 3 warm-ups, median; TFLOPS counted as the causal
half of 4 * M^2 * hd per q head (scores and P.V)."""
import cupy as cp
import numpy as np

from atomflow_bench.gpu.ops import kernel_lib
from atomflow_bench.gpu.ops.attention_prefill import attention_prefill_launch

lib = kernel_lib()
for name, n_q, n_kv, hd in (("3b", 24, 8, 128), ("8b", 32, 8, 128), ("1b", 32, 8, 64)):
    g = n_q // n_kv
    for m in (512, 2048, 8192):
        q = (cp.random.standard_normal((m, n_q * hd), dtype=cp.float32) * 0.5).astype(cp.float16)
        k = (cp.random.standard_normal((m, n_kv * hd), dtype=cp.float32) * 0.5).astype(cp.float16)
        v = cp.random.standard_normal((m, n_kv * hd), dtype=cp.float32).astype(cp.float16)
        out = cp.empty((m, n_q * hd), dtype=cp.float16)
        ln = attention_prefill_launch(lib, q, k, v, 0, m, out, n_kv, g, hd, n_q * hd, n_q * hd)
        for _ in range(3):
            ln()
        ts = []
        for _ in range(20):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            ln()
            b.record()
            b.synchronize()
            ts.append(cp.cuda.get_elapsed_time(a, b))
        ms = float(np.median(ts))
        flops = 4.0 * m * m * hd * n_q / 2
        print(f"{name} M={m}: {ms:.4f} ms (p10 {np.percentile(ts, 10):.4f}, p90 {np.percentile(ts, 90):.4f}), "
              f"{flops / ms / 1e9:.1f} TFLOPS")
