#!/usr/bin/env python3
"""The prefill attention's block shape: variants of kernels_cu/attention_prefill.cu's #defines against the product's,
checked against NumPy, then timed interleaved on one GPU.

    lab/scripts/prefill_att_ab.py [--rounds 3] [--json FILE]

Each variant is the product's source with its ATP_* #defines replaced, compiled from a copy of kernels_cu/ (the
product's code otherwise unchanged) and launched with its own grid and shared memory (the launch factory's
arithmetic with the variant's constants). Correctness: a chunk at start 300 of 200 rows against float64 NumPy (the
product test's bound, 2e-3 max|V|) for 3B's and 1B's shapes. Timing: CUDA events around each launch, 20 after 3
warm-ups, median; the variants interleaved round by round. TFLOPS of the causal work (row at position p: 4 hd (p+1)
per q head)."""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

VARIANTS = {  # ATP_ROWS, ATP_THREADS, ATP_KV, ATP_STAGES, ATP_MIN_BLOCKS, ATP_BATCH
    "product": None,
    # 8 warps over 128 stacked rows, one block an SM: each K/V tile staged in shared memory serves twice the rows
    # (a third stage needs the prefetch distance changed in the kernel; 128-position tiles break hd 64's batching)
    "rows128": dict(ATP_ROWS=128, ATP_THREADS=256, ATP_KV=64, ATP_STAGES=2, ATP_MIN_BLOCKS=1, ATP_BATCH=4),
}
SHAPES = {"3b": (24, 8, 128), "8b": (32, 8, 128), "1b": (32, 8, 64)}  # q heads, kv heads, head_dim
TIMED = [("3b", 0, 2048), ("3b", 4096, 4096), ("8b", 0, 2048), ("1b", 0, 2048), ("3b", 0, 512)]  # shape, start, m


def variant_lib(consts: dict | None, tmp: Path):
    from atomflow_bench.gpu.nvrtc import KERNELS_DIR
    from atomflow_bench.gpu.ops import declared_kernels, kernel_lib
    from atomflow_bench.gpu.nvrtc import KernelLib

    if consts is None:
        return kernel_lib()
    d = tmp / "_".join(f"{v}" for v in consts.values())
    shutil.copytree(KERNELS_DIR, d)
    p = d / "attention_prefill.cu"
    src = p.read_text()
    for k, v in consts.items():
        src, n = re.subn(rf"^#define {k} \d+", f"#define {k} {v}", src, flags=re.M)
        assert n == 1, k
    p.write_text(src)
    return KernelLib(declared_kernels(), d)


def launch(lib, consts, q, k, v, out, start, m, n_kv, g, hd):
    import numpy as np

    from atomflow_bench.gpu.launch import Launch, i32
    from atomflow_bench.gpu.launch import allow_dynamic_smem
    from atomflow_bench.gpu.ops import attention_prefill as ap

    c = consts or {"ATP_ROWS": ap.ATP_ROWS, "ATP_THREADS": ap.ATP_THREADS, "ATP_KV": ap.ATP_KV,
                   "ATP_STAGES": ap.ATP_STAGES}
    smem = c["ATP_ROWS"] * hd * 2 + c["ATP_STAGES"] * 2 * c["ATP_KV"] * hd * 2
    fn = lib[ap.prefill_kernel(hd, g)]
    allow_dynamic_smem(fn, smem)
    stride = n_kv * g * hd
    return Launch(fn, "attention_prefill", (-(-m * g // c["ATP_ROWS"]), n_kv), (c["ATP_THREADS"],),
                  (q, k, v, out, i32(start), i32(m), i32(n_kv), i32(stride), i32(stride),
                   np.float32(1.0 / math.sqrt(hd))), smem, {}, 0, "variant")


def inputs(shape, start, m, seed=0):
    import cupy as cp

    n_q, n_kv, hd = SHAPES[shape]
    rs = cp.random.RandomState(seed)
    q = (rs.standard_normal((m, n_q * hd), dtype=cp.float32) * 0.5).astype(cp.float16)
    k = (rs.standard_normal((start + m, n_kv * hd), dtype=cp.float32) * 0.5).astype(cp.float16)
    v = rs.standard_normal((start + m, n_kv * hd), dtype=cp.float32).astype(cp.float16)
    return q, k, v, cp.full((m, n_q * hd), float("nan"), dtype=cp.float16)


def reference(q, k, v, start, m, n_q, n_kv, hd):
    import numpy as np

    g = n_q // n_kv
    Q = q.get().astype(np.float64).reshape(m, n_q, hd)
    K = k.get().astype(np.float64).reshape(-1, n_kv, hd)
    V = v.get().astype(np.float64).reshape(-1, n_kv, hd)
    out = np.empty((m, n_q, hd))
    for h in range(n_q):
        s = Q[:, h] @ K[:, h // g].T / math.sqrt(hd)
        s[np.arange(start + m)[None, :] > (start + np.arange(m))[:, None]] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h] = (p / p.sum(axis=1, keepdims=True)) @ V[:, h // g]
    return out.reshape(m, -1), np.abs(V).max()


def main(argv=None) -> int:
    ap_ = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap_.add_argument("--rounds", type=int, default=3)
    ap_.add_argument("--json")
    a = ap_.parse_args(argv)
    import cupy as cp
    import numpy as np

    from atomflow_bench.store.store import write_text_atomic

    tmp = Path(tempfile.mkdtemp())
    libs, ok = {}, {}
    for name, consts in VARIANTS.items():
        try:
            libs[name] = variant_lib(consts, tmp)
            errs = []
            for shape in ("3b", "1b"):
                n_q, n_kv, hd = SHAPES[shape]
                q, k, v, out = inputs(shape, 300, 200, seed=1)
                launch(libs[name], consts, q, k, v, out, 300, 200, n_kv, n_q // n_kv, hd)()
                want, vmax = reference(q, k, v, 300, 200, n_q, n_kv, hd)
                got = out.get().astype(np.float64)
                errs.append(float(np.abs(got - want).max() / vmax) if not np.isnan(got).any() else float("nan"))
            ok[name] = all(e <= 2e-3 for e in errs)
            print(f"{name}: max error / max|V| {errs} -> {'ok' if ok[name] else 'WRONG'}", flush=True)
        except Exception as e:  # noqa: BLE001 - a variant that does not build or launch is reported, not fatal
            ok[name] = False
            print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
    runs = []
    data = {t: inputs(t[0], t[1], t[2]) for t in TIMED}
    for r in range(a.rounds):
        for t in TIMED:
            shape, start, m = t
            n_q, n_kv, hd = SHAPES[shape]
            flops = 4.0 * hd * n_q * (m * start + m * (m + 1) / 2)
            for name, consts in VARIANTS.items():
                if not ok[name]:
                    continue
                ln = launch(libs[name], consts, *data[t], start, m, n_kv, n_q // n_kv, hd)
                for _ in range(3):
                    ln()
                ts = []
                for _ in range(20):
                    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                    e0.record()
                    ln()
                    e1.record()
                    e1.synchronize()
                    ts.append(cp.cuda.get_elapsed_time(e0, e1))
                ms = float(np.median(ts))
                runs.append({"round": r, "variant": name, "shape": shape, "start": start, "m": m, "ms": ms,
                             "tflops": flops / (ms * 1e-3) / 1e12})
    for t in TIMED:
        line = []
        for name in VARIANTS:
            x = [q["ms"] for q in runs if q["variant"] == name and (q["shape"], q["start"], q["m"]) == t]
            if x:
                tf = [q["tflops"] for q in runs if q["variant"] == name and (q["shape"], q["start"], q["m"]) == t]
                line.append(f"{name} {min(x):.4f} ms {max(tf):.0f} TF")
        print(f"{t[0]} start {t[1]} m {t[2]}: " + " | ".join(line), flush=True)
    if a.json:
        write_text_atomic(Path(a.json), json.dumps({"ok": ok, "variants": VARIANTS, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
