"""HuggingFace ground truth for the tests: a tiny random Llama on disk, and HF decode with per-stage taps.

`build_tiny_llama(dir)` writes config.json + model.safetensors (fp16) + tokenizer.json that both
`atomflow_bench.store.checkpoint.Checkpoint` and `transformers` read, so both sides see identical fp16 weights.
`hf_decode(model, ids)` runs HF one token per forward (DynamicCache, like decode) and returns, per step,
the same stage names as `ReferenceDecoder.taps`, captured with forward hooks.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=256,
            tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, initializer_range=0.1)
# original_max_position_embeddings=32 puts head_dim=16's wavelengths (2*pi*10000^(i/8)) in all three llama3
# bands: kept (< 8), smoothed (8..32) and divided by `factor` (> 32).
TINY_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 32}
TINY_ROPE_THETA = 10000.0


def _tiny_tokenizer(vocab_size: int):
    """Word-level tokenizer over 'w2'..'w{V-1}' with <s>=0 prepended to every encoding and </s>=1."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<s>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.add_special_tokens(["<s>", "</s>"])
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


def build_tiny_llama(directory: str | Path, seed: int = 0, tokenizer: bool = True) -> Path:
    """A random tiny Llama (GQA 4/2, llama3 RoPE, tied embeddings) saved in fp16; returns `directory`.

    config.json is written in the legacy form real Llama checkpoints use (`rope_theta` + `rope_scaling`),
    which transformers 5 still reads (and would otherwise rewrite as `rope_parameters`).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
    cfg = LlamaConfig(**TINY, rope_theta=TINY_ROPE_THETA, rope_scaling=dict(TINY_ROPE))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float16)
    model.save_pretrained(directory, safe_serialization=True)
    hf_dict = {**TINY, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
               "attention_bias": False, "mlp_bias": False, "torch_dtype": "float16",
               "rope_theta": TINY_ROPE_THETA, "rope_scaling": dict(TINY_ROPE)}
    (directory / "config.json").write_text(json.dumps(hf_dict, indent=2))
    if tokenizer:
        _tiny_tokenizer(TINY["vocab_size"]).save(str(directory / "tokenizer.json"))
    return directory


def load_hf(directory: str | Path):
    """LlamaForCausalLM from `directory` in float32 with eager attention (fp16 weights upcast exactly)."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


class _Taps:
    """Forward hooks on HF submodules that record the ReferenceDecoder's stage names for one token."""

    def __init__(self, model):
        self.model = model
        self.out: dict[str, np.ndarray] = {}
        self.handles = []
        self.cos_sin = None
        m = model.model

        def put(name, t):
            t = t[0] if isinstance(t, tuple) else t
            self.out[name] = t.detach().float().reshape(-1).numpy().copy()

        def on_output(name):
            return lambda mod, args, out: put(name, out)

        def on_input(name):
            return lambda mod, args: put(name, args[0])

        def on_rope(mod, args, out):
            self.cos_sin = out

        self._hook(m.embed_tokens.register_forward_hook(on_output("embed")))
        self._hook(m.rotary_emb.register_forward_hook(on_rope))
        for i, layer in enumerate(m.layers):
            p = f"layers.{i}."
            self._hook(layer.input_layernorm.register_forward_hook(on_output(p + "attn_norm")))
            self._hook(layer.self_attn.q_proj.register_forward_hook(on_output(p + "q_proj")))
            self._hook(layer.self_attn.k_proj.register_forward_hook(on_output(p + "k_proj")))
            self._hook(layer.self_attn.v_proj.register_forward_hook(on_output(p + "v")))
            self._hook(layer.self_attn.o_proj.register_forward_pre_hook(on_input(p + "attn_out")))
            # the input of post_attention_layernorm is the residual stream after the attention block
            self._hook(layer.post_attention_layernorm.register_forward_pre_hook(on_input(p + "attn")))
            self._hook(layer.post_attention_layernorm.register_forward_hook(on_output(p + "mlp_norm")))
            self._hook(layer.mlp.down_proj.register_forward_pre_hook(on_input(p + "act")))
            self._hook(layer.register_forward_hook(on_output(p + "mlp")))
        self._hook(m.norm.register_forward_hook(on_output("final_norm")))

    def _hook(self, h):
        self.handles.append(h)

    def finish(self) -> dict[str, np.ndarray]:
        """Apply HF's own RoPE to the captured q/k projections -> `layers.{i}.q` / `.k`; return the taps."""
        import torch
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        cfg = self.model.config
        cos, sin = self.cos_sin
        for i in range(cfg.num_hidden_layers):
            p = f"layers.{i}."
            q = torch.from_numpy(self.out.pop(p + "q_proj")).view(1, 1, -1, cfg.head_dim).transpose(1, 2)
            k = torch.from_numpy(self.out.pop(p + "k_proj")).view(1, 1, -1, cfg.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            self.out[p + "q"] = q.transpose(1, 2).reshape(-1).numpy().copy()
            self.out[p + "k"] = k.transpose(1, 2).reshape(-1).numpy().copy()
        out, self.out = self.out, {}
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


def hf_decode(model, prompt_ids: list[int], n_new: int) -> tuple[list[int], list[dict[str, np.ndarray]], list]:
    """Decode like the engine: one token per forward through a DynamicCache, greedy for `n_new` tokens.

    Returns (generated ids, per-step taps incl. `logits`, per-step `hidden_states` tuples as numpy).
    Step s feeds token s of prompt_ids + generated (the last generated id is never fed).
    """
    import torch
    from transformers import DynamicCache

    from atomflow_bench.hf import cache_keyword

    taps = _Taps(model)
    cache, kw = DynamicCache(config=model.config), cache_keyword(model)
    steps, hidden, new = [], [], []
    seq = list(prompt_ids)
    try:
        with torch.no_grad():
            for s in range(len(prompt_ids) + n_new - 1):
                out = model(input_ids=torch.tensor([[seq[s]]]), **{kw: cache}, use_cache=True,
                            output_hidden_states=True)
                cache = getattr(out, kw)
                t = taps.finish()
                t["logits"] = out.logits[0, -1].float().numpy().copy()
                steps.append(t)
                hidden.append([h[0, -1].float().numpy().copy() for h in out.hidden_states])
                if s >= len(prompt_ids) - 1:
                    nxt = int(np.argmax(t["logits"]))
                    new.append(nxt)
                    seq.append(nxt)
    finally:
        taps.remove()
    return new, steps, hidden


def hf_perplexity(model, ids: list[int]) -> float:
    """exp(mean NLL) of ids[1:] from one full-sequence HF forward, log-softmax in float64."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    nll = -torch.log_softmax(logits, dim=-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    return float(torch.exp(nll.mean()))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
