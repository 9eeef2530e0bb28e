"""`compare BASELINE.json NEW.json`: the CI performance-regression gate between two `run` results files.

Refusal: the two files must describe the same measurement — same `gpu.name`, `model.name`, `weights` and
`context`; otherwise `CompareRefused` names the first field that differs (exit code 2, as for a file that
is missing or not a results file). A different `tokens` count or a copy bandwidth more than 5% apart
(another machine state: clocks, another card of the same model) only warns.

Regression rule, on TPOT (ms/token): with B, N the base and new medians and [p10, p90] each run's spread,

    regression  <=>  N - B > max_regression * B      (slower by more than the allowed fraction)
                and  N_p10 > B_p90                   (the runs' p10-p90 bands do not overlap)

A same-code rerun, whose median falls inside the other's p10-p90 band, therefore never fails, and a run
that is slower by more than the threshold with tight bands always does. Slower by more than the threshold
while the bands overlap is reported as "inconclusive (within noise)" and passes with a warning: the
measurement cannot tell. Exit codes of the CLI: 0 no regression, 1 regression, 2 refused / unreadable.
"""
from __future__ import annotations

from ..errors import AtomflowError

MATCH_FIELDS = (("gpu.name", lambda r: r["gpu"]["name"]), ("model.name", lambda r: r["model"]["name"]),
                ("weights", lambda r: r["weights"]), ("context", lambda r: r["context"]))
COPY_BW_WARN = 0.05


class CompareRefused(AtomflowError):
    """The two files do not measure the same thing (or cannot be read): no verdict."""


def parse_fraction(text: str) -> float:
    """'5%' or '5' -> 0.05 (always percent); refuses negatives and non-numbers."""
    try:
        v = float(str(text).strip().rstrip("%"))
    except ValueError:
        raise AtomflowError(f"--max-regression {text!r}: expected a percentage such as 5%") from None
    if not 0 <= v < 1000:
        raise AtomflowError(f"--max-regression {text!r}: must be between 0% and 1000%")
    return v / 100


def _metrics(r: dict) -> list[tuple[str, float, bool]]:
    """(label, value, lower_is_better) for the diff table."""
    t = r["tpot_ms"]
    return [("TPOT median (ms)", t["median"], True), ("TPOT p10 (ms)", t["p10"], True),
            ("TPOT p90 (ms)", t["p90"], True), ("tok/s", r["tok_per_s"], False),
            ("achieved bandwidth (GB/s)", r["bandwidth_gbs"], False), ("% of roofline", r["roofline"]["pct"], False),
            ("copy bandwidth (GB/s)", r["copy_bandwidth_gbs"]["median"], False)]


def compare_runs(base: dict, new: dict, max_regression: float = 0.05) -> dict:
    """Verdict and diff rows for two results records; CompareRefused when they are not comparable."""
    for side, r in (("baseline", base), ("new", new)):
        if r.get("instrument"):
            raise CompareRefused(f"refusing to compare: the {side} run is a timing instrument "
                                 f"({' '.join(r['instrument'])}: wrong outputs on purpose), not a result")
    for name, get in MATCH_FIELDS:
        if get(base) != get(new):
            raise CompareRefused(f"refusing to compare: {name} differs (baseline {get(base)!r}, new {get(new)!r})")
    warnings = []
    if base["tokens"] != new["tokens"]:
        warnings.append(f"tokens differ (baseline {base['tokens']}, new {new['tokens']}): mean KV length differs")
    cb, cn = base["copy_bandwidth_gbs"]["median"], new["copy_bandwidth_gbs"]["median"]
    if abs(cn - cb) > COPY_BW_WARN * cb:
        warnings.append(f"copy bandwidth differs by {100 * (cn - cb) / cb:+.1f}% ({cb:.0f} -> {cn:.0f} GB/s): "
                        "the machine state differs (clocks, another card); TPOT changes may come from it")
    b, n = base["tpot_ms"], new["tpot_ms"]
    delta = n["median"] - b["median"]
    slower = delta > max_regression * b["median"]
    separated = n["p10"] > b["p90"]
    if slower and separated:
        status = "regression"
    elif slower:
        status = "inconclusive"
        warnings.append(f"TPOT +{100 * delta / b['median']:.1f}% but the p10-p90 bands overlap "
                        f"(new p10 {n['p10']:.4f} <= baseline p90 {b['p90']:.4f} ms): within noise, not failed")
    else:
        status = "improved" if -delta > max_regression * b["median"] and n["p90"] < b["p10"] else "ok"
    rows = [{"metric": label, "baseline": vb, "new": vn, "delta": vn - vb,
             "delta_pct": 100 * (vn - vb) / vb if vb else None, "worse": vn > vb if lower else vn < vb}
            for (label, vb, lower), (_, vn, _) in zip(_metrics(base), _metrics(new))]
    return {"status": status, "regression": status == "regression", "max_regression": max_regression,
            "delta_ms": delta, "delta_pct": 100 * delta / b["median"], "rows": rows, "warnings": warnings}


def load_pair(base_path, new_path) -> tuple[dict, dict]:
    """Both results files through `report.load`; any problem becomes CompareRefused (exit 2)."""
    from .report import load

    try:
        return load(base_path), load(new_path)
    except CompareRefused:
        raise
    except AtomflowError as e:
        raise CompareRefused(str(e)) from None


def diff_table(result: dict, base_name: str, new_name: str):
    """The diff as a rich Table: metric, baseline, new, delta, delta %."""
    from rich.markup import escape
    from rich.table import Table

    verdict = {"regression": "[red]REGRESSION[/red]", "inconclusive": "[yellow]inconclusive[/yellow]",
               "improved": "[green]improved[/green]", "ok": "[green]ok[/green]"}[result["status"]]
    names = f"{escape(str(base_name))} -> {escape(str(new_name))}"
    t = Table(title=f"compare {names}: {verdict} (TPOT {result['delta_pct']:+.2f}%, "
                    f"allowed +{100 * result['max_regression']:g}% beyond the p10-p90 bands)", title_justify="left")
    for col in ("metric", "baseline", "new", "delta", "delta %"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    for r in result["rows"]:
        style = "red" if r["worse"] and abs(r["delta_pct"] or 0) > 100 * result["max_regression"] else ""
        pct = "n/a" if r["delta_pct"] is None else f"{r['delta_pct']:+.2f}%"
        t.add_row(r["metric"], f"{r['baseline']:.4g}", f"{r['new']:.4g}", f"{r['delta']:+.4g}",
                  f"[{style}]{pct}[/{style}]" if style else pct)
    return t
