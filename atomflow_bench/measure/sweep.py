"""`sweep`: the `run` measurement over a grid (models x weight formats x contexts [x tp]), resumable.

One directory per sweep (`--out`): one `atomflow-bench/run/1` record per cell, named from the cell's key
(`<model>-<weights>-ctx<context>-tp<tp>.json`), and a summary of all cells written after every cell, so an
interrupted sweep leaves a valid one: `summary.json` (schema `atomflow-bench/sweep/1`, written atomically),
`summary.csv` and `summary.md` (written to a temporary file, then renamed).

Resumption: a cell whose record exists and is valid (a readable run record of the same model, weights, context, tp,
tokens and repeats, on this sweep's GPU) is skipped and its figures are read from the file; a record that is not
(unreadable, another schema, another shape, another GPU) is measured again and replaced; a failed cell leaves no
record, so the next sweep into the same directory measures it again.

A cell is a dict (`key`: model, weights, context, tp): another axis is another entry. `context` is the prompt's
length: the tokens the prefill puts in the cache (batched, or walked through the decode step where the batched
prefill is not built) and the position the timed decode starts at, so `--ctx` is the prompt-length axis of both
TTFT and TPOT. The function that measures
one cell is an argument of `run_sweep` (`run_cell(key, tokens, repeats) -> record`), `benchmark_cell` on the GPU;
the tests drive the bookkeeping with a stand-in that returns recorded-style records.
"""
from __future__ import annotations

import csv
import io
import time
from pathlib import Path
from typing import Callable

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from .. import schemas
from ..errors import AtomflowError, GpuUnavailable
from ..output import Num, Tab, num, span, text
from ..store.store import write_json_atomic, write_text_atomic
from . import run_record
from .baselines import attach_comparisons, same_gpu

SCHEMA = schemas.current("sweep")
AXES = ("model", "weights", "context", "tp")  # the cell key's fields, in file-name and table order
WEIGHTS = ("fp8", "fp16")
STATUSES = ("done", "skipped", "failed", "pending")
SUMMARY_FILES = ("summary.json", "summary.csv", "summary.md")
CSV_COLUMNS = ["model", "weights", "context", "tp", "status", "file", "gpu", "tpot_median_ms", "tpot_p10_ms",
               "tpot_p90_ms", "tok_per_s", "roofline_pct", "bytes_per_token", "tp1_ratio", "tp_efficiency",
               "ttft_median_ms", "ttft_p10_ms", "ttft_p90_ms", "prefill_path", "prefill_tok_per_s",
               "prefill_pct_of_peak", "forms", "forms_origin", "instrument", "error", "note"]
MAX_TP = 8


# ---- the grid ------------------------------------------------------------------------------------------
def split_list(text: str, what: str) -> list[str]:
    """'a, b,,a' -> ['a', 'b']: comma-separated, blanks dropped, duplicates once (first place kept)."""
    items = list(dict.fromkeys(s.strip() for s in str(text).split(",") if s.strip()))
    if not items:
        raise AtomflowError(f"{what}: empty list")
    return items


def parse_ints(text: str, what: str, lo: int, hi: int) -> list[int]:
    """A comma-separated list of whole numbers in lo..hi (split_list's rules)."""
    out = []
    for s in split_list(text, what):
        try:
            n = int(s)
        except ValueError:
            raise AtomflowError(f"{what}: {s!r} is not an integer") from None
        if not lo <= n <= hi:
            raise AtomflowError(f"{what}: {n} is not in {lo}..{hi}")
        out.append(n)
    return out


def parse_contexts(text: str, lo: int = 1, hi: int = 32000) -> list[int]:
    return parse_ints(text, "--ctx", lo, hi)


def parse_weights(text: str) -> list[str]:
    out = split_list(text, "--weights")
    bad = [w for w in out if w not in WEIGHTS]
    if bad:
        raise AtomflowError(f"--weights: {bad[0]!r} is not one of {', '.join(WEIGHTS)}")
    return out


def parse_tps(text: str) -> list[int]:
    return parse_ints(text, "--tp", 1, MAX_TP)


def tp_of(rec: dict) -> int:
    """A run record's tensor-parallel degree (1 when it has no `tp` block)."""
    t = rec.get("tp")
    return int(t.get("n", 1)) if isinstance(t, dict) else int(t or 1)


def grid(models, weights, contexts, tps=(1,)) -> list[dict]:
    """Every cell key, models outermost, tp innermost."""
    return [{"model": m, "weights": w, "context": int(c), "tp": int(t)}
            for m in models for w in weights for c in contexts for t in tps]


def cell_filename(key: dict) -> str:
    """The record file of a cell: its key's values in AXES order (`llama-3.2-3b-fp8-ctx128-tp1.json`)."""
    return (f"{run_record.slug(str(key['model']))}-{key['weights']}-ctx{key['context']}-tp{key.get('tp', 1)}"
            + "".join(f"-{run_record.slug(k)}{run_record.slug(str(v))}" for k, v in key.items() if k not in AXES) + ".json")


def key_text(key: dict) -> str:
    return " ".join([str(key["model"]), str(key["weights"]), f"ctx {key['context']}", f"tp {key.get('tp', 1)}"]
                    + [f"{k} {v}" for k, v in key.items() if k not in AXES])


def default_out(results_dir: Path = Path("results")) -> Path:
    return results_dir / f"sweep-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"


# ---- one record: validity and the figures the summary keeps ---------------------------------------------
def _number(rec: dict, *path) -> float:
    v = rec
    for p in path:
        v = v.get(p) if isinstance(v, dict) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
        raise AtomflowError(f"field {'.'.join(path)!r} is missing or not a finite number")
    return float(v)


def _optional(rec: dict, *path) -> float | None:
    """An optional figure (a record written before it lacks it): None when absent or null, else `_number`'s."""
    v = rec
    for p in path:
        v = v.get(p) if isinstance(v, dict) else None
    return None if v is None else _number(rec, *path)


def figures(rec: dict) -> dict:
    """The summary's figures of a run record (AtomflowError naming the first missing one); the prefill's (TTFT,
    prefill tok/s and % of the tensor-core peak) are None for a record without them."""
    forms = rec.get("forms") if isinstance(rec.get("forms"), dict) else {}
    prefill = rec.get("prefill") if isinstance(rec.get("prefill"), dict) else {}
    return {"gpu": (rec.get("gpu") or {}).get("name"),
            "tpot_ms": {q: _number(rec, "tpot_ms", q) for q in ("median", "p10", "p90")},
            "tok_per_s": _number(rec, "tok_per_s"), "roofline_pct": _number(rec, "roofline", "pct"),
            "bytes_per_token": int(_number(rec, "bytes_per_token", "total")),
            "ttft_ms": (None if rec.get("ttft_ms") is None
                        else {q: _number(rec, "ttft_ms", q) for q in ("median", "p10", "p90")}),
            "prefill_path": prefill.get("path"), "prefill_tok_per_s": _optional(rec, "prefill", "tok_per_s"),
            "prefill_pct_of_peak": _optional(rec, "prefill", "pct_of_peak"),
            "forms": forms.get("forms"), "forms_origin": forms.get("origin"),
            "instrument": list(rec.get("instrument") or [])}


NO_FIGURES = {"gpu": None, "tpot_ms": None, "tok_per_s": None, "roofline_pct": None, "bytes_per_token": None,
              "ttft_ms": None, "prefill_path": None, "prefill_tok_per_s": None, "prefill_pct_of_peak": None,
              "forms": None, "forms_origin": None, "instrument": []}  # a failed or pending cell's


def check_record(path: Path, key: dict, tokens: int, repeats: int, gpu: str | None = None) -> tuple[dict | None, str]:
    """(record, "") when `path` holds a valid record of this cell, else (None, why not)."""

    path = Path(path)
    if not path.is_file():
        return None, "no record"
    try:
        rec = run_record.load(path)
        figures(rec)
    except AtomflowError as e:
        return None, " ".join(str(e).replace(str(path), path.name).split())
    want = {"model": key["model"], "weights": key["weights"], "context": key["context"], "tp": key.get("tp", 1),
            "tokens": tokens, "repeats": repeats}
    have = {"model": (rec.get("model") or {}).get("name"), "weights": rec.get("weights"),
            "context": rec.get("context"), "tp": tp_of(rec), "tokens": rec.get("tokens"),
            "repeats": rec.get("repeats")}
    for k, v in want.items():
        if have[k] != v:
            return None, f"the record has {k} {have[k]!r}, this sweep {v!r}"
    name = (rec.get("gpu") or {}).get("name", "")
    if gpu and not same_gpu(str(name), gpu):
        return None, f"the record was measured on {name}, this sweep runs on {gpu}"
    return rec, ""


# ---- the sweep -----------------------------------------------------------------------------------------
def benchmark_cell(key: dict, tokens: int, repeats: int, *, open_cell, baselines=(), peers: bool = False,
                   forms=None, retune: bool = False, source: str | None = None, console=None,
                   baselines_dir=None) -> dict:
    """One cell on the GPU(s): its run context (`open_cell`: gpu/tp/context.py open_cell; one GPU, or the ranks of
    `run --tp N`), the measurement, the comparisons of `run` (recorded baselines, and the HF peers with `peers`)
    attached; returns the run record."""
    ctx = open_cell(key["model"], key.get("tp", 1), source=source, notes=console)
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console,
                  transient=True, disable=console is None) as progress:
        rec, peer_recs = ctx.measure(key["weights"], key["context"], tokens, repeats, forms=forms, retune=retune,
                                     progress=progress, peers=peers, baselines_dir=baselines_dir)
    attach_comparisons(rec, list(baselines), peer_recs)
    return rec


def tp_scaling(summary: dict) -> dict[int, tuple[float, float]]:
    """Per cell index of tp > 1 with a measured tp 1 cell of the same model, weights and context: (TPOT / TPOT at
    tp 1, scaling efficiency = TPOT_1 / (tp x TPOT_tp))."""
    one = {}
    for e in summary["cells"]:
        k = e["key"]
        if k.get("tp", 1) == 1 and e["tpot_ms"]:
            one[(k["model"], k["weights"], k["context"])] = e["tpot_ms"]["median"]
    out = {}
    for i, e in enumerate(summary["cells"]):
        k = e["key"]
        base = one.get((k["model"], k["weights"], k["context"]))
        if k.get("tp", 1) > 1 and e["tpot_ms"] and base:
            t = e["tpot_ms"]["median"]
            out[i] = (t / base, base / (k["tp"] * t))
    return out


def _entry(key: dict, status: str, file: str | None = None, rec: dict | None = None, error: str | None = None,
           note: str | None = None, seconds: float | None = None) -> dict:
    f = figures(rec) if rec is not None else dict(NO_FIGURES, instrument=[])
    return {"key": dict(key), "status": status, "file": file, **f, "error": error, "note": note, "seconds": seconds}


def run_sweep(cells: list[dict], out_dir, run_cell: Callable[..., dict], *, tokens: int = 256,
              repeats: int = 5, gpu: str | None = None, console=None, command: str | None = None) -> dict:
    """Measure every cell not already measured in `out_dir` (see the module's doc); returns the summary.

    `run_cell(key, tokens, repeats)` returns a run record or raises: AtomflowError fails that cell (its one-line
    error kept) and the sweep goes on; GpuUnavailable and any other exception stop the sweep after the summary is
    written (that cell: failed). `gpu`: this sweep's GPU (a record of another GPU is measured again)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    say = (lambda text: console.print(text, soft_wrap=True, highlight=False, markup=False)) if console else (
        lambda text: None)
    summary = {"schema": SCHEMA, "tool": run_record.tool_info(), "created": run_record.now_iso(), "updated": None,
               "command": command if command is not None else run_record.command_line(), "gpu": gpu,
               "tokens": tokens, "repeats": repeats, "directory": str(out), "complete": False,
               "cells": [_entry(k, "pending") for k in cells]}
    names = [cell_filename(k) for k in cells]
    if len(set(names)) != len(names):
        raise AtomflowError("two cells of the sweep have the same record file name")
    n = len(cells)
    for i, key in enumerate(cells):
        name = names[i]
        path = out / name
        head = f"[{i + 1}/{n}] {key_text(key)}"
        rec, why = check_record(path, key, tokens, repeats, gpu)
        if rec is not None:
            summary["cells"][i] = _entry(key, "skipped", name, rec, note="valid record already there")
            say(f"{head}: skipped, {name} is already there")
            write_summary(summary, out)
            continue
        note = f"measured again: {why}" if path.exists() else None
        if note:
            say(f"{head}: {name} is not a valid record of this cell ({why}): measuring it again")
        say(f"{head}: measuring")
        t0 = time.perf_counter()
        try:
            rec = run_cell(key, tokens, repeats)
            figures(rec)  # a record the summary cannot read fails its cell and is not written
            run_record.write(rec, path)
        except GpuUnavailable as e:
            summary["cells"][i] = _entry(key, "failed", error=_line(e), note=note)
            write_summary(summary, out)
            raise
        except AtomflowError as e:
            summary["cells"][i] = _entry(key, "failed", error=_line(e), note=note,
                                         seconds=time.perf_counter() - t0)
            say(f"{head}: failed: {_line(e)}")
        except BaseException as e:  # a bug or an interrupt: the summary says where the sweep stopped, then it stops
            what = "interrupted" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {_line(e)}"
            summary["cells"][i] = _entry(key, "failed", error=what, note=note, seconds=time.perf_counter() - t0)
            write_summary(summary, out)
            raise
        else:
            summary["cells"][i] = _entry(key, "done", name, rec, note=note, seconds=time.perf_counter() - t0)
            say(f"{head}: done, TPOT {rec['tpot_ms']['median']:.4f} ms -> {name}")
        write_summary(summary, out)
    summary["complete"] = True
    write_summary(summary, out)
    return summary


def _line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# ---- the summary files ---------------------------------------------------------------------------------
def counts(summary: dict) -> dict:
    return {s: sum(c["status"] == s for c in summary["cells"]) for s in STATUSES}


def _f(v, spec: str) -> str:
    return "" if v is None else format(v, spec)


def sweep_table(summary: dict):
    """The summary as an output.Tab (one row per cell)."""

    cols = ["model", "weights", "ctx", "tp", "status", "TPOT ms", "p10-p90 ms", "tok/s", "% roofline", "GB/token",
            "vs TP1", "TTFT ms", "TTFT p10-p90 ms", "prefill tok/s", "% tensor-core peak", "forms", "file / error"]
    scale = tp_scaling(summary)
    c = counts(summary)
    t = Tab(f"sweep — {summary.get('gpu') or 'GPU not named'}, {summary['tokens']} tokens x {summary['repeats']} "
            "repeats per cell", cols, key="sweep", right=("ctx", "tp", "TPOT ms", "p10-p90 ms", "tok/s", "% roofline",
                                                           "GB/token", "TTFT ms", "TTFT p10-p90 ms", "prefill tok/s",
                                                           "% tensor-core peak"))
    for i, e in enumerate(summary["cells"]):
        k, tp = e["key"], e["tpot_ms"]
        # the ratio alone in csv/json: the efficiency follows from it and tp
        vs = Num(scale[i][0], f"{scale[i][0]:.3f} x ({100 * scale[i][1]:.0f}% eff.)") if i in scale else Num(None, "")
        last = e["error"] if e["status"] == "failed" else (e["file"] or "")
        if e.get("note") and e["status"] != "skipped":
            last += f" ({e['note']})"
        forms = (e["forms"] or "") + (f" ({e['forms_origin']})" if e.get("forms_origin") else "")
        if e.get("instrument"):
            forms += f" INSTRUMENT {' '.join(e['instrument'])}: a bound, not a result"
        gb = None if e["bytes_per_token"] is None else e["bytes_per_token"] / 1e9
        ft, pre = e["ttft_ms"], e["prefill_tok_per_s"]
        path = f" ({e['prefill_path']})" if e["prefill_path"] else ""
        t.add(str(k["model"]), str(k["weights"]), num(k["context"]), num(k.get("tp", 1)), e["status"],
              num(tp and tp["median"], ".4f", none=""), span(tp and tp["p10"], tp and tp["p90"], ".4f"),
              num(e["tok_per_s"], ".1f", none=""), num(e["roofline_pct"], ".1f", none=""), num(gb, ".4f", none=""),
              vs, num(ft and ft["median"], ".3f", none=""), span(ft and ft["p10"], ft and ft["p90"], ".3f"),
              num(pre, ".0f", path, none=""), num(e["prefill_pct_of_peak"], ".1f", none=""), forms, last,
              style={"failed": "red", "pending": "dim"}.get(e["status"], ""))
    t.caption = (f"{len(summary['cells'])} cells: {c['done']} measured, {c['skipped']} skipped (a valid record was "
                 f"there), {c['failed']} failed" + (f", {c['pending']} not reached" if c["pending"] else "")
                 + f"; records and summary.json/.csv/.md in {summary['directory']}; % roofline = bytes per token / "
                 "copy bandwidth of the same run, over TPOT (tp > 1: per GPU, the slowest rank's); vs TP1 = TPOT / "
                 "TPOT at tp 1 of the same model, weights and context, efficiency = TPOT_1 / (tp x TPOT); ctx = the "
                 "prompt's length; TTFT = its prefill (batched, or walked through the decode step) and the first "
                 "decode step; prefill tok/s = ctx / median TTFT; % tensor-core peak = the prefill's TFLOPS / the "
                 "fp16 tensor-core GEMM rate of the same run; blank where a record predates them")
    return t


def csv_text(summary: dict) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    scale = tp_scaling(summary)
    for i, e in enumerate(summary["cells"]):
        k, tp = e["key"], e["tpot_ms"] or {}
        ratio, eff = scale.get(i, ("", ""))
        ft = e["ttft_ms"] or {}
        w.writerow([k["model"], k["weights"], k["context"], k.get("tp", 1), e["status"], e["file"] or "",
                    e["gpu"] or "", tp.get("median", ""), tp.get("p10", ""), tp.get("p90", ""),
                    _f(e["tok_per_s"], ""), _f(e["roofline_pct"], ""), _f(e["bytes_per_token"], ""), ratio, eff,
                    ft.get("median", ""), ft.get("p10", ""), ft.get("p90", ""), e["prefill_path"] or "",
                    _f(e["prefill_tok_per_s"], ""), _f(e["prefill_pct_of_peak"], ""), e["forms"] or "",
                    e["forms_origin"] or "", " ".join(e.get("instrument") or []), e["error"] or "", e["note"] or ""])
    return out.getvalue()


def md_text(summary: dict) -> str:

    head = (f"# atomflow-bench sweep\n\n`{summary['command']}` — started {summary['created']}, updated "
            f"{summary['updated']}{'' if summary['complete'] else ' (not complete: cells not reached are pending)'}"
            "\n\n")
    return head + text(sweep_table(summary), "md")


def write_summary(summary: dict, out_dir) -> list[Path]:
    """summary.json (atomically), summary.csv and summary.md (each written to a temporary file, then renamed)."""
    out = Path(out_dir)
    summary["updated"] = run_record.now_iso()
    write_json_atomic(out / "summary.json", summary)
    write_text_atomic(out / "summary.csv", csv_text(summary))
    write_text_atomic(out / "summary.md", md_text(summary))
    return [out / f for f in SUMMARY_FILES]
