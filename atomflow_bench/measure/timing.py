"""Timing on the GPU, one way everywhere: CUDA events between the pieces of work, warm-up first, many repeats,
median and spread (`summarize`). Used by `run` (bench), `profile`, `gemv`, `tune` and the HF peers.

* `Marks`: events recorded on a stream between steps; the intervals in ms (CuPy's events, torch's for the peers,
  or perf_counter on the CPU).
* `copy_bandwidth`: device-to-device cudaMemcpy of a buffer far larger than L2; bytes counted read + write. This is
  the roofline every figure is divided by, measured on the same GPU in the same run.
* `queued_event_us`: an event pair around each launch, all queued behind a spin kernel, so no host submission time
  falls inside a pair (isolated kernel times).
* `graph_replay_us`: µs per replay of launches captured as one CUDA graph.
* `fastest`: candidates timed in interleaved rounds, each keeping its best round.
"""
from __future__ import annotations

import time

import numpy as np

from ..errors import AtomflowError
from ..gpu.graph import StepGraph
from ..gpu.ops.small import spin_launch


def summarize(samples_ms) -> dict:
    a = np.asarray(samples_ms, dtype=np.float64)
    return {"median": float(np.median(a)), "p10": float(np.percentile(a, 10)), "p90": float(np.percentile(a, 90)),
            "mean": float(a.mean()), "min": float(a.min()), "max": float(a.max()), "n": int(a.size)}


class Marks:
    """Up to `n` + 1 marks between steps: `mark()` after each (and once before the first); `intervals_ms()` waits
    for the last and returns the n step times. CUDA events on `stream` (CuPy), torch's events on its current stream
    (`torch=`), or perf_counter (`cpu=True`)."""

    def __init__(self, n: int, stream=None, torch=None, cpu: bool = False):
        self.stream, self.cpu, self.t = stream, cpu, []
        if cpu:
            self.events = []
        elif torch is not None:
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        else:
            import cupy as cp  # optional extra: imported where it is used

            self.events = [cp.cuda.Event() for _ in range(n + 1)]
        self._torch = torch

    def mark(self) -> None:
        if self.cpu:
            self.t.append(time.perf_counter())
            return
        ev = self.events[len(self.t)]
        if self._torch is not None:
            ev.record()
        else:
            ev.record(self.stream)
        self.t.append(ev)

    def intervals_ms(self) -> list[float]:
        if self.cpu:
            return [(b - a) * 1e3 for a, b in zip(self.t, self.t[1:])]
        self.t[-1].synchronize()
        if self._torch is not None:
            return [a.elapsed_time(b) for a, b in zip(self.t, self.t[1:])]
        import cupy as cp  # optional extra: imported where it is used

        return [cp.cuda.get_elapsed_time(a, b) for a, b in zip(self.t, self.t[1:])]


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 30, warmup: int = 5) -> dict:
    """GB/s of a D2D copy (2 * nbytes moved per copy), events around each copy."""
    import cupy as cp  # optional extra: imported where it is used

    src = cp.empty(nbytes, dtype=cp.uint8)
    dst = cp.empty(nbytes, dtype=cp.uint8)
    src.fill(1)
    stream = cp.cuda.Stream(non_blocking=True)
    ms = []
    with stream:
        for i in range(warmup + reps):
            m = Marks(1, stream)
            m.mark()
            cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, cp.cuda.runtime.memcpyDeviceToDevice,
                                        stream.ptr)
            m.mark()
            if i >= warmup:
                ms += m.intervals_ms()
    del src, dst
    s = summarize(ms)
    gbs = {k: 2 * nbytes / (s[k] * 1e-3) / 1e9 for k in ("median", "p10", "p90")}
    # p10 of time is p90 of bandwidth: keep names meaning "bandwidth percentile"
    return {"median": gbs["median"], "p10": gbs["p90"], "p90": gbs["p10"], "bytes": nbytes, "reps": reps}


PEAK_GEMM = 8192  # M = N = K of the tensor-core roofline's GEMM: 1.1 TFLOP a call, large enough that cuBLAS runs
# its best tile at full occupancy on every GPU we target (a 4096-cube reaches ~10% less on an H100)


def tensor_core_tflops(size: int = PEAK_GEMM, reps: int = 20, warmup: int = 5) -> dict:
    """TFLOPS of a cuBLAS fp16 GEMM (fp32 accumulation, fp16 output) of size^3 on random inputs, events around each
    call: the compute roofline a prefill is divided by, as copy_bandwidth is the memory one."""
    import cupy as cp  # optional extra: imported where it is used

    from ..gpu.ops.prefill_rows import Gemm  # imports CuPy: where it is used

    rng = cp.random.default_rng(0)
    x = rng.standard_normal((size, size), dtype=cp.float32).astype(cp.float16)
    w = rng.standard_normal((size, size), dtype=cp.float32).astype(cp.float16)
    y = cp.empty((size, size), dtype=cp.float16)
    gemm, stream = Gemm(), cp.cuda.Stream(non_blocking=True)
    ms = []
    with stream:
        for i in range(warmup + reps):
            m = Marks(1, stream)
            m.mark()
            gemm(x, w, y, size)
            m.mark()
            if i >= warmup:
                ms += m.intervals_ms()
    del x, w, y
    s = summarize(ms)
    tf = {k: 2.0 * size ** 3 / (s[k] * 1e-3) / 1e12 for k in ("median", "p10", "p90", "mean", "min", "max")}
    # as in copy_bandwidth: p10 / p90 (min / max) name the throughput's, the time's p90 / p10 (max / min)
    return {"median": tf["median"], "p10": tf["p90"], "p90": tf["p10"], "mean": tf["mean"], "min": tf["max"],
            "max": tf["min"], "n": s["n"], "shape": [size, size, size], "dtype": "fp16"}


QUEUE_BATCH = 64  # calls queued behind one spin: (event, launch, event) x 64 stays well inside a stream's queue


def queued_event_us(lib, calls, stream, per_call_ns: int = 100_000) -> list[float]:
    """µs between an event pair around each of `calls` (callables that queue GPU work on the current stream), queued
    on `stream` in batches of QUEUE_BATCH behind kernels_cu/spin.cu, so no host submission time falls inside a
    pair: each figure is the work's own time on the GPU, its launch latency included. (Batches: past ~1000 pending
    operations the host blocks in the launch until the GPU drains, i.e. until the spin ends.) When the host took
    longer to queue a batch than its spin lasted, the batch is thrown away and taken again with a longer spin."""
    out = []
    for i in range(0, len(calls), QUEUE_BATCH):
        out += _queued_batch(lib, calls[i:i + QUEUE_BATCH], stream, per_call_ns)
    return out


def _queued_batch(lib, calls, stream, per_call_ns: int) -> list[float]:
    import cupy as cp  # optional extra: imported where it is used

    for attempt in range(3):
        budget_ns = 200_000 + len(calls) * per_call_ns * 4 ** attempt
        ev = [(cp.cuda.Event(), cp.cuda.Event()) for _ in calls]
        spin = spin_launch(lib, budget_ns)  # compiled (first use) before the clock starts
        with stream as s:
            t0 = time.perf_counter()
            spin()
            for (a, b), call in zip(ev, calls):
                a.record(s)
                call()
                b.record(s)
            queued_ns = (time.perf_counter() - t0) * 1e9
        stream.synchronize()
        if queued_ns < budget_ns:
            return [cp.cuda.get_elapsed_time(a, b) * 1e3 for a, b in ev]
    raise AtomflowError(f"timing: the host needed {queued_ns / 1e6:.1f} ms to queue {len(calls)} launches, longer "
                        f"than the {budget_ns / 1e6:.1f} ms spin in front of them")


def replay_us(graph, stream, replays: int, warmup: int = 2) -> list[float]:
    """µs of each of `replays` back-to-back replays of a captured graph, after `warmup` replays."""
    m = Marks(replays + warmup, stream)
    with stream:
        m.mark()
        for _ in range(replays + warmup):
            graph.replay(1)
            m.mark()
    return [t * 1e3 for t in m.intervals_ms()[warmup:]]


def graph_replay_us(launches, stream, replays: int = 30) -> dict:
    """µs per replay of `launches` captured as one CUDA graph (2 warm-up replays)."""
    return summarize(replay_us(StepGraph(launches, stream), stream, replays))


def fastest(time_once, candidates: list, rounds: int = 3) -> tuple:
    """(the fastest candidate, {candidate: its best time}): every candidate is timed once per round, the rounds
    interleaved so that a clock ramp or drift during the measurement reaches all of them alike, and each keeps
    its best round (8B fp16's attention forms differ by ~1.5%, less than what timing them one after the other
    once could tell). Ties: the earlier candidate."""
    if not candidates or rounds < 1:
        raise AtomflowError("fastest: nothing to time")
    best = {c: float("inf") for c in candidates}
    for _ in range(rounds):
        for c in candidates:
            best[c] = min(best[c], float(time_once(c)))
    return min(candidates, key=best.get), best
