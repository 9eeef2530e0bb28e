"""Live peers: HF transformers decode on the same weights and shape, in the same process as our engine.

Modes (per-token decode after a `context`-token synthetic prompt, greedy, batch 1):

* `eager`    — `model(...)` with a `DynamicCache`, as most HF users run it;
* `static`   — a `StaticCache` without compilation (isolates the cache's own effect);
* `compiled` — HF's "static cache + torch.compile" recipe: `StaticCache`, prefill uncompiled, then
  `torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)` (CUDA graphs) for the decode steps,
  with a few untimed warm-up steps to trigger compilation and graph capture.

All modes run with PyTorch's flash, memory-efficient and math SDPA backends, not cuDNN's: with a KV length
that grows every step, cuDNN attention builds a new execution plan per step (about 5 ms of host time per
layer on an H100 with torch 2.11, never amortised over repeats), which would time plan building, not decode.

Every mode runs one untimed repeat first, then `repeats` timed ones. On CUDA each step is bracketed by CUDA
events with no host synchronisation in between (the argmax stays on the GPU); on the CPU (`device="cpu"`,
a smoke test, not a performance figure) by `time.perf_counter`. Bytes per token are counted as `run` counts
ours: all weights at 2 bytes + the fp16 K/V rows of the mean context (HF's static cache reads its whole
allocated length, masked; those extra bytes are not counted).

Energy (power.py, on CUDA only): after the timed repeats, untimed passes of the same decode (at least
ENERGY_MIN_S of steps) are the regions of an NVML meter on torch's current GPU, found by PCI bus id; the device is
synchronised before the meter starts and the last step's event completed before it stops (the timed repeats have no
such synchronisation). Each mode's record gets
`energy` (or `{"unavailable": reason}`); the peers table does not show it.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..errors import AtomflowError, GpuUnavailable
from ..hf import cache_keyword, dtype_keyword
from ..output import Tab, num
from ..progress import progress
from .baselines import spec_bandwidth
from .decode import ENERGY_MIN_S, synthetic_prompt
from .power import Unavailable, open_meter
from .timing import summarize

MODES = ("eager", "static", "compiled")
SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")  # cuDNN left out: see the module docstring
DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
HINT = "HF peers need torch and transformers: pip install 'atomflow-bench[truth]'"


def require_torch(device: str):
    try:
        import torch  # optional extra: imported where it is used
        import transformers  # optional extra: imported where it is used
    except ImportError:
        raise AtomflowError(HINT) from None
    if device == "cuda" and not torch.cuda.is_available():
        raise GpuUnavailable("torch sees no CUDA device (torch.cuda.is_available() is False); "
                             "use --device cpu for a smoke test")
    return torch, transformers


class _Timer:
    """Per-step times (ms): CUDA events on the current stream, or perf_counter on the CPU."""

    def __init__(self, torch, device: str, steps: int):
        self.torch, self.cuda = torch, device == "cuda"
        self.marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)] if self.cuda else []
        self.t = []

    def mark(self) -> None:
        if self.cuda:
            self.marks[len(self.t)].record()
            self.t.append(None)
        else:
            self.t.append(time.perf_counter())

    def times_ms(self) -> list[float]:
        if self.cuda:
            self.marks[len(self.t) - 1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:len(self.t)])]
        return [(b - a) * 1e3 for a, b in zip(self.t, self.t[1:])]


def _decode(torch, model, cache, prompt, tokens: int, device: str, step=None,
            meter=None) -> tuple[list[float], list[int]]:
    """Prefill `prompt` (uncompiled) into `cache`, then `tokens` timed greedy steps through `step` (default:
    the eager forward); returns (per-step ms, the tokens+1 generated ids, the prefill's first). A static cache
    is reset and reused, so the compiled step keeps its graph (its tensors have fixed addresses). `meter`
    (power.EnergyMeter, CUDA): started after the prefill (device synchronised), stopped after the last step."""
    cache.reset()
    kw = cache_keyword(model)
    out = model(input_ids=torch.tensor([prompt], device=device), **{kw: cache}, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    pos = torch.full((1, 1), len(prompt), dtype=torch.long, device=device)
    step = step or model.forward
    timer, gen = _Timer(torch, device, tokens), [nxt]
    metered = meter is not None and meter.measures and device == "cuda"
    if metered:
        torch.cuda.synchronize()
        meter.start()
    timer.mark()
    for _ in range(tokens):
        torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs may be overwritten
        logits = step(input_ids=nxt, position_ids=pos, **{kw: cache}, use_cache=True).logits
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        pos = pos + 1
        gen.append(nxt)
        timer.mark()
    ms = timer.times_ms()  # waits for the last step's event
    if metered:
        meter.stop(tokens, event_ms=float(sum(ms)))
    return ms, [int(t) for t in torch.cat(gen).view(-1).tolist()]


def _meter(torch, device: str):
    """An energy meter on torch's current GPU (by PCI bus id), or an Unavailable one saying why."""
    if device != "cuda":
        return Unavailable(f"device {device}: no GPU power to read")
    try:
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        bus = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    except Exception as e:  # noqa: BLE001 — an older torch without the PCI fields
        return Unavailable(f"torch does not tell its GPU's PCI bus id ({type(e).__name__}: {e})")
    return open_meter(bus)


def measure_peers(model_dir, context: int = 128, tokens: int = 64, modes=("eager", "compiled"),
                  weights: str = "fp16", device: str = "cuda", repeats: int = 3, warmup_steps: int = 3) -> list[dict]:
    """One record per mode: engine, gpu, precision, context, tokens, tpot_ms{...}, tok/s, bytes, bandwidth."""
    torch, transformers = require_torch(device)
    from torch.nn.attention import SDPBackend, sdpa_kernel  # optional extra: imported where it is used
    from transformers import DynamicCache, LlamaForCausalLM, StaticCache  # optional extra: imported where it is used

    unknown = [m for m in modes if m not in MODES]
    if unknown or weights not in DTYPES:
        raise AtomflowError(f"peers: unknown mode {unknown[0]!r} (known: {', '.join(MODES)})" if unknown
                            else f"peers: unknown weights {weights!r} (known: {', '.join(DTYPES)})")
    if device == "cuda" and "cupy" in sys.modules:  # our engine ran first in this process: give its cached blocks back
        sys.modules["cupy"].get_default_memory_pool().free_all_blocks()
    cfg = ModelConfig.from_file(Path(model_dir) / "config.json")
    dtype = {dtype_keyword(transformers): getattr(torch, DTYPES[weights])}
    model = LlamaForCausalLM.from_pretrained(model_dir, **dtype, attn_implementation="sdpa").to(device).eval()
    prompt = synthetic_prompt(cfg.vocab_size, context)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    nbytes = {"weights": cfg.weight_bytes("fp16"),
              "kv": int(round((context + (tokens - 1) / 2 + 1) * cfg.kv_bytes_per_token()))}
    nbytes["total"] = nbytes["weights"] + nbytes["kv"]
    records, reference_ids = [], None
    with torch.inference_mode(), sdpa_kernel([getattr(SDPBackend, b) for b in SDPA_BACKENDS]):
        for mode in modes:
            step = None
            cache = (DynamicCache(config=model.config) if mode == "eager" else
                     StaticCache(config=model.config, max_cache_len=context + max(tokens, warmup_steps)))
            if mode == "compiled":
                step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
                with progress(f"torch.compile of HF's decode step ({device})"):  # half a minute on a 1B model
                    _decode(torch, model, cache, prompt, warmup_steps, device, step)  # compile + capture
            samples, per_repeat, ids = [], [], []
            for r in range(repeats + 1):  # the first repeat is a warm-up
                ms, ids = _decode(torch, model, cache, prompt, tokens, device, step)
                if r:
                    samples += ms
                    per_repeat.append(float(np.median(ms)))
            meter = _meter(torch, device)  # energy: passes of their own after the timed ones (their timing untouched)
            try:
                if meter.measures:
                    spent = 0.0
                    while spent < ENERGY_MIN_S * 1e3:
                        spent += sum(_decode(torch, model, cache, prompt, tokens, device, step, meter)[0])
                energy = meter.result()
            finally:
                meter.close()
            tpot = {**summarize(samples), "repeat_medians": per_repeat}
            reference_ids = reference_ids or ids
            records.append({
                "engine": f"HF transformers {transformers.__version__} {mode} {weights}", "mode": mode,
                "framework": {"torch": torch.__version__, "transformers": transformers.__version__},
                "sdpa_backends": list(SDPA_BACKENDS),
                "gpu": gpu, "device": device, "precision": weights, "context": context, "tokens": tokens,
                "repeats": repeats, "tpot_ms": tpot, "tok_per_s": 1e3 / tpot["median"], "bytes_per_token": nbytes,
                "bandwidth_gbs": nbytes["total"] / (tpot["median"] * 1e-3) / 1e9,
                "same_tokens_as_first_mode": ids == reference_ids, "token_ids": ids[:16], "energy": energy})
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return records


def peers_table(records: list[dict]):
    """The peers as an output.Tab."""
    cols = ["engine", "device", "ctx", "tokens", "TPOT median ms", "p10 ms", "p90 ms", "tok/s", "GB/s",
            "% of spec GB/s", "same tokens"]
    t = Tab("HF transformers peers (same weights, same shape, this process)", cols, key="peers",
            right=tuple(cols[2:]))
    for r in records:
        tp, spec = r["tpot_ms"], spec_bandwidth(r["gpu"])
        t.add(r["engine"], r["gpu"], num(r["context"]), num(r["tokens"]), num(tp["median"], ".3f"),
              num(tp["p10"], ".3f"), num(tp["p90"], ".3f"), num(r["tok_per_s"], ".1f"), num(r["bandwidth_gbs"], ".0f"),
              num(100 * r["bandwidth_gbs"] / spec if spec else None, ".0f", "%", none="n/a"),
              str(r["same_tokens_as_first_mode"]))
    return t
