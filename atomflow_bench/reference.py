"""NumPy reference decoder: Llama decode in float32 on the CPU, the engine's stand-in where there is no GPU.

`generate` and `validate --backend numpy` run it instead of the GPU engine, and the GPU tests check the engine's
kernels against its taps. The ground truth itself is HuggingFace transformers (validate/truth.py).

One token per `step`, exactly the M=1 decode the engine runs, written to match HuggingFace's Llama:

    x = embed[token]
    for each layer:
        h = rmsnorm(x) ; q, k, v = Wq h, Wk h, Wv h ; rope(q, k) ; cache k, v
        x = x + Wo attention(q, K[0..pos], V[0..pos])          (GQA, softmax scale 1/sqrt(head_dim))
        h = rmsnorm(x) ; x = x + Wdown (silu(Wgate h) * Wup h)
    logits = lm_head rmsnorm(x)

`weights="fp16"` uses the stored weights upcast to float32; `weights="fp8"` passes the seven layer
projections through `quant.quantize_fp8` / `dequantize_fp8` first (W8A16 as the engine stores them;
embedding, norms and lm_head stay as stored). All weights are upcast to float32 once, at construction:
4 bytes per parameter (SmolLM2-135M: ~0.54 GB). `lazy=True` keeps the stored fp16 matrices instead and upcasts them
block by block inside each matvec, for models whose float32 copy would not fit in host memory.
"""
from __future__ import annotations

import math

import numpy as np

from .errors import ConfigError
from .quant import dequantize_fp8, quantize_fp8
from .store.checkpoint import Checkpoint


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """HF LlamaRMSNorm in float32: x * 1/sqrt(mean(x^2) + eps), then * weight."""
    inv = np.float32(1.0) / np.sqrt(np.mean(x * x, dtype=np.float32) + np.float32(eps))
    return weight * (x * inv)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def rotate_half(x: np.ndarray) -> np.ndarray:
    """HF convention on the last axis: [x1, x2] -> [-x2, x1] (halves, not interleaved pairs)."""
    x1, x2 = np.split(x, 2, axis=-1)
    return np.concatenate([-x2, x1], axis=-1)


class _Fp16Matrix:
    """A stored fp16 matrix that upcasts to float32 only inside `@` (in row blocks) and row lookups: the
    `lazy` mode, for CPU runs of models whose float32 copy would not fit in host memory."""

    BLOCK = 8192

    def __init__(self, w: np.ndarray):
        self.w = w
        self.shape = w.shape

    def __matmul__(self, x: np.ndarray) -> np.ndarray:
        return np.concatenate([self.w[r:r + self.BLOCK].astype(np.float32) @ x
                               for r in range(0, self.w.shape[0], self.BLOCK)])

    def __getitem__(self, i) -> np.ndarray:
        return self.w[i].astype(np.float32)


class _Layer:
    """One decoder layer's float32 weights, q/k/v and gate/up stacked for one matvec each."""

    def __init__(self, get, i: int):
        p = f"model.layers.{i}."
        self.attn_norm = get(p + "input_layernorm.weight")
        self.mlp_norm = get(p + "post_attention_layernorm.weight")
        self.wqkv = np.concatenate([get(p + f"self_attn.{n}_proj.weight", linear=True) for n in "qkv"])
        self.wo = get(p + "self_attn.o_proj.weight", linear=True)
        self.w_gate_up = np.concatenate([get(p + f"mlp.{n}_proj.weight", linear=True) for n in ("gate", "up")])
        self.w_down = get(p + "mlp.down_proj.weight", linear=True)


class ReferenceDecoder:
    """Single-stream Llama decoder over a `Checkpoint`; `step(token)` returns float32 logits [vocab]."""

    def __init__(self, ckpt: Checkpoint, weights: str = "fp16", max_seq: int = 2048, record_taps: bool = False,
                 lazy: bool = False):
        if weights not in ("fp16", "fp8"):
            raise ConfigError(f"unknown weight format {weights!r} (expected fp16 or fp8)")
        if max_seq < 1:
            raise ConfigError(f"max_seq must be positive, got {max_seq}")
        self.config = c = ckpt.config
        self.weights = weights
        self.max_seq = max_seq
        self.record_taps = record_taps
        self.taps: dict[str, np.ndarray] = {}

        def get(name: str, linear: bool = False) -> np.ndarray:
            w = ckpt.get(name)
            if linear and weights == "fp8":
                return dequantize_fp8(*quantize_fp8(w))
            return w.astype(np.float16 if lazy and w.ndim == 2 else np.float32)

        self.embed = get("model.embed_tokens.weight")
        self.layers = [_Layer(get, i) for i in range(c.num_hidden_layers)]
        self.norm = get("model.norm.weight")
        self.lm_head = self.embed if c.tie_word_embeddings else get("lm_head.weight")
        if lazy:  # keep 2 bytes per parameter in host memory; upcast block by block at use
            wrap = lambda w: _Fp16Matrix(w) if w.dtype == np.float16 else w  # noqa: E731
            self.embed, self.lm_head = wrap(self.embed), wrap(self.lm_head)
            for L in self.layers:
                L.wqkv, L.wo, L.w_gate_up, L.w_down = map(wrap, (L.wqkv, L.wo, L.w_gate_up, L.w_down))
        self.inv_freq = c.rope_inv_freq()
        self.k_cache = np.zeros((c.num_hidden_layers, max_seq, c.num_key_value_heads, c.head_dim), np.float32)
        self.v_cache = np.zeros_like(self.k_cache)
        self._pos = 0

    @property
    def pos(self) -> int:
        """Position of the next token (= number of tokens in the KV cache)."""
        return self._pos

    def reset(self) -> None:
        """Forget the sequence: the next `step` is position 0."""
        self._pos = 0
        self.taps = {}

    def _tap(self, name: str, x: np.ndarray) -> None:
        if self.record_taps:
            self.taps[name] = np.array(x, dtype=np.float32).reshape(-1)

    def _rope(self, x: np.ndarray, pos: int) -> np.ndarray:
        """Rotate heads x [n, head_dim] for position `pos`; the angle is float32 pos * inv_freq, as in HF."""
        angle = np.float32(pos) * self.inv_freq
        angle = np.concatenate([angle, angle])
        return x * np.cos(angle) + rotate_half(x) * np.sin(angle)

    def _attention(self, q: np.ndarray, li: int, pos: int) -> np.ndarray:
        """GQA over positions 0..pos: q [n_heads, d] -> [n_heads, d]."""
        c = self.config
        keys = self.k_cache[li, :pos + 1]                      # [T, n_kv, d]
        values = self.v_cache[li, :pos + 1]
        qg = q.reshape(c.num_key_value_heads, c.group_size, c.head_dim)   # query head h uses kv head h // group
        scores = np.einsum("kgd,tkd->kgt", qg, keys) * np.float32(1.0 / math.sqrt(c.head_dim))
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        return np.einsum("kgt,tkd->kgd", probs, values).reshape(c.num_attention_heads, c.head_dim)

    def step(self, token_id: int) -> np.ndarray:
        """Run one token at position `pos`, append its K/V to the cache, return float32 logits [vocab]."""
        c = self.config
        pos = self._pos
        if pos >= self.max_seq:
            raise ConfigError(f"sequence is full: max_seq = {self.max_seq}")
        if not 0 <= token_id < c.vocab_size:
            raise ConfigError(f"token id {token_id} out of range for vocab size {c.vocab_size}")
        if self.record_taps:
            self.taps = {}
        eps, hd = c.rms_norm_eps, c.head_dim

        x = np.array(self.embed[token_id], dtype=np.float32)
        self._tap("embed", x)
        for li, L in enumerate(self.layers):
            t = f"layers.{li}."
            h = rms_norm(x, L.attn_norm, eps)
            self._tap(t + "attn_norm", h)
            qkv = L.wqkv @ h
            q = self._rope(qkv[:c.q_dim].reshape(-1, hd), pos)
            k = self._rope(qkv[c.q_dim:c.q_dim + c.kv_dim].reshape(-1, hd), pos)
            v = qkv[c.q_dim + c.kv_dim:].reshape(-1, hd)
            self._tap(t + "q", q)
            self._tap(t + "k", k)
            self._tap(t + "v", v)
            self.k_cache[li, pos] = k
            self.v_cache[li, pos] = v
            a = self._attention(q, li, pos).reshape(-1)
            self._tap(t + "attn_out", a)
            x = x + L.wo @ a
            self._tap(t + "attn", x)

            h = rms_norm(x, L.mlp_norm, eps)
            self._tap(t + "mlp_norm", h)
            gate, up = np.split(L.w_gate_up @ h, 2)
            act = silu(gate) * up
            self._tap(t + "act", act)
            x = x + L.w_down @ act
            self._tap(t + "mlp", x)

        h = rms_norm(x, self.norm, eps)
        self._tap("final_norm", h)
        logits = self.lm_head @ h
        self._tap("logits", logits)
        self._pos = pos + 1
        return logits


def greedy(decoder: ReferenceDecoder, prompt_ids: list[int], n_new: int, stop_ids=()) -> list[int]:
    """Reset, prefill `prompt_ids` one token at a time, then pick argmax `n_new` times; return the new ids.

    Stops early after emitting any id in `stop_ids` (that id is included).
    """
    if not prompt_ids:
        raise ConfigError("greedy decoding needs at least one prompt token")
    decoder.reset()
    for t in prompt_ids:
        logits = decoder.step(int(t))
    out: list[int] = []
    stop = set(stop_ids)
    for i in range(n_new):
        nxt = int(np.argmax(logits))
        out.append(nxt)
        if nxt in stop or i == n_new - 1:
            break
        logits = decoder.step(nxt)
    return out


def perplexity(decoder: ReferenceDecoder, ids: list[int]) -> float:
    """exp(mean NLL) of ids[1:] each given its prefix (log-softmax in float64); resets the decoder first."""
    if len(ids) < 2:
        raise ConfigError("perplexity needs at least two tokens")
    decoder.reset()
    nll = 0.0
    for cur, nxt in zip(ids[:-1], ids[1:]):
        z = decoder.step(int(cur)).astype(np.float64)
        z -= z.max()
        nll += math.log(np.exp(z).sum()) - z[int(nxt)]
    return math.exp(nll / (len(ids) - 1))
