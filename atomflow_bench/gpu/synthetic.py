"""Synthetic weights generated on the GPU, each tensor-parallel rank only its own shard: the statistics of the store's
synthetic source (store/sources/synthetic.py: normal(0, initializer_range) for every linear and embedding weight,
ones for the RMSNorm weights, fp16) without writing a checkpoint to disk (Llama-3.1-70B is 141 GB of fp16).

The values are seeded from (seed, tensor name, the rows and columns held) through CuPy's generator, so a tensor every
rank holds whole (the embedding, the norms) is identical on every rank, as the replicated residual stream needs; they
are NOT the store's values (another generator): timing depends only on the shape, and `validate` runs on a fetched
checkpoint, sharded at load.
"""
from __future__ import annotations

import hashlib

import numpy as np

from ..config import ModelConfig

CHUNK = 1 << 26  # values generated per call (256 MB of fp32 scratch)


class GpuSynthetic:
    """A weight source for gpu/upload.py: `get_shard(name, shard)` -> a CuPy fp16 array of the rank's part."""

    dir = None  # no files (no tokenizer, no pre-quantised fp8)

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        self.config = cfg
        self.seed = seed
        self._shapes = cfg.tensor_shapes()

    def _seed(self, name: str, rs: slice, cs: slice) -> int:
        key = f"{self.seed}|{name}|{rs.start}:{rs.stop}|{cs.start}:{cs.stop}".encode()
        return int.from_bytes(hashlib.sha256(key).digest()[:8], "little")

    def get_shard(self, name: str, shard=None):
        import cupy

        full = self._shapes[name]
        if shard is None:
            rs, cs = slice(0, full[0]), slice(0, full[1] if len(full) > 1 else 1)
            shape = tuple(full)
        else:
            rs, cs = shard.slice_index(name)  # shard: gpu/tp/plan.py RankShard
            shape = shard.slice_shape(name, full)
        if len(shape) == 1:  # RMSNorm weight
            return cupy.ones(shape, dtype=cupy.float16)
        out = cupy.empty(shape, dtype=cupy.float16)
        flat = out.reshape(-1)
        rng = cupy.random.default_rng(self._seed(name, rs, cs))
        std = np.float32(self.config.initializer_range)
        for o in range(0, flat.size, CHUNK):
            n = min(CHUNK, flat.size - o)
            v = rng.standard_normal(n, dtype=cupy.float32)
            v *= std
            flat[o:o + n] = v.astype(cupy.float16)
        return out

    def get(self, name: str):
        return self.get_shard(name, None)
