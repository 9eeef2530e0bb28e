#!/usr/bin/env python3
"""The prefill's layer GEMMs on cuBLAS's default (cublasGemmEx, CUBLAS_GEMM_DEFAULT: what ops/prefill_rows.py Gemm
runs) against every algorithm cuBLASLt's heuristic offers for the same product, timed interleaved on one GPU.

    lab/scripts/gemm_lt_probe.py [--models llama-3.2-3b,llama-3.1-8b] [--rows 512,2048,4096] [--algos 16] [--rounds 3] [--json FILE]

The products are the prefill's: Y [M][N] = X [M][K] W[N][K]^T, fp16 inputs, fp32 accumulation; qkv and gate_up store
fp16, o_proj and down add fp32 into the residual (beta 1), as Gemm's `accumulate`. Each Lt algorithm is checked
against the default's output on the same inputs (max |diff| within 1e-2 of max |Y|: the same fp32 sums in another
order) before it is timed. Timing: CUDA events around each launch, 20 after 3 warm-ups, median; the default and the
algorithms interleaved round by round. The answer: per shape, the default's time, the heuristic's first choice and
the fastest algorithm's, and what the fastest would take off a chunk of the model's layers."""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# cublasLt.h (CUDA 13): attribute and type codes
CUDA_R_16F, CUDA_R_32F = 2, 0
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB = 3, 4
PREF_MAX_WORKSPACE_BYTES = 1
WORKSPACE = 32 << 20


class Heuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def liblt():
    from cupy_backends.cuda.libs import cublas  # noqa: F401  (loads cuBLAS and its Lt beside it)

    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("cuBLASLt not found")


def ok(rc, what):
    if rc:
        raise RuntimeError(f"{what}: cublasStatus {rc}")


class LtGemm:
    """One product's descriptors (the default's column-major view: Y^T [N][M] = W [N][K] (read transposed) X^T) and its
    heuristic's algorithms; __call__(i) runs algorithm i."""

    def __init__(self, lt, handle, x, w, y, accumulate, n_algos, workspace):
        p = ctypes.c_void_p
        self.lt, self.handle, self.x, self.w, self.y, self.ws = lt, handle, x, w, y, workspace
        n, k = w.shape
        m = x.shape[0]
        self.desc = p()
        ok(lt.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc")
        for attr, op in ((DESC_TRANSA, CUBLAS_OP_T), (DESC_TRANSB, CUBLAS_OP_N)):
            v = ctypes.c_int(op)
            ok(lt.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), ctypes.c_size_t(4)), "trans")
        self.a, self.b, self.c = p(), p(), p()
        yt = CUDA_R_32F if y.dtype.itemsize == 4 else CUDA_R_16F
        ok(lt.cublasLtMatrixLayoutCreate(ctypes.byref(self.a), CUDA_R_16F, ctypes.c_uint64(k), ctypes.c_uint64(n),
                                         ctypes.c_int64(k)), "A")
        ok(lt.cublasLtMatrixLayoutCreate(ctypes.byref(self.b), CUDA_R_16F, ctypes.c_uint64(k), ctypes.c_uint64(m),
                                         ctypes.c_int64(k)), "B")
        ok(lt.cublasLtMatrixLayoutCreate(ctypes.byref(self.c), yt, ctypes.c_uint64(n), ctypes.c_uint64(m),
                                         ctypes.c_int64(n)), "C")
        pref = p()
        ok(lt.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        wsb = ctypes.c_size_t(WORKSPACE)
        ok(lt.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(wsb),
                                                   ctypes.c_size_t(8)), "ws")
        res = (Heuristic * n_algos)()
        got = ctypes.c_int(0)
        ok(lt.cublasLtMatmulAlgoGetHeuristic(handle, self.desc, self.a, self.b, self.c, self.c, pref, n_algos, res,
                                             ctypes.byref(got)), "heuristic")
        self.algos = [res[i] for i in range(got.value) if res[i].state == 0]
        self.alpha = ctypes.c_float(1.0)
        self.beta = ctypes.c_float(1.0 if accumulate else 0.0)

    def __call__(self, i):
        import cupy as cp

        h = self.algos[i]
        ok(self.lt.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(self.w.data.ptr),
                                  self.a, ctypes.c_void_p(self.x.data.ptr), self.b, ctypes.byref(self.beta),
                                  ctypes.c_void_p(self.y.data.ptr), self.c, ctypes.c_void_p(self.y.data.ptr), self.c,
                                  ctypes.byref(h.algo), ctypes.c_void_p(self.ws.data.ptr),
                                  ctypes.c_size_t(WORKSPACE), ctypes.c_void_p(cp.cuda.get_current_stream().ptr)),
           f"matmul algo {i}")


def products(model):
    """The prefill's four layer GEMMs of catalog model `model`: (name, N, K, accumulate)."""
    from atomflow_bench.config import get_preset

    c = get_preset(model).config
    d, f = c.hidden_size, c.intermediate_size
    return [("qkv", c.qkv_dim, d, False), ("o_proj", d, c.q_dim, True), ("gate_up", 2 * f, d, False),
            ("down", d, f, True)]


def timed(fn, reps=20, warm=3):
    import cupy as cp

    for _ in range(warm):
        fn()
    ev = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    ev[-1][1].synchronize()
    t = sorted(cp.cuda.get_elapsed_time(a, b) for a, b in ev)
    return t[len(t) // 2]


def main():
    import cupy as cp
    import numpy as np

    from atomflow_bench.gpu.ops.prefill_rows import Gemm

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-3.2-3b,llama-3.1-8b")
    ap.add_argument("--rows", default="512,2048,4096")
    ap.add_argument("--algos", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    lt = liblt()
    for f in ("cublasLtCreate", "cublasLtMatmulDescCreate", "cublasLtMatmulDescSetAttribute",
              "cublasLtMatrixLayoutCreate", "cublasLtMatmulPreferenceCreate", "cublasLtMatmulPreferenceSetAttribute",
              "cublasLtMatmulAlgoGetHeuristic", "cublasLtMatmul"):
        getattr(lt, f).restype = ctypes.c_int
    handle = ctypes.c_void_p()
    ok(lt.cublasLtCreate(ctypes.byref(handle)), "create")
    ws = cp.empty(WORKSPACE, cp.uint8)
    gemm = Gemm()
    rng = cp.random.default_rng(0)
    out = []
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    for model in a.models.split(","):
        layer_default = {}
        layer_best = {}
        for m in (int(r) for r in a.rows.split(",")):
            for name, n, k, acc in products(model):
                x = rng.standard_normal((m, k), dtype=cp.float32).astype(cp.float16)
                w = (rng.standard_normal((n, k), dtype=cp.float32) / np.sqrt(k)).astype(cp.float16)
                y = cp.zeros((m, n), cp.float32 if acc else cp.float16)
                y0 = rng.standard_normal((m, n), dtype=cp.float32).astype(y.dtype)
                lg = LtGemm(lt, handle, x, w, y, acc, a.algos, ws)
                y[...] = y0
                gemm(x, w, y, m, accumulate=acc)
                ref = y.astype(cp.float32)
                good = []
                for i in range(len(lg.algos)):
                    y[...] = y0
                    try:
                        lg(i)
                    except RuntimeError as e:
                        print(f"  {model} {name} m {m} algo {i}: {e}")
                        continue
                    err = float(cp.abs(y.astype(cp.float32) - ref).max() / cp.abs(ref).max())
                    (good.append(i) if err < 1e-2 else print(f"  {model} {name} m {m} algo {i}: error {err:.2e}"))
                times = {"default": []} | {i: [] for i in good}
                for _ in range(a.rounds):
                    times["default"].append(timed(lambda: gemm(x, w, y, m, accumulate=acc)))
                    for i in good:
                        times[i].append(timed(lambda i=i: lg(i)))
                med = {key: sorted(v)[len(v) // 2] for key, v in times.items()}
                best = min(good, key=lambda i: med[i]) if good else None
                fl = 2 * m * n * k
                row = {"model": model, "m": m, "op": name, "n": n, "k": k, "default_ms": med["default"],
                       "lt_first_ms": med.get(0), "lt_best_ms": med.get(best), "lt_best_index": best,
                       "lt_algos": len(lg.algos), "lt_checked": len(good),
                       "lt_best_waves": lg.algos[best].waves if best is not None else None,
                       "ms_by_algo": {str(i): med[i] for i in good}}
                out.append(row)
                layer_default[m] = layer_default.get(m, 0) + med["default"]
                layer_best[m] = layer_best.get(m, 0) + min(med["default"], med.get(best, 1e9))
                tf = lambda t: fl / t / 1e9 if t else 0  # noqa: E731
                print(f"{model} m {m:5d} {name:8s} default {med['default']:.4f} ms {tf(med['default']):5.0f} TF | "
                      f"lt first {med.get(0, 0):.4f} | lt best #{best} {med.get(best, 0):.4f} ms "
                      f"{tf(med.get(best)):5.0f} TF ({len(good)} of {len(lg.algos)} algos)")
        from atomflow_bench.config import get_preset

        layers = get_preset(model).config.num_hidden_layers
        for m in layer_default:
            print(f"{model} m {m}: a layer's GEMMs default {layer_default[m]:.4f} ms, best of each "
                  f"{layer_best[m]:.4f} ms: {layers * (layer_default[m] - layer_best[m]):.3f} ms off {layers} layers")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
