"""`--format json` holds numbers: every numeric cell of every table is a number or null there (never "2.30G",
"86.0%" or "—"), while markdown and the terminal show the same text as ever.

Each table is built from recorded-style figures through its own builder (the GPU commands' builders take records
and dicts); `doctor`, `validate` and `peers` also run through the real CLI on this CPU machine."""
from __future__ import annotations

import csv
import io
import json
import re
import sys

import pytest
from helpers_runs import H100, make_run, with_prefill
from rich.console import Console

from atomflow_bench.output import Num, Tab, text
from helpers_cli import invoke
from test_output import gemv_record, profile_record, validate_result

# a number with a unit, a range or ratio of numbers, or a placeholder for a missing number: never a JSON value
UNIT = re.compile(r"^[-+x]?[\d.]+(e[-+]?\d+)?\s*(%|ms|us|µs|s|G|M|K|B|GB/s|TB/s|x)?$")
SEVERAL = re.compile(r"^[\d.]+(-[\d.]| / | x \()")
PLACEHOLDERS = {"—", "-", "n/a"}


def numbers_as_text(data) -> list[str]:
    """The strings of a --format json document that are numbers in disguise."""
    if isinstance(data, dict):
        return [s for v in data.values() for s in numbers_as_text(v)]
    if isinstance(data, list):
        return [s for v in data for s in numbers_as_text(v)]
    if isinstance(data, str) and (UNIT.match(data) or SEVERAL.match(data) or data in PLACEHOLDERS):
        return [data]
    return []


def as_json(tabs):
    data = json.loads(text(tabs, "json"))
    assert numbers_as_text(data) == []
    return data


def md_lines(tab) -> list[str]:
    return text(tab, "md").splitlines()


# ---- recorded-style figures --------------------------------------------------------------------------------
def run_rec(tp: bool = True) -> dict:
    rec = make_run(1.5)
    rec.update({"vram_bytes": {"weights": 1 << 30, "kv": 1 << 20, "activations": 1 << 16, "scratch": 1 << 16,
                               "total": (1 << 30) + (1 << 20) + (1 << 17)},
                "launches_per_step": 142, "pdl": True, "load": {"seconds": 2.25, "fp8_source": "the fp16 weights"},
                "other_gpu_processes": {"checked": True, "processes": []},
                "energy": {"avg_watts": 412.0, "joules_per_token": 0.598, "method": "NVML energy counter",
                           "tokens": 1280, "segments": 5, "watts": {"min": 400.0, "max": 420.0, "median": 411.0,
                                                                     "n": 90}},
                "eager": {"tpot_ms": {"median": 2.125}, "graph_speedup": 1.4167, "same_tokens": True},
                "generated": {"text": "Paris is the capital", "token_ids": [1, 2, 3]},
                "forms": {"forms": "short:ring/l2=8;split:ring/l2=0", "origin": "tuned now", "path": "/x.json",
                          "timed": {"lengths": [192, 384], "step_us": {"short:ring/l2=8": 1455.5,
                                                                       "short:ws/l2=8": 1530.0}}},
                "attention_buckets": [{"attention": "short <= 416", "lengths": [128, 383], "tokens": 256,
                                       "tpot_ms": 1.5, "gemv": "ring/l2=8"}],
                "ttft_ms": {"median": 4.5, "p10": 4.25, "p90": 4.75, "n": 5},
                "prefill": {"path": "batched", "prompt_tokens": 128, "chunk": 512, "tok_per_s": 128 / 4.5e-3,
                            "flops": 0.9e12, "tflops": 200.0, "pct_of_peak": 25.0},
                "tensor_core_tflops": {"median": 800.0, "p10": 790.0, "p90": 805.0, "n": 20, "shape": [8192] * 3,
                                       "dtype": "fp16"}})
    if tp:
        rec["tp"] = {"n": 2, "allreduce": "peer", "peer_available": True, "peer_reason": None,
                     "per_rank": [{"copy_bandwidth_gbs": 2990.0}, {"copy_bandwidth_gbs": 3004.0}],
                     "comm": {"path": "peer", "sum_bytes": 6144, "sums_per_token": 56, "in_step_us": 75.5,
                              "step_graph_us": {"median": 1500.0}, "step_without_exchanges_us": {"median": 1424.5},
                              "paths": {"peer": {"sum_us": 1.25, "per_token_us": 72.5},
                                        "nccl": {"sum_us": 9.5, "per_token_us": 540.0}}}}
    return rec


def peer_rec(gpu: str = H100) -> dict:
    return {"engine": "HF transformers 5 eager fp16", "gpu": gpu, "device": "cuda", "precision": "fp16",
            "context": 128, "tokens": 64, "tpot_ms": {"median": 20.0, "p10": 19.5, "p90": 21.0}, "tok_per_s": 50.0,
            "bandwidth_gbs": 320.0, "same_tokens_as_first_mode": True}


def tp_profile_record() -> dict:
    return {"tp": 2, "context": 128, "forms": {"forms": "short:ring/l2=8;split:ring/l2=0", "origin": "default"},
            "comm": run_rec()["tp"]["comm"]}


def tune_chosen() -> dict:
    return {"forms": "short:ring/l2=8;split:ring/l2=0", "origin": "tuned now", "path": "/tuning/x.json",
            "timed": {"lengths": [192, 384], "step_us": {"short:ws/l2=8": 1530.0, "short:ring/l2=8": 1455.5}}}


def sweep_summary(tmp_path, prefill: bool = False) -> dict:
    """A real sweep's summary over a stand-in cell runner: two tp degrees of one cell, a failed one; `prefill`: the
    records hold the prefill's fields (tp 1 batched, TTFT 9 ms; tp 2 walked, TTFT 150 ms, no tensor-core rate)."""
    from atomflow_bench.errors import AtomflowError
    from atomflow_bench.measure import sweep as sw

    def run_cell(key, tokens, repeats, **kw):
        if key["context"] == 2048:
            raise AtomflowError("llama-3.2-3b: context 2048 + tokens 64 exceed max_seq")
        rec = make_run(1.5 / key["tp"] ** 0.9, context=key["context"], tokens=tokens, seed=key["tp"])
        rec["repeats"] = repeats
        if key["tp"] > 1:  # per GPU: each rank reads its share of the bytes
            rec["tp"] = {"n": key["tp"]}
            rec["roofline"]["pct"] /= key["tp"]
        rec["forms"] = {"forms": "short:ring/l2=8;split:ring/l2=0", "origin": "saved", "path": None}
        if prefill and key["tp"] == 1:
            with_prefill(rec, 9.0)
        elif prefill:
            with_prefill(rec, 150.0, path="walked", tensor_core_tflops=None)
        return rec

    cells = sw.grid(["llama-3.2-3b"], ["fp8"], [128, 2048], [1, 2])
    return sw.run_sweep(cells, tmp_path / "sweep", run_cell, tokens=64, repeats=5, gpu=H100)


def quality_res() -> dict:
    return {"model": {"name": "tiny"}, "text": {"tokens": 120}, "backend": {"label": "NumPy reference (CPU)"},
            "fp16": {"perplexity": 12.5, "top1_next_token": 0.41}, "fp8": {"perplexity": 12.7, "top1_next_token": 0.4},
            "ppl_ratio": 1.016, "top1_agreement": 0.95, "mean_kl_fp16_fp8": 2e-3, "max_kl_fp16_fp8": 4e-2,
            "bounds": {"ppl_ratio_max": 1.05, "top1_min": 0.9, "mean_kl_max": 0.01},
            "checks": {"ppl_ratio": True, "top1_agreement": True, "mean_kl": True}, "pass": True, "note": None}


# ---- the checker, and a cell of two numbers in csv --------------------------------------------------------------
def test_a_cell_of_two_numbers_and_the_checker():
    """A p10-p90 range is a list in json and that list as JSON text in csv (one table or several); the checker
    flags every way a number hides in a string and passes names, forms and shapes."""
    from atomflow_bench.output import span

    t = Tab("t", ["what", "p10-p90 µs", "note"])
    t.add("a", span(20.1, 21.0, ".1f"), "")
    t.add("b", span(None, None, ".1f"), "")
    assert md_lines(t)[-2:] == ["| a | 20.1-21.0 |  |", "| b |  |  |"]
    assert as_json(t) == [{"what": "a", "p10-p90 µs": [20.1, 21.0], "note": ""},
                          {"what": "b", "p10-p90 µs": None, "note": ""}]
    assert list(csv.reader(io.StringIO(text(t, "csv"))))[1:] == [["a", "[20.1, 21.0]", ""], ["b", "", ""]]
    two = [t, Tab("u", ["x"], key="u")]
    two[1].add(Num(1.5, "1.5 ms"))
    rows = list(csv.reader(io.StringIO(text(two, "csv"))))
    assert rows == [["table", "what", "p10-p90 µs", "note", "x"], ["t", "a", "[20.1, 21.0]", "", ""],
                    ["t", "b", "", "", ""], ["u", "", "", "", "1.5"]]
    hidden = ["2.30G", "86.0%", "—", "-", "n/a", "1455.5", "2.14x", "x1.30", "3.10-3.40", "1.20e-03", "2485 GB/s",
              "320 / 3350 = 10%", "320 / ?", "0.536 x (93% eff.)", "20.5 µs"]
    assert numbers_as_text(hidden) == hidden
    assert numbers_as_text({"a": ["fp8", "16384x3072", "layer 0", "short:ring/l2=8", "PASS", "", None, 3.2]}) == []


# ---- run ---------------------------------------------------------------------------------------------------------
RUN_FIGURES = {"TPOT (graph)": ("tpot_ms", "median"), "tok/s": ("tok_per_s",), "achieved bandwidth": ("bandwidth_gbs",),
               "copy bandwidth (same run)": ("copy_bandwidth_gbs", "median"), "% of roofline": ("roofline", "pct"),
               "energy": ("energy", "joules_per_token"), "eager (--no-graph)": ("eager", "tpot_ms", "median"),
               "load": ("load", "seconds"), "exchanges inside the step": ("tp", "comm", "in_step_us"),
               "sum across ranks (peer)": ("tp", "comm", "paths", "peer", "sum_us"), "TTFT": ("ttft_ms", "median"),
               "prompt tok/s": ("prefill", "tok_per_s"), "% of tensor-core peak": ("prefill", "pct_of_peak")}


def test_run_table():
    from atomflow_bench.measure.run_record import run_table

    rec = run_rec()
    rows = {r["metric"]: r["value"] for r in as_json(run_table(rec))}
    for metric, path in RUN_FIGURES.items():  # the figure, in the unit its text names first
        v = rec
        for k in path:
            v = v[k]
        assert rows[metric] == v, metric
    assert rows["bytes read / token"] == rec["bytes_per_token"]["total"] / 1e9  # GB, as the text
    assert rows["GPU"].startswith("NVIDIA H100 80GB HBM3") and rows["launch"].startswith("142 kernels/step")
    md = md_lines(run_table(rec))
    for line in ("| TPOT (graph) | median 1.4992 ms  (p10 1.4812, p90 1.5184, n=1280) |", "| tok/s | 667.0 |",
                 "| bytes read / token | 3.7250 GB (weights 3.6950 + KV 30.00 MB) |",
                 "| achieved bandwidth | 2485 GB/s |",
                 "| % of roofline | 82.8%  (floor 1.2417 ms = bytes / copy bandwidth, per GPU: the slowest rank's) |",
                 "| sum across ranks (peer) | 1.25 us per 6 KB sum inside a graph; one token's 56 sums + argmax 72.5 us"
                 "  <- the step's |",
                 "| energy | 412 W average, 0.598 J/token (NVML energy counter, 5 x 256 tokens); samples 400-420 W, "
                 "median 411 W, n=90 |",
                 "| load | 2.2 s, fp8 from the fp16 weights |",
                 "| TTFT | median 4.500 ms  (p10 4.250, p90 4.750, n=5; 128 prompt tokens, batched prefill, chunks of "
                 "512, to the first token) |", "| prompt tok/s | 28444 |",
                 "| % of tensor-core peak | 25.0%  (200 TFLOPS of the prompt's 0.90 TFLOP in the TTFT; peak 800 TFLOPS "
                 "= cuBLAS fp16 GEMM 8192x8192x8192, same run) |"):
        assert line in md
    rec = run_rec(tp=False)
    rec["prefill"]["weights_form"] = "staged"
    assert any("chunks of 512, weights staged before each GEMM, to the first token" in ln for ln in md_lines(run_table(rec)))
    rec["prefill"]["attention"] = "wgmma"
    assert any("weights staged before each GEMM, attention on wgmma, to the first" in ln for ln in md_lines(run_table(rec)))
    rec["energy"] = {"unavailable": "pynvml is not importable"}  # no figure: the reason stays text
    rows = {r["metric"]: r["value"] for r in as_json(run_table(rec))}
    assert rows["energy"] == "unavailable: pynvml is not importable" and "tensor parallel" not in rows
    assert "| % of roofline | 82.8%  (floor 1.2417 ms = bytes / copy bandwidth) |" in md_lines(run_table(rec))


def test_comparison_table():
    from atomflow_bench.measure.baselines import DEFAULT_DIR, comparison_rows, comparison_table, load_baselines

    rec = run_rec()
    t = comparison_table(comparison_rows(rec, load_baselines(DEFAULT_DIR), [peer_rec(), peer_rec("cpu")]))
    rows = as_json(t)
    assert rows[0]["achieved / spec GB/s"] == [rec["bandwidth_gbs"], 3350.0]  # the percentage follows from the two
    assert rows[1]["speedup (same GPU)"] == pytest.approx(20.0 / rec["tpot_ms"]["median"])
    assert rows[2]["achieved / spec GB/s"] == [320.0, None]  # a CPU has no spec bandwidth
    assert rows[3]["ctx"] is None and rows[3]["roofline-normalised (different GPU)"] > 0
    md = md_lines(t)
    assert ("| atomflow-bench 0.1.0 | NVIDIA H100 80GB HBM3 | fp8 | 128 | 1.499 | — | 2485 / 3350 = 74% | — | "
            "this run |") in md
    assert ("| HF transformers 5 eager fp16 | cpu | fp16 | 128 | 20.000 | — (different GPU) | 320 / ? | "
            "n/a (bandwidth unknown) | measured in this run |") in md


def test_run_cli_json_is_numbers(monkeypatch, capsys, tmp_path):
    """`run --format json` through the CLI: one document, the run table and the comparison, numbers throughout."""
    import atomflow_bench.gpu.device as device
    import atomflow_bench.gpu.tp.context as tp_context
    import atomflow_bench.measure.decode as decode
    from atomflow_bench.measure.context import RunContext

    class Engine:
        gpu = {"name": H100, "sms": 132, "l2_bytes": 50 << 20}

    def engine(self, *a, **k):
        self.forms = {"forms": "short:ring/l2=8;split:ring/l2=0", "origin": "default"}
        return Engine()

    monkeypatch.setattr(device, "require_gpu", lambda: None)
    monkeypatch.setattr(tp_context, "resolve_model", lambda spec, console=None, **k: tmp_path)
    monkeypatch.setattr(RunContext, "engine", engine)
    monkeypatch.setattr(decode, "benchmark", lambda *a, **k: run_rec(tp=False))
    code, out, err = invoke(capsys, "run", "--no-json", "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert numbers_as_text(data) == [] and set(data) == {"run", "comparison"}
    assert {r["metric"]: r["value"] for r in data["run"]}["tok/s"] == run_rec(tp=False)["tok_per_s"]


# ---- profile, gemv, tune -----------------------------------------------------------------------------------------
def test_profile_tables():
    from atomflow_bench.measure.profile import attention_table, marginal_table, profile_table

    p = profile_record()
    tabs = [profile_table(p), marginal_table(p), attention_table(p)]
    data = as_json(tabs)
    assert data["profile"][0] == {"kernel": "gemv fp8 wgu 16384x3072", "% of step": 25.2, "count/step": 28,
                                  "mean µs": 23.97, "µs/step": 672.4, "GB/s": 2167.0, "% copy BW": 72.4}
    assert data["profile"][1]["GB/s"] is None and data["profile"][1]["% copy BW"] is None
    assert data["roles"] == [{"role": "wgu", "launches": 28, "step without (µs)": 1100.0, "role adds (µs)": 690.0,
                              "per launch (µs)": 24.64, "bytes floor (µs)": 560.0, "excess (µs)": 130.0}]
    assert data["attention"] == [{"length": 148, "µs per layer": 3.21, "p10-p90 µs": [3.1, 3.4], "KV floor µs": 1.5,
                                  "x the floor": 2.14, "DRAM": "caches fit in L2: not a DRAM figure"}]
    assert md_lines(tabs[0])[4:6] == ["| gemv fp8 wgu 16384x3072 | 25.2 | 28 | 23.97 | 672.4 | 2167 | 72 |",
                                      "| embed_lookup | 0.1 | 1 | 2.00 | 2.0 | - | - |"]
    assert md_lines(tabs[1])[4] == "| wgu | 28 | 1100.0 | 690.0 | 24.64 | 560.0 | 130.0 |"
    assert md_lines(tabs[2])[4] == "| 148 | 3.21 | 3.10-3.40 | 1.50 | 2.14x | caches fit in L2: not a DRAM figure |"


def test_tp_profile_tables():
    """`profile --tp`: the exchanges' table and what each role adds to the rank's step."""
    from atomflow_bench.gpu.tp.figures import tp_profile_table
    from atomflow_bench.measure.profile import marginal_table

    t = tp_profile_table(tp_profile_record(), None)
    data = as_json([t, marginal_table(profile_record())])
    assert [r["us"] for r in data["tp_profile"]] == [1500.0, 1424.5, 75.5, 1.25, 72.5, 9.5, 540.0]
    assert data["roles"][0]["role adds (µs)"] == 690.0
    assert "| peer: one sum of 6144 B | 1.25 | the standalone one-shot sum; 56 sums replayed back to back in one " \
           "graph, per call |" in md_lines(t)


def test_gemv_table():
    from atomflow_bench.measure.profile import gemv_table

    t = gemv_table(gemv_record())
    assert as_json(t) == [{"GEMV": "wgu", "format": "fp8", "rows x K": "16384x3072", "MB": 50.724864,
                           "isolated µs": 20.5, "p10-p90 µs": [20.1, 21.0], "GB/s": 2474.4, "% copy BW": 82.6,
                           "isolated ceiling %": 88.0, "chained µs": 18.2, "chained GB/s": 2787.1,
                           "chained % copy BW": 93.1}]
    assert md_lines(t)[4] == ("| wgu | fp8 | 16384x3072 | 50.7 | 20.50 | 20.1-21.0 | 2474 | 82.6 | 88 | 18.20 | 2787 | "
                              "93.1 |")


def test_tune_table():
    from atomflow_bench.measure.tune import tune_table

    t = tune_table(tune_chosen(), "tune")
    assert as_json(t) == [{"forms": "short:ring/l2=8", "step µs (best round)": 1455.5},
                          {"forms": "short:ws/l2=8", "step µs (best round)": 1530.0}]
    assert md_lines(t)[4:] == ["| short:ring/l2=8 | 1455.5 |", "| short:ws/l2=8 | 1530.0 |"]


# ---- sweep -------------------------------------------------------------------------------------------------------
def test_sweep_table(tmp_path):
    from atomflow_bench.measure.sweep import md_text, sweep_table

    summary = sweep_summary(tmp_path)
    rows = as_json(sweep_table(summary))
    one, two = summary["cells"][:2]
    assert rows[0]["ctx"] == 128 and rows[1]["tp"] == 2
    assert rows[0]["TPOT ms"] == one["tpot_ms"]["median"] and rows[0]["% roofline"] == one["roofline_pct"]
    assert rows[0]["p10-p90 ms"] == [one["tpot_ms"]["p10"], one["tpot_ms"]["p90"]]
    assert rows[0]["GB/token"] == one["bytes_per_token"] / 1e9 and rows[0]["vs TP1"] is None
    assert rows[1]["vs TP1"] == pytest.approx(two["tpot_ms"]["median"] / one["tpot_ms"]["median"])
    assert rows[2]["status"] == "failed" and all(rows[2][c] is None for c in ("TPOT ms", "p10-p90 ms", "tok/s",
                                                                               "% roofline", "GB/token", "vs TP1"))
    md = md_text(summary).splitlines()  # summary.md: the table as people read it
    assert ("| llama-3.2-3b | fp8 | 128 | 2 | done | 0.8034 | 0.7931-0.8137 | 1244.7 | 77.3 | 3.7250 | "
            "0.536 x (93% eff.) |  |  |  |  | short:ring/l2=8;split:ring/l2=0 (saved) | "
            "llama-3.2-3b-fp8-ctx128-tp2.json |") in md  # records without the prefill's fields: those columns blank
    assert ("| llama-3.2-3b | fp8 | 2048 | 1 | failed |  |  |  |  |  |  |  |  |  |  |  | llama-3.2-3b: context 2048 + "
            "tokens 64 exceed max_seq |") in md
    assert all(rows[i][c] is None for i in range(4) for c in ("TTFT ms", "TTFT p10-p90 ms", "prefill tok/s",
                                                               "% tensor-core peak"))


def test_sweep_table_prefill_columns(tmp_path):
    from atomflow_bench.measure.sweep import md_text, sweep_table

    summary = sweep_summary(tmp_path, prefill=True)
    rows = as_json(sweep_table(summary))
    one, two = summary["cells"][:2]
    assert one["ttft_ms"] == {"median": 9.0, "p10": 9.0 * 0.99, "p90": 9.0 * 1.01}
    assert rows[0]["TTFT ms"] == 9.0 and rows[0]["TTFT p10-p90 ms"] == [9.0 * 0.99, 9.0 * 1.01]
    assert rows[0]["prefill tok/s"] == pytest.approx(128 / 0.009) and one["prefill_path"] == "batched"
    tflops = 2 * 3_212_749_824 * 128 / 0.009 / 1e12
    assert rows[0]["% tensor-core peak"] == pytest.approx(100 * tflops / 700.0)
    assert rows[1]["prefill tok/s"] == pytest.approx(128 / 0.150) and rows[1]["% tensor-core peak"] is None
    assert two["prefill_path"] == "walked" and rows[2]["TTFT ms"] is None
    md = md_text(summary).splitlines()
    pct = f"{100 * tflops / 700.0:.1f}"
    assert any(line.startswith("| llama-3.2-3b | fp8 | 128 | 1 | done |")
               and f"|  | 9.000 | 8.910-9.090 | 14222 (batched) | {pct} | short" in line for line in md)
    assert any("| 0.536 x (93% eff.) | 150.000 | 148.500-151.500 | 853 (walked) |  | short" in line for line in md)


# ---- compare -----------------------------------------------------------------------------------------------------
def test_compare_table_with_and_without_ttft():
    """compare's diff: every figure a number, a figure one record lacks null (its text "not recorded")."""
    from atomflow_bench.measure.gate import compare_runs, diff_table

    base, new = make_run(2.0, seed=1), with_prefill(make_run(2.02, seed=3), 9.0)
    t = diff_table(compare_runs(base, new), "base.json", "new.json")
    rows = {r["metric"]: r for r in as_json(t)}
    assert rows["TTFT median (ms)"] == {"metric": "TTFT median (ms)", "baseline": None, "new": 9.0, "delta": None,
                                        "delta %": None}
    assert rows["prefill tok/s"]["new"] == pytest.approx(128 / 0.009) and rows["tensor-core TFLOPS"]["new"] == 700.0
    assert rows["TPOT median (ms)"]["delta"] == pytest.approx(new["tpot_ms"]["median"] - base["tpot_ms"]["median"])
    assert "| TTFT median (ms) | not recorded | 9 | — | n/a |" in md_lines(t)
    with_prefill(base, 10.0)
    rows = {r["metric"]: r for r in as_json(diff_table(compare_runs(base, new), "base.json", "new.json"))}
    assert rows["TTFT median (ms)"]["delta"] == pytest.approx(-1.0) and rows["TTFT median (ms)"]["delta %"] == \
        pytest.approx(-10.0)


# ---- peers -------------------------------------------------------------------------------------------------------
def test_peers_table():
    from atomflow_bench.measure.peers import peers_table

    t = peers_table([peer_rec(), peer_rec("cpu")])
    rows = as_json(t)
    assert rows[0] == {"engine": "HF transformers 5 eager fp16", "device": H100, "ctx": 128, "tokens": 64,
                       "TPOT median ms": 20.0, "p10 ms": 19.5, "p90 ms": 21.0, "tok/s": 50.0, "GB/s": 320.0,
                       "% of spec GB/s": pytest.approx(100 * 320 / 3350), "same tokens": "True"}
    assert rows[1]["% of spec GB/s"] is None
    assert md_lines(t)[4:] == [
        "| HF transformers 5 eager fp16 | NVIDIA H100 80GB HBM3 | 128 | 64 | 20.000 | 19.500 | 21.000 | 50.0 | 320 | "
        "10% | True |",
        "| HF transformers 5 eager fp16 | cpu | 128 | 64 | 20.000 | 19.500 | 21.000 | 50.0 | 320 | n/a | True |"]


def test_peers_cli_on_cpu_is_numbers(tiny_llama_dir, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    code, out, err = invoke(capsys, "peers", tiny_llama_dir, "--device", "cpu", "--modes", "eager", "--ctx", "4",
                            "--tokens", "3", "--repeats", "1", "--format", "json")
    assert code == 0, err
    [row] = json.loads(out)
    assert numbers_as_text(row) == [] and row["ctx"] == 4 and row["TPOT median ms"] > 0
    assert row["p10 ms"] <= row["TPOT median ms"] <= row["p90 ms"] and row["% of spec GB/s"] is None


# ---- validate ----------------------------------------------------------------------------------------------------
def printed(capsys, fn, res, fmt):
    fn(res, Console(file=sys.stdout), fmt)
    return capsys.readouterr().out


def test_validate_tables(capsys):
    from atomflow_bench.validate import print_quality, print_result

    rows = json.loads(printed(capsys, print_result, validate_result(), "json"))
    assert numbers_as_text(rows) == []
    assert rows[0] == {"probe": "layer 0", "cos (min)": 0.9999991, "rel L2": 1.2e-3, "max|diff|": 3.4e-3, "pos": 5,
                       "threshold": "≥0.9999/≤0.02", "result": "PASS"}
    assert "| layer 2 | 0.9999991 | 1.20e-03 | 3.40e-03 | 5 | ≥0.9999/≤0.02 | FAIL |" in \
        printed(capsys, print_result, validate_result(), "md").splitlines()
    rows = json.loads(printed(capsys, print_quality, quality_res(), "json"))
    assert numbers_as_text(rows) == []
    assert [(r["fp16"], r["fp8"]) for r in rows] == [(12.5, 12.7), (0.41, 0.4), (None, 0.95), (None, 2e-3),
                                                      (None, 4e-2)]
    md = printed(capsys, print_quality, quality_res(), "md").splitlines()
    assert "| perplexity | 12.5000 | 12.7000 | fp8/fp16 ≤ 1.05 (is 1.0160) | PASS |" in md
    assert "| mean KL(fp16 \\|\\| fp8) / token |  | 2.000e-03 | ≤ 0.01 nats | PASS |" in md


@pytest.fixture(scope="module")
def tiny_truth(tiny_llama_dir, tmp_path_factory):
    pytest.importorskip("transformers")
    from atomflow_bench.validate.truth import generate_truth

    d = tmp_path_factory.mktemp("tiny-truth-numbers") / "truth"
    generate_truth(tiny_llama_dir, d, prompt="w5 w17 w42", steps=3, device="cpu")
    return d


def test_validate_cli_json_is_numbers(tiny_llama_dir, tiny_truth, capsys):
    code, out, err = invoke(capsys, "validate", tiny_llama_dir, "--backend", "numpy", "--weights", "fp16",
                            "--truth", tiny_truth, "--format", "json")
    assert code == 0, err
    rows = json.loads(out)
    assert rows and numbers_as_text(rows) == []
    assert all(isinstance(r["cos (min)"], float) and isinstance(r["pos"], int) for r in rows)


# ---- doctor ------------------------------------------------------------------------------------------------------
def test_doctor_copy_bandwidth_is_a_number(monkeypatch, capsys):
    """The measured check (copy bandwidth) gives its GB/s in csv and json; the others stay sentences."""
    import atomflow_bench.doctor as doctor

    checks = [doctor.Check("disk", doctor.OK, "120.5 GiB free under /h; the default model needs 6.0 GiB"),
              doctor.bandwidth_check({"median": 2994.2, "p10": 2990.0, "p90": 2999.0})]
    monkeypatch.setattr(doctor, "run_checks", lambda bandwidth=True: checks)
    code, out, err = invoke(capsys, "doctor", "--format", "json")
    assert code == 0 and numbers_as_text(json.loads(out)) == []
    assert {r["check"]: r["detail"] for r in json.loads(out)}["copy bandwidth"] == 2994.2
    code, out, err = invoke(capsys, "doctor", "--format", "md")
    assert ("| copy bandwidth | ok | GPU 0: 2994 GB/s (device-to-device, read + write, 256 MiB x 10) |"
            in out.splitlines())


def test_doctor_cli_json_on_this_machine(capsys, tmp_path, monkeypatch):
    """The real checks (no GPU here: exit 3, the table all the same): sentences and a number, nothing in between."""
    monkeypatch.setenv("ATOMFLOW_HOME", str(tmp_path / "home"))
    import atomflow_bench.doctor as doctor

    real = doctor.run_checks
    monkeypatch.setattr(doctor, "run_checks", lambda bandwidth=True: real(bandwidth=False)
                        + [doctor.bandwidth_check({"median": 3001.0})])
    code, out, err = invoke(capsys, "doctor", "--format", "json")
    rows = json.loads(out)
    assert code in (0, 1, 3) and numbers_as_text(rows) == [] and rows[-1]["detail"] == 3001.0
    assert {"atomflow-bench", "NVIDIA driver", "disk"} <= {r["check"] for r in rows}
