"""`sweep` and `plot` (CPU).

The sweep's bookkeeping (record files, resumption, the summary files, a failed cell) runs through `run_sweep` and
through the real CLI with a stand-in cell runner that returns recorded-style records (helpers_runs.make_run): it
checks the bookkeeping, never a GPU figure. Without a GPU the real `sweep` refuses first (exit 3). The plots are made
from such records and a small hand-built profile record, and checked as PNG files."""
from __future__ import annotations

import csv
import io
import json
import struct
import sys
from pathlib import Path

import pytest
from helpers_runs import H100, make_run, with_prefill

from atomflow_bench.cli import EXIT_NO_GPU
from atomflow_bench.errors import AtomflowError, GpuUnavailable
from atomflow_bench.gpu.device import gpu_problem
from atomflow_bench.measure import sweep as sw
from atomflow_bench.measure.baselines import attach_comparisons
from helpers_cli import invoke as cli

MODELS, WEIGHTS, CONTEXTS = ["llama-3.2-1b", "llama-3.2-3b"], ["fp8", "fp16"], [128, 2048]
TOKENS, REPEATS = 64, 5


def fake_tpot(key) -> float:
    return ({"fp8": 1.45, "fp16": 2.5}[key["weights"]] * (0.4 if key["model"] == "llama-3.2-1b" else 1.0)
            * (1 + key["context"] / 20000))


class StandIn:
    """A cell runner: records from make_run (the cell's model, weights, context, tokens, repeats); raises
    AtomflowError for the keys in `fail`; remembers the keys it was called for."""

    def __init__(self, fail=(), gpu=H100, raise_at=None, exc=None):
        self.calls, self.fail, self.gpu, self.raise_at, self.exc = [], list(fail), gpu, raise_at, exc

    def __call__(self, key, tokens, repeats, **kw):
        self.calls.append(dict(key))
        if self.raise_at is not None and len(self.calls) == self.raise_at:
            raise self.exc
        if key in self.fail:
            raise AtomflowError(f"{key['model']}: context {key['context']} + tokens {tokens}\nexceed max_seq")
        rec = make_run(fake_tpot(key), gpu=self.gpu, model=key["model"], weights=key["weights"],
                       context=key["context"], tokens=tokens, seed=len(self.calls))
        rec["repeats"] = repeats
        rec["forms"] = {"forms": "short:ws-pre2/l2=8;split:ring/l2=0", "origin": "saved", "path": None}
        return rec


def cells():
    return sw.grid(MODELS, WEIGHTS, CONTEXTS)


def sweep(out, runner, **kw):
    return sw.run_sweep(cells(), out, runner, tokens=TOKENS, repeats=REPEATS, gpu=H100, **kw)


def summary_files(out: Path) -> tuple[dict, list[dict], str]:
    js = json.loads((out / "summary.json").read_text())
    rows = list(csv.DictReader(io.StringIO((out / "summary.csv").read_text())))
    return js, rows, (out / "summary.md").read_text()


FAILING = {"model": "llama-3.2-3b", "weights": "fp16", "context": 2048, "tp": 1}


# ---- the sweep: records, summary, a failed cell ----------------------------------------------------------
def test_grid_keys_and_file_names():
    keys = cells()
    assert len(keys) == 8 and keys[0] == {"model": "llama-3.2-1b", "weights": "fp8", "context": 128, "tp": 1}
    names = [sw.cell_filename(k) for k in keys]
    assert names[0] == "llama-3.2-1b-fp8-ctx128-tp1.json" and len(set(names)) == 8
    assert sw.cell_filename({**keys[0], "tp": 2}) == "llama-3.2-1b-fp8-ctx128-tp2.json"
    assert sw.parse_contexts("128, 2048,128") == [128, 2048]
    for bad in ("12x", "0", "40000", ""):
        with pytest.raises(AtomflowError):
            sw.parse_contexts(bad)
    with pytest.raises(AtomflowError, match="int4"):
        sw.parse_weights("fp8,int4")


def test_a_sweep_writes_one_record_per_cell_and_a_consistent_summary(tmp_path):
    out = tmp_path / "sweep"
    runner = StandIn(fail=[FAILING])
    summary = sweep(out, runner)
    assert len(runner.calls) == 8 and summary["complete"]
    assert sw.counts(summary) == {"done": 7, "skipped": 0, "failed": 1, "pending": 0}
    js, rows, md = summary_files(out)
    assert js == json.loads(json.dumps(summary)) and js["schema"] == sw.SCHEMA and js["gpu"] == H100
    assert (js["tokens"], js["repeats"]) == (TOKENS, REPEATS)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [sw.cell_filename(k) for k in cells() if k != FAILING] + list(sw.SUMMARY_FILES))  # no temporary file left
    assert [c["key"] for c in js["cells"]] == cells() and len(rows) == 8
    for cell, row in zip(js["cells"], rows):
        key = cell["key"]
        assert [row["model"], row["weights"], row["context"], row["tp"], row["status"]] == [
            key["model"], key["weights"], str(key["context"]), str(key["tp"]), cell["status"]]
        if key == FAILING:
            assert cell["status"] == "failed" and cell["file"] is None and cell["tpot_ms"] is None
            assert cell["error"] == "llama-3.2-3b: context 2048 + tokens 64 exceed max_seq"  # one line
            assert row["error"] == cell["error"] and row["tpot_median_ms"] == ""
            assert "| failed |" in md and cell["error"] in md
            continue
        rec = json.loads((out / cell["file"]).read_text())
        assert cell["file"] == sw.cell_filename(key) and cell["status"] == "done" and cell["error"] is None
        assert (rec["model"]["name"], rec["weights"], rec["context"]) == (key["model"], key["weights"], key["context"])
        assert cell["tpot_ms"] == {q: rec["tpot_ms"][q] for q in ("median", "p10", "p90")}
        assert cell["tok_per_s"] == rec["tok_per_s"] and cell["roofline_pct"] == rec["roofline"]["pct"]
        assert cell["bytes_per_token"] == rec["bytes_per_token"]["total"] and cell["gpu"] == H100
        assert cell["forms"] == rec["forms"]["forms"] and cell["forms_origin"] == "saved"
        assert float(row["tpot_median_ms"]) == pytest.approx(rec["tpot_ms"]["median"], rel=1e-12)
        assert float(row["roofline_pct"]) == pytest.approx(rec["roofline"]["pct"], rel=1e-12)
        assert int(row["bytes_per_token"]) == rec["bytes_per_token"]["total"]
        line = next(ln for ln in md.splitlines() if f"| {cell['file']} |" in ln)
        assert f"| {rec['tpot_ms']['median']:.4f} |" in line and f"| {rec['roofline']['pct']:.1f} |" in line


def test_a_second_sweep_skips_valid_records_and_measures_failed_and_invalid_cells_again(tmp_path):
    out = tmp_path / "sweep"
    sweep(out, StandIn(fail=[FAILING]))
    keys = cells()
    broken, other_shape, other_gpu = keys[0], keys[1], keys[2]
    (out / sw.cell_filename(broken)).write_text('{"schema": "atomflow-bench/run/1", "tpot')  # cut short
    rec = json.loads((out / sw.cell_filename(other_shape)).read_text())
    rec["tokens"] = 256  # a record of another sweep's shape
    (out / sw.cell_filename(other_shape)).write_text(json.dumps(rec))
    rec = json.loads((out / sw.cell_filename(other_gpu)).read_text())
    rec["gpu"]["name"] = "NVIDIA A100-SXM4-80GB"
    (out / sw.cell_filename(other_gpu)).write_text(json.dumps(rec))
    kept = {k["context"]: (out / sw.cell_filename(k)).read_bytes() for k in keys[3:] if k != FAILING}

    runner = StandIn()
    summary = sweep(out, runner)
    assert runner.calls == [broken, other_shape, other_gpu, FAILING]
    by_key = {json.dumps(c["key"]): c for c in summary["cells"]}
    status = {json.dumps(k): by_key[json.dumps(k)]["status"] for k in keys}
    assert [status[json.dumps(k)] for k in keys] == ["done", "done", "done", "skipped", "skipped", "skipped",
                                                     "skipped", "done"]
    assert "not valid JSON" in by_key[json.dumps(broken)]["note"]
    assert by_key[json.dumps(other_shape)]["note"] == "measured again: the record has tokens 256, this sweep 64"
    assert "A100" in by_key[json.dumps(other_gpu)]["note"]
    assert {k["context"]: (out / sw.cell_filename(k)).read_bytes() for k in keys[3:] if k != FAILING} == kept
    assert by_key[json.dumps(FAILING)]["error"] is None and (out / sw.cell_filename(FAILING)).is_file()
    js, rows, md = summary_files(out)
    assert [r["status"] for r in rows] == [status[json.dumps(k)] for k in keys] and js["complete"]
    assert "4 measured, 4 skipped (a valid record was there), 0 failed" in md

    third = StandIn()
    assert sw.counts(sweep(out, third)) == {"done": 0, "skipped": 8, "failed": 0, "pending": 0} and not third.calls


def test_an_interrupted_sweep_leaves_a_valid_summary_and_resumes(tmp_path):
    out = tmp_path / "sweep"
    with pytest.raises(KeyboardInterrupt):
        sweep(out, StandIn(raise_at=3, exc=KeyboardInterrupt()))
    js, rows, md = summary_files(out)
    assert not js["complete"]
    assert [c["status"] for c in js["cells"]] == ["done", "done", "failed"] + ["pending"] * 5
    assert js["cells"][2]["error"] == "interrupted" and [r["status"] for r in rows][:3] == ["done", "done", "failed"]
    assert "5 not reached" in md and "not complete" in md
    assert not list(out.glob("*.tmp"))
    runner = StandIn()
    summary = sweep(out, runner)
    assert runner.calls == cells()[2:]
    assert [c["status"] for c in summary["cells"]] == ["skipped"] * 2 + ["done"] * 6


def test_a_gpu_lost_mid_sweep_stops_it(tmp_path):
    out = tmp_path / "sweep"
    with pytest.raises(GpuUnavailable):
        sweep(out, StandIn(raise_at=2, exc=GpuUnavailable("the CUDA driver reports no usable device")))
    js, _, _ = summary_files(out)
    assert [c["status"] for c in js["cells"]][:3] == ["done", "failed", "pending"]
    assert js["cells"][1]["error"] == "the CUDA driver reports no usable device"


def test_a_record_the_summary_cannot_read_fails_its_cell_and_is_not_written(tmp_path):
    def runner(key, tokens, repeats):
        rec = StandIn()(key, tokens, repeats)
        if key["context"] == 2048:
            del rec["tpot_ms"]["p90"]
        return rec

    summary = sweep(tmp_path / "s", runner)
    failed = [c for c in summary["cells"] if c["status"] == "failed"]
    assert len(failed) == 4 and all("tpot_ms.p90" in c["error"] for c in failed)
    assert not any((tmp_path / "s" / sw.cell_filename(c["key"])).exists() for c in failed)


class PrefillStandIn(StandIn):
    """StandIn's records with the prefill's fields (helpers_runs.with_prefill): TTFT grows with the prompt (`context`),
    the 1B's cells at 2048 without the fields (records written before them)."""

    def __call__(self, key, tokens, repeats, **kw):
        rec = super().__call__(key, tokens, repeats, **kw)
        if not (key["model"] == "llama-3.2-1b" and key["context"] == 2048):
            with_prefill(rec, 5.0 + key["context"] / 100)
        return rec


def test_the_summary_reports_the_prefill_of_each_prompt_length(tmp_path):
    out = tmp_path / "sweep"
    sweep(out, PrefillStandIn())
    js, rows, md = summary_files(out)
    assert sw.CSV_COLUMNS == list(rows[0]) and {"ttft_median_ms", "ttft_p10_ms", "ttft_p90_ms", "prefill_path",
                                                "prefill_tok_per_s", "prefill_pct_of_peak"} <= set(rows[0])
    for cell, row in zip(js["cells"], rows):
        rec = json.loads((out / cell["file"]).read_text())
        n = cell["key"]["context"]
        if "ttft_ms" not in rec:  # blank in the csv, null in summary.json
            assert cell["ttft_ms"] is None and cell["prefill_tok_per_s"] is None and cell["prefill_path"] is None
            assert [row[c] for c in ("ttft_median_ms", "prefill_path", "prefill_tok_per_s",
                                     "prefill_pct_of_peak")] == ["", "", "", ""]
            continue
        ttft = 5.0 + n / 100
        assert cell["ttft_ms"] == {q: rec["ttft_ms"][q] for q in ("median", "p10", "p90")}
        assert cell["ttft_ms"]["median"] == ttft and float(row["ttft_median_ms"]) == ttft
        assert float(row["ttft_p90_ms"]) == pytest.approx(ttft * 1.01, rel=1e-12)
        assert cell["prefill_tok_per_s"] == pytest.approx(n / (ttft * 1e-3)) and row["prefill_path"] == "batched"
        assert float(row["prefill_pct_of_peak"]) == pytest.approx(rec["prefill"]["pct_of_peak"], rel=1e-12)
    assert sum(c["ttft_ms"] is None for c in js["cells"]) == 2
    t = 5.0 + 2048 / 100
    assert f"| {t:.3f} | {t * 0.99:.3f}-{t * 1.01:.3f} | {2048 / t * 1e3:.0f} (batched) |" in md
    assert "ctx = the prompt's length" in md


def test_a_record_with_an_unreadable_prefill_figure_is_measured_again(tmp_path):
    out = tmp_path / "sweep"
    sweep(out, PrefillStandIn())
    first = cells()[0]
    rec = json.loads((out / sw.cell_filename(first)).read_text())
    rec["ttft_ms"]["median"] = "fast"
    (out / sw.cell_filename(first)).write_text(json.dumps(rec))
    runner = PrefillStandIn()
    summary = sweep(out, runner)
    assert runner.calls == [first]
    assert summary["cells"][0]["note"] == "measured again: field 'ttft_ms.median' is missing or not a finite number"


# ---- the real CLI ---------------------------------------------------------------------------------------
GRID = ["--models", ",".join(MODELS), "--weights", ",".join(WEIGHTS), "--ctx", ",".join(map(str, CONTEXTS)),
        "--tokens", TOKENS, "--repeats", REPEATS]


@pytest.mark.skipif(gpu_problem() is None, reason="this machine has a usable GPU")
def test_sweep_without_a_gpu_refuses_before_anything(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ATOMFLOW_HOME", str(tmp_path / "home"))
    code, out, err = cli(capsys, "sweep", *GRID, "--out", tmp_path / "out", "--format", "json")
    assert code == EXIT_NO_GPU and out == ""
    assert err.strip().splitlines() == [f"error: {gpu_problem()}"]
    assert not (tmp_path / "out").exists() and not (tmp_path / "home").exists()


@pytest.mark.parametrize("bad", [["--ctx", "128,abc"], ["--weights", "fp8,int4"], ["--models", " , "]])
def test_sweep_usage_errors(tmp_path, capsys, bad):
    code, out, err = cli(capsys, "sweep", *bad, "--out", tmp_path / "out")
    assert code == 2 and "Invalid value" in err and not (tmp_path / "out").exists()


@pytest.fixture
def gpu_stand_in(monkeypatch):
    """require_gpu passes, the GPU is named, each cell is measured by a StandIn (returned)."""
    import atomflow_bench.gpu.device as device

    runner = StandIn(fail=[FAILING])
    monkeypatch.setattr(device, "require_gpu", lambda: None)
    monkeypatch.setattr(device, "gpu_info", lambda: {"name": H100})
    monkeypatch.setattr(sw, "benchmark_cell", runner)
    return runner


def test_sweep_cli_json_table_and_resume(gpu_stand_in, tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = cli(capsys, "sweep", *GRID, "--out", out, "--format", "json")
    assert code == 1  # a cell failed: the table and summary are there, the exit says so
    rows = json.loads(stdout)  # stdout holds the table alone; the notes went to stderr
    assert [r["status"] for r in rows] == ["done"] * 7 + ["failed"]
    assert set(rows[0]) == {"model", "weights", "ctx", "tp", "status", "TPOT ms", "p10-p90 ms", "tok/s", "% roofline",
                            "GB/token", "vs TP1", "TTFT ms", "TTFT p10-p90 ms", "prefill tok/s", "% tensor-core peak",
                            "forms", "file / error"}
    js = json.loads((out / "summary.json").read_text())
    for row, cell in zip(rows, js["cells"]):
        assert row["ctx"] == cell["key"]["context"] and row["status"] == cell["status"]
        if cell["status"] == "done":  # the data: numbers, no units
            assert row["TPOT ms"] == cell["tpot_ms"]["median"] and row["file / error"] == cell["file"]
            assert row["p10-p90 ms"] == [cell["tpot_ms"]["p10"], cell["tpot_ms"]["p90"]]
        else:
            assert row["TPOT ms"] is None and row["p10-p90 ms"] is None and row["vs TP1"] is None
    assert rows[-1]["file / error"] == "llama-3.2-3b: context 2048 + tokens 64 exceed max_seq"
    assert "[8/8] llama-3.2-3b fp16 ctx 2048 tp 1: failed" in err and f"summary: {out / 'summary.json'}" in err

    gpu_stand_in.fail.clear()
    code, stdout, err = cli(capsys, "sweep", *GRID, "--out", out, "--format", "json")
    assert code == 0 and [r["status"] for r in json.loads(stdout)] == ["skipped"] * 7 + ["done"]
    assert gpu_stand_in.calls[8:] == [FAILING]
    assert "[1/8] llama-3.2-1b fp8 ctx 128 tp 1: skipped, llama-3.2-1b-fp8-ctx128-tp1.json is already there" in err


def test_sweep_and_plot_take_format(capsys):
    for command in ("sweep", "plot"):
        code, out, _ = cli(capsys, command, "--help")
        assert code == 0 and "--format [table|md|csv|json]" in " ".join(out.split())


# ---- plot -----------------------------------------------------------------------------------------------
PNG = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def profile_record() -> dict:
    rows = [("embed_lookup", 1, 2.1, 6144), ("wqkv", 28, 190.0, 440_401_920), ("attention_decode", 28, 60.0, 16_973_824),
            ("wo", 28, 130.0, 264_241_152), ("wgu", 28, 700.0, 1_409_286_144), ("wd", 28, 340.0, 704_643_072),
            ("lm_head", 1, 180.0, 787_972_096)]
    return {"schema": "atomflow-bench/profile/1", "gpu": {"name": H100}, "model": "llama-3.2-3b", "weights": "fp8",
            "context": 128, "steps": 20, "copy_bandwidth_gbs": {"median": 2963.0},
            "role_marginals": {"length": 148, "step_us": {"median": 1452.0, "p10": 1448.0, "p90": 1460.0},
                               "rows": [{"role": r, "count": c, "step_without_us": {"median": 1452.0 - s},
                                         "saved_us": s, "saved_us_per_launch": s / c, "bytes": b,
                                         "floor_us": b / 2963e3, "excess_us": s - b / 2963e3}
                                        for r, c, s, b in rows],
                               "sum_saved_us": 1602.1, "floor_us": 1209.0}}


def peer(tpot: float, mode: str) -> dict:
    rec = make_run(tpot, weights="fp16")
    return {"engine": f"HF transformers 5.0 {mode} fp16", "mode": mode, "gpu": H100, "device": "cuda",
            "precision": "fp16", "context": 128, "tokens": 64, "repeats": 3, "tpot_ms": rec["tpot_ms"],
            "tok_per_s": rec["tok_per_s"], "bytes_per_token": rec["bytes_per_token"],
            "bandwidth_gbs": rec["bandwidth_gbs"]}


def baseline(gpu: str, tpot: float) -> dict:
    return {"schema": "atomflow-bench/baseline/1", "engine": {"name": "vLLM", "version": "0.9", "flags": None},
            "gpu": {"name": gpu, "memory_bandwidth_gbs": None}, "model": "llama-3.2-3b", "precision": "bf16",
            "bytes_format": "fp16", "context": 128, "tokens": 128, "metrics": {"tpot_ms": tpot, "tok_per_s": 1e3 / tpot},
            "source": "measured with atomflow-bench baseline record on 2026-01-01", "method": "streamed completions"}


@pytest.fixture
def records(tmp_path) -> Path:
    """A sweep-like directory (2 models x 2 formats x 3 contexts, one fp8 record with peers and comparisons), a
    profile record, a same-GPU and an other-GPU baseline record."""
    d = tmp_path / "records"
    d.mkdir()
    for model in MODELS:
        for w in WEIGHTS:
            for ctx in (128, 1024, 4096):
                key = {"model": model, "weights": w, "context": ctx, "tp": 1}
                rec = make_run(fake_tpot(key), model=model, weights=w, context=ctx)
                if (model, w, ctx) == ("llama-3.2-3b", "fp8", 128):
                    attach_comparisons(rec, [], [peer(4.2, "compiled"), peer(24.7, "eager")])
                (d / sw.cell_filename(key)).write_text(json.dumps(rec))
    (d / "summary.json").write_text(json.dumps({"schema": sw.SCHEMA, "cells": []}))
    (d / "notes.json").write_text("[1, 2]")
    (tmp_path / "profile.json").write_text(json.dumps(profile_record()))
    (tmp_path / "vllm-h100.json").write_text(json.dumps(baseline(H100, 2.9)))
    (tmp_path / "vllm-a100.json").write_text(json.dumps(baseline("NVIDIA A100-SXM4-80GB", 3.3)))
    return d


def test_each_plot_kind_writes_a_png(records, tmp_path):
    pytest.importorskip("matplotlib")
    from atomflow_bench.measure.plot import plot_all

    out = tmp_path / "png"
    res = plot_all([records, tmp_path / "profile.json", tmp_path / "vllm-h100.json", tmp_path / "vllm-a100.json"], out)
    by_kind = {}
    for p in res["plots"]:
        by_kind.setdefault(p["kind"], []).append(p)
    assert sorted(by_kind) == ["compare", "context", "roles"]
    assert [p["path"].name for p in by_kind["context"]] == [f"context-{m}-nvidia-h100-80gb-hbm3.png" for m in MODELS]
    # the fp8 record with its peers and the given same-GPU baseline; the fp16 one with the baseline alone (the
    # baseline's context is 128: not beside the records at 1024 and 4096)
    assert [p["path"].name for p in by_kind["compare"]] == [f"compare-llama-3.2-3b-{w}-ctx128-nvidia-h100-80gb-hbm3.png"
                                                            for w in ("fp16", "fp8")]
    assert [p["path"].name for p in by_kind["roles"]] == ["roles-llama-3.2-3b-fp8-ctx128-nvidia-h100-80gb-hbm3.png"]
    for p in res["plots"]:
        w, h = png_size(p["path"])
        assert w >= 900 and h >= 300 and p["path"].stat().st_size > 20_000, (p["path"], w, h)
    assert len(by_kind["context"][0]["sources"]) == 6
    assert by_kind["compare"][1]["sources"] == [records / "llama-3.2-3b-fp8-ctx128-tp1.json",
                                                tmp_path / "vllm-h100.json"]  # the same-GPU baseline, not the A100
    assert by_kind["roles"][0]["sources"] == [tmp_path / "profile.json"]
    assert sorted(p.name for p, _ in res["ignored"]) == ["notes.json", "summary.json"]
    assert sorted(p.name for p in out.iterdir()) == sorted(p["path"].name for p in res["plots"])


def test_plot_cli_lists_what_it_wrote(records, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    code, out, err = cli(capsys, "plot", records, tmp_path / "profile.json", "--out", tmp_path / "png",
                         "--format", "json")
    assert code == 0
    rows = json.loads(out)
    assert [r["plot"] for r in rows] == ["context", "context", "compare", "roles"]  # no baseline given: one compare
    assert all(Path(r["png"]).read_bytes()[:8] == PNG for r in rows)
    assert "ignored" in err and "notes.json" in err

    code, out, err = cli(capsys, "plot", records / "notes.json", "--out", tmp_path / "png2")  # named: an error
    assert code == 1 and err.startswith("error: ") and "not a run, profile or baseline record" in err
    code, out, err = cli(capsys, "plot", tmp_path / "vllm-h100.json", "--out", tmp_path / "png3")
    assert code == 1 and "nothing to plot" in err and not (tmp_path / "png3").exists()


def test_no_comparison_plot_without_a_same_gpu_peer_or_baseline(tmp_path):
    pytest.importorskip("matplotlib")
    from atomflow_bench.measure.plot import plot_all

    d = tmp_path / "r"
    d.mkdir()
    rec = make_run(1.5)
    attach_comparisons(rec, [baseline("NVIDIA A100-SXM4-80GB", 3.3)])
    (d / "a.json").write_text(json.dumps(rec))
    res = plot_all([d], tmp_path / "png")
    assert [p["kind"] for p in res["plots"]] == ["context"]
    assert any(n.startswith("no comparison plot") for n in res["notes"])


def test_plot_without_matplotlib_is_one_line_naming_the_extra(records, tmp_path, capsys, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # import -> ImportError
    code, out, err = cli(capsys, "plot", records, "--out", tmp_path / "png")
    assert code == 1 and out == ""
    assert err.splitlines() == ["error: plot needs matplotlib, which is not installed: pip install "
                                "'atomflow-bench[plot]'"]
    assert not (tmp_path / "png").exists()


class TpStandIn(StandIn):
    """Cells of tp > 1 answer with a record holding a `tp` block, TPOT = tp 1's / (0.8 tp): 80% efficiency."""

    def __call__(self, key, tokens, repeats, **kw):
        rec = super().__call__({**key, "tp": 1}, tokens, repeats, **kw)
        if key["tp"] > 1:
            for q in ("median", "p10", "p90", "mean", "min", "max"):
                if q in rec["tpot_ms"]:
                    rec["tpot_ms"][q] = fake_tpot(key) / (0.8 * key["tp"])
            rec["tp"] = {"n": key["tp"], "allreduce": "peer"}
        return rec


def test_parse_tps():
    assert sw.parse_tps("1, 2,4,2") == [1, 2, 4]
    for bad, word in (("0", "not in 1..8"), ("9", "not in 1..8"), ("two", "not an integer"), (",", "empty list")):
        with pytest.raises(AtomflowError, match=word):
            sw.parse_tps(bad)


def test_a_tp_axis_gets_its_ratio_and_efficiency_against_tp1(tmp_path):
    keys = sw.grid(["llama-3.1-8b"], ["fp16"], [128], [1, 2, 4])
    assert [sw.cell_filename(k) for k in keys] == [f"llama-3.1-8b-fp16-ctx128-tp{n}.json" for n in (1, 2, 4)]
    summary = sw.run_sweep(keys, tmp_path, TpStandIn(), tokens=TOKENS, repeats=REPEATS, gpu=H100)
    scale = sw.tp_scaling(summary)
    assert set(scale) == {1, 2}
    t1 = summary["cells"][0]["tpot_ms"]["median"]
    for i, n in ((1, 2), (2, 4)):
        tn = summary["cells"][i]["tpot_ms"]["median"]
        assert tn == pytest.approx(fake_tpot(keys[i]) / (0.8 * n))
        assert scale[i] == pytest.approx((tn / t1, t1 / (n * tn)))
    rows = list(csv.DictReader(io.StringIO((tmp_path / "summary.csv").read_text())))
    assert rows[0]["tp_efficiency"] == "" and float(rows[2]["tp_efficiency"]) == pytest.approx(scale[2][1])
    assert f"{scale[2][0]:.3f} x ({100 * scale[2][1]:.0f}% eff.)" in (tmp_path / "summary.md").read_text()
    # resumed: the records of tp > 1 (their `tp` block) are valid cells of this sweep
    again = sw.run_sweep(keys, tmp_path, TpStandIn(), tokens=TOKENS, repeats=REPEATS, gpu=H100)
    assert [c["status"] for c in again["cells"]] == ["skipped"] * 3


def test_a_tp_cell_without_its_tp1_cell_has_no_ratio(tmp_path):
    summary = sw.run_sweep(sw.grid(["llama-3.1-8b"], ["fp16"], [128], [2]), tmp_path, TpStandIn(), tokens=TOKENS,
                           repeats=REPEATS, gpu=H100)
    assert sw.tp_scaling(summary) == {} and summary["cells"][0]["status"] == "done"


def test_a_tp_cell_runs_run_tp_and_reports_its_error_line(monkeypatch, tmp_path):
    """A cell of tp > 1 is `atomflow-bench run --tp N` in a process of its own; its one-line error becomes the cell's
    (here the CPU's: no GPU, exit 3, nothing written)."""
    from atomflow_bench.gpu import device
    from atomflow_bench.gpu.tp.context import RanksRun

    if device.gpu_problem() is None:
        pytest.skip("a GPU is here: the run would measure")
    monkeypatch.setenv("ATOMFLOW_HOME", str(tmp_path))
    with pytest.raises(AtomflowError) as e:
        RanksRun("llama-3.1-8b", 2).measure("fp16", 128, 8, 1)
    assert str(e.value).startswith("run --tp 2: error:") and "\n" not in str(e.value)
