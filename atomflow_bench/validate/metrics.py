"""How close the engine is to the truth: per-vector metrics, KL of logits, the bounds, and the per-probe verdict.

Pure NumPy in float64; nothing here knows where the vectors came from. docs/VALIDATION.md says why the bounds are
what they are.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import VerifyError


@dataclass(frozen=True)
class Thresholds:
    cos_min: float   # every probe: min cosine over the positions
    rel_max: float   # every probe: max ||engine - truth|| / ||truth|| over the positions
    kl_max: float    # KL(HF || engine) of the last position's logits, nats


# Same bounds for both formats: each is compared with a truth made from its own weight values, so the only
# legitimate differences are float32 accumulation order and the engine's fp16 activation buffers.
THRESHOLDS = {
    "fp16": Thresholds(cos_min=0.999, rel_max=0.05, kl_max=1e-3),
    "fp8": Thresholds(cos_min=0.999, rel_max=0.05, kl_max=1e-3),
}
# fp8 against fp16 on real text: what the format may cost (real weights only).
QUALITY_BOUNDS = {"top1_min": 0.90, "mean_kl_max": 0.05, "ppl_ratio_max": 1.10}
PROBE_RULE = ("a probe PASSes when its min cosine >= cos_min and its max rel L2 <= rel_max over all positions; "
              "KL(HF || engine) of the last position's logits <= kl_max; the prefill path (GPU) by the same rule, "
              "each probe over the positions where it computes it; exit 0 only if all pass")


def probe_metrics(engine: np.ndarray, truth: np.ndarray) -> tuple[float, float, float]:
    """(cosine, relative L2 = ||e - t|| / ||t||, max |e - t|) in float64. A non-finite engine vector scores
    cosine -1 and rel L2 inf, so a NaN can never pass."""
    e = np.asarray(engine, np.float64).ravel()
    t = np.asarray(truth, np.float64).ravel()
    if e.shape != t.shape:
        raise VerifyError(f"probe sizes differ: engine {e.size}, truth {t.size}")
    ne, nt = np.linalg.norm(e), np.linalg.norm(t)
    d = e - t
    cos = float(e @ t / (ne * nt)) if ne > 0 and nt > 0 else (1.0 if ne == nt else 0.0)
    rel = float(np.linalg.norm(d) / nt) if nt > 0 else (0.0 if not d.any() else math.inf)
    if not np.isfinite(e).all():
        cos, rel = -1.0, math.inf
    return cos, rel, float(np.abs(d).max()) if d.size else 0.0


def log_softmax64(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, np.float64)
    z = z - z.max()
    return z - math.log(np.exp(z).sum())


def kl_div(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """KL(softmax(p) || softmax(q)) in nats, float64."""
    lp, lq = log_softmax64(p_logits), log_softmax64(q_logits)
    return float(np.sum(np.exp(lp) * (lp - lq)))


def worst_positions(positions: list[dict[str, np.ndarray]], truth, variant: str,
                    names: list[str]) -> tuple[dict[str, dict], list[float]]:
    """Per probe the worst position ({cos, rel_l2, max_abs, worst_pos, positions}: positions counts those that have
    the probe), and KL(truth || engine) of the logits per position that has them. A position may lack probes (the
    prefill computes no logits before the last prompt token): each probe is judged where the engine computed it,
    and a probe no position has is left out. `truth.get(variant, position, probe)` gives the truth's vector
    (validate.truth.Truth)."""
    worst: dict[str, dict] = {}
    key: dict[str, tuple] = {}  # (cos, -rel) of each probe's worst position so far
    kls = []
    for s, probes in enumerate(positions):
        for n in names:
            if n not in probes:
                continue
            c, r, a = probe_metrics(probes[n], truth.get(variant, s, n))
            w = worst.setdefault(n, {"cos": 1.0, "rel_l2": 0.0, "max_abs": 0.0, "worst_pos": s, "positions": 0})
            if (c, -r) < key.get(n, (2.0, 0.0)):
                key[n], w["worst_pos"] = (c, -r), s
            w["cos"], w["rel_l2"], w["max_abs"] = min(w["cos"], c), max(w["rel_l2"], r), max(w["max_abs"], a)
            w["positions"] += 1
        if "logits" in probes:
            kls.append(kl_div(truth.get(variant, s, "logits"), probes["logits"]))
    return {n: worst[n] for n in names if n in worst}, kls


def judge_probes(worst: dict[str, dict], names: list[str], th: Thresholds) -> list[dict]:
    """The probe rows of the result record, in decode order, each with its PASS/FAIL under `th`; the names `worst`
    lacks (no position computed them) get no row."""
    return [{"name": n, **worst[n], "pass": bool(worst[n]["cos"] >= th.cos_min and worst[n]["rel_l2"] <= th.rel_max)}
            for n in names if n in worst]


def text_metrics(logits: dict[str, np.ndarray], ids: list[int]) -> dict:
    """fp8 against fp16 over a teacher-forced text: `logits[fmt]` [len(ids) - 1, vocab] predicts ids[1:].

    Per format the perplexity (exp mean NLL) and how often the argmax is the next token; between them the top-1
    agreement, KL(fp16 || fp8) per token (mean and max), the perplexity ratio and the checks against QUALITY_BOUNDS.
    """
    nxt = np.asarray(ids[1:])
    out: dict = {}
    logp = {}
    for fmt in ("fp16", "fp8"):
        z = logits[fmt]
        lp = np.stack([log_softmax64(row) for row in z])
        logp[fmt] = lp
        nll = -lp[np.arange(len(nxt)), nxt]
        out[fmt] = {"perplexity": float(math.exp(nll.mean())),
                    "top1_next_token": float(np.mean(np.argmax(z, axis=1) == nxt))}
    kl = np.sum(np.exp(logp["fp16"]) * (logp["fp16"] - logp["fp8"]), axis=1)
    top1 = float(np.mean(np.argmax(logits["fp8"], axis=1) == np.argmax(logits["fp16"], axis=1)))
    ratio = out["fp8"]["perplexity"] / out["fp16"]["perplexity"]
    b = QUALITY_BOUNDS
    return {
        "fp16": out["fp16"], "fp8": out["fp8"],
        "top1_agreement": top1,
        "mean_kl_fp16_fp8": float(kl.mean()), "max_kl_fp16_fp8": float(kl.max()),
        "ppl_ratio": ratio,
        "bounds": b,
        "checks": {"top1_agreement": top1 >= b["top1_min"], "mean_kl": float(kl.mean()) <= b["mean_kl_max"],
                   "ppl_ratio": ratio <= b["ppl_ratio_max"]},
    }
