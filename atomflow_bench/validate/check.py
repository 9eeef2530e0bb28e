"""The two checks of `atomflow-bench validate`: the engine against the ground truth, probe by probe (`validate`), and
fp8 against fp16 on real text (`quality`). Each returns its record; validate.report prints it."""
from __future__ import annotations

import hashlib
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .. import schemas
from ..errors import ConfigError, VerifyError
from ..gpu.nvrtc import instrument_defines
from ..measure.run_record import now_iso, tool_info
from ..store.checkpoint import Checkpoint
from ..store.tokenizer import load_tokenizer
from .metrics import PROBE_RULE, THRESHOLDS, judge_probes, text_metrics, worst_positions
from .probes import backend_info, engine_logits, engine_probes, pick_backend, probe_names
from .truth import config_sha256, find_or_make_truth, model_name, model_source, weights_sha256

RESULT_SCHEMA = schemas.current("validate")
QUALITY_SCHEMA = schemas.current("quality")
PARAGRAPH = Path(__file__).resolve().parents[1] / "data" / "english_paragraph.txt"


def prepare_truth(model_dir: str | Path, truth_dir=None, steps: int | None = None, prompt: str | None = None,
                  console=None) -> Path:
    """The ground truth `validate` will use, made now if missing (a tensor-parallel launch makes it once, before its
    ranks start)."""
    model_dir = Path(model_dir)
    cfg = Checkpoint(model_dir).config
    return find_or_make_truth(model_dir, cfg.vocab_size, weights_sha256(model_dir), truth_dir, steps, prompt,
                              console).dir


def judge_path(positions: list[dict], truth, weights: str, names: list[str], prompt_len: int) -> tuple[list, dict]:
    """One path's probe rows and summary (`validate`'s record): each probe judged over the positions that have it,
    greedy agreement and KL over the positions from the last prompt token on."""
    th = THRESHOLDS[weights]
    worst, kls = worst_positions(positions, truth, weights, names)
    own = [int(np.argmax(positions[s]["logits"])) for s in range(prompt_len - 1, len(positions))]
    probes = judge_probes(worst, names, th)
    n_pass = sum(p["pass"] for p in probes)
    kl_ok = kls[-1] <= th.kl_max
    return probes, {
        "probes_pass": n_pass, "probes_total": len(probes),
        "first_fail": next((p["name"] for p in probes if not p["pass"]), None),
        "greedy_agree": sum(a == b for a, b in zip(own, truth.predicted(weights))), "greedy_total": len(own),
        "engine_ids": own, "kl_last": kls[-1], "kl_max_over_positions": max(kls), "kl_pass": bool(kl_ok),
        "min_cos": min(p["cos"] for p in probes), "max_rel_l2": max(p["rel_l2"] for p in probes),
        "pass": bool(n_pass == len(probes) and kl_ok),
    }


def prefill_section(pre: dict, truth, weights: str, names: list[str], prompt_len: int) -> dict:
    """The record's "prefill": the batched prefill's probes at its positions (the prompt's, and its lm_head's at
    the last; tensor parallel: 0 .. P-2) and the decode steps from its cache after them (probes.prefill_probes),
    judged as the decode path is."""
    probes, summary = judge_path(pre["positions"], truth, weights, names, prompt_len)
    return {"chunk": pre["chunk"], "prompt_tokens": prompt_len, "batched_positions": pre["batched"],
            "decode_positions": len(pre["positions"]) - pre["batched"],
            "not_computed": f"final_norm and logits at positions 0..{prompt_len - 2}: the lm_head runs on the last "
                            "prompt token only",
            "probes": probes, "summary": summary}


def validate(model_dir: str | Path, weights: str = "fp8", truth_dir: str | Path | None = None,
             steps: int | None = None, prompt: str | None = None, backend: str = "auto",
             allow_mismatch: bool = False, console=None, forms=None, context=None,
             prefill_chunk: int | None = None) -> dict:
    """Compare the engine's probes with the ground truth, on the decode path and (GPU, one GPU) the prefill path;
    returns the result record (schema validate/1). `forms`: the launch forms to check (gpu/forms.py; default: a saved
    tune, else the defaults). `context`: the run context the engine is made in (one GPU by default, or a
    tensor-parallel rank's; probes.engine_probes). `prefill_chunk`: the prefill's tokens per chunk (default the
    product's; a small one crosses chunk boundaries on a short prompt)."""
    if weights not in THRESHOLDS:
        raise ConfigError(f"unknown weight format {weights!r} (expected fp16 or fp8)")
    inst = instrument_defines()
    if inst:
        raise ConfigError(f"ATOMFLOW_KERNEL_DEFINES sets the timing instrument {' '.join(inst)}, which makes the "
                          "kernels wrong on purpose; unset it to validate")
    model_dir = Path(model_dir)
    cfg = Checkpoint(model_dir).config
    whash = weights_sha256(model_dir)
    truth = find_or_make_truth(model_dir, cfg.vocab_size, whash, truth_dir, steps, prompt, console)
    m = truth.manifest
    notes = []
    if m["weights_sha256"] != whash:
        msg = (f"the ground truth in {truth.dir} was made from other weights (sha256 {m['weights_sha256'][:12]}…, "
               f"this model {whash[:12]}…)")
        if not allow_mismatch:
            raise VerifyError(msg + "; regenerate it for this model, or pass --allow-mismatch to compare anyway")
        notes.append(msg + " — compared anyway (--allow-mismatch)")
    if m.get("config_sha256") and m["config_sha256"] != config_sha256(model_dir):
        notes.append("config.json differs from the one the ground truth was made with")
    if m["num_hidden_layers"] != cfg.num_hidden_layers:
        raise VerifyError(f"the ground truth has {m['num_hidden_layers']} layers, the model {cfg.num_hidden_layers}")
    if weights not in truth.variants:
        raise ConfigError(f"{truth.dir}: the ground truth has no {weights} variant (it has "
                          f"{', '.join(truth.variants)}); point --truth at an empty directory and validate makes "
                          "both")
    if console is not None:
        for n in notes:
            console.print(f"[yellow]note: {n}[/yellow]")

    names = probe_names(cfg.num_hidden_layers)
    seq, P, N = truth.sequence, len(m["prompt_ids"]), int(m["steps"])
    n_pos = P + N - 1  # the last new token is predicted, never fed
    info, positions, pre = engine_probes(model_dir, weights, seq, n_pos, names, backend, forms, context,
                                         prompt_len=P, prefill_chunk=prefill_chunk)
    if console is not None:
        console.print(f"engine: {info['label']}")
    th = THRESHOLDS[weights]
    probes, summary = judge_path(positions, truth, weights, names, P)
    own = summary["engine_ids"]
    prefill = None
    if "skipped" in pre:
        notes.append(f"the prefill path is not checked: {pre['skipped']}")
    else:
        prefill = prefill_section(pre, truth, weights, names, P)
        summary["pass"] = summary["pass"] and prefill["summary"]["pass"]

    drift = None
    if weights != "fp16" and "fp16" in truth.variants:
        # not gated: how far the quantized model itself is from the unquantized one (see also --quality)
        dw, dkl = worst_positions(positions, truth, "fp16", names)
        hidden = min((dw[n] for n in names[:-1]), key=lambda w: w["cos"])
        drift = {"against": "fp16 variant (unquantized weights)",
                 "hidden_min_cos": hidden["cos"], "hidden_max_rel_l2": max(dw[n]["rel_l2"] for n in names[:-1]),
                 "logits_min_cos": dw["logits"]["cos"], "logits_max_rel_l2": dw["logits"]["rel_l2"],
                 "kl_last": dkl[-1], "kl_mean": float(np.mean(dkl)), "kl_max": max(dkl),
                 "greedy_agree": sum(a == b for a, b in zip(own, seq[P:])), "greedy_total": N,
                 "probes": {n: dw[n] for n in names}}
    return {
        "schema": RESULT_SCHEMA,
        "created": now_iso(),
        "tool": tool_info(),
        "model": {"name": model_name(model_dir), "dir": str(model_dir), "source": model_source(model_dir),
                  "weights_sha256": whash, "layers": cfg.num_hidden_layers, "params": cfg.param_count()},
        "weights": weights,
        "backend": info,
        "truth": {"dir": str(truth.dir), "variant": weights, "variant_weights": m["variants"][weights]["weights"],
                  **{k: m.get(k) for k in ("weights_sha256", "prompt", "prompt_ids", "generated_ids", "steps",
                                           "positions", "device", "torch", "transformers", "created")}},
        "notes": notes,
        "thresholds": {"format": weights, **asdict(th), "rule": PROBE_RULE},
        "probes": probes,
        "summary": summary,
        "drift": drift,
        "prefill": prefill,
    }


def quality(model_dir: str | Path, backend: str = "auto", text: str | None = None, console=None) -> dict:
    """fp8 vs fp16 of the same backend, teacher-forced over `text` (default: the shipped English paragraph); returns
    the record (schema quality/1). A synthetic model's random weights get no verdict (`pass` None)."""
    model_dir = Path(model_dir)
    Checkpoint(model_dir)  # a loadable model before anything runs
    tok = load_tokenizer(model_dir)
    if tok is None:
        raise ConfigError(f"{model_dir}: --quality needs the model's tokenizer (tokenizer.json)")
    text = PARAGRAPH.read_text().strip() if text is None else text
    ids = [int(t) for t in tok.encode(text).ids]
    if len(ids) < 2:
        raise ConfigError("--quality needs a text of at least two tokens")
    kind, label = pick_backend(backend)
    if console is not None:
        console.print(f"quality: {len(ids)} tokens of English text, fp16 and fp8 on {label}")
    found = text_metrics({fmt: engine_logits(model_dir, fmt, ids, kind) for fmt in ("fp16", "fp8")}, ids)
    synthetic = model_source(model_dir) == "synthetic"
    return {
        "schema": QUALITY_SCHEMA,
        "created": now_iso(),
        "tool": tool_info(),
        "model": {"name": model_name(model_dir), "dir": str(model_dir), "source": model_source(model_dir),
                  "weights_sha256": weights_sha256(model_dir)},
        "backend": {"kind": kind, "label": label, **backend_info(kind)},
        "text": {"tokens": len(ids), "predictions": len(ids) - 1, "sha256": hashlib.sha256(text.encode()).hexdigest()},
        **found,
        "pass": None if synthetic else bool(all(found["checks"].values())),
        "note": "synthetic random weights: quality numbers carry no meaning; no verdict" if synthetic else None,
    }
