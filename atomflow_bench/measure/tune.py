"""Tuning, apart from running: measure the forms (gpu/forms.py candidates) on a loaded engine, keep the fastest,
and save the choice under $ATOMFLOW_HOME/tuning keyed by (GPU name, model shape, weight format, max_seq, source
hash). `run` uses a saved choice when there is one and tunes once otherwise; `validate` and `generate` never time.
A saved choice is found from the key alone (`choose`: no engine, no steps), so an engine is built once, with the
forms it runs.

How a candidate is timed: its step (position held: step.hold_position) captured as a graph, replayed at the longest
length the short bucket serves and at half of it (the mean of the two, because the GEMV forms' differences depend on
the length), in interleaved rounds (timing.fastest). When the short bucket wins and lengths beyond it remain, the
split bucket's GEMV form is timed again at its own lengths: at long contexts QKV's L2 prefetch competes with the split
attention's K/V stream, so the split bucket may want another form.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
from rich.markup import escape

from .. import schemas
from ..errors import AtomflowError
from ..gpu.forms import Forms, candidates, from_env
from ..gpu.graph import StepGraph
from ..gpu.step import hold_position
from ..output import Tab, num
from ..store.store import home, write_json_atomic
from . import run_record
from .timing import fastest, replay_us

SCHEMA = schemas.current("tuning")


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


SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "tie_word_embeddings")


def key_of(gpu_name: str, cfg, fmt: str, defines, pdl: bool) -> dict:
    """What a saved choice is valid for: the GPU, the model's shape, the weight format, the kernel -D's and PDL (an
    instrument or a portable form is another build), the source hash (any code change retunes) — and, apart from
    these, the max_seq it was timed for (the file name within the key's folder). None of it needs an engine."""
    shape = {k: v for k, v in cfg.to_hf_dict().items() if k in SHAPE_KEYS}
    return {"gpu": gpu_name, "shape": shape, "weights": fmt, "defines": sorted(defines), "pdl": bool(pdl),
            "source_sha256": run_record.source_sha256()}


def key(engine) -> dict:
    """key_of a built engine."""
    return key_of(engine.gpu["name"], engine.cfg, engine.fmt, getattr(getattr(engine, "lib", None), "defines", ()),
                  getattr(engine, "pdl", True))


def folder_of(k: dict) -> Path:
    return home() / "tuning" / hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()[:16]


def path_of(k: dict, max_seq: int) -> Path:
    return folder_of(k) / f"max_seq-{max_seq}.json"


def load_key(k: dict, max_seq: int, nearest: bool = False) -> tuple[Forms, Path] | None:
    """The saved choice for key `k` and `max_seq`; with `nearest`, else the one of the same key timed for the nearest
    max_seq (validate, generate and profile reuse `run`'s tune at another length). None when there is none."""
    folder = folder_of(k)
    exact = folder / f"max_seq-{max_seq}.json"
    cands = [exact] if exact.is_file() else []
    if not cands and nearest and folder.is_dir():
        saved = [(int(p.stem.split("-")[1]), p) for p in folder.glob("max_seq-*.json") if p.stem.split("-")[1].isdigit()]
        cands = [p for _, p in sorted(saved, key=lambda sp: (abs(sp[0] - max_seq), sp[0]))]
    for p in cands:
        try:
            rec = json.loads(p.read_text())
            if schemas.check(rec, ("tuning",), "the file") is None:
                raise ValueError(f"not a saved tune (schema={rec.get('schema') if isinstance(rec, dict) else None!r})")
            return Forms.parse(rec["forms"]), p
        except (OSError, ValueError, KeyError, TypeError, AtomflowError) as e:  # corrupt or another version's: tune anew
            why = f"{type(e).__name__}: {e}".splitlines()[0]
            print(f"warning: {p}: saved tune unreadable ({why}); ignored", file=sys.stderr, flush=True)
    return None


def load(engine, nearest: bool = False) -> tuple[Forms, Path] | None:
    return load_key(key(engine), engine.max_seq, nearest)


def save(engine, forms: Forms, report: dict) -> Path:
    k = key(engine)
    p = path_of(k, engine.max_seq)
    p.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(p, {"schema": SCHEMA, "key": k, "max_seq": engine.max_seq, "forms": forms.text,
                          "created": run_record.now_iso(), "timed": report})
    return p


def choose(k: dict, max_seq: int, given: Forms | None = None, retune: bool = False,
           nearest: bool = False) -> tuple[Forms | None, dict | None]:
    """The forms to build an engine with, before it is made, and where they came from: given (--forms, else
    ATOMFLOW_FORMS), else saved under key `k` (`nearest`: at the nearest max_seq). (None, None): neither; the caller
    tunes now or takes the defaults."""
    given = given or from_env()
    if given is not None:
        return given, {"forms": given.text, "origin": "given"}
    saved = None if retune else load_key(k, max_seq, nearest)
    if saved is not None:
        return saved[0], {"forms": saved[0].text, "origin": "saved", "path": str(saved[1])}
    return None, None


def tune_and_save(engine, progress=None) -> dict:
    """Tune now, put the winner on `engine` and save it; what resolve answers for it."""
    forms, report = tune(engine, progress=progress)
    engine.use(forms)
    try:
        where = {"path": str(save(engine, forms, report))}
    except OSError as e:  # a read-only or full $ATOMFLOW_HOME: the run goes on, the record says it was not saved
        where = {"path": None, "not_saved": f"{type(e).__name__}: {e}"}
    return {"forms": forms.text, "origin": "tuned now", **where, "timed": report}


def resolve(engine, given: Forms | None = None, retune: bool = False, tune_missing: bool = True, progress=None) -> dict:
    """Put the forms a command uses on a built `engine` and say where they came from: given, saved, tuned now (and
    saved; `run`), or the defaults (`tune_missing` False: validate and generate never time forms). The commands of
    measure/context.py resolve before the engine is made instead (choose); this is for an engine already built."""
    forms, chosen = choose(key(engine), engine.max_seq, given, retune=retune, nearest=not tune_missing)
    if forms is not None:
        engine.use(forms)
        return chosen
    if not tune_missing:
        return {"forms": engine.forms.text, "origin": "default"}
    return tune_and_save(engine, progress)


def tune_table(chosen: dict, title: str):
    """`tune`: every candidate's step time, fastest first (output.Tab)."""
    t = Tab(title, ["forms", "step µs (best round)"], key="tune", right=("step µs (best round)",))
    for k, v in sorted(chosen["timed"]["step_us"].items(), key=lambda kv: kv[1]):
        t.add(k, num(v, ".1f"))
    return t


def tune_notes(chosen: dict) -> list[str]:
    """`tune`'s lines beside the table (rich markup): the split bucket's best, the choice, where it was saved."""
    lines = []
    split = chosen["timed"].get("split")
    if split:
        lines.append("split bucket: " + ", ".join(f"{k} {v:.1f} µs" for k, v in
                                                  sorted(split["step_us"].items(), key=lambda kv: kv[1])[:5]))
    lines.append(f"chosen: {chosen['forms']} ({run_record.forms_text(chosen['forms'])})")
    lines.append(f"saved: {escape(str(chosen['path']))}" if chosen.get("path")
                 else f"[yellow]not saved[/yellow]: {escape(str(chosen['not_saved']))}")
    return lines
