"""Tuning, apart from running: measure the forms (gpu/forms.py candidates) on a loaded engine, keep the fastest,
and save the choice under $ATOMFLOW_HOME/tuning keyed by (GPU name, model shape, weight format, max_seq, source
hash). `run` uses a saved choice when there is one and tunes once otherwise; `validate` and `generate` never time.

How a candidate is timed: its step (position held: step.hold_position) captured as a graph, replayed at the longest
length the short bucket serves and at half of it (the mean of the two; the GEMV forms' differences depend on the
length, docs/PERF_NOTES.md v17), in interleaved rounds (timing.fastest). When the short bucket wins and lengths beyond
it remain, the split bucket's GEMV form is timed again at its own lengths: at ctx 8192 QKV's L2 prefetch competes
with the split attention's K/V stream (v34).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from ..gpu.forms import Forms, candidates, from_env
from ..gpu.graph import StepGraph
from ..gpu.step import hold_position
from .timing import fastest, replay_us

SCHEMA = "atomflow-bench/tuning/1"


def tune(engine, replays: int = 12, rounds: int = 3, progress=None) -> tuple[Forms, dict]:
    """(the fastest forms, what was timed): every (GEMV form, attention bucket) pair of forms.candidates."""
    cap = engine.short_capacity
    gemv_forms, shorts = candidates(engine.fmt, engine.cc, cap)
    a, stream = engine.arena, engine.stream
    a["cur_token"].set(np.zeros(1, np.int32))
    graphs: dict = {}

    def graph(g, short):
        if (g, short) not in graphs:
            graphs[g, short] = StepGraph(hold_position(engine.bucket_launches(cap if short else None, g)), stream)
        return graphs[g, short]

    def timer(lengths):
        def time_once(pair) -> float:
            us = []
            for n in lengths:
                with stream:
                    a["pos"].set(np.array([n - 1], np.int32), stream=stream)
                us.append(float(np.median(replay_us(graph(*pair), stream, replays, warmup=3))))
            return float(np.mean(us))
        return time_once

    length = min(cap or engine.max_seq, engine.max_seq)
    lengths = sorted({max(1, length // 2), length})
    pairs = [(g, s) for g in gemv_forms for s in shorts]
    (g, short), us = fastest(timer(lengths), pairs, rounds)
    report = {"lengths": lengths, "step_us": {f"{'short' if s else 'split'}:{f.text}": t for (f, s), t in us.items()}}
    split = g
    if short and engine.max_seq > cap and len(gemv_forms) > 1:
        split_lengths = sorted({(cap + 1 + engine.max_seq) // 2, engine.max_seq})
        (split, _), us = fastest(timer(split_lengths), [(f, False) for f in gemv_forms], rounds)
        report["split"] = {"lengths": split_lengths, "step_us": {f.text: t for (f, _), t in us.items()}}
    graphs.clear()  # the candidates' graphs go before the chosen forms are built
    a["pos"].set(np.zeros(1, np.int32))
    engine.position = 0  # the engine's host copy, as reset() leaves it
    return Forms(short, g, split), report


def key(engine) -> dict:
    """What a saved choice is valid for: the GPU, the model's shape, the weight format, the kernel -D's and PDL (an
    instrument or a portable form is another build), the source hash (any code change retunes) — and, apart from
    these, the max_seq it was timed for (the file name within the key's folder)."""
    from .report import source_sha256

    shape = {k: v for k, v in engine.cfg.to_hf_dict().items()
             if k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")}
    return {"gpu": engine.gpu["name"], "shape": shape, "weights": engine.fmt,
            "defines": sorted(getattr(getattr(engine, "lib", None), "defines", ())),
            "pdl": bool(getattr(engine, "pdl", True)), "source_sha256": source_sha256()}


def folder_of(k: dict) -> Path:
    from ..store.store import home

    return home() / "tuning" / hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()[:16]


def path_of(k: dict, max_seq: int) -> Path:
    return folder_of(k) / f"max_seq-{max_seq}.json"


def load(engine, nearest: bool = False) -> tuple[Forms, Path] | None:
    """The saved choice for this engine's key and max_seq; with `nearest`, else the one of the same key timed for the
    nearest max_seq (validate, generate and profile reuse `run`'s tune at another length). None when there is none."""
    folder = folder_of(key(engine))
    exact = folder / f"max_seq-{engine.max_seq}.json"
    cands = [exact] if exact.is_file() else []
    if not cands and nearest and folder.is_dir():
        saved = [(int(p.stem.split("-")[1]), p) for p in folder.glob("max_seq-*.json") if p.stem.split("-")[1].isdigit()]
        cands = [p for _, p in sorted(saved, key=lambda sp: (abs(sp[0] - engine.max_seq), sp[0]))]
    for p in cands:
        try:
            return Forms.parse(json.loads(p.read_text())["forms"]), p
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable or from an older schema: not used
    return None


def save(engine, forms: Forms, report: dict) -> Path:
    from ..store.store import write_json_atomic
    from .report import now_iso

    k = key(engine)
    p = path_of(k, engine.max_seq)
    p.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(p, {"schema": SCHEMA, "key": k, "max_seq": engine.max_seq, "forms": forms.text,
                          "created": now_iso(), "timed": report})
    return p


def resolve(engine, given: Forms | None = None, retune: bool = False, tune_missing: bool = True, progress=None) -> dict:
    """Put the forms a command uses on `engine` and say where they came from: given (--forms, else ATOMFLOW_FORMS),
    saved (a tune of the same key), tuned now (and saved; `run`), or the defaults (`tune_missing` False: validate and
    generate never time forms)."""
    given = given or from_env()
    if given is not None:
        engine.use(given)
        return {"forms": given.text, "origin": "given"}
    saved = None if retune else load(engine, nearest=not tune_missing)
    if saved is not None:
        engine.use(saved[0])
        return {"forms": saved[0].text, "origin": "saved", "path": str(saved[1])}
    if not tune_missing:
        return {"forms": engine.forms.text, "origin": "default"}
    forms, report = tune(engine, progress=progress)
    engine.use(forms)
    try:
        where = {"path": str(save(engine, forms, report))}
    except OSError as e:  # a read-only or full $ATOMFLOW_HOME: the run goes on, the record says it was not saved
        where = {"path": None, "not_saved": f"{type(e).__name__}: {e}"}
    return {"forms": forms.text, "origin": "tuned now", **where, "timed": report}
