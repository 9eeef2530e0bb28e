"""`atomflow-bench validate` on the CPU: the NumPy reference path against HF transformers ground truth.

Positive runs (tiny random Llama, real SmolLM2-135M) must PASS every probe; three deliberately broken
engines (a layer's k_proj scaled, a wrong RoPE theta, gate/up swapped) must FAIL first at the right probe,
with every earlier probe still passing, and exit non-zero. The ground truth of the negative cases is always
made from the ORIGINAL model.
"""
from __future__ import annotations

import ast
import graphlib
import json
import shutil
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from atomflow_bench.validate import check, metrics, probes, truth
from atomflow_bench.cli import main

REPO = Path(__file__).resolve().parents[1]
TINY_PROMPT = "w5 w17 w42 w99 w150"   # the tiny tokenizer prepends <s>: 6 prompt ids
TINY_STEPS = 12                        # 17 positions: far enough for a wrong RoPE theta to show clearly


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    """`atomflow-bench ARGS` through the real entry point (errors -> one line, exit codes as in a shell)."""
    try:
        main(args)
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


@pytest.fixture(scope="module")
def tiny_truth(tiny_llama_dir, tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("tiny-truth") / "truth"
    truth.generate_truth(tiny_llama_dir, d, prompt=TINY_PROMPT, steps=TINY_STEPS, device="cpu")
    return d


# ---- metrics and identities ---------------------------------------------------------------------------
def test_metrics_and_kl():
    x = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    assert metrics.probe_metrics(x, x) == (pytest.approx(1.0), 0.0, 0.0)
    c, r, a = metrics.probe_metrics(2 * x, x)        # a scale error: cosine cannot see it, rel L2 does
    assert c == pytest.approx(1.0) and r == pytest.approx(1.0) and a == pytest.approx(np.abs(x).max())
    assert metrics.probe_metrics(-x, x)[0] == pytest.approx(-1.0)
    assert metrics.probe_metrics(np.full(3, np.nan), np.ones(3))[:2] == (-1.0, float("inf"))
    assert metrics.kl_div(x, x) == pytest.approx(0.0, abs=1e-15)
    assert metrics.kl_div(x, x + 5.0) == pytest.approx(0.0, abs=1e-12)  # softmax is shift-invariant
    assert metrics.kl_div(x, -x) > 1.0
    names = probes.probe_names(28)
    assert len(names) == 1 + 56 + 2 and names[:3] == ["embed", "layers.0.attn", "layers.0.mlp"]
    assert names[-2:] == ["final_norm", "logits"]


def test_weights_hash_covers_only_fp16_safetensors(tiny_llama_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, d)
    h = truth.weights_sha256(d)
    assert h == truth.weights_sha256(tiny_llama_dir)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "rope_theta": 1.0}))
    (d / "model-fp8.safetensors").write_bytes(b"derived")
    assert truth.weights_sha256(d) == h                      # config and the derived fp8 file are not covered
    st = d / "model.safetensors"
    # a store manifest's per-file hash is used when it lists the file at its current size
    (d / "manifest.json").write_text(json.dumps({"format": "atomflow-manifest/1", "model": "m", "source": {},
                                                 "files": {"model.safetensors": {"sha256": "ab" * 32,
                                                                                 "size": st.stat().st_size}}}))
    assert truth.weights_sha256(d) != h
    (d / "manifest.json").unlink()
    raw = bytearray(st.read_bytes())
    raw[-1] ^= 1
    st.write_bytes(bytes(raw))
    assert truth.weights_sha256(d) != h


def test_validate_modules_import_in_layers():
    """validate/'s modules import each other without a circle, the engine side never reaches for the HF side, and
    the only imports inside functions are the optional extras (torch, transformers, cupy)."""
    deps: dict[str, set[str]] = {}
    inside: set[str] = set()
    for f in sorted((REPO / "atomflow_bench" / "validate").glob("*.py")):
        tree = ast.parse(f.read_text())
        deps[f.stem] = {node.module or a.name for node in ast.walk(tree)
                        if isinstance(node, ast.ImportFrom) and node.level == 1 for a in node.names}
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inside |= {a.name.split(".")[0] if isinstance(n, ast.Import) else (n.module or "").split(".")[0]
                           for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    assert {"truth", "probes", "metrics", "report", "check"} <= set(deps)
    list(graphlib.TopologicalSorter(deps).static_order())   # raises CycleError on a circle
    assert deps["metrics"] == set() and deps["report"] == set() and deps["probes"] == set()
    assert deps["truth"] == {"probes"}
    assert inside <= {"torch", "transformers", "cupy"}, inside


# ---- the ground truth ---------------------------------------------------------------------------------
def test_truth_files_match_hf(tiny_truth, tiny_llama_dir):
    """truth.json + truth.safetensors, cross-checked against the independent HF helper of test_reference."""
    from helpers_hf import hf_decode, load_hf
    from safetensors import safe_open

    m = json.loads((tiny_truth / "truth.json").read_text())
    assert m["schema"] == truth.TRUTH_SCHEMA and m["dtype"] == "float32" and m["device"].startswith("cpu")
    assert m["prompt_ids"] == [0, 5, 17, 42, 99, 150] and m["prompt"] == TINY_PROMPT
    assert len(m["generated_ids"]) == m["steps"] == TINY_STEPS
    assert m["positions"] == 6 + TINY_STEPS - 1
    assert m["weights_sha256"] == truth.weights_sha256(tiny_llama_dir)
    assert set(m["variants"]) == {"fp16", "fp8"}
    assert m["variants"]["fp16"]["predicted_ids"] == m["generated_ids"]
    for key in ("torch", "transformers", "created", "model", "config_sha256"):
        assert m[key]
    names = probes.probe_names(3)
    with safe_open(str(tiny_truth / "truth.safetensors"), framework="numpy") as f:
        assert len(list(f.keys())) == 2 * m["positions"] * len(names)
        t = f.get_tensor("fp16.pos0.logits")
        assert t.dtype == np.float32 and t.shape == (300,)

    new, steps, hidden = hf_decode(load_hf(tiny_llama_dir), m["prompt_ids"], TINY_STEPS)
    assert new == m["generated_ids"]
    stored = truth.Truth(tiny_truth)
    for s, ref in enumerate(steps):
        for n in names:
            np.testing.assert_allclose(stored.get("fp16", s, n), ref[n], rtol=1e-6, atol=1e-6, err_msg=f"{s} {n}")
        for i in range(2):  # hidden_states[i + 1] is layer i's output (the last one is normed in transformers 5)
            np.testing.assert_allclose(stored.get("fp16", s, f"layers.{i}.mlp"), hidden[s][i + 1], rtol=1e-6, atol=1e-6)
    # the fp8 variant differs (other weight values) but is close, and is teacher-forced on the same tokens
    c = metrics.probe_metrics(stored.get("fp8", 5, "logits"), stored.get("fp16", 5, "logits"))[0]
    assert 0.95 < c < 1.0


def test_truth_script(tiny_llama_dir, tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "t"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_ground_truth.py"), str(tiny_llama_dir),
                        "--prompt", "w7 w8", "--steps", "2", "--out", str(out), "--device", "cpu"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    m = json.loads((out / "truth.json").read_text())
    assert m["prompt_ids"] == [0, 7, 8] and len(m["generated_ids"]) == 2 and m["positions"] == 4
    assert "ok" in r.stdout


def _load_script():
    from helpers_scripts import load_script

    return load_script("gen_ground_truth")


def test_missing_torch_gives_the_install_hint(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    from click.testing import CliRunner

    monkeypatch.setitem(sys.modules, "torch", None)   # `import torch` now raises ImportError
    monkeypatch.setenv("ATOMFLOW_HOME", str(tmp_path / "home"))
    rc, out = run_cli(["validate", str(tiny_llama_dir), "--backend", "numpy", "--steps", "2"], capsys)
    assert rc == 1
    assert "pip install 'atomflow-bench[truth]'" in out and "--truth DIR" in out
    res = CliRunner().invoke(_load_script().main, [str(tiny_llama_dir), "--out", str(tmp_path / "t")])
    assert res.exit_code == 1
    text = res.output + (getattr(res, "stderr", "") or "")
    assert "pip install 'atomflow-bench[truth]'" in text and "pip install torch transformers" in text


# ---- positive: tiny model ------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_validate_tiny_passes(fmt, tiny_llama_dir, tiny_truth, tmp_path, capsys):
    js = tmp_path / "v.json"
    rc, out = run_cli(["validate", str(tiny_llama_dir), "--weights", fmt, "--backend", "numpy",
                       "--truth", str(tiny_truth), "--json", str(js)], capsys)
    assert rc == 0, out
    assert "9/9 probes PASS" in out and f"greedy agreement: {TINY_STEPS}/{TINY_STEPS}" in out
    assert "NumPy reference (CPU)" in out
    res = json.loads(js.read_text())
    assert res["schema"] == check.RESULT_SCHEMA and res["summary"]["pass"] and res["backend"]["kind"] == "numpy"
    assert res["truth"]["variant"] == fmt and len(res["probes"]) == 9
    # the NumPy path is float32 math on the same weight values as HF: orders of magnitude inside the bounds
    assert res["summary"]["min_cos"] > 1 - 1e-9 and res["summary"]["max_rel_l2"] < 1e-5
    assert res["summary"]["kl_last"] < 1e-9
    if fmt == "fp8":
        d = res["drift"]
        assert d and 0.95 < d["hidden_min_cos"] < 0.9999 and "quantization drift" in out
    print(f"\ntiny {fmt}: worst cos {res['summary']['min_cos']:.12f}, worst rel L2 {res['summary']['max_rel_l2']:.2e}, "
          f"KL {res['summary']['kl_last']:.2e}")


def test_validate_makes_and_reuses_truth(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    monkeypatch.setenv("ATOMFLOW_HOME", str(tmp_path / "home"))
    args = ["validate", str(tiny_llama_dir), "--weights", "fp16", "--backend", "numpy", "--prompt", "w9 w10",
            "--steps", "3"]
    rc, out = run_cli(args, capsys)
    assert rc == 0 and "ground truth written to" in out and "9/9 probes PASS" in out, out
    made = list((tmp_path / "home" / "truth").iterdir())
    assert len(made) == 1 and (made[0] / "truth.json").is_file() and made[0].name.endswith("-s3")
    rc, out = run_cli(args, capsys)
    assert rc == 0 and "reusing" in out
    rc, out = run_cli(["validate", str(tiny_llama_dir), "--backend", "numpy", "--truth", str(made[0]),
                       "--steps", "5"], capsys)
    assert rc == 1 and "3 steps" in out



def test_making_the_truth_prints_our_lines_only(tiny_llama_dir, tmp_path, monkeypatch, capfd):
    """validate makes the truth with transformers' warnings and log lines off: its output is its own."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("ATOMFLOW_HOME", str(tmp_path / "home"))
    once = getattr(logging.Logger, "warning_once", None)  # transformers logs some lines once per process
    if hasattr(once, "cache_clear"):
        once.cache_clear()
    level = transformers.utils.logging.get_verbosity()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            main(["validate", str(tiny_llama_dir), "--weights", "fp16", "--backend", "numpy", "--prompt", "w3 w4",
                  "--steps", "2", "--truth", str(tmp_path / "truth")])
        except SystemExit as e:
            assert e.code in (0, None)
    out, err = capfd.readouterr()
    assert "ground truth written to" in out and "probes PASS" in out, out + err
    theirs = [f"{w.category.__name__}: {w.message}" for w in seen if issubclass(w.category, (FutureWarning, UserWarning))]
    assert theirs == [], theirs
    assert "transformers" not in err and "Warning" not in err and "deprecated" not in err, err
    assert transformers.utils.logging.get_verbosity() == level


def test_quiet_silences_transformers_and_restores_it(capfd):
    transformers = pytest.importorskip("transformers")
    from atomflow_bench.hf import quiet

    log = transformers.utils.logging
    level = log.get_verbosity()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet(transformers):
            log.get_logger("transformers.modeling_utils").warning("their chatter")
            warnings.warn("their old name", FutureWarning)
            warnings.warn("their note", UserWarning)
        warnings.warn("ours", UserWarning)
    assert [str(w.message) for w in seen] == ["ours"]
    assert "their chatter" not in capfd.readouterr().err and log.get_verbosity() == level

# ---- negative: deliberately broken engines against the ORIGINAL model's truth ------------------------------
def _broken_copy(src: Path, dst: Path, case: str) -> Path:
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    if case == "rope":  # the engine computes RoPE with the wrong base (Llama-3's instead of this model's)
        cfg = json.loads((dst / "config.json").read_text())
        assert cfg["rope_theta"] == 10000.0
        (dst / "config.json").write_text(json.dumps({**cfg, "rope_theta": 500000.0}))
        return dst
    st = dst / "model.safetensors"
    t = load_file(str(st))
    p = "model.layers.1."
    if case == "k_proj":
        k = p + "self_attn.k_proj.weight"
        t[k] = (t[k].astype(np.float32) * 1.5).astype(np.float16)
    elif case == "gate_up":
        gate, up = p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"
        t[gate], t[up] = t[up], t[gate]
    save_file(t, str(st), metadata={"format": "pt"})
    return dst


NEGATIVE = {  # case -> (first failing probe, probes that must still pass)
    "k_proj": ("layers.1.attn", ["embed", "layers.0.attn", "layers.0.mlp"]),
    "rope": ("layers.0.attn", ["embed"]),
    "gate_up": ("layers.1.mlp", ["embed", "layers.0.attn", "layers.0.mlp", "layers.1.attn"]),
}


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("case", list(NEGATIVE))
def test_broken_engine_fails_at_the_right_probe(case, fmt, tiny_llama_dir, tiny_truth, tmp_path, capsys):
    broken = _broken_copy(tiny_llama_dir, tmp_path / case, case)
    js = tmp_path / "v.json"
    args = ["validate", str(broken), "--weights", fmt, "--backend", "numpy", "--truth", str(tiny_truth),
            "--json", str(js)]
    if case != "rope":
        # the truth was made from other weights: refused unless asked for explicitly
        rc, out = run_cli(args, capsys)
        assert rc == 1 and "other weights" in out and "--allow-mismatch" in out and not js.exists()
        args.append("--allow-mismatch")
    rc, out = run_cli(args, capsys)
    first, passing = NEGATIVE[case]
    assert rc != 0, out
    assert f"(first FAIL: {first})" in out and "probes PASS" in out
    res = json.loads(js.read_text())
    by_name = {p["name"]: p for p in res["probes"]}
    assert res["summary"]["first_fail"] == first and not res["summary"]["pass"]
    assert not by_name[first]["pass"]
    for name in passing:
        assert by_name[name]["pass"], name
        assert by_name[name]["cos"] > 1 - 1e-9, name   # untouched by the fault: exact
    th = metrics.THRESHOLDS[fmt]
    p = by_name[first]
    print(f"\n{case} {fmt}: {first} cos {p['cos']:.5f} (bound {th.cos_min}), rel L2 {p['rel_l2']:.3f} "
          f"(bound {th.rel_max}) -> 1-cos {((1 - p['cos']) / (1 - th.cos_min)):.1f}x / rel "
          f"{p['rel_l2'] / th.rel_max:.1f}x past the bounds")
    assert (1 - p["cos"]) > 2 * (1 - th.cos_min) or p["rel_l2"] > 2 * th.rel_max  # fails by a clear margin
    if case == "rope":
        assert "config.json differs" in out


# ---- real weights: SmolLM2-135M ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_truth(smollm2_fetched, tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("smol-truth") / "truth"
    truth.generate_truth(smollm2_fetched, d, steps=4, device="cpu")   # "The capital of France is" + 4 steps
    return d


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_validate_smollm2_passes(fmt, smollm2_fetched, smol_truth, tmp_path, capsys):
    js = tmp_path / "v.json"
    rc, out = run_cli(["validate", str(smollm2_fetched), "--weights", fmt, "--backend", "numpy",
                       "--truth", str(smol_truth), "--json", str(js)], capsys)
    assert rc == 0, out
    assert "63/63 probes PASS" in out and "greedy agreement: 4/4" in out
    s = json.loads(js.read_text())["summary"]
    assert s["min_cos"] > 1 - 1e-8 and s["max_rel_l2"] < 1e-4
    print(f"\nSmolLM2 {fmt}: worst cos {s['min_cos']:.10f}, worst rel L2 {s['max_rel_l2']:.2e}, KL {s['kl_last']:.2e}")


@pytest.mark.slow
def test_quality_smollm2(smollm2_fetched, tmp_path, capsys):
    js = tmp_path / "q.json"
    rc, out = run_cli(["validate", str(smollm2_fetched), "--quality", "--backend", "numpy", "--json", str(js)], capsys)
    assert rc == 0, out
    q = json.loads(js.read_text())
    assert q["schema"] == check.QUALITY_SCHEMA and q["pass"] is True
    assert 100 <= q["text"]["tokens"] <= 150
    assert q["fp16"]["perplexity"] < 30 and q["ppl_ratio"] < 1.10
    assert q["top1_agreement"] >= 0.90 and q["mean_kl_fp16_fp8"] <= 0.05
    print(f"\nSmolLM2 quality over {q['text']['tokens']} tokens: ppl fp16 {q['fp16']['perplexity']:.4f}, fp8 "
          f"{q['fp8']['perplexity']:.4f} (x{q['ppl_ratio']:.4f}); top-1 agreement {q['top1_agreement']:.4f}; "
          f"mean KL(fp16||fp8) {q['mean_kl_fp16_fp8']:.3e}, max {q['max_kl_fp16_fp8']:.3e}")


def test_validate_refuses_a_timing_instrument(tiny_llama_dir, tiny_truth, monkeypatch, capsys):
    """AF_NO_WAIT in ATOMFLOW_KERNEL_DEFINES makes the kernels wrong on purpose: validate says so and stops (exit 1)
    before any work, instead of reporting failed probes."""
    monkeypatch.setenv("ATOMFLOW_KERNEL_DEFINES", "GEMV_ONE_WAVE=1 AF_NO_WAIT=2")
    rc, out = run_cli(["validate", str(tiny_llama_dir), "--backend", "numpy", "--truth", str(tiny_truth)], capsys)
    assert rc == 1
    assert "timing instrument AF_NO_WAIT=2" in out and "unset it to validate" in out
    monkeypatch.setenv("ATOMFLOW_KERNEL_DEFINES", "AF_NO_WAIT=0")
    rc, out = run_cli(["validate", str(tiny_llama_dir), "--backend", "numpy", "--truth", str(tiny_truth)], capsys)
    assert rc == 0, out
