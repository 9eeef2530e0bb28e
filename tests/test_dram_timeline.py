"""lab/scripts/dram_timeline.py's reading of Nsight Compute's raw CSV page (CPU): the PM-sampling series of each profiled
graph replay, where the layers and lm_head lie, and the per-layer fold that lab/PERF_NOTES.md v30 quotes."""
from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "lab" / "scripts" / "dram_timeline.py"


@pytest.fixture(scope="module")
def dt():
    spec = importlib.util.spec_from_file_location("dram_timeline", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


LAYER = [95.0] * 6 + [60.0, 3.0, 2.0, 40.0]  # one layer: a stream, then a two-sample hole (the dip starts at 7)


def fake_raw(path: Path, dt, layers: int, replays: int = 2) -> list[np.ndarray]:
    """A raw page as `ncu --page raw --csv --print-metric-instances values` writes it: a header, a units row, one row
    per workload whose instanced cells read "first (v0; v1; ...)" with thousands separators."""
    rng = np.random.default_rng(0)
    cols = ["ID", "Kernel Name", "profiler__pmsampler_interval_time", *dt.SERIES.values()]
    rows = [cols, ["", "", "us", *["%"] * len(dt.SERIES)]]
    series = []
    for k in range(replays):
        dram = np.array([0.0] * (12 + k) + LAYER * layers + [92.0] * 50 + [1.0] * 5)
        series.append(dram)
        cells = []
        for name in dt.SERIES:
            v = dram if name == "dram" else rng.uniform(0, 3000, dram.size)
            cells.append(f"{v[0]:.2f} (" + "; ".join(f"{x:,.2f}" for x in v) + ")")
        rows.append([str(k), "graph", "1.50 (1.50)", *cells])
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    return series


def test_read_raw_and_layers(dt, tmp_path):
    series = fake_raw(tmp_path / "raw.csv", dt, layers=5)
    got = dt.read_raw(str(tmp_path / "raw.csv"))
    assert len(got) == 2
    for k, (w, dram) in enumerate(zip(got, series)):
        assert w["interval_us"] == 1.5
        np.testing.assert_allclose(w["dram"], dram)
        assert w["sm_active"].max() > 1000  # "1,234.56" read as 1234.56
        at = dt.layers_of(w["dram"], 5)
        first = 12 + k
        assert at["first"] == first and at["lm_head"] == first + 5 * len(LAYER) and at["last"] == at["lm_head"] + 49
        assert at["dips"] == [first + i * len(LAYER) + 7 for i in range(5)]


def test_summary_fold(dt, tmp_path):
    fake_raw(tmp_path / "raw.csv", dt, layers=4, replays=1)
    out = tmp_path / "s.json"
    dt.summary(str(tmp_path / "raw.csv"), str(out), 4)
    r = json.loads(out.read_text())["replays"][0]
    assert r["us_per_layer"] == pytest.approx(len(LAYER) * 1.5)
    assert r["below10_us_per_layer"] == pytest.approx(2 * 1.5)  # two samples under 10% per layer
    assert r["dram_mean_layers"] == pytest.approx(np.mean(LAYER))
    fold = {f["offset"]: f["dram"] for f in r["fold"]}
    assert fold[0] == 3.0 and fold[1] == 2.0 and fold[2] == 40.0 and fold[-1] == 60.0 and fold[-4] == 95.0
    assert not list(tmp_path.glob("*.tmp"))  # written through a temporary name


def test_refuses_a_page_without_samples(dt, tmp_path):
    (tmp_path / "raw.csv").write_text('"ID","Kernel Name"\n"",""\n')
    with pytest.raises(SystemExit, match="no profiled workload"):
        dt.read_raw(str(tmp_path / "raw.csv"))
