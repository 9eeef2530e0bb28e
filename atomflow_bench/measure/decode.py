"""Decode timing and `run`'s measurement (timing.py's helpers, one record).

* `time_decode`: the prompt (context) goes into the cache by the batched prefill (gpu/prefill.py; walked through the
  decode step where the prefill is not built), then every generated token is one graph replay; CUDA events between
  them (no host sync in between): the time to first token (prefill + the first step) and the TPOT samples of the
  steps after it, from all repeats -> median and spread. Eager mode (`graph=False`) launches the same kernels one by
  one from Python.
* `energy_passes` (`power.py`): after the timed repeats, passes of their own over the same graph replays (at least
  ENERGY_MIN_S of them) are the regions of an NVML meter: the stream is synchronised after each pass's prefill, the
  meter started, and stopped once the last token's event has completed. The timed repeats keep their own method (no
  synchronisation between prefill and decode), so the energy passes do not change how TPOT is measured.
* `benchmark`: the whole `run` on a run context (measure/context.py: one GPU, or a rank of a group), one record.
"""
from __future__ import annotations

import numpy as np

from ..gpu.nvrtc import instrument_defines
from ..gpu.prefill import prefill_flops
from ..store.tokenizer import load_tokenizer
from . import run_record
from .power import open_meter, other_gpu_processes, our_pids
from .timing import Marks, copy_bandwidth, summarize, tensor_core_tflops


def synthetic_prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def time_decode(engine, context: int, tokens: int, repeats: int, graph: bool = True, prompt=None) -> dict:
    """Per-token decode times (ms) after a `context`-token prompt, and each repeat's time to first token: events around
    `Engine.fill` (the batched prefill and its lm_head, or the prompt walked through the decode step), which ends with
    the first new token made; the `tokens` - 1 decode steps after it are the TPOT samples. Also returns the last
    repeat's tokens."""
    prompt = prompt if prompt is not None else synthetic_prompt(engine.cfg.vocab_size, context)
    if len(prompt) + tokens > engine.max_seq:
        raise ValueError(f"context {len(prompt)} + tokens {tokens} exceed max_seq {engine.max_seq}")
    if tokens < 2:
        raise ValueError("time_decode needs 2 tokens or more: the first is the TTFT's, the others the TPOT's")
    stream = engine.stream
    samples, per_repeat, ttft, ids = [], [], [], []
    for r in range(repeats + 1):  # the first pass is a warm-up (clocks, caches, graph capture and upload)
        engine.reset(prompt)
        first = Marks(1, stream)
        marks = Marks(tokens - 1, stream)
        with stream:
            first.mark()
            engine.fill(graph=graph)  # the prompt and the first new token
            first.mark()
            marks.mark()
            for _ in range(tokens - 1):
                engine.run(1, graph=graph)
                marks.mark()
        t = marks.intervals_ms()
        if r > 0:
            samples += t
            per_repeat.append(float(np.median(t)))
            ttft += first.intervals_ms()
        ids = engine.tokens(len(prompt) - 1, tokens)
    out = summarize(samples)
    out["repeat_medians"] = per_repeat
    per_token = np.median(np.reshape(samples, (repeats, tokens - 1)), axis=0) if repeats else np.zeros(0)
    return {"tpot_ms": out, "ttft_ms": summarize(ttft) if ttft else None, "token_ids": ids,
            "prompt_len": len(prompt), "per_token_ms": per_token.tolist()}


ENERGY_MIN_S = 2.0  # seconds of metered decode: the NVML energy counter moves in coarse steps


def energy_passes(engine, prompt, tokens: int, meter, min_s: float = ENERGY_MIN_S, passes: int | None = None) -> dict:
    """Joules per token of the graph replays: passes (prefill, synchronise, `tokens` replays) until at least `min_s`
    seconds of replays were metered, or exactly `passes` of them (tensor parallel: every rank makes the same number
    of replays); `meter.result()` (or its reason when NVML is unavailable)."""
    if meter.measures:
        spent_ms, stream, done = 0.0, engine.stream, 0
        while (spent_ms < min_s * 1e3) if passes is None else (done < passes):
            done += 1
            engine.start(prompt)
            stream.synchronize()  # the prefill done: the region holds the decode steps only
            meter.start()
            marks = Marks(tokens, stream)
            with stream:
                marks.mark()
                for _ in range(tokens):
                    engine.run(1)
                    marks.mark()
            t = marks.intervals_ms()  # waits for the last token's event
            meter.stop(tokens, event_ms=float(sum(t)))
            spent_ms += sum(t)
    return meter.result()


def by_bucket(engine, context: int, per_token_ms: list[float]) -> list[dict]:
    """Median per-token time of the timed tokens in each attention bucket (TPOT sample i is the step at length
    context + 1 + i: the first step, at length context, is the TTFT's), with the bucket's layer-GEMV form."""
    groups: dict = {}
    for i, t in enumerate(per_token_ms):
        L = context + 1 + i
        g = groups.setdefault(engine.bucket(L), {"attention": engine.bucket(L), "lengths": [L, L], "ms": []})
        g["lengths"][1] = L
        g["ms"].append(t)
    return [{"attention": "split" if g["attention"] is None else f"short <= {g['attention']}",
             "lengths": g["lengths"], "tokens": len(g["ms"]), "tpot_ms": float(np.median(g["ms"])),
             "gemv": engine.gemv_form_of(g["lengths"][0]).text}
            for g in groups.values()]


def prefill_figures(eng, context: int, ttft: dict, peak: dict) -> dict:
    """What the run record says of the prompt's processing: its path, prompt tokens/s over the TTFT, and the FLOPs
    done in the TTFT against the tensor-core roofline measured in the same run (of every GPU of the group)."""
    flops = prefill_flops(eng.cfg, context)
    tflops = flops / (ttft["median"] * 1e-3) / 1e12
    gpus = eng.group.size if eng.group is not None else 1
    pf = eng.prefiller() if eng.prefills else None
    return {"path": "batched" if pf else "walked", "prompt_tokens": context,
            "chunk": pf.chunk if pf else None, "weights_form": pf.weights_form if pf else None,
            "attention": ("wgmma" if pf.wgmma else "mma.sync") if pf else None,
            "tok_per_s": context / (ttft["median"] * 1e-3), "flops": flops, "tflops": tflops,
            "pct_of_peak": 100.0 * tflops / (peak["median"] * gpus)}


def benchmark(ctx, weights: str, context: int, tokens: int, repeats: int, eager_tokens: int = 32, progress=None,
              forms=None, retune: bool = False) -> dict:
    """The `run` measurement on the GPU(s) of run context `ctx`: the engine (forms given, saved or tuned now: the
    context resolves them), copy roofline, graph decode, energy, eager decode; returns the record. Under tensor
    parallel every rank runs this in lockstep and the context adds what the ranks agree on (gpu/tp/figures.py)."""
    eng = ctx.engine(weights, context + tokens, given=forms, retune=retune, progress=progress)
    others = other_gpu_processes(own=our_pids())  # looked at before and after the timings: either taints them
    copy = copy_bandwidth()
    peak = tensor_core_tflops()
    prompt = synthetic_prompt(eng.cfg.vocab_size, context)
    g = time_decode(eng, context, tokens, repeats, graph=True, prompt=prompt)
    meter = open_meter()  # the GPU CuPy runs on, by PCI bus id; Unavailable (a reason, no exception) without NVML
    try:
        energy = ctx.energy(eng, prompt, tokens, meter, g["tpot_ms"]["median"])
    finally:
        meter.close()
    n_e = min(eager_tokens, tokens)
    e = time_decode(eng, context, n_e, 1, graph=False, prompt=prompt)
    others = other_gpu_processes(own=our_pids(), seen=others)
    same = e["token_ids"] == g["token_ids"][:n_e]
    tpot = g["tpot_ms"]
    # bytes per token: all streamed weights + the K/V rows, averaged over the timed steps (lengths context + 1 ..
    # context + tokens - 1: each reads its length's rows and writes one)
    nbytes = eng.streamed_bytes(context + tokens / 2 + 1)
    bw = nbytes["total"] / (tpot["median"] * 1e-3) / 1e9
    floor_ms = nbytes["total"] / (copy["median"] * 1e9) * 1e3
    tok = load_tokenizer(eng.ckpt.dir) if eng.ckpt.dir is not None else None
    text = tok.decode(g["token_ids"]) if tok is not None else None
    rec = {
        "schema": run_record.SCHEMA, "tool": run_record.tool_info(), "created": run_record.now_iso(),
        "command": run_record.command_line(), "gpu": eng.gpu, "copy_bandwidth_gbs": copy,
        "model": {"name": ctx.model, "source": ctx.source, "params": eng.cfg.param_count(),
                  "config": eng.cfg.to_hf_dict()},
        "weights": weights, "context": context, "tokens": tokens, "repeats": repeats,
        "tpot_ms": tpot, "tok_per_s": 1e3 / tpot["median"],
        "ttft_ms": g["ttft_ms"], "prefill": prefill_figures(eng, context, g["ttft_ms"], peak),
        "tensor_core_tflops": peak,
        "attention_buckets": by_bucket(eng, context, g["per_token_ms"]),
        "forms": ctx.forms,
        "bytes_per_token": nbytes, "bandwidth_gbs": bw,
        "roofline": {"tpot_floor_ms": floor_ms, "pct": 100.0 * floor_ms / tpot["median"]},
        "vram_bytes": eng.vram(),
        "energy": energy,
        "other_gpu_processes": others,
        "eager": {"tpot_ms": e["tpot_ms"], "tokens": n_e, "graph_speedup": e["tpot_ms"]["median"] / tpot["median"],
                  "same_tokens": bool(same)},
        "generated": {"token_ids": g["token_ids"], "text": text},
        "load": {"seconds": ctx.load_seconds, **eng.load_info},
        "launches_per_step": len(eng.launches),
        "pdl": eng.pdl,
        "kernel_defines": list(eng.lib.defines),
        "compiled": eng.lib.compiled_files(),
        "instrument": instrument_defines(eng.lib.defines),  # non-empty: a timing bound with wrong outputs
    }
    rec.update(ctx.figures(eng, copy, tpot, nbytes, context))
    return rec
