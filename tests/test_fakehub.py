"""`--source hf` end to end against a local fake hub: real huggingface_hub download code, real HTTP.

In-process tests patch huggingface_hub's constants (it reads HF_ENDPOINT / HF_HOME once, at import);
the CLI tests set the environment variables of a fresh process instead, as a user would.
"""
import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

from atomflow_bench.store import store
from atomflow_bench.config import ModelConfig
from atomflow_bench.errors import FetchError
from atomflow_bench.store.fetch import fetch_model, resolve_model, verify_model
from atomflow_bench.store.sources.synthetic import make_synthetic
from atomflow_bench.store.checkpoint import Checkpoint

from fakehub import FakeHub

REPO = "acme/tiny-llama"
# Big enough (~17 MB) that the model file spans several of huggingface_hub's 10 MiB download chunks.
CONFIG = ModelConfig(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    make_synthetic(CONFIG, d, seed=5)
    (d / "generation_config.json").write_text('{"bos_token_id": 1}')
    return d


@pytest.fixture
def hub(tiny_model):
    with FakeHub() as h:
        h.commit = h.add_repo(REPO, tiny_model, extra={"README.md": b"# tiny\n",
                                                       "original/consolidated.safetensors": b"not wanted"})
        yield h


@pytest.fixture
def hf_env(hub, tmp_path, monkeypatch):
    """This process's huggingface_hub and store pointed at the fake hub and at tmp dirs."""
    from huggingface_hub import constants
    monkeypatch.setenv("ATOMFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return tmp_path


def _store_is_empty():
    models = store.models_dir()
    return not models.exists() or os.listdir(models) == []


def test_fetch_verifies_and_records_commit(hf_env, hub, tiny_model):
    path = fetch_model(REPO)
    assert path == store.model_dir(REPO)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "generation_config.json", "manifest.json",
                                                       "model.safetensors"]
    m = store.read_manifest(path)
    assert m["source"] == {"kind": "hf", "repo": REPO, "revision": "main", "commit": hub.commit,
                           "endpoint": hub.url}
    assert store.verify_dir(path, full=True) == []
    assert verify_model(REPO) == path
    assert resolve_model(REPO, fetch_if_missing=False) == path
    ours, theirs = Checkpoint(path), Checkpoint(tiny_model)
    np.testing.assert_array_equal(ours.get("model.embed_tokens.weight"), theirs.get("model.embed_tokens.weight"))
    # downloads went through the HF cache, under the configured HF_HUB_CACHE
    blobs = hf_env / "hf-cache" / "models--acme--tiny-llama" / "blobs"
    sha = hashlib.sha256((tiny_model / "model.safetensors").read_bytes()).hexdigest()
    assert (blobs / sha).is_file()


def test_second_fetch_reuses_store_and_cache(hf_env, hub):
    fetch_model(REPO)
    n = len(hub.log)
    fetch_model(REPO)  # store hit: no request at all
    assert len(hub.log) == n
    fetch_model(REPO, force=True)  # rebuilt from the HF cache: one metadata call, no file transfer
    assert [m for m, p, _ in hub.log[n:] if "/resolve/" in p] == []


def test_revision_pin(hf_env, hub):
    path = fetch_model(REPO, revision=hub.commit)
    assert store.read_manifest(path)["source"]["revision"] == hub.commit
    assert any(p == f"/api/models/{REPO}/revision/{hub.commit}" for _, p, _ in hub.log)
    with pytest.raises(FetchError, match=r"revision 'v9' not found"):
        fetch_model(REPO, revision="v9")
    assert store.verify_dir(path) == []  # the failed fetch left the pinned copy alone


def test_dropped_connection_resumes_with_range(hf_env, hub):
    hub.drop_once(REPO, "model.safetensors", after=12 << 20)  # past huggingface_hub's first 10 MiB chunk
    path = fetch_model(REPO)
    ranged = [r for m, p, r in hub.log if m == "GET" and p.endswith("/model.safetensors") and r]
    (start,) = [int(r.removeprefix("bytes=").rstrip("-")) for r in ranged]
    assert 0 < start <= 12 << 20  # it asked only for bytes it had not written yet
    assert store.verify_dir(path, full=True) == []


@pytest.mark.parametrize("name, kind", [("model.safetensors", "sha256"), ("config.json", "git blob sha1")])
def test_corrupt_file_fails_and_leaves_nothing(hf_env, hub, name, kind):
    hub.corrupt(REPO, name)
    with pytest.raises(FetchError, match=rf"^{name}: {kind} [0-9a-f]+… != hub [0-9a-f]+…") as e:
        fetch_model(REPO)
    assert "\n" not in str(e.value)
    assert _store_is_empty()
    snapshot = hf_env / "hf-cache" / "models--acme--tiny-llama" / "snapshots" / hub.commit
    assert not (snapshot / name).exists()  # evicted from the HF cache too
    blob = hub.repos[REPO].files[name].etag
    assert not (hf_env / "hf-cache" / "models--acme--tiny-llama" / "blobs" / blob).exists()


def test_unknown_repo(hf_env, hub):
    with pytest.raises(FetchError, match=r"^acme/nope: repository not found on http://127\.0\.0\.1:\d+") as e:
        fetch_model("acme/nope")
    assert "\n" not in str(e.value)
    assert _store_is_empty()


def test_repo_without_safetensors(hf_env, hub, tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text("{}")
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"\0" * 10)
    hub.add_repo("acme/bin-only", tmp_path / "bin")
    with pytest.raises(FetchError, match="no \\*.safetensors"):
        fetch_model("acme/bin-only")


# ---- the CLI in a fresh process, configured by environment variables -------------------------------
def _cli(hub, home, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(ATOMFLOW_HOME=str(home / "store"), HF_HOME=str(home / "hf"), HF_ENDPOINT=hub.url,
               HF_HUB_DISABLE_TELEMETRY="1", COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "atomflow_bench.cli", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def test_cli_fetch_ok_then_verify(hub, tmp_path):
    r = _cli(hub, tmp_path, "fetch", REPO)
    assert r.returncode == 0, r.stderr
    final = tmp_path / "store" / "models" / "acme--tiny-llama"
    assert f"ok {final}" in r.stdout.replace("\n", "")
    assert (tmp_path / "hf" / "hub" / "models--acme--tiny-llama").is_dir()  # HF_HOME honoured
    r = _cli(hub, tmp_path, "fetch", REPO, "--verify")
    assert r.returncode == 0, r.stderr


def test_cli_corrupt_and_unknown_are_one_line_errors(hub, tmp_path):
    hub.corrupt(REPO, "model.safetensors")
    r = _cli(hub, tmp_path, "fetch", REPO)
    assert r.returncode == 1
    assert r.stderr.startswith("error: model.safetensors: sha256 ") and r.stderr.count("\n") == 1
    assert os.listdir(tmp_path / "store" / "models") == []
    r = _cli(hub, tmp_path, "fetch", "acme/nope")
    assert r.returncode == 1
    assert r.stderr.startswith("error: acme/nope: repository not found") and r.stderr.count("\n") == 1
