"""`compare-peers RESULTS...`: one table of ours, live peers and recorded baselines, from files.

Inputs: `run` records (`atomflow-bench/run/1`; a record of `run --peers` holds its HF peers in `peers[]`), baseline
files (`atomflow-bench/baseline/1`: a llama.cpp or server record, ...) and the recorded baselines directory (default:
the shipped baselines/; `--baselines DIR`). Ours, the reference, is the first run record among RESULTS, or `--ours`.

One row per record (and per peer in a run record). Columns and rules:

* TPOT ms, tok/s — the median TPOT and 1000 / TPOT. A baseline with a fitted line (`metrics.tpot_fit_ms`) is
  evaluated at ours' context and labelled "fitted line, evaluated at ctx N"; tok/s is then 1000 / that TPOT.
* bytes/token GB — each engine's own bytes read per token, from its record: a run's and a peer's
  `bytes_per_token.total`; a baseline's `weight_bytes` (a llama.cpp record's: its GGUF's size, less the
  token-embedding table when the model is untied, see measure/llama_cpp.py) or its catalog count at `bytes_format`,
  plus K/V rows (`baselines.baseline_bytes_per_token`); blank when unknown.
* % of copy roofline — (bytes / the copy bandwidth measured in the same run) / TPOT, only where the record has a copy
  bandwidth measured on that GPU: a run record (`roofline.pct`) and its peers on the run's GPU; a baseline measured on
  the same GPU model as ours (`baselines.gpu_relation` "same", e.g. llama-bench on the same machine) against our run's
  copy bandwidth, labelled so; blank otherwise.
* ours, per weight width — the reference run record (the first, or `--ours`) and every other run record of the same
  model, GPU and context whose weights are of another width (16-bit: fp16, F16, bf16; 8-bit: fp8, W8A16, Q8_0) are
  all "ours". Each other row is compared with ours of its own width (`weight_width` of its format), else with the
  reference: a Q8_0 row with our fp8 run, an F16 row with our fp16 run. The speedup cell names which ("vs ours fp8")
  whenever the table has several references or the row's width differs from its reference's.
* speedup vs ours — their TPOT / ours (>1: ours is faster), only on the same GPU as ours (`baselines.same_gpu`: the
  names equal word for word, case, punctuation and the words NVIDIA/GeForce aside). A baseline whose GPU variant is not
  stated gets the absolute ratio, labelled so (`baselines.gpu_relation` says why).
* roofline-normalised vs ours — for rows on another GPU: (our achieved GB/s / our GPU's spec GB/s) / (theirs / their
  GPU's spec GB/s), ours of the row's width as above, >1: ours gets closer to its GPU's peak; "n/a" when bytes or a
  spec bandwidth are unknown.
* prompt tokens, prefill tok/s, TTFT ms (these and the next column only when a row has a prefill figure: a table
  of records written before them keeps its columns) — the prefill, where a record has one: a run record's `prefill.prompt_tokens`,
  `prefill.tok_per_s` (prompt tokens / median TTFT, labelled with its `prefill.path`, batched or walked) and
  `ttft_ms.median`; a llama.cpp record's llama-bench prompt-processing test (`pp512`: `prompt_tests[]` in the
  provenance line of its notes, measure/llama_cpp.py; llama-bench's mean tok/s over repetitions, labelled "pp<n>", and
  "@ d<depth>" when llama-bench ran it after a context of that many tokens); a server baseline's `metrics.ttft_ms` at
  its `context` (the prompt the server reported). Blank for records without one (every record written before them).
* prefill vs ours — ours ahead when > 1: our prefill tok/s / theirs (a server's: their TTFT / ours, labelled
  "TTFT"), ours of the row's weight width, only on the same GPU and only where both prompts have the same length
  and start from an empty cache; a figure at another prompt length (llama-bench's pp512 against our 128-token
  prompt, or a pp test at a depth) is shown with its length and the cell says why it is not compared.
* Rows of another model than ours are left out, each with a note (on stderr with csv/json); rows at another context
  are kept, with their context and a note.
"""
from __future__ import annotations

import json
import math
import numbers
import re
from pathlib import Path

from .. import schemas
from ..errors import AtomflowError
from ..output import Num, Tab, num
from . import baselines as bl
from .gate import check_record
from .llama_cpp import provenance_of

RUN_SCHEMA = schemas.current("run")


def _positive_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _check_peers(rec: dict, where: str) -> None:
    peers = rec.get("peers")
    if peers is None:
        return
    if not isinstance(peers, list):
        raise AtomflowError(f"{where}: field 'peers' must be a list, got {type(peers).__name__}")
    for i, p in enumerate(peers):
        name = f"peers[{i}]"
        if not isinstance(p, dict):
            raise AtomflowError(f"{where}: field {name!r} must be an object")
        for key in ("engine", "gpu", "precision"):
            if not isinstance(p.get(key), str) or not p[key]:
                raise AtomflowError(f"{where}: field '{name}.{key}' must be a non-empty string, got {p.get(key)!r}")
        ctx = p.get("context")
        if not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < 0:
            raise AtomflowError(f"{where}: field '{name}.context' must be an integer >= 0, got {ctx!r}")
        tp = p.get("tpot_ms")
        if not isinstance(tp, dict) or not _positive_number(tp.get("median")):
            got = tp.get("median") if isinstance(tp, dict) else tp
            raise AtomflowError(f"{where}: field '{name}.tpot_ms.median' must be a positive number, got {got!r}")
        nbytes = p.get("bytes_per_token")
        if nbytes is not None and not (isinstance(nbytes, dict) and _positive_number(nbytes.get("total"))):
            raise AtomflowError(f"{where}: field '{name}.bytes_per_token.total' must be a positive number")


def load_result(path) -> tuple[str, dict]:
    """("run", record) or ("baseline", record) for a file; AtomflowError (one line naming the file) otherwise."""
    path = Path(path)
    try:
        rec = json.loads(path.read_text())
    except FileNotFoundError:
        raise AtomflowError(f"{path}: not found") from None
    except IsADirectoryError:
        raise AtomflowError(f"{path}: a directory, not a results file") from None
    except UnicodeDecodeError:
        raise AtomflowError(f"{path}: not a text file, not a results file") from None
    except json.JSONDecodeError as e:
        raise AtomflowError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except OSError as e:
        raise AtomflowError(f"{path}: unreadable ({e.strerror or e})") from None
    schema = rec.get("schema") if isinstance(rec, dict) else None
    kind = schemas.check(rec, ("run", "baseline"), path)
    if kind == "run":
        if rec.get("instrument"):
            raise AtomflowError(f"{path}: a timing-instrument run ({rec['instrument']}): wrong outputs on purpose, "
                                "a bound, not a result")
        check_record(rec, str(path))  # every figure read here, as `compare` checks them
        _check_peers(rec, str(path))
        return "run", rec
    if kind == "baseline":
        return "baseline", bl.validate(rec, str(path))
    raise AtomflowError(f"{path}: not a {RUN_SCHEMA} run record nor a {bl.SCHEMA} baseline "
                        f"(schema={schema!r})")


def _recorded(directory) -> list[tuple[str, dict]]:
    d = Path(directory) if directory is not None else bl.DEFAULT_DIR
    if directory is not None and not d.is_dir():
        raise AtomflowError(f"--baselines {directory}: not a directory")
    if not d.is_dir():
        return []
    return [(str(p), bl.load_baseline(p)) for p in sorted(d.glob("*.json"))]


def _model_of(kind: str, rec: dict) -> str:
    return bl.catalog_name(rec["model"]["name"] if kind == "run" else rec["model"])


_WIDTH = {16: ("fp16", "f16", "bf16", "float16", "bfloat16", "half"),
          8: ("fp8", "w8a16", "q8_0", "q8", "int8", "fp8-e4m3", "e4m3")}


def weight_width(fmt: str | None) -> int | None:
    """16 or 8: the weight width a format's leading word names ("fp16", "F16 (GGUF ...)", "bf16", "fp8", "W8A16 (...)",
    "Q8_0"); None when it names none ("unspecified (likely bf16)", "Q4_K")."""
    word = re.split(r"[\s(;,]", (fmt or "").strip().lower(), maxsplit=1)[0]
    return next((w for w, names in _WIDTH.items() if word in names), None)


def _run_prefill(rec: dict) -> dict | None:
    """A run record's prefill figures, None for a record written before them."""
    pre = rec.get("prefill") or {}
    ttft = (rec.get("ttft_ms") or {}).get("median")
    if ttft is None and not pre:
        return None
    return {"prompt_tokens": pre.get("prompt_tokens", rec["context"]), "depth": 0, "tok_per_s": pre.get("tok_per_s"),
            "ttft_ms": ttft, "what": pre.get("path")}


def _baseline_prefill(b: dict, prompt_tokens: int | None) -> dict | None:
    """A baseline's prefill figures: its TTFT at its prompt (`context`, a server's); else llama-bench's
    prompt-processing test from the provenance of a llama.cpp record, the one of `prompt_tokens` tokens from an empty
    cache where llama-bench ran it, else the first; None when the record has neither."""
    ttft = b["metrics"].get("ttft_ms")
    if ttft is not None:
        return {"prompt_tokens": b["context"], "depth": 0, "tok_per_s": None, "ttft_ms": ttft, "what": None}
    try:
        tests = (provenance_of(b) or {}).get("prompt_tests") or []
    except ValueError:  # a notes line that is not the JSON records_from_bench wrote
        return None
    tests = [t for t in tests if isinstance(t, dict) and _positive_number(t.get("avg_ts"))
             and isinstance(t.get("n_prompt"), int) and isinstance(t.get("n_depth") or 0, int)]
    if not tests:
        return None
    t = next((t for t in tests if t["n_prompt"] == prompt_tokens and not t.get("n_depth")), tests[0])
    depth = t.get("n_depth") or 0
    return {"prompt_tokens": t["n_prompt"], "depth": depth, "tok_per_s": float(t["avg_ts"]), "ttft_ms": None,
            "what": f"llama-bench pp{t['n_prompt']}" + (f" @ d{depth}" if depth else "") + ", mean"}


def _prefill_ratio(pre: dict | None, ours: dict | None, match: str) -> tuple[float | None, str]:
    """(our prefill's lead, > 1: ours ahead; its basis "tok/s" or "TTFT", or why there is none) for a row's prefill
    figures against ours: the same GPU, the same prompt length, both from an empty cache."""
    if pre is None:
        return None, ""
    if match != "same":
        return None, "GPU variant not stated" if match == bl.VARIANT_NOT_STATED else "other GPU"
    if ours is None:
        return None, "ours has no prefill figure"
    if pre["prompt_tokens"] is None:
        return None, "prompt length not stated"
    if pre["prompt_tokens"] != ours["prompt_tokens"] or pre["depth"]:
        at = f"prompt {pre['prompt_tokens']}" + (f" after {pre['depth']}" if pre["depth"] else "")
        return None, f"{at}, ours {ours['prompt_tokens']}: not compared"
    if pre["tok_per_s"] and ours["tok_per_s"]:
        return ours["tok_per_s"] / pre["tok_per_s"], "tok/s"
    if pre["ttft_ms"] and ours["ttft_ms"]:
        return pre["ttft_ms"] / ours["ttft_ms"], "TTFT"
    return None, ""


def _row(kind, engine, fmt, gpu, ctx, tpot, nbytes, copy_pct, source, ours, *, gpu_bw=None, label=None,
         prefill=None) -> dict:
    match = "same" if kind == "ours" else bl.gpu_relation(gpu, ours["gpu"])
    spec = gpu_bw if gpu_bw is not None else (None if bl.variant_not_stated(gpu) else bl.spec_bandwidth(gpu))
    bw = nbytes / (tpot * 1e-3) / 1e9 if nbytes else None
    frac = bw / spec if bw and spec else None
    notes = [label] if label else []
    if kind != "ours":
        if match == bl.VARIANT_NOT_STATED:
            notes.append("GPU variant not stated: absolute TPOT ratio, not a same-GPU speedup")
        elif match == "different":
            spec_text = f"spec {spec:.0f} GB/s" if spec else "spec bandwidth unknown"
            notes.append(f"other GPU: roofline-normalised ({spec_text})")
        if ctx is None:
            notes.append("ctx not stated")
        elif ctx != ours["context"]:
            notes.append(f"ctx {ctx}, ours {ours['context']}")
    ratio, basis = (None, "") if kind == "ours" else _prefill_ratio(prefill, ours["prefill"], match)
    pre = prefill or {}
    return {"kind": kind, "engine": engine, "format": fmt, "gpu": gpu, "gpu_match": match, "context": ctx,
            "prompt_tokens": pre.get("prompt_tokens"), "prompt_depth": pre.get("depth"),
            "prefill_tok_per_s": pre.get("tok_per_s"), "prefill_what": pre.get("what"), "ttft_ms": pre.get("ttft_ms"),
            "prefill_ratio": ratio, "prefill_basis": basis,
            "tpot_ms": tpot, "tok_per_s": 1e3 / tpot, "bytes_per_token": nbytes, "bandwidth_gbs": bw,
            "gpu_bandwidth_gbs": spec, "roofline_frac": frac, "copy_roofline_pct": copy_pct,
            "speedup": tpot / ours["tpot_ms"] if match != "different" else None,
            "normalised_ratio": (ours["roofline_frac"] / frac if match == "different" and frac
                                 and ours["roofline_frac"] else None),
            "note": "; ".join(notes), "source": source,
            "ours_format": None if kind == "ours" else ours["format"],
            "ours_named": kind != "ours" and (ours["several"] or weight_width(fmt) != weight_width(ours["format"]))}


def _run_rows(kind: str, path: str, rec: dict, ours_for) -> list[dict]:
    """The run's row and one per peer in it; `ours_for(format)`: the reference of that format's weight width."""
    gpu, copy = rec["gpu"]["name"], rec["copy_bandwidth_gbs"]["median"]
    tpot = rec["tpot_ms"]["median"]
    nbytes = rec["bytes_per_token"].get("total") if isinstance(rec["bytes_per_token"], dict) else None
    rows = [_row(kind, f"atomflow-bench {rec.get('tool', {}).get('version', '?')}", rec["weights"], gpu,
                 rec["context"], tpot, nbytes, rec["roofline"]["pct"], path, ours_for(rec["weights"]),
                 prefill=_run_prefill(rec))]
    for i, p in enumerate(rec.get("peers") or []):
        pb = (p.get("bytes_per_token") or {}).get("total")
        p_tpot = p["tpot_ms"]["median"]
        # the copy bandwidth was measured on the run's GPU: a roofline only for peers that ran on it
        pct = 100 * pb / (copy * 1e9) * 1e3 / p_tpot if pb and p["gpu"] == gpu else None
        rows.append(_row("peer", p["engine"], p["precision"], p["gpu"], p["context"], p_tpot, pb, pct,
                         f"{path} peers[{i}]", ours_for(p["precision"])))
    return rows


def _baseline_row(path: str, b: dict, ours: dict) -> dict:
    tpot, ctx, label = bl.baseline_tpot(b, ours["context"])
    nbytes = bl.baseline_bytes_per_token(b, ctx)
    pct = None
    if nbytes and tpot and bl.gpu_relation(b["gpu"]["name"], ours["gpu"]) == "same":
        # measured on our GPU model: its bytes over the copy bandwidth our run measured on that GPU
        pct = 100 * nbytes / (ours["copy_gbs"] * 1e9) * 1e3 / tpot
        label = "; ".join(x for x in (label, "% of roofline: our run's copy bandwidth (same GPU model)") if x)
    prompt = (ours["prefill"] or {}).get("prompt_tokens", ours["context"])  # our run's prompt: its context
    return _row("baseline", bl.engine_label(b), b["precision"], b["gpu"]["name"], ctx, tpot, nbytes, pct,
                f"{b['source']} [{Path(path).name}]", ours, gpu_bw=bl.baseline_gpu_bandwidth(b), label=label,
                prefill=_baseline_prefill(b, prompt))


def compare_peers(results, ours: str | None = None, baselines_dir=None) -> tuple[list[dict], list[str]]:
    """(rows, notes): the rows of `compare_peers_table`, ours first; notes name what was left out and why."""
    paths = list(results)
    if ours is not None and all(Path(ours).resolve() != Path(p).resolve() for p in paths):
        paths.insert(0, ours)
    if not paths:
        raise AtomflowError("compare-peers: no files given (RESULTS... or --ours FILE)")
    loaded, seen = [], set()
    for p in paths:
        key = Path(p).resolve()
        if key in seen:
            continue
        seen.add(key)
        loaded.append((str(p), *load_result(p)))
    for p, b in _recorded(baselines_dir):
        if Path(p).resolve() not in seen:
            seen.add(Path(p).resolve())
            loaded.append((p, "baseline", b))
    if ours is not None:
        ref = next(x for x in loaded if Path(x[0]).resolve() == Path(ours).resolve())
        if ref[1] != "run":
            raise AtomflowError(f"--ours {ours}: not a {RUN_SCHEMA} run record (a baseline)")
    else:
        ref = next((x for x in loaded if x[1] == "run"), None)
        if ref is None:
            raise AtomflowError(f"compare-peers: no {RUN_SCHEMA} run record among RESULTS to compare with; "
                                "give one (or --ours FILE)")
    rec = ref[2]
    gpu, model = rec["gpu"]["name"], _model_of("run", rec)
    # ours: the reference, then one run record per other weight width of the same model, GPU and context
    refs = [ref]
    for x in loaded:
        if (x[1] == "run" and x[2] is not rec and _model_of("run", x[2]) == model
                and bl.same_gpu(x[2]["gpu"]["name"], gpu) and x[2]["context"] == rec["context"]
                and weight_width(x[2]["weights"]) is not None
                and all(weight_width(x[2]["weights"]) != weight_width(y[2]["weights"]) for y in refs)):
            refs.append(x)

    def as_ref(r: dict) -> dict:
        spec = bl.spec_bandwidth(r["gpu"]["name"])
        return {"gpu": r["gpu"]["name"], "tpot_ms": r["tpot_ms"]["median"], "context": r["context"],
                "format": r["weights"], "several": len(refs) > 1, "copy_gbs": r["copy_bandwidth_gbs"]["median"],
                "roofline_frac": r["bandwidth_gbs"] / spec if spec else None, "prefill": _run_prefill(r)}

    by_width = {weight_width(r["weights"]): as_ref(r) for _, _, r in reversed(refs)}
    main = as_ref(rec)

    def ours_for(fmt: str) -> dict:
        return by_width.get(weight_width(fmt), main)

    rows, notes = [], []
    for path, _, r in refs:
        rows += _run_rows("ours", path, r, ours_for)
    is_ref = {id(x[2]) for x in refs}
    for path, kind, r in loaded:
        if id(r) in is_ref:
            continue
        m = _model_of(kind, r)
        if m != model:
            what = "run" if kind == "run" else " ".join(x for x in (r["engine"]["name"], r["engine"]["version"]) if x)
            notes.append(f"left out: {path} ({what}): model {m}, ours {model}")
            continue
        if kind == "run":
            rows += _run_rows("run", path, r, ours_for)
        else:
            rows.append(_baseline_row(path, r, ours_for(r["precision"])))
    return rows, notes


PREFILL_VS = "prefill vs ours (same GPU, same prompt)"
PREFILL_COLUMNS = ("prompt tokens", "prefill tok/s", "TTFT ms", PREFILL_VS)


def _prefill_cells(r: dict) -> list:
    """The row's prompt tokens, prefill tok/s, TTFT ms and prefill-vs-ours cells."""
    depth = f" @ d{r['prompt_depth']}" if r["prompt_depth"] else ""
    what = f" ({r['prefill_what']})" if r["prefill_what"] else ""
    if r["kind"] == "ours":
        vs = Num(None, "— (ours)" if r["prompt_tokens"] is not None else "")
    elif r["prefill_ratio"] is not None:
        named = f" vs ours {r['ours_format']}" if r["ours_named"] else ""
        vs = num(r["prefill_ratio"], ".2f", named + (" (TTFT)" if r["prefill_basis"] == "TTFT" else ""), prefix="x")
    else:
        vs = Num(None, f"— ({r['prefill_basis']})" if r["prefill_basis"] else "")
    return [num(r["prompt_tokens"], "d", depth, none=""), num(r["prefill_tok_per_s"], ".0f", what, none=""),
            num(r["ttft_ms"], ".2f", none=""), vs]


def compare_peers_table(rows: list[dict]):
    """The rows of `compare_peers` as an output.Tab; the prefill's columns only where a row has a prefill figure (none
    of the records written before them has one: their table keeps its columns)."""
    prefill = any(r["prompt_tokens"] is not None or r["ttft_ms"] is not None for r in rows)
    extra = list(PREFILL_COLUMNS) if prefill else []
    cols = ["engine", "format", "GPU", "ctx", "TPOT ms", "tok/s", "bytes/token GB", "% of copy roofline",
            "speedup vs ours (same GPU)", "roofline-normalised vs ours (other GPU)", *extra, "note", "source"]
    t = Tab("compare-peers — speedup = their TPOT / ours (same GPU only); roofline-normalised = (our achieved GB/s / "
            "our GPU's spec GB/s) / (theirs / their GPU's spec GB/s) (other GPU only); "
            + ("prefill vs ours = our prefill tok/s / theirs (or their TTFT / ours) at the same prompt length from an "
               "empty cache (same GPU only); " if prefill else "")
            + "ours = our run of the row's weight width (16-bit: fp16/F16/bf16, 8-bit: fp8/W8A16/Q8_0) when given, "
            "else the first; >1: ours is ahead",
            cols, key="compare-peers", right=("ctx", "TPOT ms", "tok/s", "bytes/token GB", "% of copy roofline",
                                              "speedup vs ours (same GPU)", "roofline-normalised vs ours (other GPU)",
                                              *extra))
    for r in rows:
        match = r["gpu_match"]
        if r["kind"] == "ours":
            speed, norm = Num(None, "— (ours)"), Num(None, "— (ours)")
        else:
            vs = f" vs ours {r['ours_format']}" if r["ours_named"] else ""
            if match == "same":
                speed, norm = num(r["speedup"], ".2f", vs, prefix="x"), Num(None, "— (same GPU)")
            elif match == bl.VARIANT_NOT_STATED:
                speed = num(r["speedup"], ".2f", f"{vs} (absolute; GPU variant not stated)", prefix="x")
                norm = Num(None, "— (GPU variant not stated)")
            else:
                speed = Num(None, "— (other GPU)")
                norm = num(r["normalised_ratio"], ".2f", vs, prefix="x", none="n/a (bytes or spec bandwidth unknown)")
        t.add(r["engine"], r["format"], r["gpu"], num(r["context"], "d", none=""),
              num(r["tpot_ms"], ".3f"), num(r["tok_per_s"], ".1f"),
              num(None if r["bytes_per_token"] is None else r["bytes_per_token"] / 1e9, ".3f", none=""),
              num(r["copy_roofline_pct"], ".1f", "%", none=""),
              speed, norm, *(_prefill_cells(r) if prefill else []), r["note"] or None, r["source"],
              cell_styles={"engine": "bold" if r["kind"] == "ours" else "",
                           "TPOT ms": "" if match == "same" else "dim"})
    return t
