"""The prefill GEMM's first timings (issue 48's brick): 3B's four layer GEMMs (QKV 5120x3072 rope pairing, o_proj
3072x3072, gate/up 16384x3072 halves pairing, down 3072x8192) at M = 512 and 2048, fp16 and fp8 weights in the tiled
layout, against cuBLAS through CuPy on the same shapes (cupy.matmul of X [M,K] fp16 by a row-major fp16 copy of the
weight transposed, fp16 out); CUDA events over 20 launches after 3 warm-ups, median; TFLOPS = 2 M N K / time."""
import cupy as cp
import numpy as np

from atomflow_bench.gpu.ops import kernel_lib
from atomflow_bench.gpu.ops.prefill_gemm import prefill_gemm_launch

lib = kernel_lib()


def median_ms(fn) -> tuple[float, float, float]:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(20):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b))
    return float(np.median(ts)), float(np.percentile(ts, 10)), float(np.percentile(ts, 90))


# The kernels only read the bytes: random fp16 for fp16 weights, random E4M3 codes (no NaN: 0x7f/0xff cleared) and
# scales near 1/448 for fp8 — the timings do not depend on the values.
for name, n, k, pairing, half, epi in (("qkv", 5120, 3072, "rope", 64, "store16"),
                                       ("o_proj", 3072, 3072, "none", 0, "resid"),
                                       ("gate_up", 16384, 3072, "halves", 0, "store16"),
                                       ("down", 3072, 8192, "none", 0, "resid")):
    w16 = (cp.random.standard_normal((n, k), dtype=cp.float32) * 0.02).astype(cp.float16)
    w_t = cp.ascontiguousarray(w16.T)  # cuBLAS's operand: [K, N] row-major
    w8 = cp.random.randint(0, 256, (n, k), dtype=cp.int32).astype(cp.uint8) & 0xF7
    s8 = cp.full((n, k // 128), 0.02 / 448, dtype=cp.float32)
    for m in (512, 2048):
        x = cp.random.standard_normal((m, k), dtype=cp.float32).astype(cp.float16)
        y = cp.empty((m, n), dtype=cp.float16 if epi == "store16" else cp.float32)
        flops = 2.0 * m * n * k
        out = cp.empty((m, n), dtype=cp.float16)
        ms, p10, p90 = median_ms(lambda: cp.matmul(x, w_t, out=out))
        print(f"{name} {n}x{k} M={m} cublas fp16: {ms:.4f} ms (p10 {p10:.4f}, p90 {p90:.4f}), "
              f"{flops / ms / 1e9:.1f} TFLOPS", flush=True)
        for fmt, w, s in (("fp16", w16, None), ("fp8", w8, s8)):
            ln = prefill_gemm_launch(lib, fmt, w, s, x, y, m, n, k, k, n, epi, pairing, half, role=name)
            ms, p10, p90 = median_ms(ln)
            print(f"{name} {n}x{k} M={m} ours {fmt} {epi}: {ms:.4f} ms (p10 {p10:.4f}, p90 {p90:.4f}), "
                  f"{flops / ms / 1e9:.1f} TFLOPS", flush=True)
