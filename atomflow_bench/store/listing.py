"""What the store holds, as `models` lists it, and the one reader of a manifest's source.

`manifest_source` reads where a store directory came from (its manifest's source kind and model); `source_label` is
that kind as a run record names it ("local" for a directory with no manifest). `models_tables` builds the tables of
`atomflow-bench models`: the catalog with what of it is in the store, its sources, and the other store directories;
`stale_notes` says which staging directories were left by a killed fetch. `removable` is what `rm NAME` removes.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..config import CATALOG
from ..errors import AtomflowError
from ..output import Num, Tab
from . import store


def manifest_source(directory) -> tuple[str, str]:
    """(source kind, model) from a store directory's manifest; ("no manifest", "") when it has none,
    ("unreadable manifest", "") when it cannot be read, kind "unknown" when it names none."""
    try:
        m = json.loads((Path(directory) / store.MANIFEST).read_text())
        return str(m.get("source", {}).get("kind", "unknown")), str(m.get("model", ""))
    except FileNotFoundError:
        return "no manifest", ""
    except (OSError, ValueError, AttributeError):
        return "unreadable manifest", ""


def source_label(directory) -> str:
    """The source a run record names for a model directory: its manifest's kind, "local" without a manifest."""
    kind, _ = manifest_source(directory)
    return "local" if kind == "no manifest" else kind


def gib(n: int) -> Num:
    """Bytes as GiB: 2.30 for csv and json, "2.30G" for people."""
    return Num(round(n / 2**30, 2), f"{n / 2**30:.2f}G")


def size_text(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} B"


def dir_bytes(directory) -> int:
    """Sum of the sizes of the regular files under `directory` (stat only; symlinks not followed)."""
    total, stack = 0, [str(directory)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        elif e.is_file(follow_symlinks=False):
                            total += e.stat(follow_symlinks=False).st_size
                    except OSError:
                        continue
        except OSError:
            continue
    return total


def catalog_dir(preset, source: str) -> Path:
    """The store directory `fetch NAME --source SOURCE` fills (the layout in store/fetch.py): models/<name> for the
    default source, models/<org>--<repo> for hf, models/<name>--<source> for another."""
    if source == preset.sources[0]:
        return store.model_dir(preset.name)
    return store.model_dir(preset.hub_repo if source == "hf" else f"{preset.name}--{source}")


def store_entries() -> tuple[dict, list]:
    """({catalog name: [(source, directory)]}, [other store directories]): what `fetch` has put in the store."""
    claimed, by_model = set(), {}
    for p in CATALOG.values():
        dirs = []
        for src in dict.fromkeys([*p.sources, "synthetic", "hf"]):
            d = catalog_dir(p, src)
            claimed.add(d.name)
            if d.is_dir():
                dirs.append((src, d))
        by_model[p.name] = dirs
    root = store.models_dir()
    try:
        others = sorted((d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")
                         and d.name not in claimed), key=lambda d: d.name)
    except OSError:  # no store yet
        others = []
    return by_model, others


def models_tables() -> list[Tab]:
    """`models`: the catalog (shape, parameters, bytes per format, what is in the store and its size on disk), its
    sources, and the other models in the store."""
    by_model, others = store_entries()
    cols = ["name", "layers", "d_model", "ffn", "q/kv", "hd", "vocab", "params", "fp16 GiB", "fp8 GiB", "in store"]
    cat = Tab("atomflow-bench model catalog", cols, key="catalog", right=tuple(cols[1:10]),
              caption="fp8 = W8A16: FP8-E4M3 layer projections with one fp32 scale per 128 inputs; embedding, norms "
                      "and lm_head stay fp16. fp16/fp8 GiB: weight bytes on the GPU. in store: each source "
                      f"fetched and its size on disk, under {store.models_dir()}.")
    for p in CATALOG.values():
        c = p.config
        held = "; ".join(f"{src} {size_text(dir_bytes(d))}" + ("" if (d / store.MANIFEST).is_file()
                                                                else " (no manifest)")
                         for src, d in by_model[p.name]) or "not fetched"
        cat.add(p.name, c.num_hidden_layers, c.hidden_size, c.intermediate_size,
                f"{c.num_attention_heads}/{c.num_key_value_heads}", c.head_dim, c.vocab_size,
                Num(c.param_count(), f"{c.param_count() / 1e9:.3f}B"), gib(c.weight_bytes("fp16")),
                gib(c.weight_bytes("fp8")), held,
                cell_styles={"in store": "" if by_model[p.name] else "dim"})
    srcs = Tab("sources", ["name", "sources", "hub", "note"], key="sources")
    for p in CATALOG.values():
        srcs.add(p.name, ", ".join(p.sources), p.hub_repo, p.note or "")
    other = Tab("in the store, not in the catalog", ["name", "source", "model", "bytes"], key="store", right=("bytes",),
                caption=f"under {store.models_dir()}" + ("; a name works as MODEL in every command" if others
                                                          else ": none"))
    for d in others:
        kind, model = manifest_source(d)
        n = dir_bytes(d)
        other.add(d.name, kind, model, Num(n, size_text(n)))
    return [cat, srcs, other]


def stale_notes() -> list[str]:
    """One line per staging or replaced directory whose writer is not running here: what it is, its size, and what
    removes it."""
    notes = []
    for left in store.leftovers():
        if left.writer == "running":
            continue
        why = (f"left by a fetch that was killed (pid {left.pid}); the next `fetch` removes it" if left.writer == "gone"
               else "its writer cannot be checked from this host; `rm` it once no fetch is running")
        notes.append(f"{left.path.name} ({size_text(dir_bytes(left.path))}): {why}")
    return notes


def removable(name: str) -> list[Path]:
    """The store directories `rm NAME` removes: every source fetched of a catalog name; else the store directory
    of that name (a hub id 'org/name' as 'org--name'); else a leftover staging directory whose writer is not running.
    AtomflowError when NAME is none of these."""
    if name in CATALOG:
        dirs = [d for _, d in store_entries()[0][name]]
    elif name and not name.startswith(".") and "\0" not in name:
        d = store.model_dir(name)
        dirs = [d] if d.parent == store.models_dir() and d.is_dir() and not d.is_symlink() else []
    else:
        dirs = [left.path for left in store.leftovers() if left.path.name == name and left.writer != "running"]
    if not dirs:
        raise AtomflowError(f"{name}: not in the store {store.models_dir()} (`atomflow-bench models` lists it)")
    return dirs
