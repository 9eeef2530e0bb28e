"""`compare BASELINE.json NEW.json`: the CI performance-regression gate between two `run` results files.

Exit codes of `atomflow-bench compare` (the contract CI scripts rely on; `gate()` returns them):

    0  no regression: within the threshold, faster, or slower but within noise ("inconclusive", a warning)
    1  a regression beyond the threshold (and outside the p10-p90 bands), in TPOT or in TTFT; nothing else exits 1
    2  refused, no verdict: the records are not comparable (another `gpu.name`, `model.name`, `weights`,
       `context` or tensor-parallel degree `tp.n`; a timing-instrument record), a figure the verdict or the table uses is missing or is not a
       positive finite number (NaN, inf, <= 0, a string, a bool, null), a file is missing, unreadable, not
       valid JSON or not a results file, `--max-regression` is not a percentage in [0%, 100%], or anything
       unexpected went wrong. Exactly one line on stderr, `error: <file>: <field> ...`.

Refusal: the two files must describe the same measurement — same `gpu.name`, `model.name`, `weights`,
`context` and `tp.n` (1 when a record has no `tp`); otherwise `CompareRefused` names the first field that differs. Every figure used is checked
first (`check_record`), in both records, so a NaN median cannot slip through as "ok (TPOT +nan%)" and a
missing `p10` cannot become a traceback (which would exit 1, the code for "regression"). A different
`tokens` count, a copy bandwidth or a tensor-core rate more than 5% apart (another machine state: clocks, another
card of the same model) only warns.

Regression rule, on TPOT (ms/token): with B, N the base and new medians and [p10, p90] each run's spread,

    regression  <=>  N - B > max_regression * B      (slower by more than the allowed fraction)
                and  N_p10 > B_p90                   (the runs' p10-p90 bands do not overlap)

A same-code rerun, whose median falls inside the other's p10-p90 band, therefore never fails, and a run
that is slower by more than the threshold with tight bands always does. Slower by more than the threshold
while the bands overlap is reported as "inconclusive (within noise)" and passes with a warning: the
measurement cannot tell.

TTFT (`ttft_ms`, time to first token: the prompt's prefill up to the first token made) is gated by the same rule
when both records hold it and their prompts went the same way (`prefill.path` and `prefill.prompt_tokens` equal).
The verdict is a regression (or inconclusive) when either time is one, else improved when either improved. The
optional fields (`ttft_ms`, `prefill`, `tensor_core_tflops`) are absent from records written before them: when only
one record has TTFT, or the prefill paths differ ("batched" against "walked": the batched prefill against the prompt
walked token by token through the decode step, two different algorithms), TTFT is shown but not gated, with a
warning that says why. Such a pair is not refused: the TPOT verdict still holds (the decode step is the same
measurement), and a refusal (exit 2) would take the decode gate away from every CI run whose reference predates TTFT
or whose prefill path changed. A CI that requires the batched path checks `prefill.path` in the new record itself.
"""
from __future__ import annotations

import math
import numbers

from rich.markup import escape

from ..errors import AtomflowError
from ..output import PipeClosed, Tab, is_machine, num, render
from .run_record import load

EXIT_OK, EXIT_REGRESSION, EXIT_REFUSED = 0, 1, 2
MAX_THRESHOLD = 1.0  # 100%: a gate that lets a run twice as slow pass is a mistake, not a threshold
MATCH_FIELDS = (("gpu.name", lambda r: r["gpu"]["name"]), ("model.name", lambda r: r["model"]["name"]),
                ("weights", lambda r: r["weights"]), ("context", lambda r: r["context"]),
                ("tp.n", lambda r: (r.get("tp") or {}).get("n", 1)))
MACHINE_WARN = 0.05  # a copy bandwidth or a tensor-core rate this far apart: another machine state, a warning
GATED_FIELDS = {"TPOT": "tpot_ms", "TTFT": "ttft_ms"}  # the times the regression rule judges
PREFILL_PATHS = ("batched", "walked")
SPREAD = ("median", "p10", "p90")


class CompareRefused(AtomflowError):
    """The two files do not measure the same thing (or cannot be read): no verdict."""


def parse_fraction(text: str) -> float:
    """'5%' or '5' -> 0.05 (always percent); refuses non-numbers, NaN/inf, negatives and more than 100%."""
    t = str(text).strip()
    try:
        v = float(t[:-1] if t.endswith("%") else t)
    except ValueError:
        raise AtomflowError(f"--max-regression {text!r}: expected a percentage such as 5%") from None
    if not math.isfinite(v):
        raise AtomflowError(f"--max-regression {text!r}: not a finite number; expected a percentage such as 5%")
    if not 0 <= v / 100 <= MAX_THRESHOLD:
        raise AtomflowError(f"--max-regression {text!r}: must be between 0% and {100 * MAX_THRESHOLD:g}%")
    return v / 100


# every figure compare_runs reads: (dotted field, kind). "number": a positive finite int/float, not a bool;
# "count": a positive int; "name": a non-empty string. The table reads the figures, the verdict the TPOT ones.
CHECKED_FIELDS = (("gpu.name", "name"), ("model.name", "name"), ("weights", "name"), ("context", "count"),
                  ("tokens", "count"), ("tpot_ms.median", "number"), ("tpot_ms.p10", "number"),
                  ("tpot_ms.p90", "number"), ("tok_per_s", "number"), ("bandwidth_gbs", "number"),
                  ("roofline.pct", "number"), ("copy_bandwidth_gbs.median", "number"))


def _describe(v) -> str:
    """A value as the JSON file spells it, short: nan, -1, 'a string', true, null, a list."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "the boolean " + ("true" if v else "false")
    if isinstance(v, str):
        return "the string " + _short(repr(v))
    if isinstance(v, numbers.Real):
        return _short(repr(v) if isinstance(v, numbers.Integral) else repr(float(v)))
    return {dict: "an object", list: "a list"}.get(type(v), f"a {type(v).__name__}")


def _short(r: str, n: int = 40) -> str:
    return r if len(r) <= n else r[:n - 3] + "..."


def _lookup(rec: dict, label: str, dotted: str):
    cur, path = rec, []
    for key in dotted.split("."):
        if not isinstance(cur, dict):
            raise CompareRefused(f"{label}: {'.'.join(path)} is {_describe(cur)}, not an object")
        if key not in cur:
            raise CompareRefused(f"{label}: {'.'.join(path + [key])} is missing")
        cur = cur[key]
        path.append(key)
    return cur


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _check_figure(v, label: str, field: str, kind: str) -> None:
    if kind == "name":
        if not isinstance(v, str) or not v.strip():
            raise CompareRefused(f"{label}: {field} is {_describe(v)}, not a non-empty string")
    elif kind == "count":
        if not (isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0):
            raise CompareRefused(f"{label}: {field} is {_describe(v)}, not a positive integer")
    else:
        try:
            ok = _is_number(v) and math.isfinite(v) and v > 0
        except OverflowError:  # an integer too large for a float
            ok = False
        if not ok:
            raise CompareRefused(f"{label}: {field} is {_describe(v)}, not a positive finite number")


def _check_spread(rec: dict, label: str, field: str) -> None:
    """`field`'s median, p10 and p90: positive finite numbers, ordered p10 <= median <= p90."""
    for q in SPREAD:
        _check_figure(_lookup(rec, label, f"{field}.{q}"), label, f"{field}.{q}", "number")
    t = rec[field]
    if not t["p10"] <= t["median"] <= t["p90"]:
        raise CompareRefused(f"{label}: {field}.p10/median/p90 are {t['p10']!r}/{t['median']!r}/{t['p90']!r}, "
                             "not an ordered p10 <= median <= p90 spread")


def check_record(rec, label: str) -> None:
    """CompareRefused naming `label` (the file) and the first field compare_runs reads that is missing or invalid:
    figures must be positive finite numbers (not NaN/inf, not <= 0, not strings, bools or null), counts positive
    integers, names non-empty strings, and the TPOT spread ordered p10 <= median <= p90. The optional fields
    `ttft_ms`, `tensor_core_tflops` (their spreads, ordered) and `prefill` (`path` batched or walked,
    `prompt_tokens`, `tok_per_s`, `pct_of_peak` where not null) are checked where a record holds them; absent or
    null, they were not measured."""
    if not isinstance(rec, dict):
        raise CompareRefused(f"{label}: the record is {_describe(rec)}, not a JSON object")
    for field, kind in CHECKED_FIELDS:
        _check_figure(_lookup(rec, label, field), label, field, kind)
    _check_spread(rec, label, "tpot_ms")
    for field in ("ttft_ms", "tensor_core_tflops"):
        if rec.get(field) is not None:
            _check_spread(rec, label, field)
    if rec.get("prefill") is not None:
        path = _lookup(rec, label, "prefill.path")
        if path not in PREFILL_PATHS:
            raise CompareRefused(f"{label}: prefill.path is {_describe(path)}, not one of "
                                 + ", ".join(map(repr, PREFILL_PATHS)))
        _check_figure(_lookup(rec, label, "prefill.prompt_tokens"), label, "prefill.prompt_tokens", "count")
        _check_figure(_lookup(rec, label, "prefill.tok_per_s"), label, "prefill.tok_per_s", "number")
        if rec["prefill"].get("pct_of_peak") is not None:
            _check_figure(rec["prefill"]["pct_of_peak"], label, "prefill.pct_of_peak", "number")


def _instrument(r: dict) -> str | None:
    """The timing instrument a record was made with, as one string, or None for an ordinary run."""
    inst = r.get("instrument")
    if not inst:
        return None
    if isinstance(inst, (list, tuple)):
        return " ".join(str(x) for x in inst)
    return str(inst)


def _get(r: dict, path: tuple):
    """The value at `path` in a record, None where a key (an optional field) is absent."""
    for k in path:
        r = r.get(k) if isinstance(r, dict) else None
    return r


# (label, path, lower_is_better): the diff table's rows, in order; the optional fields' rows come where either
# record holds the figure
METRICS = (("TPOT median (ms)", ("tpot_ms", "median"), True), ("TPOT p10 (ms)", ("tpot_ms", "p10"), True),
           ("TPOT p90 (ms)", ("tpot_ms", "p90"), True), ("tok/s", ("tok_per_s",), False),
           ("achieved bandwidth (GB/s)", ("bandwidth_gbs",), False), ("% of roofline", ("roofline", "pct"), False),
           ("copy bandwidth (GB/s)", ("copy_bandwidth_gbs", "median"), False))
OPTIONAL_METRICS = (("TTFT median (ms)", ("ttft_ms", "median"), True), ("TTFT p10 (ms)", ("ttft_ms", "p10"), True),
                    ("TTFT p90 (ms)", ("ttft_ms", "p90"), True), ("prefill tok/s", ("prefill", "tok_per_s"), False),
                    ("tensor-core TFLOPS", ("tensor_core_tflops", "median"), False))


def _row(label: str, vb, vn, lower: bool) -> dict:
    if vb is None or vn is None:  # the figure is in one record only
        return {"metric": label, "baseline": vb, "new": vn, "delta": None, "delta_pct": None, "worse": False}
    return {"metric": label, "baseline": vb, "new": vn, "delta": vn - vb,
            "delta_pct": 100 * (vn - vb) / vb if vb else None, "worse": vn > vb if lower else vn < vb}


def _judge(b: dict, n: dict, max_regression: float) -> dict:
    """The regression rule (module doc) on one spread {median, p10, p90} of a lower-is-better time."""
    delta = n["median"] - b["median"]
    slower = delta > max_regression * b["median"]
    if slower:
        status = "regression" if n["p10"] > b["p90"] else "inconclusive"
    else:
        status = "improved" if -delta > max_regression * b["median"] and n["p90"] < b["p10"] else "ok"
    return {"status": status, "delta_ms": delta, "delta_pct": 100 * delta / b["median"]}


def ttft_not_gated(base: dict, new: dict) -> str | None:
    """Why TTFT is not gated between two checked records (shown, with a warning), None when it is or when neither
    record has it."""
    has = (base.get("ttft_ms") is not None, new.get("ttft_ms") is not None)
    if not any(has):
        return None
    if not all(has):
        side, other = ("new", "baseline") if has[1] else ("baseline", "new")
        return (f"TTFT only in the {side} record (the {other} has no ttft_ms): not gated; "
                "a reference recorded with TTFT gates it")
    for key in ("path", "prompt_tokens"):
        vb, vn = _get(base, ("prefill", key)), _get(new, ("prefill", key))
        if vb != vn:
            return (f"prefill {key} differs (baseline {vb if vb is not None else 'not recorded'}, new "
                    f"{vn if vn is not None else 'not recorded'}): TTFT not gated, the two are not like-for-like")
    return None


def _apart(label: str, what: str, vb: float, vn: float, unit: str) -> str | None:
    if abs(vn - vb) <= MACHINE_WARN * vb:
        return None
    return (f"{label} differs by {100 * (vn - vb) / vb:+.1f}% ({vb:.0f} -> {vn:.0f} {unit}): the machine state "
            f"differs (clocks, another card); {what} changes may come from it")


def compare_runs(base: dict, new: dict, max_regression: float = 0.05,
                 names: tuple[str, str] = ("baseline", "new")) -> dict:
    """Verdict and diff rows for two results records; CompareRefused when they are not comparable or a figure is
    missing or invalid (`names`: how the refusal names each record, e.g. its file). `gated`: the rule's outcome per
    gated time (TPOT, and TTFT where both records hold it like-for-like); `status`: a regression (else inconclusive)
    when either is one, else improved when either improved, else ok."""
    if not (_is_number(max_regression) and 0 <= max_regression <= MAX_THRESHOLD):  # NaN fails the comparison
        raise CompareRefused(f"max_regression {max_regression!r}: must be a fraction between 0 and {MAX_THRESHOLD:g}")
    for side, r, label in (("baseline", base, names[0]), ("new", new, names[1])):
        inst = _instrument(r) if isinstance(r, dict) else None
        if inst:
            raise CompareRefused(f"{label}: refusing to compare: the {side} run is a timing instrument "
                                 f"({inst}: wrong outputs on purpose), not a result")
    check_record(base, names[0])
    check_record(new, names[1])
    for name, get in MATCH_FIELDS:
        if get(base) != get(new):
            raise CompareRefused(f"refusing to compare: {name} differs (baseline {get(base)!r}, new {get(new)!r})")
    warnings = []
    if base["tokens"] != new["tokens"]:
        warnings.append(f"tokens differ (baseline {base['tokens']}, new {new['tokens']}): mean KV length differs")
    w = _apart("copy bandwidth", "TPOT", base["copy_bandwidth_gbs"]["median"], new["copy_bandwidth_gbs"]["median"],
               "GB/s")
    tb, tn = _get(base, ("tensor_core_tflops", "median")), _get(new, ("tensor_core_tflops", "median"))
    w2 = _apart("tensor-core TFLOPS", "TTFT", tb, tn, "TFLOPS") if tb and tn else None
    warnings += [x for x in (w, w2) if x]
    gated = {"TPOT": _judge(base["tpot_ms"], new["tpot_ms"], max_regression)}
    ttft_note = ttft_not_gated(base, new)
    if ttft_note:
        warnings.append(ttft_note)
    elif new.get("ttft_ms") is not None:
        gated["TTFT"] = _judge(base["ttft_ms"], new["ttft_ms"], max_regression)
    for name, j in gated.items():
        if j["status"] == "inconclusive":
            b, n = (r[GATED_FIELDS[name]] for r in (base, new))
            warnings.append(f"{name} +{j['delta_pct']:.1f}% but the p10-p90 bands overlap "
                            f"(new p10 {n['p10']:.4f} <= baseline p90 {b['p90']:.4f} ms): within noise, not failed")
    status = next(s for s in ("regression", "inconclusive", "improved", "ok")
                  if any(j["status"] == s for j in gated.values()))
    rows = [_row(label, _get(base, path), _get(new, path), lower) for label, path, lower in METRICS]
    rows += [_row(label, _get(base, path), _get(new, path), lower) for label, path, lower in OPTIONAL_METRICS
             if _get(base, path) is not None or _get(new, path) is not None]
    return {"status": status, "regression": status == "regression", "max_regression": max_regression,
            "delta_ms": gated["TPOT"]["delta_ms"], "delta_pct": gated["TPOT"]["delta_pct"], "gated": gated,
            "ttft_note": ttft_note, "rows": rows, "warnings": warnings}


def _load(path) -> dict:
    try:
        return load(path)
    except CompareRefused:
        raise
    except AtomflowError as e:  # not found, not valid JSON, not a results file, lacks a top-level field
        raise CompareRefused(str(e)) from None
    except UnicodeDecodeError:
        raise CompareRefused(f"{path}: not valid JSON (not UTF-8 text)") from None
    except OSError as e:  # a directory, no permission, an I/O error
        raise CompareRefused(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
    except (ValueError, RecursionError) as e:  # whatever else the JSON parser refuses
        raise CompareRefused(f"{path}: not valid JSON ({type(e).__name__})") from None


def load_pair(base_path, new_path) -> tuple[dict, dict]:
    """Both results files through `report.load`; any problem becomes CompareRefused naming the file (exit 2)."""
    return _load(base_path), _load(new_path)


VERDICTS = {"regression": ("REGRESSION", "red"), "inconclusive": ("inconclusive", "yellow"),
            "improved": ("improved", "green"), "ok": ("ok", "green")}


def verdict_text(result: dict) -> str:
    """The verdict in words, e.g. "ok (TPOT +1.00%, TTFT -0.50%, allowed +5% beyond the p10-p90 bands)"."""
    parts = [f"{name} {j['delta_pct']:+.2f}%" for name, j in result["gated"].items()]
    if result.get("ttft_note"):
        parts.append("TTFT not gated")
    return (f"{VERDICTS[result['status']][0]} ({', '.join(parts)}, "
            f"allowed +{100 * result['max_regression']:g}% beyond the p10-p90 bands)")


def diff_table(result: dict, base_name: str, new_name: str):
    """The diff as an output.Tab: metric, baseline, new, delta, delta %; the verdict in the title."""
    cols = ["metric", "baseline", "new", "delta", "delta %"]
    t = Tab(f"compare {base_name} -> {new_name}: {verdict_text(result)}", cols, key="compare",
            right=tuple(cols[1:]), title_style=VERDICTS[result["status"]][1])
    for r in result["rows"]:
        worse = r["worse"] and abs(r["delta_pct"] or 0) > 100 * result["max_regression"]
        t.add(r["metric"], num(r["baseline"], ".4g", none="not recorded"), num(r["new"], ".4g", none="not recorded"),
              num(r["delta"], "+.4g"),
              num(r["delta_pct"], "+.2f", "%", none="n/a"),
              cell_styles={"delta %": "red" if worse else ""})
    return t


def one_line(text) -> str:
    """`text` on one line (newlines, carriage returns and other line breaks become spaces)."""
    return " ".join(str(text).splitlines()).strip()


def gate(base_path, new_path, max_regression_text, console, err, fmt=None) -> int:
    """The `compare` command: the diff table (in `fmt`, output.render) and warnings on `console` (on stderr, one
    line each, with --format csv or json), and the exit code (EXIT_OK, EXIT_REGRESSION, EXIT_REFUSED). A refusal —
    and any unexpected exception, so that nothing but a regression exits 1 — is one line on stderr through
    `err(line)`, `error: <file>: <field> ...`, and EXIT_REFUSED."""
    try:
        threshold = parse_fraction(max_regression_text)
        base, new = load_pair(base_path, new_path)
        result = compare_runs(base, new, threshold, names=(str(base_path), str(new_path)))
        table = diff_table(result, base_path, new_path)
        render(table, fmt, console)
        for w in result["warnings"]:
            if is_machine(fmt, console):
                err(one_line(f"warning: {w}"))
            else:
                console.print(f"[yellow]warning:[/yellow] {escape(w)}", highlight=False, soft_wrap=True)
        if result["regression"]:
            which = ", ".join(f"{name} median {j['delta_pct']:+.2f}%" for name, j in result["gated"].items()
                              if j["status"] == "regression")
            err(one_line(f"regression: {which} (> {100 * result['max_regression']:g}%, outside the p10-p90 bands)"))
            return EXIT_REGRESSION
        if is_machine(fmt, console):  # the table's title, which holds the verdict, is not in csv or json
            err(one_line(f"verdict: {verdict_text(result)}"))
        return EXIT_OK
    except AtomflowError as e:  # refused, unreadable, invalid, bad option: no verdict
        err(one_line(f"error: {e}"))
    except BrokenPipeError:  # the reader has gone: no one to tell, the CLI ends as SIGPIPE ends tools
        raise PipeClosed() from None
    except Exception as e:  # a bug or a record no check foresaw: still no verdict, never exit 1
        err(one_line(f"error: compare failed, no verdict ({type(e).__name__}: {e})"))
    return EXIT_REFUSED
