"""`compare` gates TTFT as it gates TPOT: records with the prefill's optional fields (`ttft_ms`, `prefill`,
`tensor_core_tflops`; helpers_runs.with_prefill, and the committed reference, recorded with them), records without them
(read as before), one of each (shown, not gated), and prefill paths that differ (shown, not gated)."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
from helpers_runs import make_run, with_prefill

from atomflow_bench.measure.gate import compare_runs, ttft_not_gated
from test_compare_gate import MISSING, assert_refused, invoke, pair, set_field

REPO = Path(__file__).resolve().parents[1]
OLD_ROWS = ["TPOT median (ms)", "TPOT p10 (ms)", "TPOT p90 (ms)", "tok/s", "achieved bandwidth (GB/s)",
            "% of roofline", "copy bandwidth (GB/s)"]
NEW_ROWS = ["TTFT median (ms)", "TTFT p10 (ms)", "TTFT p90 (ms)", "prefill tok/s", "tensor-core TFLOPS"]


def runs(ttft_base: float | None, ttft_new: float | None, jitter: float = 0.01, tpot_new: float = 2.0,
         paths: tuple[str, str] = ("batched", "batched")) -> tuple[dict, dict]:
    """Two same-TPOT-ish records (1% per-token jitter, a rerun apart) with the given TTFT medians (None: the record
    has no prefill fields)."""
    base, new = make_run(2.0, seed=1), make_run(tpot_new, seed=3)
    if ttft_base is not None:
        with_prefill(base, ttft_base, jitter, paths[0])
    if ttft_new is not None:
        with_prefill(new, ttft_new, jitter, paths[1])
    return base, new


def rows_of(result: dict) -> dict[str, dict]:
    return {r["metric"]: r for r in result["rows"]}


# ---- the verdicts ----------------------------------------------------------------------------------------------
def test_a_ttft_regression_fails_the_gate(tmp_path, capsys):
    base, new = runs(20.0, 23.0)  # TPOT a rerun apart (ok), TTFT 15% slower with tight bands
    r = compare_runs(base, new)
    assert r["gated"]["TPOT"]["status"] == "ok" and r["gated"]["TTFT"]["status"] == "regression"
    assert r["status"] == "regression" and r["regression"] and r["gated"]["TTFT"]["delta_pct"] == pytest.approx(15.0)
    assert invoke("compare", *pair(tmp_path, base, new)) == 1
    out = capsys.readouterr()
    assert out.err.splitlines() == ["regression: TTFT median +15.00% (> 5%, outside the p10-p90 bands)"]
    assert "REGRESSION" in out.out and "TTFT median" in out.out and "prefill tok/s" in out.out


def test_ttft_slower_within_noise_is_inconclusive_not_failed(tmp_path, capsys):
    base, new = runs(20.0, 21.5, jitter=0.1)  # +7.5%, but the new p10 (19.35) is under the baseline p90 (22.0)
    r = compare_runs(base, new)
    assert r["status"] == "inconclusive" and not r["regression"]
    assert any(w.startswith("TTFT +7.5% but the p10-p90 bands overlap") for w in r["warnings"])
    assert invoke("compare", *pair(tmp_path, base, new)) == 0
    assert "within noise" in capsys.readouterr().out


def test_ttft_within_the_threshold_or_a_rerun_passes():
    r = compare_runs(*runs(20.0, 20.6, jitter=0.002))  # 3% slower, bands apart: under the 5% threshold
    assert r["gated"]["TTFT"]["status"] == "ok" and r["status"] == "ok"
    r = compare_runs(*runs(20.0, 20.1, jitter=0.02))  # a rerun: the median inside the other's band
    assert r["status"] == "ok" and "TTFT" in r["gated"]
    assert compare_runs(*runs(20.0, 23.0), max_regression=0.2)["status"] == "ok"  # the threshold applies to TTFT


def test_the_verdict_is_the_worst_of_tpot_and_ttft(tmp_path, capsys):
    r = compare_runs(*runs(20.0, 23.0, tpot_new=1.6))  # TPOT improved, TTFT regressed
    assert (r["gated"]["TPOT"]["status"], r["gated"]["TTFT"]["status"], r["status"]) == \
        ("improved", "regression", "regression")
    r = compare_runs(*runs(20.0, 15.0))  # TTFT improved, TPOT a rerun
    assert (r["gated"]["TPOT"]["status"], r["status"]) == ("ok", "improved")
    base, new = runs(20.0, 23.0, tpot_new=2.3)  # both slower beyond the threshold: one line names both
    assert invoke("compare", *pair(tmp_path, base, new)) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("regression: TPOT median +") and ", TTFT median +15.00% (> 5%" in line


def test_the_verdict_text_names_each_gated_time(tmp_path, capsys):
    from atomflow_bench.measure.gate import verdict_text

    assert verdict_text(compare_runs(*runs(20.0, 15.0))).startswith("improved (TPOT ")
    assert ", TTFT -25.00%, allowed +5% beyond the p10-p90 bands)" in verdict_text(compare_runs(*runs(20.0, 15.0)))
    assert invoke("compare", *pair(tmp_path, *runs(20.0, 15.0)), "--format", "json") == 0
    assert ", TTFT -25.00%, allowed" in capsys.readouterr().err  # csv/json: the verdict on stderr


# ---- one record has TTFT, the other not; the prefill paths differ ----------------------------------------------
@pytest.mark.parametrize("side", ["base", "new"])
def test_ttft_in_one_record_only_is_shown_not_gated(tmp_path, capsys, side):
    base, new = runs(20.0 if side == "base" else None, 2000.0 if side == "new" else None)
    r = compare_runs(base, new)
    assert list(r["gated"]) == ["TPOT"] and r["status"] == "ok"  # 100x slower TTFT: nothing to hold it against
    theirs = "new" if side == "new" else "baseline"
    assert r["ttft_note"].startswith(f"TTFT only in the {theirs} record") and r["ttft_note"] in r["warnings"]
    row = rows_of(r)["TTFT median (ms)"]
    has, lacks = ("new", "baseline") if side == "new" else ("baseline", "new")
    assert row[has] == (2000.0 if side == "new" else 20.0) and row[lacks] is None and row["delta"] is None
    assert invoke("compare", *pair(tmp_path, base, new), "--format", "md") == 0
    out = capsys.readouterr().out
    assert "TTFT not gated" in out and "not recorded" in out and f"TTFT only in the {theirs} record" in out


@pytest.mark.parametrize("paths", [("batched", "walked"), ("walked", "batched")])
def test_prefill_paths_that_differ_are_noted_not_gated(tmp_path, capsys, paths):
    ttft = (20.0, 400.0) if paths[1] == "walked" else (400.0, 20.0)
    base, new = runs(*ttft, paths=paths)
    r = compare_runs(base, new)
    assert list(r["gated"]) == ["TPOT"] and r["status"] == "ok"
    assert r["ttft_note"] == (f"prefill path differs (baseline {paths[0]}, new {paths[1]}): TTFT not gated, "
                              "the two are not like-for-like")
    assert rows_of(r)["TTFT median (ms)"]["delta"] == pytest.approx(ttft[1] - ttft[0])  # shown all the same
    assert invoke("compare", *pair(tmp_path, base, new)) == 0
    assert "prefill path differs" in capsys.readouterr().out


def test_the_same_walked_path_is_gated():
    r = compare_runs(*runs(400.0, 460.0, paths=("walked", "walked")))
    assert r["gated"]["TTFT"]["status"] == "regression" and r["ttft_note"] is None


def test_ttft_not_gated_reasons():
    assert ttft_not_gated(*runs(None, None)) is None and ttft_not_gated(*runs(20.0, 20.0)) is None
    base, new = runs(20.0, 20.0)
    new["prefill"]["prompt_tokens"] = 127
    assert ttft_not_gated(base, new).startswith("prefill prompt_tokens differs (baseline 128, new 127)")
    del base["prefill"]
    assert "prefill path differs (baseline not recorded, new batched)" in ttft_not_gated(base, new)


def test_records_without_the_fields_compare_as_before():
    r = compare_runs(make_run(2.0, seed=1), make_run(2.02, seed=3))
    assert [row["metric"] for row in r["rows"]] == OLD_ROWS and list(r["gated"]) == ["TPOT"]
    assert r["ttft_note"] is None and r["warnings"] == []
    r = compare_runs(*runs(20.0, 20.0))
    assert [row["metric"] for row in r["rows"]] == OLD_ROWS + NEW_ROWS
    rows = rows_of(r)
    assert rows["prefill tok/s"]["baseline"] == pytest.approx(128 / 0.020) and not rows["prefill tok/s"]["worse"]


def test_null_fields_are_not_measured(tmp_path):
    base, new = runs(20.0, 30.0)
    for rec in (base, new):
        rec["ttft_ms"] = rec["prefill"] = rec["tensor_core_tflops"] = None
    r = compare_runs(base, new)
    assert [row["metric"] for row in r["rows"]] == OLD_ROWS and list(r["gated"]) == ["TPOT"]


def test_a_tensor_core_rate_apart_warns():
    base, new = runs(20.0, 20.0)
    with_prefill(new, 20.0, tensor_core_tflops=600.0)
    r = compare_runs(base, new)
    assert any(w.startswith("tensor-core TFLOPS differs by -14.3% (700 -> 600 TFLOPS)") for w in r["warnings"])
    assert not compare_runs(*runs(20.0, 20.0))["warnings"]


# ---- the committed CI reference, and a record from before TTFT -------------------------------------------------
def test_the_committed_reference_gates_ttft_and_a_record_without_it_is_noted(tmp_path, capsys):
    ref = json.loads((REPO / "results" / "reference" / "llama-3.2-3b-fp8-ctx128.json").read_text())
    assert ref["ttft_ms"]["median"] > 0 and ref["prefill"]["path"] == "batched"  # recorded with its prompt's TTFT
    before = {k: v for k, v in ref.items() if k not in ("ttft_ms", "prefill", "tensor_core_tflops")}
    assert invoke("compare", *pair(tmp_path, before, ref)) == 0  # a base from before TTFT: noted, not gated
    assert "TTFT only in the new record" in capsys.readouterr().out
    slower = copy.deepcopy(ref)
    slower["ttft_ms"] = {k: v * (1.1 if k != "n" else 1) for k, v in ref["ttft_ms"].items()}
    assert invoke("compare", *pair(tmp_path, ref, slower)) == 1
    assert capsys.readouterr().err.startswith("regression: TTFT median +10.00%")
    assert invoke("compare", *pair(tmp_path, ref, copy.deepcopy(ref))) == 0


# ---- check_record: the fields, where present ------------------------------------------------------------------
@pytest.mark.parametrize("side", ["base", "new"])
@pytest.mark.parametrize("field, value, message", [
    ("ttft_ms.median", math.nan, "ttft_ms.median is nan, not a positive finite number"),
    ("ttft_ms.median", "20", "ttft_ms.median is the string '20', not a positive finite number"),
    ("ttft_ms.p10", MISSING, "ttft_ms.p10 is missing"),
    ("ttft_ms.p90", 0, "ttft_ms.p90 is 0, not a positive finite number"),
    ("ttft_ms", [20.0], "ttft_ms is a list, not an object"),
    ("prefill.path", "fast", "prefill.path is the string 'fast', not one of 'batched', 'walked'"),
    ("prefill.path", MISSING, "prefill.path is missing"),
    ("prefill.prompt_tokens", 0, "prefill.prompt_tokens is 0, not a positive integer"),
    ("prefill.prompt_tokens", 128.0, "prefill.prompt_tokens is 128.0, not a positive integer"),
    ("prefill.tok_per_s", None, "prefill.tok_per_s is null, not a positive finite number"),
    ("prefill.pct_of_peak", math.inf, "prefill.pct_of_peak is inf, not a positive finite number"),
    ("tensor_core_tflops.median", -1, "tensor_core_tflops.median is -1, not a positive finite number"),
    ("tensor_core_tflops.p10", True, "tensor_core_tflops.p10 is the boolean true, not a positive finite number"),
])
def test_invalid_prefill_fields_refused(tmp_path, capsys, side, field, value, message):
    base, new = runs(20.0, 20.0)
    set_field(base if side == "base" else new, field, value)
    assert_refused(invoke("compare", *pair(tmp_path, base, new)), capsys.readouterr().err, side, message)


@pytest.mark.parametrize("field", ["ttft_ms", "tensor_core_tflops"])
def test_an_unordered_spread_refused(tmp_path, capsys, field):
    base, new = runs(20.0, 20.0)
    new[field]["p10"], new[field]["p90"] = new[field]["p90"], new[field]["p10"]
    assert_refused(invoke("compare", *pair(tmp_path, base, new)), capsys.readouterr().err, "new",
                   f"{field}.p10/median/p90", "not an ordered")
