"""Recorded-style `atomflow-bench/run/1` results records for the CPU tests (compare, baselines)."""
from __future__ import annotations

import numpy as np

from atomflow_bench.measure import run_record as report
from atomflow_bench.measure.timing import summarize

H100 = "NVIDIA H100 80GB HBM3"


def make_run(tpot_ms: float, jitter: float = 0.01, seed: int = 0, gpu: str = H100, model: str = "llama-3.2-3b",
             weights: str = "fp8", context: int = 128, tokens: int = 256, copy_gbs: float = 3000.0) -> dict:
    """A schema-valid `atomflow-bench/run/1` record whose per-token TPOT samples scatter `jitter` around `tpot_ms`."""
    rng = np.random.default_rng(seed)
    repeats = 5
    samples = tpot_ms * (1 + jitter * rng.standard_normal(tokens * repeats))
    tp = summarize(samples)
    tp["repeat_medians"] = [float(np.median(c)) for c in np.split(samples, repeats)]
    nbytes = {"weights": 3_695_007_744, "kv": 30_000_000}
    nbytes["total"] = nbytes["weights"] + nbytes["kv"]
    floor_ms = nbytes["total"] / (copy_gbs * 1e9) * 1e3
    return {
        "schema": report.SCHEMA, "tool": {"name": "atomflow-bench", "version": "0.1.0", "git_commit": None,
                                          "python": "3.11"},
        "created": "2026-01-01T00:00:00Z", "command": "atomflow-bench run",
        "gpu": {"name": gpu, "cc": "9.0", "sms": 132, "l2_bytes": 52428800, "memory_bytes": 85_000_000_000,
                "cuda_driver": "13.0", "cuda_runtime": "13.0", "cupy": "14.0"},
        "copy_bandwidth_gbs": {"median": copy_gbs, "p10": copy_gbs * 0.99, "p90": copy_gbs * 1.01,
                               "bytes": 1 << 30, "reps": 30},
        "model": {"name": model, "source": "synthetic", "params": 3_212_749_824, "config": {}},
        "weights": weights, "context": context, "tokens": tokens, "repeats": repeats,
        "tpot_ms": tp, "tok_per_s": 1e3 / tp["median"], "bytes_per_token": nbytes,
        "bandwidth_gbs": nbytes["total"] / (tp["median"] * 1e-3) / 1e9,
        "roofline": {"tpot_floor_ms": floor_ms, "pct": 100 * floor_ms / tp["median"]},
    }


def with_prefill(rec: dict, ttft_ms: float, jitter: float = 0.01, path: str = "batched",
                 tensor_core_tflops: float | None = 700.0) -> dict:
    """`rec` with the prefill's optional fields (`ttft_ms`, `prefill`, `tensor_core_tflops`) as `run` writes them:
    a TTFT spread of +-`jitter` around `ttft_ms`, the prompt of `context` tokens, 2 x params FLOPs per token."""
    n = rec["context"]
    rec["ttft_ms"] = {"median": ttft_ms, "p10": ttft_ms * (1 - jitter), "p90": ttft_ms * (1 + jitter),
                      "mean": ttft_ms, "min": ttft_ms * (1 - 2 * jitter), "max": ttft_ms * (1 + 2 * jitter),
                      "n": rec.get("repeats", 5)}
    flops = 2.0 * rec["model"]["params"] * n
    tflops = flops / (ttft_ms * 1e-3) / 1e12
    rec["prefill"] = {"path": path, "prompt_tokens": n, "chunk": 512 if path == "batched" else None,
                      "tok_per_s": n / (ttft_ms * 1e-3), "flops": flops, "tflops": tflops, "pct_of_peak": None}
    if tensor_core_tflops is not None:
        tc = tensor_core_tflops
        rec["tensor_core_tflops"] = {"median": tc, "p10": tc * 0.99, "p90": tc * 1.01, "mean": tc, "min": tc * 0.98,
                                     "max": tc * 1.02, "n": 10, "shape": [8192, 8192, 8192], "dtype": "fp16"}
        rec["prefill"]["pct_of_peak"] = 100 * tflops / tc
    return rec
