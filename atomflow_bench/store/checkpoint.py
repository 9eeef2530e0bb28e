"""A model directory's tensors, by HF name, memory-mapped.

`Checkpoint(dir)` opens config.json and every `*.safetensors` file (single or sharded) lazily; tensors are
read on demand as NumPy arrays (safetensors memory-maps the files). Both the NumPy reference decoder
and the GPU loader read weights only through this class.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from ..config import ModelConfig
from ..errors import ConfigError, VerifyError


class Checkpoint:
    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise ConfigError(f"{self.dir}: not a model directory")
        self.config = ModelConfig.from_file(self.dir / "config.json")
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise VerifyError(f"{self.dir}: no *.safetensors files")
        self._where: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        for f in files:
            try:
                h = safe_open(str(f), framework="numpy")
            except Exception as e:  # SafetensorError (truncated, garbage header), OSError (unreadable)
                raise VerifyError(f"{f}: not a readable safetensors file ({self._first_line(e)})") from None
            self._handles[f] = h
            for k in h.keys():
                self._where[k] = f
        missing = [k for k in self.config.tensor_shapes() if k not in self._where]
        if missing:
            raise VerifyError(f"{self.dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[0]!r}")

    @staticmethod
    def _first_line(e: BaseException) -> str:
        lines = str(e).strip().splitlines()
        return lines[0] if lines else type(e).__name__

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def keys(self):
        return self._where.keys()

    def get(self, name: str) -> np.ndarray:
        """Tensor `name` as stored (usually float16), shape-checked against the config."""
        try:
            f = self._where[name]
        except KeyError:
            raise VerifyError(f"{self.dir}: no tensor {name!r}") from None
        try:
            t = self._handles[f].get_tensor(name)
        except Exception as e:  # SafetensorError, OSError (file changed or unreadable), TypeError (dtype)
            raise VerifyError(f"{f}: cannot read tensor {name!r} ({self._first_line(e)})") from None
        want = self.config.tensor_shapes().get(name)
        if want is not None and tuple(t.shape) != want:
            raise VerifyError(f"{self.dir}: tensor {name!r} has shape {tuple(t.shape)}, config says {want}")
        return t

    def lm_head(self) -> np.ndarray:
        name = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        return self.get(name)

    def tokenizer_path(self) -> Path | None:
        p = self.dir / "tokenizer.json"
        return p if p.is_file() else None

    def manifest(self) -> dict | None:
        p = self.dir / "manifest.json"
        return json.loads(p.read_text()) if p.is_file() else None
