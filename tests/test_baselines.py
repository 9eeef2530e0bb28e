"""Recorded baselines: the shipped files, strict validation, and the comparison `run` prints."""
from __future__ import annotations

import copy
import json

import pytest
from helpers_runs import make_run

from atomflow_bench import output
from atomflow_bench.measure.baselines import (DEFAULT_DIR, baseline_bytes_per_token, catalog_name, comparison_rows,
                                      comparison_table, gpu_relation, load_baselines, spec_bandwidth, validate)
from atomflow_bench.cli import main
from atomflow_bench.config import CATALOG
from atomflow_bench.errors import AtomflowError

RTX = "NVIDIA GeForce RTX 5060 Ti"


@pytest.fixture(scope="module")
def shipped() -> dict[str, dict]:
    """The AtomFlow README's RTX 5060 Ti baselines, by engine name."""
    return {b["engine"]["name"]: b for b in load_baselines(DEFAULT_DIR) if b["gpu"]["name"] == RTX}


@pytest.fixture(scope="module")
def vllm_h100() -> dict:
    """The vLLM FP8 KV-cache post's fitted line, loaded as `run` loads it (the default directory)."""
    [b] = [b for b in load_baselines() if b["model"] == "llama-3.1-8b" and b["engine"]["name"] == "vLLM"]
    return b


def _fit_only(b: dict) -> dict:
    b = copy.deepcopy(b)
    del b["metrics"]["tpot_ms"], b["metrics"]["tok_per_s"]
    return b


def test_shipped_baselines_hold_the_published_figures(shipped):
    vllm, atom = shipped["vLLM"], shipped["AtomFlow"]
    assert vllm["metrics"]["tpot_ms"] == 16.1 and atom["metrics"]["tpot_ms"] == 14.5
    for b in (vllm, atom):
        assert b["gpu"] == {"name": RTX, "memory_bandwidth_gbs": 448}
        assert b["model"] == "llama-3.2-3b" and "AtomFlow README" in b["source"]
    assert "torch.compile" in vllm["engine"]["flags"] and "CUDA Graph" in vllm["engine"]["flags"]
    assert vllm["precision"].startswith("unspecified") and "W8A16" in atom["precision"]


@pytest.mark.parametrize("mutate, field", [
    (lambda b: b.update(speed=1), "'speed'"),                                  # unknown field
    (lambda b: b.pop("source"), "'source'"),                                   # missing field
    (lambda b: b["metrics"].update(tpot_ms="16.1"), "'metrics.tpot_ms'"),      # wrong type, nested
    (lambda b: b["metrics"].update(tpot_ms=-1.0), "'metrics.tpot_ms'"),        # out of range
    (lambda b: b["metrics"].pop("tok_per_s"), "'metrics.tok_per_s'"),          # missing, nested
    (lambda b: b["gpu"].update(vendor="nvidia"), "'gpu.vendor'"),              # unknown, nested
    (lambda b: b.update(context=True), "'context'"),                           # bool is not an integer
    (lambda b: b.update(context=12.5), "'context'"),
    (lambda b: b.update(bytes_format="int4"), "'bytes_format'"),
    (lambda b: b.update(schema="atomflow-bench/baseline/2"), "schema 'atomflow-bench/baseline/2' is not one"),
    (lambda b: b.update(engine="vLLM"), "'engine'"),
])
def test_malformed_baseline_names_file_and_field(tmp_path, shipped, mutate, field):
    b = copy.deepcopy(shipped["vLLM"])
    mutate(b)
    (tmp_path / "a-good.json").write_text(json.dumps(shipped["AtomFlow"]))
    (tmp_path / "b-bad.json").write_text(json.dumps(b))
    with pytest.raises(AtomflowError) as e:
        load_baselines(tmp_path)
    assert "b-bad.json" in str(e.value) and field in str(e.value)


def test_not_json_and_not_an_object(tmp_path):
    (tmp_path / "x.json").write_text("[1, 2]")
    with pytest.raises(AtomflowError, match=r"x\.json: expected a JSON object"):
        load_baselines(tmp_path)
    (tmp_path / "x.json").write_text("{oops")
    with pytest.raises(AtomflowError, match=r"x\.json: not valid JSON"):
        load_baselines(tmp_path)


def test_an_absent_directory_given_is_an_error_the_default_absent_none(tmp_path, monkeypatch):
    import atomflow_bench.measure.baselines as bl

    with pytest.raises(AtomflowError, match="--baselines .*none: not a directory"):
        load_baselines(tmp_path / "none")
    monkeypatch.setattr(bl, "DEFAULT_DIR", tmp_path / "none")  # a wheel built without them
    assert load_baselines() == []


def test_run_refuses_a_malformed_baseline_before_measuring(tmp_path, capsys):
    (tmp_path / "bad.json").write_text(json.dumps({"schema": "atomflow-bench/baseline/1"}))
    with pytest.raises(SystemExit) as e:
        main(["run", "--baselines", str(tmp_path), "--no-json"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "bad.json" in err and "missing field 'engine'" in err


@pytest.mark.parametrize("name, gbs", [
    ("NVIDIA H100 80GB HBM3", 3350), ("NVIDIA H100 PCIe", 2000), ("NVIDIA H200", 4800), ("NVIDIA A100-SXM4-80GB", 2039),
    (RTX, 448), ("NVIDIA GeForce RTX 4090", 1008), ("NVIDIA L40S", 864), ("NVIDIA GeForce RTX 5060", None),
    ("Tesla T4", None)])
def test_spec_bandwidth(name, gbs):
    assert spec_bandwidth(name) == gbs


def test_catalog_name():
    assert catalog_name("meta-llama/Llama-3.2-3B-Instruct") == "llama-3.2-3b"
    assert catalog_name("llama-3.2-3b") == "llama-3.2-3b"
    assert catalog_name("/some/dir") == "/some/dir"


def test_same_gpu_gives_tpot_and_speedup(shipped):
    run = make_run(14.0, gpu=RTX)
    rows = comparison_rows(run, list(shipped.values()))
    ours, others = rows[0], {r["engine"].split()[0]: r for r in rows[1:]}
    assert ours["kind"] == "ours" and ours["tpot_ms"] == pytest.approx(run["tpot_ms"]["median"])
    v = others["vLLM"]
    assert v["same_gpu"] and v["speedup"] == pytest.approx(16.1 / run["tpot_ms"]["median"])
    assert v["normalised_ratio"] is None
    assert others["AtomFlow"]["speedup"] == pytest.approx(14.5 / run["tpot_ms"]["median"])


def test_different_gpu_gives_only_the_roofline_normalised_ratio(shipped):
    run = make_run(2.0)  # H100 SXM, spec 3350 GB/s
    rows = comparison_rows(run, [shipped["vLLM"]])
    v = rows[1]
    assert not v["same_gpu"] and v["speedup"] is None
    cfg = CATALOG["llama-3.2-3b"].config
    their_frac = cfg.weight_bytes("fp16") / 16.1e-3 / 1e9 / 448  # no context stated: weights only
    assert v["roofline_frac"] == pytest.approx(their_frac)
    assert v["normalised_ratio"] == pytest.approx(run["bandwidth_gbs"] / 3350 / their_frac)


def test_baseline_bytes_include_kv_at_its_context(shipped):
    b = copy.deepcopy(shipped["vLLM"])
    b.update(context=1000, tokens=1)
    cfg = CATALOG["llama-3.2-3b"].config
    assert baseline_bytes_per_token(b) == cfg.weight_bytes("fp16") + 1001 * cfg.kv_bytes_per_token()
    b.update(bytes_format=None)
    assert baseline_bytes_per_token(b) is None


def test_other_models_are_not_compared(shipped):
    rows = comparison_rows(make_run(2.0, model="llama-3.2-1b"), list(shipped.values()))
    assert [r["kind"] for r in rows] == ["ours"]
    rows = comparison_rows(make_run(2.0, model="meta-llama/Llama-3.2-3B-Instruct"), list(shipped.values()))
    assert len(rows) == 3


def test_peers_on_the_same_gpu_get_a_speedup():
    run = make_run(2.0)
    peer = {"engine": "HF transformers 5 eager fp16", "gpu": run["gpu"]["name"], "precision": "fp16",
            "context": 128, "tpot_ms": {"median": 20.0}, "bandwidth_gbs": 320.0}
    rows = comparison_rows(run, [], [peer])
    assert rows[1]["kind"] == "peer" and rows[1]["speedup"] == pytest.approx(20.0 / run["tpot_ms"]["median"])


def test_table_labels_the_normalised_column(shipped):
    rows = comparison_rows(make_run(2.0), list(shipped.values())) + comparison_rows(
        make_run(14.0, gpu=RTX), list(shipped.values()))[1:]
    text = output.text(comparison_table(rows), "md")
    assert "roofline-normalised (different GPU)" in text and "speedup (same GPU)" in text
    assert "— (different GPU)" in text and "— (same GPU)" in text
    json.dumps(rows)  # stored in the results JSON as they are


# ---- fitted lines (metrics.tpot_fit_ms) and a GPU whose variant is not stated ------------------------------
H100_UNSTATED = "NVIDIA H100 (variant not stated)"


def test_shipped_vllm_h100_holds_the_posts_fit_and_provenance(vllm_h100):
    b = vllm_h100
    assert b["metrics"]["tpot_fit_ms"] == {"intercept": 6.44, "per_input_token": 4.37e-5,
                                           "input": "prompt length in tokens"}
    assert b["context"] is None and b["tokens"] == 128
    assert b["gpu"] == {"name": H100_UNSTATED, "memory_bandwidth_gbs": None}
    assert b["engine"]["name"] == "vLLM" and b["engine"]["version"] == "v0.19.1"
    for flag in ("FlashAttention-3", "bf16 KV cache", "concurrency 1", "128 output tokens"):
        assert flag in b["engine"]["flags"]
    for words in ("_posts/2026-04-22-fp8-kvcache.md", "The State of FP8 KV-Cache and Attention Quantization in vLLM",
                  "2026-04-22", "v0.19.1", "fitted line through `vllm bench serve` (HTTP client)"):
        assert words in b["source"]
    assert "weights not stated" in b["precision"] and b["bytes_format"] is None and "weight_bytes" not in b
    assert baseline_bytes_per_token(b, 128) is None  # the weights' precision is not stated: bytes unknown


def test_fitted_baseline_validates_and_is_evaluated_at_the_runs_context(vllm_h100):
    for b in (vllm_h100, _fit_only(vllm_h100)):  # besides one TPOT, and instead of it
        validate(b)
        for ctx, tpot in ((128, 6.445594), (4096, 6.44 + 4.37e-5 * 4096)):
            run = make_run(7.0, model="meta-llama/Llama-3.1-8B-Instruct", context=ctx)
            [ours, row] = comparison_rows(run, [b])
            assert row["tpot_ms"] == pytest.approx(tpot, abs=1e-6) and row["context"] == ctx
            assert row["label"] == f"fitted line, evaluated at ctx {ctx}"
    text = output.text(comparison_table(comparison_rows(make_run(7.0, model="llama-3.1-8b"), [vllm_h100])), "md")
    assert "| 128 (fitted line, evaluated at ctx 128) |" in text and "| 6.446 |" in text


@pytest.mark.parametrize("mutate, message", [
    (lambda m: m["tpot_fit_ms"].update(intercept="6.44"), "field 'metrics.tpot_fit_ms.intercept' must be number"),
    (lambda m: m["tpot_fit_ms"].update(intercept=0), "field 'metrics.tpot_fit_ms.intercept' must be > 0"),
    (lambda m: m["tpot_fit_ms"].pop("per_input_token"), "missing field 'metrics.tpot_fit_ms.per_input_token'"),
    (lambda m: m["tpot_fit_ms"].update(per_input_token=-1e-5), "field 'metrics.tpot_fit_ms.per_input_token' must be >= 0"),
    (lambda m: m["tpot_fit_ms"].update(slope=4.37e-5), "unknown field 'metrics.tpot_fit_ms.slope'"),
    (lambda m: m["tpot_fit_ms"].pop("input"), "missing field 'metrics.tpot_fit_ms.input'"),
    (lambda m: m.update(tpot_fit_ms=[6.44, 4.37e-5]), "field 'metrics.tpot_fit_ms' must be object"),
    (lambda m: m.pop("tpot_fit_ms"), "missing field 'metrics.tpot_ms'"),       # neither one TPOT nor a fit
    (lambda m: m.update(tpot_ms=6.44), "missing field 'metrics.tok_per_s'"),   # one TPOT without its tok/s
])
def test_malformed_fit_is_refused_naming_the_field(vllm_h100, mutate, message):
    b = _fit_only(vllm_h100)
    mutate(b["metrics"])
    with pytest.raises(AtomflowError) as e:
        validate(b, "vllm.json")
    assert str(e.value).startswith("vllm.json: ") and message in str(e.value)


def test_a_fit_needs_a_null_context(vllm_h100):
    b = copy.deepcopy(vllm_h100)
    b["context"] = 128
    with pytest.raises(AtomflowError, match="field 'context' must be null with 'metrics.tpot_fit_ms'"):
        validate(b)


@pytest.mark.parametrize("ours, relation", [
    ("NVIDIA H100 80GB HBM3", "variant not stated"), ("NVIDIA H100 PCIe", "variant not stated"),
    ("NVIDIA H100 NVL", "variant not stated"), ("NVIDIA H200", "different"), (RTX, "different")])
def test_gpu_relation_of_an_unstated_variant(ours, relation):
    assert gpu_relation(H100_UNSTATED, ours) == relation
    assert gpu_relation("NVIDIA H100 80GB HBM3", ours) == ("same" if ours == "NVIDIA H100 80GB HBM3" else "different")


def test_unstated_variant_is_an_absolute_ratio_never_a_same_gpu_speedup(vllm_h100):
    run = make_run(5.0, model="llama-3.1-8b")  # an H100 SXM
    row = comparison_rows(run, [vllm_h100])[1]
    assert not row["same_gpu"] and row["gpu_match"] == "variant not stated"
    assert row["speedup"] == pytest.approx(6.445594 / run["tpot_ms"]["median"])
    assert row["gpu_bandwidth_gbs"] is None and row["normalised_ratio"] is None  # no SXM bandwidth assumed silently
    t = comparison_table([row])
    assert t.records()[0]["speedup (same GPU)"] == pytest.approx(row["speedup"], abs=0.005)  # data: the number
    cell = str(t.rows[0][t.columns.index("speedup (same GPU)")])  # people: the number and what it is
    assert cell.startswith(f"x{row['speedup']:.2f} (absolute ratio; GPU variant not stated")
    other = comparison_rows(make_run(20.0, model="llama-3.1-8b", gpu=RTX), [vllm_h100])[1]
    assert other["gpu_match"] == "different" and other["speedup"] is None


def test_weight_bytes_are_the_records_own(shipped):
    b = copy.deepcopy(shipped["vLLM"])
    b.update(weight_bytes=3_420_000_000, bytes_format=None, context=0, tokens=1)
    assert baseline_bytes_per_token(b) == 3_420_000_000 + CATALOG["llama-3.2-3b"].config.kv_bytes_per_token()
    b.update(weight_bytes=0)
    with pytest.raises(AtomflowError, match="field 'weight_bytes' must be > 0"):
        validate(b)
