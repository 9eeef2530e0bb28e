"""`atomflow-bench generate`: greedy continuation of a prompt on the NumPy reference or the GPU engine."""
from __future__ import annotations

import time
from pathlib import Path

from .errors import ConfigError
from .store.checkpoint import Checkpoint


def _stop_ids(eos) -> tuple[int, ...]:
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def generate_text(path: str | Path, prompt: str, n_tokens: int, backend: str = "numpy", weights: str = "fp16",
                  console=None) -> str:
    """`prompt` followed by up to `n_tokens` greedily decoded tokens (stopping early at an EOS id).

    The prompt is encoded with the model's tokenizer including its special tokens (its post-processor
    decides whether a BOS is prepended). backend "numpy" runs `reference.ReferenceDecoder`; "gpu" runs
    `generate_gpu` (the GPU engine with the saved tuned forms if any, else the defaults: nothing is timed).
    """
    from .store.tokenizer import load_tokenizer

    if backend not in ("numpy", "gpu"):
        raise ConfigError(f"unknown backend {backend!r} (expected numpy or gpu)")
    ckpt = Checkpoint(path)
    tok = load_tokenizer(ckpt.dir)
    if tok is None:
        raise ConfigError(f"{ckpt.dir}: the model has no tokenizer (tokenizer.json), so it cannot encode a prompt")
    prompt_ids = tok.encode(prompt).ids
    if not prompt_ids:
        raise ConfigError("the prompt encodes to no tokens")
    n_prompt = len(prompt_ids)
    ckpt.config.check_positions(n_prompt + n_tokens, f"a prompt of {n_prompt} tokens + --tokens {n_tokens}")
    stop_ids = _stop_ids(ckpt.config.eos_token_id)

    t0 = time.perf_counter()
    if backend == "numpy":
        from .reference import ReferenceDecoder, greedy

        decoder = ReferenceDecoder(ckpt, weights=weights, max_seq=len(prompt_ids) + n_tokens)
        new_ids = greedy(decoder, prompt_ids, n_tokens, stop_ids=stop_ids)
    else:
        new_ids = generate_gpu(ckpt, prompt_ids, n_tokens, weights=weights, stop_ids=stop_ids)
    seconds = time.perf_counter() - t0
    if console is not None:
        console.print(f"[dim]{backend} {weights}: {len(prompt_ids)} prompt + {len(new_ids)} new tokens "
                      f"in {seconds:.2f} s[/dim]")

    # Decode the continuation in context (some tokenizers drop a leading space when decoding a suffix alone).
    head = tok.decode(prompt_ids, skip_special_tokens=True)
    full = tok.decode(prompt_ids + new_ids, skip_special_tokens=True)
    continuation = full[len(head):] if full.startswith(head) else tok.decode(new_ids, skip_special_tokens=True)
    return prompt + continuation


def generate_gpu(ckpt, prompt_ids, n_tokens: int, weights: str = "fp16", stop_ids=()) -> list[int]:
    """Greedy continuation on the GPU (all n_tokens run as graph replays), cut after the first stop id."""
    from .measure.context import RunContext

    ctx = RunContext(str(ckpt.dir), ckpt.dir, "")  # forms: given, else a saved tune, else the defaults (never timed)
    eng = ctx.engine(weights, len(prompt_ids) + n_tokens, tune_missing=False)
    ids = eng.generate(prompt_ids, n_tokens)
    for i, t in enumerate(ids):
        if t in stop_ids:
            return ids[: i + 1]
    return ids
