"""`compare`: the CI performance-regression gate, on recorded-style results files written by the tests."""
from __future__ import annotations

import json

import pytest
from helpers_runs import make_run

from atomflow_bench.measure import run_record as report
from atomflow_bench.cli import main
from atomflow_bench.measure.gate import CompareRefused, compare_runs, parse_fraction

def write(tmp_path, name: str, rec: dict):
    p = tmp_path / name
    p.write_text(json.dumps(rec))
    return str(p)


def run_compare(tmp_path, base: dict, new: dict, *extra) -> int:
    with pytest.raises(SystemExit) as e:
        main(["compare", write(tmp_path, "base.json", base), write(tmp_path, "new.json", new), *extra])
        raise SystemExit(0)
    return e.value.code


def test_ten_percent_slower_fails(tmp_path, capsys):
    assert run_compare(tmp_path, make_run(2.0, seed=1), make_run(2.2, seed=2)) == 1
    out = capsys.readouterr()
    assert "REGRESSION" in out.out and "regression" in out.err
    assert "TPOT median" in out.out and "% of roofline" in out.out and "copy bandwidth" in out.out


def test_same_code_rerun_passes(tmp_path, capsys):
    # a rerun: the median moves by 1% (another process, clocks), 1% per-token jitter in both
    base, new = make_run(2.0, seed=1), make_run(2.02, seed=3)
    assert base["tpot_ms"]["p10"] <= new["tpot_ms"]["median"] <= base["tpot_ms"]["p90"]
    assert run_compare(tmp_path, base, new) == 0
    assert "ok" in capsys.readouterr().out


@pytest.mark.parametrize("seed", range(5))
def test_rerun_medians_within_bands_never_fail_even_at_zero_threshold(seed):
    base, new = make_run(2.0, jitter=0.02, seed=seed), make_run(2.02, jitter=0.02, seed=seed + 100)
    assert not compare_runs(base, new, max_regression=0.0)["regression"]


def test_small_shift_outside_bands_passes_under_threshold():
    # tight bands that do not overlap, but only 3% slower: below the 5% threshold
    r = compare_runs(make_run(2.0, jitter=0.002, seed=1), make_run(2.06, jitter=0.002, seed=2), 0.05)
    assert r["status"] == "ok" and 2.5 < r["delta_pct"] < 3.5


def test_threshold_is_respected(tmp_path):
    base, new = make_run(2.0, jitter=0.002, seed=1), make_run(2.2, jitter=0.002, seed=2)
    assert run_compare(tmp_path, base, new, "--max-regression", "15%") == 0
    assert run_compare(tmp_path, base, new, "--max-regression", "5") == 1


def test_slower_but_within_noise_is_inconclusive_not_failed(tmp_path, capsys):
    base, new = make_run(2.0, jitter=0.2, seed=1), make_run(2.2, jitter=0.2, seed=2)
    r = compare_runs(base, new, 0.05)
    assert r["status"] == "inconclusive" and not r["regression"]
    assert run_compare(tmp_path, base, new) == 0
    assert "within noise" in capsys.readouterr().out


def test_faster_run_is_improved():
    r = compare_runs(make_run(2.0, seed=1), make_run(1.7, seed=2), 0.05)
    assert r["status"] == "improved" and r["delta_pct"] < -10
    tpot = next(row for row in r["rows"] if row["metric"] == "TPOT median (ms)")
    assert not tpot["worse"] and tpot["delta"] < 0


def test_mismatched_gpus_refused(tmp_path, capsys):
    code = run_compare(tmp_path, make_run(2.0), make_run(2.0, gpu="NVIDIA H200"))
    assert code == 2
    err = capsys.readouterr().err
    assert "gpu.name" in err and "NVIDIA H200" in err


@pytest.mark.parametrize("field, kwargs", [("model.name", {"model": "llama-3.2-1b"}), ("weights", {"weights": "fp16"}),
                                           ("context", {"context": 512})])
def test_other_mismatches_refused(field, kwargs):
    with pytest.raises(CompareRefused, match=field):
        compare_runs(make_run(2.0), make_run(2.0, **kwargs))


def test_copy_bandwidth_change_warns_but_does_not_fail():
    r = compare_runs(make_run(2.0, seed=1), make_run(2.0, seed=2, copy_gbs=2700.0), 0.05)
    assert not r["regression"]
    assert any("copy bandwidth differs by -10.0%" in w for w in r["warnings"])
    assert not compare_runs(make_run(2.0, seed=1), make_run(2.0, seed=2, copy_gbs=2950.0))["warnings"]


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    (json.dumps({"schema": "something/else"}), "not an atomflow-bench/run/1 results file"),
    (json.dumps({"schema": report.SCHEMA, "gpu": {}}), "lacks field 'model'"),
])
def test_malformed_file_is_a_clear_error(tmp_path, capsys, content, message):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(SystemExit) as e:
        main(["compare", write(tmp_path, "base.json", make_run(2.0)), str(bad)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "bad.json" in err


def test_missing_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["compare", str(tmp_path / "nope.json"), write(tmp_path, "new.json", make_run(2.0))])
    assert e.value.code == 2 and "nope.json: not found" in capsys.readouterr().err


@pytest.mark.parametrize("text, value", [("5%", 0.05), ("5", 0.05), (" 12.5 % ", 0.125), ("0%", 0.0)])
def test_parse_fraction(text, value):
    assert parse_fraction(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["five", "-3%", "5x", "nan", "inf%", "150%", ""])
def test_parse_fraction_rejects(text):
    from atomflow_bench.errors import AtomflowError

    with pytest.raises(AtomflowError, match="max-regression"):
        parse_fraction(text)


@pytest.mark.parametrize("side", ["base", "new"])
def test_instrument_run_is_refused(tmp_path, capsys, side):
    """A `run` record made with a timing instrument (AF_NO_WAIT: wrong outputs on purpose) is a bound, not a result:
    the gate refuses it (exit 2) on either side, and names the instrument."""
    base, new = make_run(2.0, seed=1), make_run(2.0, seed=2)
    (base if side == "base" else new)["instrument"] = ["AF_NO_WAIT=15"]
    assert run_compare(tmp_path, base, new) == 2
    err = capsys.readouterr().err
    assert "timing instrument" in err and "AF_NO_WAIT=15" in err
    with pytest.raises(CompareRefused):
        compare_runs(base, new)
    (base if side == "base" else new)["instrument"] = []   # the field on an ordinary run: compared as usual
    assert compare_runs(base, new)["status"] == "ok"
