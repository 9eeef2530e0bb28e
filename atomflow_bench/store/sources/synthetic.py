"""Seeded random weights at a model's exact shape: the benchmark needs the bytes, not the knowledge.

Initialisation follows HF `LlamaPreTrainedModel`: normal(0, initializer_range) for every linear and
embedding weight, ones for RMSNorm weights; stored fp16 in HF-style shards of at most ~2 GB (whole layers).

Tensors are generated in fixed row chunks and each chunk draws from its own generator, seeded from
(seed, tensor name, chunk index) only. So chunks are generated in parallel in any order (numpy releases
the GIL), the bytes never depend on the thread count, and each tensor's values depend only on the seed
and its name. Tensors are streamed to disk in order while later ones are generated, with at most
IN_FLIGHT_BYTES (plus one tensor) held: an 8B model takes ~2 GB of host memory whatever its size.
"""
from __future__ import annotations

import hashlib
import math
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .. import store
from ...config import ModelConfig, Preset
from ...errors import ConfigError
from . import SafetensorsStream, byte_progress

SHARD_BYTES = 2_000_000_000
CHUNK_ELEMS = 1 << 22  # values per generator; part of the output definition, so never change it
IN_FLIGHT_BYTES = 1 << 30


def _chunk_rows(shape: tuple[int, ...]) -> int:
    return max(1, CHUNK_ELEMS // math.prod(shape[1:]))


def _chunk_seed(seed: int, name: str, chunk: int) -> np.random.SeedSequence:
    digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:16], "little")
    return np.random.SeedSequence(entropy=[seed, digest], spawn_key=(chunk,))


def _shards(cfg: ModelConfig, shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped into shards: whole layers packed greedily, in checkpoint order."""
    shapes = cfg.tensor_shapes()
    units: list[list[str]] = [["model.embed_tokens.weight"]]
    units += [[n for n in shapes if n.startswith(f"model.layers.{i}.")] for i in range(cfg.num_hidden_layers)]
    units.append([n for n in ("model.norm.weight", "lm_head.weight") if n in shapes])
    shards: list[list[str]] = []
    size = 0
    for unit in units:
        nbytes = sum(2 * math.prod(shapes[n]) for n in unit)
        if shards and size + nbytes <= shard_bytes:
            shards[-1] += unit
            size += nbytes
        else:
            shards.append(list(unit))
            size = nbytes
    return shards


def make_synthetic(preset_or_config: Preset | ModelConfig, out_dir: Path, seed: int = 0, console=None, *,
                   shard_bytes: int = SHARD_BYTES, workers: int | None = None) -> dict:
    """Write config.json, fp16 safetensors shards (+ index) and, for Llama presets, tokenizer.json.

    Returns the manifest source record {"kind": "synthetic", "seed", "preset"}.
    """
    preset = preset_or_config if isinstance(preset_or_config, Preset) else None
    cfg = preset.config if preset else preset_or_config
    if not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    store.write_json_atomic(out_dir / "config.json", cfg.to_hf_dict())

    shapes = cfg.tensor_shapes()
    std = np.float32(cfg.initializer_range)
    local = threading.local()

    def fill(out: np.ndarray, name: str, chunk: int) -> None:
        rows = _chunk_rows(out.shape)
        dst = out[chunk * rows:(chunk + 1) * rows]
        buf = getattr(local, "buf", None)
        if buf is None or buf.size < dst.size:
            buf = local.buf = np.empty(max(dst.size, CHUNK_ELEMS), dtype=np.float32)
        vals = buf[:dst.size].reshape(dst.shape)
        np.random.Generator(np.random.PCG64(_chunk_seed(seed, name, chunk))).standard_normal(
            dtype=np.float32, out=vals)
        np.multiply(vals, std, out=dst, casting="same_kind")

    def finished(out: np.ndarray, jobs: list) -> np.ndarray:
        for job in jobs:
            job.result()
        return out

    def generated(pool: ThreadPoolExecutor):
        """Every tensor, in checkpoint order; later ones are being generated while earlier ones are written."""
        queue = deque()
        for name, shape in shapes.items():
            out = np.empty(shape, dtype=np.float16)
            if len(shape) == 1:  # RMSNorm weight
                out[...] = 1
                jobs = []
            else:
                jobs = [pool.submit(fill, out, name, c) for c in range(math.ceil(shape[0] / _chunk_rows(shape)))]
            queue.append((out, jobs))
            while len(queue) > 1 and sum(o.nbytes for o, _ in queue) > IN_FLIGHT_BYTES:
                yield finished(*queue.popleft())
        while queue:
            yield finished(*queue.popleft())

    groups = _shards(cfg, shard_bytes)
    files = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    total = 2 * cfg.param_count()
    label = preset.name if preset else "model"
    with byte_progress(console, f"synthetic {label} (seed {seed})", total) as advance, \
            ThreadPoolExecutor(max_workers=workers or os.cpu_count()) as pool:
        tensors = generated(pool)
        for fname, names in zip(files, groups):
            with SafetensorsStream(out_dir / fname, [(n, np.float16, shapes[n]) for n in names],
                                   {"format": "pt"}) as out:
                for _ in names:
                    t = next(tensors)
                    out.write(t)
                    advance(t.nbytes)
    if len(files) > 1:
        weight_map = {n: f for f, names in zip(files, groups) for n in names}
        store.write_json_atomic(out_dir / "model.safetensors.index.json",
                                {"metadata": {"total_size": total}, "weight_map": weight_map})
    _attach_tokenizer(preset, out_dir, console)
    return {"kind": "synthetic", "seed": seed, "preset": preset.name if preset else None}


def _attach_tokenizer(preset: Preset | None, out_dir: Path, console) -> None:
    """Copy the real Llama-3.2 tokenizer.json for Llama presets (their vocabulary is its vocabulary)."""
    if preset is None or not preset.hub_repo.startswith("meta-llama/"):
        if console is not None:
            console.print("no tokenizer for this synthetic model: it runs on token ids only")
        return
    from ..tokenizer import llama3_tokenizer_json

    path = llama3_tokenizer_json()
    if path is None:
        if console is not None:
            console.print("[yellow]Llama-3.2 tokenizer unavailable (offline?): the model runs on token ids "
                          "only; fetch again with --force to attach it[/yellow]")
        return
    (out_dir / "tokenizer.json").write_bytes(Path(path).read_bytes())
