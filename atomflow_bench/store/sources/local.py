"""An HF-layout model directory already on disk, copied into the store."""
from __future__ import annotations

import shutil
from pathlib import Path

from .. import store
from ...config import ModelConfig
from ...errors import FetchError, VerifyError
from . import byte_progress, is_model_file


def import_local(src: Path, out_dir: Path, console=None) -> dict:
    """Validate `src` (config.json, *.safetensors, its own manifest if any) and copy its model files to `out_dir`.

    Copies rather than links, so later edits to `src` cannot change the store. Returns the source record.
    """
    src = Path(src).resolve()
    if not src.is_dir():
        raise FetchError(f"{src}: not a directory")
    ModelConfig.from_file(src / "config.json")
    if not any(src.glob("*.safetensors")):
        raise FetchError(f"{src}: no *.safetensors files (only safetensors checkpoints are supported)")
    if (src / store.MANIFEST).is_file():
        problems = store.verify_dir(src, full=True)
        if problems:
            raise VerifyError(f"{src}: does not match its own manifest: {'; '.join(problems[:3])}")
    files = sorted(p for p in src.iterdir() if p.is_file() and is_model_file(p.name))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    with byte_progress(console, f"copying {src.name}", sum(p.stat().st_size for p in files)) as advance:
        for p in files:
            shutil.copyfile(p, Path(out_dir) / p.name)
            advance(p.stat().st_size)
    return {"kind": "local", "path": str(src)}
