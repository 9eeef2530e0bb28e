"""`compare` as a CI gate cannot be fooled: every invalid or missing figure, in either record, and every unreadable
file or bad option exits 2 with exactly one line on stderr naming the file and the field, never a traceback and
never 1 (reserved for a regression beyond the threshold). The tests run the real CLI: `main()` (what the
`atomflow-bench` script calls) in-process, and `python3 -m atomflow_bench.cli` in a subprocess for a sample."""
from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_runs import make_run

from atomflow_bench.measure import gate as compare_mod
from atomflow_bench.cli import main
from atomflow_bench.measure.gate import CompareRefused, check_record, compare_runs

REPO = Path(__file__).resolve().parents[1]
MISSING = object()
NAMES = {"base": "BASE.json", "new": "NEW.json"}


def invoke(*args) -> int:
    try:
        main([str(a) for a in args])
    except SystemExit as e:
        return e.code
    return 0


def pair(tmp_path, base: dict, new: dict) -> tuple[str, str]:
    paths = []
    for name, rec in (("BASE.json", base), ("NEW.json", new)):
        p = tmp_path / name
        p.write_text(json.dumps(rec))  # NaN / Infinity / -Infinity as Python's json writes (and reads) them
        paths.append(str(p))
    return paths[0], paths[1]


def set_field(rec: dict, dotted: str, value) -> dict:
    *parents, last = dotted.split(".")
    cur = rec
    for k in parents:
        cur = cur[k]
    if value is MISSING:
        del cur[last]
    else:
        cur[last] = value
    return rec


def records(side: str, dotted: str, value) -> tuple[dict, dict]:
    base, new = make_run(2.0, seed=1), make_run(2.0, seed=2)
    set_field(base if side == "base" else new, dotted, value)
    return base, new


def assert_refused(code, err: str, side: str, *needles: str) -> str:
    """Exit 2, exactly one line on stderr, no traceback, naming the file of `side` (not the other) and each needle."""
    assert code == 2, f"exit {code}, stderr {err!r}"
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("error: "), line
    if side:
        assert NAMES[side] in line, line
        other = NAMES["new" if side == "base" else "base"]
        assert other not in line, line
    for n in needles:
        assert n in line, line
    return line


SIDES = pytest.mark.parametrize("side", ["base", "new"])

# the TPOT median, which the verdict and the percentage divide by: every way to be not a positive finite number
MEDIAN_CASES = [
    (math.nan, "tpot_ms.median is nan, not a positive finite number"),
    (math.inf, "tpot_ms.median is inf, not a positive finite number"),
    (-math.inf, "tpot_ms.median is -inf, not a positive finite number"),
    (-1, "tpot_ms.median is -1, not a positive finite number"),
    (-1.0, "tpot_ms.median is -1.0, not a positive finite number"),
    (0, "tpot_ms.median is 0, not a positive finite number"),
    (0.0, "tpot_ms.median is 0.0, not a positive finite number"),
    ("1.2", "tpot_ms.median is the string '1.2', not a positive finite number"),
    (True, "tpot_ms.median is the boolean true, not a positive finite number"),
    (False, "tpot_ms.median is the boolean false, not a positive finite number"),
    (None, "tpot_ms.median is null, not a positive finite number"),
    ([2.0], "tpot_ms.median is a list, not a positive finite number"),
    (MISSING, "tpot_ms.median is missing"),
]


@SIDES
@pytest.mark.parametrize("value, message", MEDIAN_CASES, ids=[m.split(" is ")[1].split(",")[0] for _, m in MEDIAN_CASES])
def test_invalid_median_refused(tmp_path, capsys, side, value, message):
    code = invoke("compare", *pair(tmp_path, *records(side, "tpot_ms.median", value)))
    assert_refused(code, capsys.readouterr().err, side, message)


# the other figures compare reads: the noise band (p10, p90) of the verdict, and the table's rows
OTHER_FIGURES = ["tpot_ms.p10", "tpot_ms.p90", "tok_per_s", "bandwidth_gbs", "roofline.pct", "copy_bandwidth_gbs.median"]
OTHER_VALUES = [(math.nan, "is nan"), (math.inf, "is inf"), (-1, "is -1"), (0, "is 0"),
                ("1.2", "is the string '1.2'"), (True, "is the boolean true"), (False, "is the boolean false"),
                (None, "is null"), (MISSING, "is missing")]


@SIDES
@pytest.mark.parametrize("field", OTHER_FIGURES)
@pytest.mark.parametrize("value, message", OTHER_VALUES, ids=[m for _, m in OTHER_VALUES])
def test_invalid_figure_refused(tmp_path, capsys, side, field, value, message):
    code = invoke("compare", *pair(tmp_path, *records(side, field, value)))
    assert_refused(code, capsys.readouterr().err, side, f"{field} {message}")


@SIDES
@pytest.mark.parametrize("field, value, message", [
    ("context", "128", "context is the string '128', not a positive integer"),
    ("context", 0, "context is 0, not a positive integer"),
    ("context", True, "context is the boolean true, not a positive integer"),
    ("context", 128.5, "context is 128.5, not a positive integer"),
    ("tokens", -256, "tokens is -256, not a positive integer"),
    ("tokens", None, "tokens is null, not a positive integer"),
    ("gpu.name", MISSING, "gpu.name is missing"),
    ("gpu.name", None, "gpu.name is null, not a non-empty string"),
    ("gpu.name", "", "gpu.name is the string '', not a non-empty string"),
    ("model.name", MISSING, "model.name is missing"),
    ("model.name", 3, "model.name is 3, not a non-empty string"),
    ("weights", None, "weights is null, not a non-empty string"),
    ("tpot_ms", [1.9, 2.0, 2.1], "tpot_ms is a list, not an object"),
    ("gpu", "NVIDIA H100 80GB HBM3", "gpu is the string 'NVIDIA H100 80GB HBM3', not an object"),
    ("roofline", None, "roofline is null, not an object"),
    ("copy_bandwidth_gbs", 3000.0, "copy_bandwidth_gbs is 3000.0, not an object"),
])
def test_invalid_identity_or_structure_refused(tmp_path, capsys, side, field, value, message):
    code = invoke("compare", *pair(tmp_path, *records(side, field, value)))
    assert_refused(code, capsys.readouterr().err, side, message)


@SIDES
@pytest.mark.parametrize("field", ["schema", "gpu", "model", "weights", "context", "tokens", "tpot_ms",
                                   "copy_bandwidth_gbs", "bytes_per_token", "roofline", "tok_per_s", "bandwidth_gbs"])
def test_missing_top_level_field_refused(tmp_path, capsys, side, field):
    code = invoke("compare", *pair(tmp_path, *records(side, field, MISSING)))
    line = assert_refused(code, capsys.readouterr().err, side)
    # report.load names its REQUIRED fields ("lacks field 'tokens'"); check_record the ones compare adds
    assert field in line and ("lacks field" in line or "is missing" in line or "schema" in line), line


@SIDES
def test_inverted_noise_band_refused(tmp_path, capsys, side):
    """p10 above the median would make the bands look separated (or overlapping) at will: refused."""
    base, new = make_run(2.0, seed=1), make_run(2.0, seed=2)
    rec = base if side == "base" else new
    rec["tpot_ms"]["p10"], rec["tpot_ms"]["p90"] = rec["tpot_ms"]["p90"], rec["tpot_ms"]["p10"]
    code = invoke("compare", *pair(tmp_path, base, new))
    assert_refused(code, capsys.readouterr().err, side, "tpot_ms.p10/median/p90", "not an ordered")


@SIDES
@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ("", "not valid JSON"),
    ("[1, 2]", "not an atomflow-bench/run/1 results file"),
    ("null", "not an atomflow-bench/run/1 results file"),
    (b"\xff\xfe\x00binary", "not valid JSON"),
])
def test_invalid_file_refused(tmp_path, capsys, side, content, message):
    base, new = pair(tmp_path, make_run(2.0, seed=1), make_run(2.0, seed=2))
    bad = Path(base if side == "base" else new)
    bad.write_bytes(content) if isinstance(content, bytes) else bad.write_text(content)
    code = invoke("compare", base, new)
    assert_refused(code, capsys.readouterr().err, side, message)


@SIDES
def test_missing_file_refused(tmp_path, capsys, side):
    base, new = pair(tmp_path, make_run(2.0, seed=1), make_run(2.0, seed=2))
    os.remove(base if side == "base" else new)
    code = invoke("compare", base, new)
    assert_refused(code, capsys.readouterr().err, side, "not found")


@SIDES
def test_directory_refused(tmp_path, capsys, side):
    base, new = pair(tmp_path, make_run(2.0, seed=1), make_run(2.0, seed=2))
    victim = Path(base if side == "base" else new)
    victim.unlink()
    victim.mkdir()
    code = invoke("compare", base, new)
    assert_refused(code, capsys.readouterr().err, side, "cannot be read")


@SIDES
def test_instrument_of_odd_type_refused_in_one_line(tmp_path, capsys, side):
    base, new = records(side, "instrument", True)   # not the usual list of strings
    code = invoke("compare", *pair(tmp_path, base, new))
    assert_refused(code, capsys.readouterr().err, side, "timing instrument")


def test_mismatch_is_one_line_exit_2(tmp_path, capsys):
    code = invoke("compare", *pair(tmp_path, make_run(2.0), make_run(2.0, gpu="NVIDIA H200")))
    assert_refused(code, capsys.readouterr().err, None, "gpu.name differs", "NVIDIA H200")


@pytest.mark.parametrize("text", ["-5%", "-0.1", "nan", "NaN%", "inf", "-inf%", "150%", "101", "1e3", "", "five",
                                  "5%%", "5 x"])
def test_bad_max_regression_refused(tmp_path, capsys, text):
    code = invoke("compare", *pair(tmp_path, make_run(2.0, seed=1), make_run(2.0, seed=2)), "--max-regression", text)
    assert_refused(code, capsys.readouterr().err, None, "--max-regression")


@pytest.mark.parametrize("text, code", [("0%", 0), ("100%", 0), ("100", 0), ("0", 0)])
def test_max_regression_bounds_accepted(tmp_path, capsys, text, code):
    assert invoke("compare", *pair(tmp_path, make_run(2.0, seed=1), make_run(2.0, seed=3)),
                  "--max-regression", text) == code
    assert capsys.readouterr().err == ""


def test_ok_path_exits_0_with_empty_stderr(tmp_path, capsys):
    assert invoke("compare", *pair(tmp_path, make_run(2.0, seed=1), make_run(2.02, seed=3))) == 0
    out = capsys.readouterr()
    assert out.err == "" and "ok" in out.out and "TPOT median" in out.out


def test_faster_path_exits_0(tmp_path, capsys):
    assert invoke("compare", *pair(tmp_path, make_run(2.0, seed=1), make_run(1.5, seed=2))) == 0
    out = capsys.readouterr()
    assert out.err == "" and "improved" in out.out


def test_regression_path_exits_1_with_one_line(tmp_path, capsys):
    assert invoke("compare", *pair(tmp_path, make_run(2.0, seed=1), make_run(2.2, seed=2))) == 1
    out = capsys.readouterr()
    lines = out.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("regression: TPOT median +") and "Traceback" not in out.err
    assert "REGRESSION" in out.out


@pytest.mark.parametrize("target", ["compare_runs", "diff_table", "load_pair"])
def test_unexpected_exception_exits_2_not_1(tmp_path, capsys, monkeypatch, target):
    def boom(*a, **k):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(compare_mod, target, boom)
    code = invoke("compare", *pair(tmp_path, make_run(2.0, seed=1), make_run(2.2, seed=2)))
    assert_refused(code, capsys.readouterr().err, None, "RuntimeError: boom second line", "no verdict")


def test_gate_itself_failing_exits_2_not_1(tmp_path, capsys, monkeypatch):
    def boom(*a, **k):
        raise KeyError("x")

    monkeypatch.setattr(compare_mod, "gate", boom)
    code = invoke("compare", *pair(tmp_path, make_run(2.0, seed=1), make_run(2.2, seed=2)))
    assert_refused(code, capsys.readouterr().err, None, "KeyError", "no verdict")


def test_help_documents_exit_codes(capsys):
    assert invoke("compare", "--help") == 0
    out = capsys.readouterr().out
    assert "Exit codes:" in out
    for line in ("0  no regression", "1  a regression beyond the threshold", "2  refused, no verdict"):
        assert line in out, out
    for doc in (compare_mod.__doc__,):
        assert "0  no regression" in doc and "1  a regression" in doc and "2  refused" in doc


def test_compare_runs_api_checks_records_and_threshold():
    base, new = make_run(2.0, seed=1), make_run(2.0, seed=2)
    with pytest.raises(CompareRefused, match=r"^new: tpot_ms\.median is nan"):
        compare_runs(base, set_field(copy.deepcopy(new), "tpot_ms.median", math.nan))
    with pytest.raises(CompareRefused, match=r"^baseline: tpot_ms\.p10 is missing"):
        compare_runs(set_field(copy.deepcopy(base), "tpot_ms.p10", MISSING), new)
    for bad in (math.nan, -0.01, 1.5, "0.05", True):
        with pytest.raises(CompareRefused, match="max_regression"):
            compare_runs(base, new, bad)


def test_recorded_references_pass_the_checks(capsys):
    """The committed CI references (and every recorded run file) are valid: the checks refuse no real record."""
    refs = sorted((REPO / "results" / "reference").glob("*.json"))
    assert refs
    for r in refs:
        rec = json.loads(r.read_text())
        check_record(rec, str(r))
        assert invoke("compare", r, r) == 0
    assert capsys.readouterr().err == ""


# the same contract through a real process: python3 -m atomflow_bench.cli (this checkout's package first)
def _subprocess(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "atomflow_bench.cli", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("side, field, value, message", [
    ("new", "tpot_ms.median", math.nan, "tpot_ms.median is nan, not a positive finite number"),
    ("base", "tpot_ms.median", -1, "tpot_ms.median is -1, not a positive finite number"),
    ("new", "tpot_ms.median", "1.2", "tpot_ms.median is the string '1.2'"),
    ("base", "tpot_ms.p10", MISSING, "tpot_ms.p10 is missing"),
    ("new", "tpot_ms.p90", None, "tpot_ms.p90 is null"),
])
def test_subprocess_refusals(tmp_path, side, field, value, message):
    p = _subprocess("compare", *pair(tmp_path, *records(side, field, value)))
    assert_refused(p.returncode, p.stderr, side, message)


def test_subprocess_missing_and_invalid_files(tmp_path):
    base, new = pair(tmp_path, make_run(2.0, seed=1), make_run(2.0, seed=2))
    Path(new).write_text("{not json")
    p = _subprocess("compare", base, new)
    assert_refused(p.returncode, p.stderr, "new", "not valid JSON")
    os.remove(base)
    p = _subprocess("compare", base, new)
    assert_refused(p.returncode, p.stderr, "base", "not found")
    p = _subprocess("compare", new, new, "--max-regression", "nan")
    assert_refused(p.returncode, p.stderr, None, "--max-regression")


def test_subprocess_verdicts(tmp_path):
    p = _subprocess("compare", *pair(tmp_path, make_run(2.0, seed=1), make_run(2.02, seed=3)))
    assert p.returncode == 0 and p.stderr == "", p.stderr
    p = _subprocess("compare", *pair(tmp_path, make_run(2.0, seed=1), make_run(2.2, seed=2)))
    assert p.returncode == 1 and len(p.stderr.splitlines()) == 1 and p.stderr.startswith("regression:"), p.stderr
