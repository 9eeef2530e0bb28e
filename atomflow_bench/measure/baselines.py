"""Recorded baselines (`baselines/*.json`) and the comparison table `run` prints under its own.

One JSON file per recorded measurement, schema `atomflow-bench/baseline/1`. Fields (all others are
rejected; `null` is allowed only where the type says so):

    schema          "atomflow-bench/baseline/1"
    engine          object:
      name          string: the engine as its users know it ("vLLM", "AtomFlow", "llama.cpp server")
      version       string or null: its version, null when the source does not say
      flags         string or null: how it was configured ("torch.compile + CUDA Graph", "--enforce-eager")
    gpu             object:
      name          string: the GPU as the driver names it ("NVIDIA GeForce RTX 5060 Ti"); when the source names
                    only the family, say so with the suffix "(variant not stated)": "NVIDIA H100 (variant not
                    stated)" (see the comparison rules: never the same GPU as a run's)
      memory_bandwidth_gbs
                    number or null: the GPU's spec memory bandwidth in GB/s (10^9 B/s); null when unknown (then the
                    built-in table is used, except for a GPU whose variant is not stated)
    model           string: the model; a catalog name ("llama-3.2-3b") so runs of the same model find it
    served_model    string or null (optional): the name the engine served the model under
    precision       string: the weight/activation precision as the source states it ("W8A16", "bf16");
                    say so when the source does not ("unspecified (likely bf16)")
    bytes_format    "fp16", "fp8" or null (optional): the catalog weight format whose byte count
                    (ModelConfig.weight_bytes) is read per token at this precision, used for the
                    roofline-normalised comparison; null: not normalised
    weight_bytes    integer > 0 or null (optional): the engine's own weight bytes read per token as the record
                    states them; when given it is used instead of bytes_format's catalog count. A llama.cpp
                    record (measure/llama_cpp.py): the GGUF file's size, less the token-embedding table when
                    the model's embeddings are untied (one row of it is read per token; a tied table is the
                    output matrix, read in full)
    gguf_bytes      integer > 0 or null (optional): the size of the GGUF file the engine ran, in bytes
    weight_bytes_basis
                    string or null (optional): how weight_bytes was computed (the sizes and the rule), or why
                    it is null
    context         integer or null: prompt tokens before the timed decode; null when not stated (must be null
                    with metrics.tpot_fit_ms: the fit is evaluated at the run's context)
    tokens          integer or null: generated tokens per measurement; null when not stated
    metrics         object:
      tpot_ms       number > 0: time per output token, the median (ms); optional when tpot_fit_ms is given
      tok_per_s     number > 0: decode tokens per second; given exactly when tpot_ms is
      tpot_fit_ms   object (optional): TPOT as a published linear fit over the prompt length, instead of (or
                    besides) one TPOT; when given, comparisons evaluate it at the run's context and ignore tpot_ms
                    (then only a one-number reader such as `baseline list` shows tpot_ms; `notes` says what it is):
        intercept         number > 0: TPOT at prompt length 0 (ms)
        per_input_token   number >= 0: ms added per prompt token
        input             string: what the fit's x is ("prompt length in tokens")
      tpot_p10_ms   number or null (optional): 10th percentile of TPOT
      tpot_p90_ms   number or null (optional): 90th percentile of TPOT
      ttft_ms       number or null (optional): time to first token, the median
      samples       integer or null (optional): how many measurements the figures summarise
    source          string: a URL or publication ("AtomFlow README (...), figures as published"), or
                    "measured with <command> on <date>"
    method          string: how it was measured (what was timed, how lengths were fixed, what is approximate)
    created         string (optional): when the file was written (ISO 8601, UTC)
    notes           string or null (optional): anything else a reader must know

Comparison rules (`comparison_rows`): a baseline is compared with a run when it names the same model
(catalog name; a hub repo id is mapped to its catalog name). On the same GPU (names equal once "NVIDIA" and
"GeForce" are dropped) the row gives the baseline's TPOT and the speedup = its TPOT / ours. On a different
GPU absolute times say nothing about the engines, so the row gives the roofline-normalised comparison:
each side's achieved bandwidth (bytes read per token / TPOT) divided by its own GPU's spec memory
bandwidth, and the ratio ours / theirs. A baseline's bytes per token are its `weight_bytes`, else computed
from the catalog config at its `bytes_format`, plus fp16 K/V rows at its mean context, exactly as `run`
counts ours. A baseline with `metrics.tpot_fit_ms` is evaluated at the run's context (TPOT = intercept +
per_input_token x ctx) and its row is labelled "fitted line, evaluated at ctx N". A baseline whose GPU's
variant is not stated ("NVIDIA H100 (variant not stated)") against a run on a GPU of that family (every
word of the name before the suffix is in the run's GPU name) gets the absolute ratio their TPOT / ours,
labelled "variant not stated", never the same-GPU speedup (see `gpu_relation`).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

from .. import schemas
from ..config import CATALOG
from ..errors import AtomflowError
from ..output import Num, Tab, num

SCHEMA = schemas.current("baseline")
# The checkout's baselines/ in a source tree or an editable install (where `baseline record` writes and the files are
# committed); else the copy a wheel installs inside the package (pyproject maps baselines/ to the package
# `atomflow_bench.baselines` as package data: a wheel carries nothing outside its packages).
_ROOT = Path(__file__).resolve().parents[2]  # the repository root in a checkout; site-packages when installed
DEFAULT_DIR = (_ROOT / "baselines" if (_ROOT / "pyproject.toml").is_file() and (_ROOT / "baselines").is_dir()
               else Path(__file__).resolve().parents[1] / "baselines")

# Spec memory bandwidth (GB/s) by the words of the GPU's name; the first entry all of whose words appear wins.
GPU_BANDWIDTH_GBS: list[tuple[tuple[str, ...], float]] = [
    (("h100", "pcie"), 2000.0),
    (("h100",), 3350.0),            # H100 SXM5 80GB HBM3 ("NVIDIA H100 80GB HBM3")
    (("h200",), 4800.0),
    (("a100", "80gb"), 2039.0),     # A100 SXM4 80GB ("NVIDIA A100-SXM4-80GB")
    (("rtx", "5060", "ti"), 448.0),
    (("rtx", "4090"), 1008.0),
    (("l40s",), 864.0),
]

_NUM = (int, float)


def _words(gpu_name: str) -> list[str]:
    return [w for w in re.split(r"[^a-z0-9]+", gpu_name.lower()) if w and w not in ("nvidia", "geforce")]


def spec_bandwidth(gpu_name: str) -> float | None:
    """Spec memory bandwidth (GB/s) of a GPU from the table above, None when it is not listed."""
    words = set(_words(gpu_name))
    return next((bw for keys, bw in GPU_BANDWIDTH_GBS if words.issuperset(keys)), None)


def same_gpu(a: str, b: str) -> bool:
    return _words(a) == _words(b)


def catalog_name(model: str) -> str:
    """The catalog name for a catalog name or a catalog hub repo id (case-insensitive); else `model`."""
    low = model.lower()
    return next((p.name for p in CATALOG.values() if low in (p.name, p.hub_repo.lower())), model)


# ---- schema ------------------------------------------------------------------------------------
# field -> (allowed types, required, extra check or nested spec)
Spec = dict[str, tuple[tuple[type, ...], bool, "Callable[[Any], str | None] | dict | None"]]


def _positive(v) -> str | None:
    return None if v is None or v > 0 else f"must be > 0, got {v!r}"


def _one_of(*allowed) -> Callable[[Any], str | None]:
    return lambda v: None if v in allowed else f"must be one of {', '.join(map(repr, allowed))}, got {v!r}"


_N = type(None)
SPEC: Spec = {
    "schema": ((str,), True, _one_of(*schemas.ids("baseline"))),
    "engine": ((dict,), True, {"name": ((str,), True, None), "version": ((str, _N), True, None),
                               "flags": ((str, _N), True, None)}),
    "gpu": ((dict,), True, {"name": ((str,), True, None), "memory_bandwidth_gbs": (_NUM + (_N,), True, _positive)}),
    "model": ((str,), True, None),
    "served_model": ((str, _N), False, None),
    "precision": ((str,), True, None),
    "bytes_format": ((str, _N), False, _one_of("fp16", "fp8", None)),
    "weight_bytes": ((int, _N), False, _positive),
    "gguf_bytes": ((int, _N), False, _positive),
    "weight_bytes_basis": ((str, _N), False, None),
    "context": ((int, _N), True, lambda v: None if v is None or v >= 0 else f"must be >= 0, got {v!r}"),
    "tokens": ((int, _N), True, _positive),
    "metrics": ((dict,), True, {
        # tpot_ms and tok_per_s: required unless tpot_fit_ms is given (checked in `validate`)
        "tpot_ms": (_NUM, False, _positive), "tok_per_s": (_NUM, False, _positive),
        "tpot_fit_ms": ((dict,), False, {
            "intercept": (_NUM, True, _positive),
            "per_input_token": (_NUM, True, lambda v: None if v >= 0 else f"must be >= 0, got {v!r}"),
            "input": ((str,), True, None)}),
        "tpot_p10_ms": (_NUM + (_N,), False, _positive), "tpot_p90_ms": (_NUM + (_N,), False, _positive),
        "ttft_ms": (_NUM + (_N,), False, _positive), "samples": ((int, _N), False, _positive)}),
    "source": ((str,), True, None),
    "method": ((str,), True, None),
    "created": ((str,), False, None),
    "notes": ((str, _N), False, None),
}


def _type_name(types: tuple[type, ...]) -> str:
    names = {int: "integer", float: "number", str: "string", dict: "object", _N: "null"}
    out = [names[t] for t in types if not (t is int and float in types)]
    return " or ".join(out)


def _check(obj: dict, spec: Spec, where: str, prefix: str = "") -> None:
    for key in obj:
        if key not in spec:
            raise AtomflowError(f"{where}: unknown field {prefix + key!r}")
    for key, (types, required, extra) in spec.items():
        name = prefix + key
        if key not in obj:
            if required:
                raise AtomflowError(f"{where}: missing field {name!r}")
            continue
        v = obj[key]
        if isinstance(v, bool) or not isinstance(v, types):
            raise AtomflowError(f"{where}: field {name!r} must be {_type_name(types)}, got {v!r}")
        if isinstance(extra, dict):
            _check(v, extra, where, name + ".")
        elif extra is not None and (msg := extra(v)):
            raise AtomflowError(f"{where}: field {name!r} {msg}")


def validate(rec: Any, where: str = "baseline") -> dict:
    """`rec` if it is a valid baseline, else AtomflowError naming `where` and the first bad field."""
    if not isinstance(rec, dict):
        raise AtomflowError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    schemas.check(rec, ("baseline",), where)  # another version's baseline: said so, before its fields
    _check(rec, SPEC, where)
    m = rec["metrics"]
    if "tpot_fit_ms" in m:
        if rec["context"] is not None:
            raise AtomflowError(f"{where}: field 'context' must be null with 'metrics.tpot_fit_ms' (the fit is "
                                f"evaluated at the run's context), got {rec['context']!r}")
        if ("tpot_ms" in m) != ("tok_per_s" in m):
            have, lack = ("tpot_ms", "tok_per_s") if "tpot_ms" in m else ("tok_per_s", "tpot_ms")
            raise AtomflowError(f"{where}: missing field 'metrics.{lack}' (given with 'metrics.{have}')")
    else:
        for key in ("tpot_ms", "tok_per_s"):
            if key not in m:
                raise AtomflowError(f"{where}: missing field 'metrics.{key}'")
    return rec


def load_baseline(path: Path) -> dict:
    path = Path(path)
    try:
        rec = json.loads(path.read_text())
    except FileNotFoundError:
        raise AtomflowError(f"{path}: not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AtomflowError(f"{path}: not valid JSON ({e})") from None
    return validate(rec, str(path))


def load_baselines(directory: Path | None = None) -> list[dict]:
    """Every `*.json` in `directory` (default: the repository's baselines/), validated; [] when the default is absent
    (a wheel built without them); a directory the user named that is not one is an error, never an empty list."""
    if directory is not None and not Path(directory).is_dir():
        raise AtomflowError(f"--baselines {directory}: not a directory")
    directory = Path(directory) if directory is not None else DEFAULT_DIR
    if not directory.is_dir():
        return []
    return [load_baseline(p) for p in sorted(directory.glob("*.json"))]


# ---- comparison --------------------------------------------------------------------------------
VARIANT_NOT_STATED = "variant not stated"


def variant_not_stated(gpu_name: str) -> bool:
    """Whether a baseline's GPU name says the source named only the GPU's family ("NVIDIA H100 (variant not stated)")."""
    return VARIANT_NOT_STATED in gpu_name.lower()


def gpu_relation(theirs: str, ours: str) -> str:
    """How a row's GPU relates to ours: "same" (`same_gpu`), "variant not stated" (theirs names only a family that
    ours belongs to: every word of their name before "(variant not stated)" is in ours) or "different".

    Why an unstated variant is never "same": the H100 SXM (80GB HBM3, 3350 GB/s) and the H100 PCIe (2000 GB/s)
    share a name up to the variant and differ 1.7x in memory bandwidth, so a same-GPU speedup would be a claim the
    source does not support. We show the absolute ratio (their TPOT / ours), labelled "variant not stated", rather
    than a roofline-normalised ratio against an assumed SXM bandwidth: the normalisation needs the baseline's bytes
    per token too, and a source that leaves the variant unstated (the vLLM FP8 KV-cache post) also leaves the
    weight precision unstated, so it would rest on two assumptions where the absolute ratio rests on one, which
    the label names. (With bf16 weights, 16 GB per token at the post's 6.44 ms would be ~2.5 TB/s, above the PCIe
    card's 2.0 TB/s, so its card was likely SXM or NVL; that too assumes the precision the post does not state.)
    """
    if variant_not_stated(theirs):
        family = set(_words(theirs.lower().replace(VARIANT_NOT_STATED, "")))
        return VARIANT_NOT_STATED if family and family <= set(_words(ours)) else "different"
    return "same" if same_gpu(theirs, ours) else "different"


def baseline_gpu_bandwidth(b: dict) -> float | None:
    """The baseline's GPU spec bandwidth: its own figure, else the built-in table (never for an unstated variant)."""
    gpu = b["gpu"]
    if gpu["memory_bandwidth_gbs"]:
        return gpu["memory_bandwidth_gbs"]
    return None if variant_not_stated(gpu["name"]) else spec_bandwidth(gpu["name"])


def baseline_tpot(b: dict, context: int) -> tuple[float, int | None, str | None]:
    """(TPOT ms, the context it holds at, label) of a baseline compared with a run at `context`: a fitted line is
    evaluated there (label "fitted line, evaluated at ctx N"); one TPOT holds at the baseline's own context."""
    fit = b["metrics"].get("tpot_fit_ms")
    if fit is None:
        return b["metrics"]["tpot_ms"], b["context"], None
    return fit["intercept"] + fit["per_input_token"] * context, context, f"fitted line, evaluated at ctx {context}"


def engine_label(b: dict) -> str:
    e = b["engine"]
    return " ".join(x for x in (e["name"], e["version"]) if x) + (f" ({e['flags']})" if e["flags"] else "")


def baseline_bytes_per_token(b: dict, context: int | None = None) -> int | None:
    """Bytes one decode step reads for a baseline, None when unknown: its `weight_bytes`, else the catalog model at
    its `bytes_format`; plus fp16 K/V rows at the mean context (`context`, default the baseline's own) when the
    model is in the catalog."""
    preset = CATALOG.get(catalog_name(b["model"]))
    weights = b.get("weight_bytes")
    if weights is None:
        fmt = b.get("bytes_format")
        if preset is None or fmt is None:
            return None
        weights = preset.config.weight_bytes(fmt)
    if preset is None:
        return weights
    ctx = (context if context is not None else b["context"]) or 0
    mean_pos = ctx + ((b["tokens"] - 1) / 2 + 1 if b["tokens"] else 0)
    return weights + int(round(mean_pos * preset.config.kv_bytes_per_token()))


def _row(kind: str, engine: str, gpu: str, gpu_bw: float | None, precision: str, context, tpot_ms: float,
         bandwidth_gbs: float | None, source: str, ours: dict, label: str | None = None) -> dict:
    match = gpu_relation(gpu, ours["gpu"])
    frac = bandwidth_gbs / gpu_bw if bandwidth_gbs and gpu_bw else None
    normalised = (ours["roofline_frac"] / frac) if (match == "different" and frac and ours["roofline_frac"]) else None
    return {"kind": kind, "engine": engine, "gpu": gpu, "same_gpu": match == "same", "gpu_match": match,
            "precision": precision, "context": context, "tpot_ms": tpot_ms,
            "speedup": tpot_ms / ours["tpot_ms"] if match != "different" else None,
            "bandwidth_gbs": bandwidth_gbs, "gpu_bandwidth_gbs": gpu_bw, "roofline_frac": frac,
            "normalised_ratio": normalised, "label": label, "source": source}


def comparison_rows(run_record: dict, baselines: list[dict], peers: list[dict] | None = None) -> list[dict]:
    """Rows comparing a `run` record with the baselines of its model and with live peers (same process).

    The first row is ours. `speedup` (their TPOT / ours, >1: we are faster) is set only on the same GPU (`same_gpu`)
    and, as an absolute ratio, for a baseline whose GPU variant is not stated (`gpu_match`, see `gpu_relation`);
    `normalised_ratio` (our bandwidth fraction / theirs, >1: we get closer to our GPU's peak) only on a different
    GPU. A bandwidth fraction is achieved GB/s / the GPU's spec GB/s (`spec_bandwidth`). A fitted baseline is
    evaluated at the run's context and labelled (`label`).
    """
    gpu = run_record["gpu"]["name"]
    bw = run_record["bandwidth_gbs"]
    gpu_bw = spec_bandwidth(gpu)
    ours = {"gpu": gpu, "tpot_ms": run_record["tpot_ms"]["median"],
            "roofline_frac": bw / gpu_bw if gpu_bw else None}
    rows = [{"kind": "ours", "engine": f"atomflow-bench {run_record['tool']['version']}", "gpu": gpu,
             "same_gpu": True, "gpu_match": "same", "precision": run_record["weights"],
             "context": run_record["context"], "tpot_ms": ours["tpot_ms"], "speedup": 1.0, "bandwidth_gbs": bw,
             "gpu_bandwidth_gbs": gpu_bw, "roofline_frac": ours["roofline_frac"], "normalised_ratio": None,
             "label": None, "source": "this run"}]
    for p in peers or []:
        rows.append(_row("peer", p["engine"], p["gpu"], spec_bandwidth(p["gpu"]), p["precision"], p["context"],
                         p["tpot_ms"]["median"], p["bandwidth_gbs"], "measured in this run", ours))
    model = catalog_name(run_record["model"]["name"])
    for b in baselines:
        if catalog_name(b["model"]) != model:
            continue
        tpot, ctx, label = baseline_tpot(b, run_record["context"])
        nbytes = baseline_bytes_per_token(b, ctx)
        rows.append(_row("baseline", engine_label(b), b["gpu"]["name"], baseline_gpu_bandwidth(b), b["precision"],
                         ctx, tpot, nbytes / (tpot * 1e-3) / 1e9 if nbytes else None, b["source"], ours, label))
    return rows


def _fmt(v, spec: str, none: str = "n/a") -> str:
    return none if v is None else format(v, spec)


def comparison_table(rows: list[dict]):
    """The comparison (rows from `comparison_rows`) as an output.Tab."""
    cols = ["engine", "GPU", "precision", "ctx", "TPOT ms", "speedup (same GPU)", "achieved / spec GB/s",
            "roofline-normalised (different GPU)", "source"]
    t = Tab("comparison — speedup = their TPOT / ours (same GPU only); roofline-normalised = "
            "(our achieved GB/s / our GPU's spec GB/s) / (theirs / their GPU's spec GB/s) (different GPU only)",
            cols, key="comparison",
            right=tuple(c for c in cols if c not in ("engine", "GPU", "precision", "source")))
    for r in rows:
        if r["roofline_frac"] is None:
            frac = f"{_fmt(r['bandwidth_gbs'], '.0f')} / {_fmt(r['gpu_bandwidth_gbs'], '.0f', '?')}"
        else:
            frac = f"{r['bandwidth_gbs']:.0f} / {r['gpu_bandwidth_gbs']:.0f} = {100 * r['roofline_frac']:.0f}%"
        frac = Num((r["bandwidth_gbs"], r["gpu_bandwidth_gbs"]), frac)  # the percentage follows from the two
        match = r.get("gpu_match", "same" if r["same_gpu"] else "different")
        if r["kind"] == "ours":
            speed, norm = Num(None, "—"), Num(None, "—")
        elif match == "same":
            speed, norm = num(r["speedup"], ".2f", prefix="x"), Num(None, "— (same GPU)")
        elif match == VARIANT_NOT_STATED:
            speed = num(r["speedup"], ".2f", " (absolute ratio; GPU variant not stated, not a same-GPU speedup)",
                        prefix="x")
            norm = Num(None, "— (GPU variant not stated)")
        else:
            speed = Num(None, "— (different GPU)")
            norm = num(r["normalised_ratio"], ".2f", prefix="x", none="n/a (bandwidth unknown)")
        ctx = num(r["context"], "d", f" ({r['label']})" if r.get("label") else "", none="?")
        t.add(r["engine"], r["gpu"], r["precision"], ctx, num(r["tpot_ms"], ".3f"), speed,
              frac, norm, r["source"], cell_styles={"engine": "bold" if r["kind"] == "ours" else "",
                                                    "TPOT ms": "" if r["same_gpu"] else "dim"})
    return t


def attach_comparisons(rec: dict, baselines: list[dict], peers: list[dict] | None = None) -> list[dict]:
    """Compare `rec` with `baselines` and `peers`; both the peers and the rows are stored in `rec`."""
    if peers:
        rec["peers"] = peers
    rec["comparisons"] = comparison_rows(rec, baselines, peers)
    return rec["comparisons"]


def baselines_table(baselines: list[dict]):
    """`baseline list`: one row per recorded baseline (output.Tab)."""
    t = Tab("recorded baselines", ["model", "engine", "GPU", "GB/s", "precision", "ctx", "tokens", "TPOT ms", "tok/s",
                                   "source"], key="baselines", right=("GB/s", "ctx", "tokens", "TPOT ms", "tok/s"))
    for b in baselines:
        e, m = b["engine"], b["metrics"]
        fit = m.get("tpot_fit_ms")
        tpot = (Num(None, f"{fit['intercept']:g} + {fit['per_input_token']:g} x {fit['input']} (fitted)") if fit
                else num(m["tpot_ms"], ".3f"))
        tok_s = Num(None, "—") if fit else num(m["tok_per_s"], ".1f")
        t.add(b["model"], " ".join(x for x in (e["name"], e["version"]) if x), b["gpu"]["name"],
              num(b["gpu"]["memory_bandwidth_gbs"]), b["precision"], *(num(b[k]) for k in ("context", "tokens")),
              tpot, tok_s, b["source"])
    return t
