#!/usr/bin/env python3
"""The prefill's RMSNorm rows: the product's kernel (the row held in registers) against lab/kernels/prefill_rows_v0.cu
(the row read twice), checked against each other and NumPy, then timed interleaved on one GPU beside a device copy of
the same bytes (the copy roofline of the same run).

    lab/scripts/prefill_rows_ab.py [--rounds 3] [--json FILE]

Shapes: M rows of H (1B 2048, 3B 3072, 8B 4096, 70B 8192) at M = 2048 and 4096. Timing: CUDA events around 20
launches after 3 warm-ups, the median of 5 such samples per round; bytes = M H 6 (h fp32 read, x fp16 written)."""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

V0 = ROOT / "lab/kernels/prefill_rows_v0.cu"
LAB_INCLUDE = '#include "../../kernels_cu/common.cuh"'
SHAPES = [(m, H) for m in (2048, 4096) for H in (2048, 3072, 4096, 8192)]


def libs(tmp: Path):
    """{"product": the product's KernelLib, "v0": a copy of kernels_cu/ whose prefill_rows.cu is v0's}."""
    from atomflow_bench.gpu.nvrtc import KERNELS_DIR, KernelLib
    from atomflow_bench.gpu.ops import kernel_lib

    d = tmp / "v0"
    shutil.copytree(KERNELS_DIR, d)
    src = V0.read_text()
    assert src.count(LAB_INCLUDE) == 1
    (d / "prefill_rows.cu").write_text(src.replace(LAB_INCLUDE, '#include "common.cuh"'))
    return {"product": kernel_lib(), "v0": KernelLib({"prefill_rows.cu": ("rmsnorm_rows",)}, d)}


def launches(lib_map, h, w, xs, m):
    """name -> a callable launching that version's RMSNorm over h[:m] into xs[name]."""
    from atomflow_bench.gpu.ops.prefill_rows import PREFILL_THREADS, rmsnorm_rows_launch

    H = w.shape[0]
    v0 = lib_map["v0"]["rmsnorm_rows"]
    return {"product": rmsnorm_rows_launch(lib_map["product"], h, w, xs["product"], m, 1e-5),
            "v0": lambda: v0((m,), (PREFILL_THREADS,), (h, w, xs["v0"], np.int32(H), np.float32(1e-5)))}


def timed_us(fn, reps: int = 20, samples: int = 5) -> float:
    import cupy as cp

    for _ in range(3):
        fn()
    out = []
    for _ in range(samples):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        out.append(cp.cuda.get_elapsed_time(a, b) * 1e3 / reps)
    return float(np.median(out))


def main() -> None:
    import cupy as cp

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    rng = np.random.default_rng()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        lib_map = libs(Path(tmp))
        for m, H in SHAPES:
            h0 = rng.standard_normal((m, H)).astype(np.float32)
            w0 = (1 + 0.2 * rng.standard_normal(H)).astype(np.float16)
            h, w = cp.asarray(h0), cp.asarray(w0)
            xs = {k: cp.full((m, H), np.nan, dtype=cp.float16) for k in ("product", "v0")}  # poisoned
            fns = launches(lib_map, h, w, xs, m)
            for fn in fns.values():
                fn()
            cp.cuda.Device().synchronize()
            inv = 1 / np.sqrt((h0.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-5)
            want = ((h0 * inv).astype(np.float16).astype(np.float32) * w0.astype(np.float32)).astype(np.float32)
            got = {k: x.get() for k, x in xs.items()}
            same = bool(np.array_equal(got["product"], got["v0"]))
            err = max(float(np.abs(g.astype(np.float32) - want).max()) for g in got.values())
            assert err <= 2 * np.abs(want).max() * 2 ** -10, f"M {m} H {H}: error {err}"
            nbytes = m * H * 6
            src, dst = cp.empty(nbytes // 2, cp.uint8), cp.empty(nbytes // 2, cp.uint8)
            fns["copy"] = lambda s=src, d=dst: d.__setitem__(Ellipsis, s)  # reads and writes nbytes / 2: nbytes moved
            row = {"m": m, "H": H, "bits_equal": same, "us": {k: [] for k in fns}}
            for _ in range(args.rounds):
                for k, fn in fns.items():
                    row["us"][k].append(timed_us(fn))
            best = {k: min(v) for k, v in row["us"].items()}
            gbs = {k: nbytes / (t * 1e-6) / 1e9 for k, t in best.items()}
            print(f"M {m} H {H}: " + " | ".join(f"{k} {best[k]:.2f} us {gbs[k]:.0f} GB/s"
                                                 + ("" if k == "copy" else f" {100 * gbs[k] / gbs['copy']:.0f}%")
                                                 for k in fns) + f" | bits equal: {same}", flush=True)
            results.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps({"shapes": results}, indent=1))


if __name__ == "__main__":
    main()
