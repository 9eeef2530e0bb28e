#!/usr/bin/env python3
"""Does a change of kernels_cu/ change the code of kernels it was not meant to touch? (CPU: needs nvcc and git.)

    scripts/ptx_compare.py REV [SOURCE ...] [--arch sm_90] [-D NAME=V ...]

compiles each kernels_cu source (default: all of both trees) to PTX at git revision REV and in the working tree, splits
both into their kernel entries and compares each kernel's body, found by name in whichever source defines it, after
renumbering virtual registers and labels by first use (so a refactor that only shifts nvcc's numbering reads "same").
A kernel that moved to another source compares the same way ("same, from OLD.cu"); one present only on one side is
matched to a kernel only on the other side whose body, its own name aside, is the same ("renamed from OLD").
Prints one line per kernel (same, differs with the count of changed lines, renamed, or only on one side), then a
summary, and exits 1 when any kernel present on both sides differs.
"""
from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_ENTRY = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+)?\.entry\s+(\w+)", re.M)
_LOCAL_STATIC = re.compile(r"_ZZ\w+E(\d+)(\w+)")  # _ZZ<function>E<length><name>: a function-local static
_NAMES = re.compile(r"\$L__BB\d+_\d+|%(?:rd|rs|r|fd|f|p|hh|h)\d+")


def normalize(body: str, name: str = "") -> str:
    """A PTX body with comments, .loc / .file lines, the virtual-register pool declarations (.reg: their sizes follow
    the numbering) and blank lines dropped, and each virtual register / label renamed by its kind and order of first
    use (%r57 -> %r#0 if it is the first %r seen). A function-local static's mangled name keeps only the static's
    own name (`_ZZ14attention_itemILi128ELi2EE...E3w_m` -> `_ZZ<w_m>`): a template parameter added to the function
    changes the mangling, not the code. The kernel's own `name` (its entry and parameter names) reads `<kernel>`, so
    a renamed kernel with the same code compares equal."""
    seen: dict[str, str] = {}
    counts: dict[str, int] = {}

    def rename(m: re.Match) -> str:
        name = m.group(0)
        if name not in seen:
            kind = re.match(r"\$L__BB|%[a-z]+", name).group(0)
            seen[name] = f"{kind}#{counts.get(kind, 0)}"
            counts[kind] = counts.get(kind, 0) + 1
        return seen[name]

    lines = [re.sub(r"\s*//.*$", "", ln) for ln in body.splitlines()]
    lines = [ln for ln in lines if ln.strip() and not ln.strip().startswith((".loc", ".file", ".reg"))]
    text = _LOCAL_STATIC.sub(lambda m: f"_ZZ<{m.group(2)}>", "\n".join(lines))
    if name:
        text = re.sub(re.escape(name) + r"(?=_param_|\W|$)", "<kernel>", text)
    return _NAMES.sub(rename, text)


def entries(ptx: str) -> dict[str, str]:
    """{kernel name: normalized body} of every .entry of a PTX module (a body runs to the next entry or the end)."""
    starts = [(m.start(), m.group(1)) for m in _ENTRY.finditer(ptx)]
    out = {}
    for i, (pos, name) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(ptx)
        out[name] = normalize(ptx[pos:end], name)
    return out


def compare(old: dict[str, str], new: dict[str, str]) -> list[tuple[str, str, int]]:
    """(kernel, "same" | "differs" | "renamed from OLD" | "only old" | "only new", changed lines) for every kernel of
    either side; a kernel only old whose body equals that of exactly one kernel only new is that one, renamed."""
    gone = {n: b for n, b in old.items() if n not in new}
    came = {n: b for n, b in new.items() if n not in old}
    renamed = {}  # new name -> old name
    for n, b in came.items():
        match = [o for o, ob in gone.items() if ob == b]
        if len(match) == 1 and sum(nb == b for nb in came.values()) == 1:
            renamed[n] = match[0]
    rows = []
    for name in sorted((set(old) | set(new)) - set(renamed.values())):
        if name in renamed:
            rows.append((name, f"renamed from {renamed[name]}", 0))
        elif name not in new:
            rows.append((name, "only old", 0))
        elif name not in old:
            rows.append((name, "only new", 0))
        elif old[name] == new[name]:
            rows.append((name, "same", 0))
        else:
            diff = difflib.unified_diff(old[name].splitlines(), new[name].splitlines(), lineterm="", n=0)
            changed = sum(1 for ln in diff if ln[:1] in "+-" and not ln.startswith(("+++", "---")))
            rows.append((name, "differs", changed))
    return rows


def tree_entries(tree: Path, names: list[str], arch: str, defines: list[str]) -> tuple[dict, dict]:
    """({kernel: normalized body}, {kernel: source}) over the sources `names` of the kernels folder `tree` (those it
    has)."""
    bodies, where = {}, {}
    for name in names:
        if (tree / name).is_file():
            for kernel, body in entries(ptx(tree / name, tree, arch, defines)).items():
                bodies[kernel], where[kernel] = body, name
    return bodies, where


def ptx(src: Path, include: Path, arch: str, defines: list[str]) -> str:
    out = subprocess.run(["nvcc", f"-arch={arch}", "-std=c++17", f"-I{include}", *[f"-D{d}" for d in defines],
                          "-ptx", str(src), "-o", "-"], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"error: nvcc failed on {src}: {out.stderr.strip().splitlines()[-1:]}")
    return out.stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", help="git revision to compare the working tree against")
    ap.add_argument("sources", nargs="*", help="kernels_cu sources, e.g. gemv_fp8.cu (default: all)")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="a -D define for both sides")
    args = ap.parse_intermixed_args(argv)  # sources may follow -D options
    got = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", args.rev, "kernels_cu"],
                         capture_output=True, timeout=120)
    if got.returncode != 0:
        raise SystemExit(f"error: git archive {args.rev!r}: {got.stderr.decode().strip()}")
    new_dir = ROOT / "kernels_cu"
    for name in args.sources:
        if not (new_dir / name).is_file():
            raise SystemExit(f"error: no kernels_cu/{name} in the working tree")
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=BytesIO(got.stdout)) as tar:
            tar.extractall(tmp, filter="data")
        old_dir = Path(tmp) / "kernels_cu"
        names = args.sources or sorted({p.name for d in (old_dir, new_dir) for p in d.glob("*.cu")})
        old, old_where = tree_entries(old_dir, names, args.arch, args.defines)
        new, new_where = tree_entries(new_dir, names, args.arch, args.defines)
    counts: dict[str, int] = {}
    differs = 0
    for kernel, state, changed in compare(old, new):
        differs += state == "differs"
        src = new_where.get(kernel) or old_where[kernel]
        if state == "same" and old_where[kernel] != src:
            state = f"same, from {old_where[kernel]}"
        kind = "same, moved" if state.startswith("same, from") else state.split(" from ")[0]
        counts[kind] = counts.get(kind, 0) + 1
        print(f"{src:22s} {kernel:40s} {state}" + (f" ({changed} lines)" if changed else ""))
    print(f"{sum(counts.values())} kernels: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
