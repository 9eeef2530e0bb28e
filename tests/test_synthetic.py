"""Synthetic weights: exact shapes, HF init statistics, deterministic per (seed, tensor name), sharded."""
import dataclasses
import hashlib
import json

import numpy as np
import pytest

from atomflow_bench.store import tokenizer as tokenizer_mod
from atomflow_bench.config import ModelConfig, Preset
from atomflow_bench.store.sources import synthetic
from atomflow_bench.store.sources.synthetic import make_synthetic
from atomflow_bench.store.checkpoint import Checkpoint

TINY = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=320, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def _digests(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob("*.safetensors"))}


@pytest.fixture
def small_chunks(monkeypatch):
    """Make every weight span several generator chunks, so chunk seeding and threading are exercised."""
    monkeypatch.setattr(synthetic, "CHUNK_ELEMS", 5000)


def test_shapes_dtypes_and_init_statistics(tmp_path):
    info = make_synthetic(TINY, tmp_path, seed=3)
    assert info == {"kind": "synthetic", "seed": 3, "preset": None}
    ckpt = Checkpoint(tmp_path)
    assert ckpt.config == TINY
    assert set(ckpt.keys()) == set(TINY.tensor_shapes())
    for name, shape in TINY.tensor_shapes().items():
        t = ckpt.get(name)
        assert t.dtype == np.float16 and t.shape == shape
        if len(shape) == 1:
            assert np.all(t == 1), name
        else:
            assert abs(float(t.astype(np.float32).std()) - TINY.initializer_range) < 0.002, name
            assert abs(float(t.astype(np.float32).mean())) < 0.002, name
    assert not (tmp_path / "tokenizer.json").exists()


def test_initializer_range_is_honoured(tmp_path):
    make_synthetic(dataclasses.replace(TINY, initializer_range=0.5), tmp_path)
    w = Checkpoint(tmp_path).get("model.layers.1.mlp.down_proj.weight").astype(np.float32)
    assert w.std() == pytest.approx(0.5, rel=0.05)


def test_same_seed_same_bytes_whatever_the_threads(tmp_path, small_chunks, monkeypatch):
    make_synthetic(TINY, tmp_path / "a", seed=7, workers=1)
    monkeypatch.setattr(synthetic, "IN_FLIGHT_BYTES", 1)  # one tensor in flight at a time
    make_synthetic(TINY, tmp_path / "b", seed=7, workers=4)
    make_synthetic(TINY, tmp_path / "c", seed=8, workers=4)
    a, b, c = (_digests(tmp_path / x) for x in "abc")
    assert a == b
    assert all(a[k] != c[k] for k in a)


def test_values_depend_only_on_seed_and_name(tmp_path):
    make_synthetic(TINY, tmp_path / "three", seed=1)
    make_synthetic(dataclasses.replace(TINY, num_hidden_layers=1), tmp_path / "one", seed=1)
    three, one = Checkpoint(tmp_path / "three"), Checkpoint(tmp_path / "one")
    for name in one.keys():
        np.testing.assert_array_equal(one.get(name), three.get(name))
    # ...and distinct names get distinct values
    assert not np.array_equal(three.get("model.layers.0.mlp.up_proj.weight"),
                              three.get("model.layers.0.mlp.gate_proj.weight"))


def test_chunks_are_independent_streams(tmp_path, small_chunks):
    make_synthetic(TINY, tmp_path, seed=0)
    w = Checkpoint(tmp_path).get("model.embed_tokens.weight")  # 512 x 128: chunks of 39 rows
    rows = synthetic._chunk_rows(w.shape)
    assert rows < w.shape[0]
    assert not np.array_equal(w[:rows], w[rows:2 * rows])


def test_shards_group_whole_layers(tmp_path):
    layer_bytes = 2 * sum(int(np.prod(s)) for n, s in TINY.tensor_shapes().items() if n.startswith("model.layers.0."))
    make_synthetic(TINY, tmp_path, shard_bytes=layer_bytes)  # exactly one layer fits per shard
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    n = TINY.num_hidden_layers + 2  # embedding | layer 0 | layer 1 | layer 2 | norm + lm_head
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    wm = index["weight_map"]
    assert set(wm) == set(TINY.tensor_shapes())
    assert set(wm.values()) == set(files)
    for i in range(TINY.num_hidden_layers):
        assert {f for k, f in wm.items() if k.startswith(f"model.layers.{i}.")} == {files[i + 1]}
    assert index["metadata"]["total_size"] == 2 * TINY.param_count()
    assert Checkpoint(tmp_path).get("lm_head.weight").shape == (TINY.vocab_size, TINY.hidden_size)


def test_tiny_tied_model_is_one_file(tmp_path):
    tiny = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=4, tie_word_embeddings=True)
    make_synthetic(tiny, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert "lm_head.weight" not in Checkpoint(tmp_path)


def test_llama_presets_get_the_llama3_tokenizer(tmp_path, monkeypatch):
    preset = Preset("tiny-llama", "meta-llama/Tiny", TINY, ("synthetic",))
    tok = tmp_path / "tok.json"
    tok.write_text('{"version": "1.0"}')
    monkeypatch.setattr(tokenizer_mod, "llama3_tokenizer_json", lambda: tok)
    info = make_synthetic(preset, tmp_path / "with", seed=2)
    assert info == {"kind": "synthetic", "seed": 2, "preset": "tiny-llama"}
    assert (tmp_path / "with" / "tokenizer.json").read_text() == tok.read_text()

    monkeypatch.setattr(tokenizer_mod, "llama3_tokenizer_json", lambda: None)  # offline
    make_synthetic(preset, tmp_path / "without")
    assert not (tmp_path / "without" / "tokenizer.json").exists()


def test_negative_seed_rejected(tmp_path):
    from atomflow_bench.errors import ConfigError
    with pytest.raises(ConfigError, match="seed"):
        make_synthetic(TINY, tmp_path, seed=-1)
