"""Getting models into the store (`fetch_model`), checking them (`verify_model`), finding them (`resolve_model`).

A model spec is a catalog name, a hub repo id ('org/name'), a local HF-layout directory or a local .gguf
file. Where each lands in the store (`store.model_dir`):

    catalog name, its default source      models/<name>                  e.g. models/llama-3.2-3b
    catalog name, --source hf             models/<org>--<repo>           the hub id, shared with `fetch org/repo`
    catalog name, another source          models/<name>--<source>        e.g. models/smollm2-135m--synthetic
    hub repo id                           models/<org>--<repo>
    local directory / .gguf file          models/local--<dir name> / models/gguf--<file stem>

A store directory holds one version; asking for a different one (another seed or revision) replaces it. A local
directory or file whose base name is already held by another path is refused (`--force` replaces it), so two
sources never silently share a name. Everything is built in a staging directory and renamed into place with its manifest, so a
failed or interrupted fetch leaves the store as it was.
"""
from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import shutil
import sys
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import store
from .dtypes import check_dtypes, to_fp16
from .dtypes import safetensors_header as _safetensors_header
from ..config import CATALOG, GROUP, ModelConfig, Preset, get_preset
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
    if path.is_file():  # it exists: say what it is not, never "no such file"
        raise FetchError(f"{spec}: is a file, not a model directory or a .gguf file"
                         + (f" (its directory: {path.parent})" if path.name == "config.json" else ""))
    if looks_like_path or source == "local":
        raise FetchError(f"{spec}: no such file or directory")
    if not _REPO_ID.fullmatch(spec):
        get_preset(spec)  # not a catalog name either: raises, listing the catalog
    if source not in (None, "hf"):
        raise ConfigError(f"{spec}: a hub repo id is fetched with --source hf, not {source}")
    return _Plan(spec, "hf", store.model_dir(spec), spec)


def _store_entry(spec: str) -> Path | None:
    """The store directory named exactly `spec` (the name `fetch` reports, e.g. 'local--good' for `fetch
    ./good`), when it holds a manifest; None otherwise."""
    if not spec or spec.startswith(".") or "/" in spec or os.sep in spec:
        return None
    d = store.models_dir() / spec
    return d if (d / store.MANIFEST).is_file() else None


def _entry_plan(entry: Path, spec: str, source: str | None) -> _Plan:
    """The plan that built the store directory `entry`, read back from its manifest."""
    m = store.read_manifest(entry)
    kind, model = m.get("source", {}).get("kind"), m.get("model")
    if source not in (None, kind) and not (source == "local" and kind in ("local", "gguf")):
        raise ConfigError(f"{spec}: this store entry came from {kind}; --source {source} does not apply")
    if kind in ("local", "gguf") and isinstance(model, str):
        return _Plan(model, kind, entry, Path(model))
    if kind == "hf" and isinstance(model, str):
        return _Plan(model, kind, entry, model)
    if kind in ("synthetic", "pypi-gguf") and model in CATALOG:
        return _Plan(model, kind, entry, CATALOG[model])
    raise FetchError(f"{spec}: the store entry's source ({kind!r}, model {model!r}) is unknown here; "
                     "fetch it by its original name")


def _candidates(spec: str) -> list[Path]:
    """Store directories that may hold `spec`, preferred first (a catalog name: its default source first;
    a store directory's own name, e.g. 'local--good', is accepted too)."""
    if spec in CATALOG:
        return [_plan(spec, s).directory for s in dict.fromkeys([*CATALOG[spec].sources, "synthetic", "hf"])]
    entry = _store_entry(spec)
    try:
        planned = [_plan(spec).directory]
    except AtomflowError:
        if entry is None:
            raise
        return [entry]
    return planned + ([entry] if entry is not None and entry not in planned else [])


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
        held = manifest.get("source", {}).get("path")
        if plan.kind in ("local", "gguf") and held:  # two sources of one base name, not two versions of one
            raise FetchError(f"{plan.name}: the store name {plan.directory.name} already holds {held}; "
                             f"`atomflow-bench rm {plan.directory.name}` it or pass --force to replace it")
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


# safetensors float dtype -> (unsigned view, exponent mask, mantissa mask): a value is NaN or inf exactly when
# all its exponent bits are set (F8_E4M3 has no inf: S.1111.111 is its NaN). Bit tests are np.isfinite
# without the float conversion, several times faster on float16.
_FLOAT_BITS = {
    "F16": (np.uint16, 0x7C00, 0x03FF),
    "BF16": (np.uint16, 0x7F80, 0x007F),
    "F32": (np.uint32, 0x7F800000, 0x007FFFFF),
    "F64": (np.uint64, 0x7FF0000000000000, 0x000FFFFFFFFFFFFF),
    "F8_E5M2": (np.uint8, 0x7C, 0x03),
    "F8_E4M3": (np.uint8, 0x7F, 0x7F),
}
CHECK_CHUNK_BYTES = 16 << 20  # per memory-mapped chunk; a few chunks in flight bound the memory used


def _first_nonfinite(path: Path, offset: int, count: int, bits) -> tuple[int, str] | None:
    """(index, 'NaN' | 'inf') of the first non-finite of `count` values at byte `offset`, or None."""
    udt, exp, mant = bits
    values = np.memmap(path, dtype=udt, mode="r", offset=offset, shape=(count,))
    masked = values & udt(exp)
    if masked.max() != exp:
        return None
    i = int(np.flatnonzero(masked == exp)[0])
    return i, "NaN" if int(values[i]) & mant else "inf"


def check_weights(directory: Path, cfg: ModelConfig, workers: int | None = None) -> None:
    """Raise VerifyError unless every tensor the config names has the config's shape and every floating-point
    value in every *.safetensors file of `directory` is finite. Values are scanned in memory-mapped chunks of
    CHECK_CHUNK_BYTES, a few at a time, so memory stays bounded whatever the model's size."""
    want = cfg.tensor_shapes()
    jobs = []  # (file, tensor, shape, element offset in the tensor, byte offset in the file, count, bits)
    for f in sorted(Path(directory).glob("*.safetensors")):
        header, data_start = _safetensors_header(f)
        check_dtypes(f, header, want)
        for name, info in header.items():
            shape = tuple(info["shape"])
            if name in want and shape != want[name]:
                raise VerifyError(f"{f.name}: tensor {name!r} has shape {shape}, config.json says {want[name]}")
            layer = name.split(".")[2] if name.startswith("model.layers.") else ""
            if layer.isdigit() and int(layer) >= cfg.num_hidden_layers:
                raise VerifyError(f"{f.name}: tensor {name!r} is beyond config.json's num_hidden_layers = "
                                  f"{cfg.num_hidden_layers}")
            bits = _FLOAT_BITS.get(info["dtype"])
            begin, end = info["data_offsets"]
            if bits is None or end <= begin:
                continue
            size = np.dtype(bits[0]).itemsize
            n, step = (end - begin) // size, max(1, CHECK_CHUNK_BYTES // size)
            jobs += [(f, name, shape, o, data_start + begin + o * size, min(step, n - o), bits)
                     for o in range(0, n, step)]
    workers = workers or min(4, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for (f, name, shape, start, _, _, _), hit in zip(
                jobs, _ordered_map(pool, lambda j: _first_nonfinite(j[0], *j[4:]), jobs, 2 * workers)):
            if hit is not None:
                where = list(np.unravel_index(start + hit[0], shape)) if shape else []
                raise VerifyError(f"{f.name}: tensor {name!r} has {'a NaN' if hit[1] == 'NaN' else 'an inf'} "
                                  f"at {[int(i) for i in where]} (weights must be finite)")


def _check_model(directory: Path, name: str, error: type[AtomflowError] = FetchError) -> None:
    """The directory opens as a Llama checkpoint, its tensors match its config.json, its weights are finite."""
    from .checkpoint import Checkpoint
    try:
        check_weights(directory, Checkpoint(directory).config)
    except AtomflowError as e:
        msg = str(e).replace(f"{directory}/", "").replace(f"{directory}: ", "")
        raise error(f"{name}: not a usable Llama checkpoint: {msg}") from None


def _warn_no_tokenizer(directory: Path, name: str, console) -> None:
    """One warning line on stderr (CLI use only: `console` given) when the model has no tokenizer.json."""
    if console is not None and not (Path(directory) / "tokenizer.json").is_file():
        print(f"warning: {name}: no tokenizer (tokenizer.json), so `generate` cannot encode a prompt; "
              "run, profile, tune and gemv work on token ids", file=sys.stderr, flush=True)


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _os_error(e: OSError, name: str) -> FetchError:
    """A one-line FetchError for an OSError met while fetching `name` (full disk, read-only store, ...)."""
    where = store.home()
    why = e.strerror or _first_line(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return FetchError(f"{name}: no space left on the device holding {where} (nothing was kept; free some "
                          "space or set ATOMFLOW_HOME to another disk)")
    paths = [str(p) for p in (e.filename, e.filename2) if p]
    root = os.path.abspath(where)
    in_store = any(os.path.abspath(p) == root or os.path.abspath(p).startswith(root + os.sep) for p in paths)
    if e.errno == errno.EROFS or (in_store and e.errno in (errno.EACCES, errno.EPERM)):
        return FetchError(f"{name}: cannot write to the store {where}: {why} "
                          "(set ATOMFLOW_HOME to a writable directory)")
    if in_store:
        return FetchError(f"{name}: the store {where}: {why}")
    if paths:
        return FetchError(f"{paths[0]}: {why}")
    return FetchError(f"{name}: {why}")


@contextlib.contextmanager
def _os_errors(name: str):
    try:
        yield
    except OSError as e:
        raise _os_error(e, name) from None


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
    total = cfg.fp8_projection_bytes()
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


SPACE_SLACK = 16 << 20  # config, index, manifest, a synthetic Llama's tokenizer.json (~9 MB)


def _check_space(name: str, directory: Path, need: int) -> None:
    """Refuse before writing when the disk that will hold `directory` has less than `need` bytes free: a full disk
    would otherwise be found only after writing all it holds (a synthetic 405B is 811 GB)."""
    root = Path(directory)
    while not root.exists() and root != root.parent:
        root = root.parent
    free = shutil.disk_usage(root).free
    if need + SPACE_SLACK > free:
        raise FetchError(f"{name}: needs {need / 1e9:.1f} GB on the disk holding {store.home()}, "
                         f"{free / 1e9:.1f} GB free (nothing was written; free some space or set ATOMFLOW_HOME to "
                         "another disk)")


def _add_fp8(directory: Path, manifest: dict, console) -> None:
    """Rebuild `directory` with the fp8 file added: links to its files plus the new one, new manifest."""
    from .checkpoint import Checkpoint

    _check_space(manifest["model"], directory, Checkpoint(directory).config.fp8_projection_bytes())
    _say(console, f"adding {FP8_FILE} to {directory}")
    with _os_errors(manifest["model"]), store.staging_dir(directory, overwrite=True) as tmp:
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
    for left in store.remove_stale():
        if console is not None:
            print(f"note: removed {left.path.name}, left by a fetch that was killed (pid {left.pid})",
                  file=sys.stderr, flush=True)
    try:
        plan = _plan(spec, source)
    except AtomflowError:
        entry = _store_entry(spec)  # the name an earlier `fetch` reported, e.g. local--good
        if entry is None:
            raise
        plan = _entry_plan(entry, spec, source)
        if not force and revision is None and not seed and store.verify_dir(entry, full=False) == []:
            if fmt == "fp8" and FP8_FILE not in store.read_manifest(entry)["files"]:
                _add_fp8(entry, store.read_manifest(entry), console)
            else:
                _say(console, f"{plan.name}: already in the store")
            _warn_no_tokenizer(entry, spec, console)
            return entry
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
        _warn_no_tokenizer(plan.directory, plan.name, console)
        return plan.directory
    if plan.kind == "synthetic":  # the one source whose size is known before anything is written
        cfg = plan.target.config
        _check_space(plan.name, plan.directory,
                     cfg.weight_bytes("fp16") + (cfg.fp8_projection_bytes() if fmt == "fp8" else 0))
    _say(console, f"fetching {plan.name} ({plan.kind}) into {plan.directory}")
    with _os_errors(plan.name), store.staging_dir(plan.directory, overwrite=True) as tmp:
        source_info = _build(plan, tmp, revision, seed, console)
        for name in to_fp16(tmp):
            _say(console, f"{name}: bf16 tensors converted to fp16")
        _check_model(tmp, plan.name)
        if fmt == "fp8":
            write_fp8(tmp, console)
        store.write_manifest(tmp, plan.name, source_info)
    _warn_no_tokenizer(plan.directory, plan.name, console)
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
    with _os_errors(str(directory)):
        problems = store.verify_dir(directory, full=True)
        if problems:
            more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
            raise VerifyError(f"{directory}: {len(problems)} problem(s): {'; '.join(problems[:3])}{more}")
        _say(console, "checking shapes against config.json and that every weight is finite")
        _check_model(directory, str(directory), VerifyError)
    _say(console, f"{len(store.read_manifest(directory)['files'])} files match the manifest")
    return directory


def model_config(spec: str, source: str | None = None):
    """The ModelConfig of `spec` without fetching anything or touching a GPU, so that a command refuses a model it
    cannot run before it asks for a GPU: a local directory's (checked as `resolve_model` checks it), the store's
    copy, else the catalog's shape; None where only a download tells (a hub id not in the store, a .gguf file).
    An unknown name or a --source that does not apply raises here."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return ModelConfig.from_file(resolve_model(spec, fetch_if_missing=False) / "config.json")
    if source is not None:
        try:
            _plan(spec, source)
        except AtomflowError:
            if _store_entry(spec) is None:
                raise
    if path.suffix.lower() == ".gguf" and path.is_file():
        return None
    directory = next((d for d in _candidates(spec) if (d / store.MANIFEST).is_file()), None)
    if directory is not None:
        return ModelConfig.from_file(directory / "config.json")
    return CATALOG[spec].config if spec in CATALOG else None


def pending_fetch(spec: str) -> tuple[str, int | None] | None:
    """What `resolve_model(spec)` would fetch first: None when nothing (a local directory, or in the store), else (its
    source kind, the bytes it writes where the catalog knows them: the fp16 weights)."""
    if Path(spec).expanduser().is_dir() or any((d / store.MANIFEST).is_file() for d in _candidates(spec)):
        return None
    return _plan(spec).kind, (CATALOG[spec].config.weight_bytes("fp16") if spec in CATALOG else None)


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
