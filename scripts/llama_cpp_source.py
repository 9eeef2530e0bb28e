#!/usr/bin/env python3
"""Pinned, stripped llama.cpp source for the llama.cpp peer measurement (runs on a CPU machine with PyPI).

    python3 scripts/llama_cpp_source.py [--version 0.3.36] [--out .carry/llama.cpp] [--sdist PATH] [--check]

1. `pip download --no-binary :all: --no-deps llama-cpp-python==VERSION` (or --sdist: a copy already here);
2. extracts its vendored `vendor/llama.cpp` tree;
3. deletes what the CUDA build of llama-bench, llama-quantize and llama-server does not need (STRIP below:
   docs, models, tests, examples, other ggml backends, the web UI's sources, media, CI files); no file is
   edited, so the tree's own CMake files configure it unchanged (tests/examples must be configured off);
4. packs it as OUT/llama.cpp-VERSION.tar.xz (top folder `llama.cpp-VERSION/`) and writes OUT/SOURCE.json
   (sdist name and sha256, the llama.cpp commit the sdist's CHANGELOG names, ggml/llama versions, the ggml
   sync commit, what was stripped, the tarball's sha256 and size);
5. --check: configures the stripped tree for the CPU (`cmake -DGGML_CUDA=OFF ...`) to catch a missing file.

The tree records no git commit of its own (its `.git` is a submodule pointer into the sdist's absent git
dir), so a build from it reports build_commit "unknown"/build_number 0 unless CMake is given
-DLLAMA_BUILD_COMMIT=<commit> -DLLAMA_BUILD_NUMBER=...; scripts/peer_llama_cpp.sh passes the commit from
SOURCE.json (build number 0: the sdist does not say).
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Top-level entries of vendor/llama.cpp that are kept; everything else at the top level is deleted.
KEEP_TOP = {
    "CMakeLists.txt", "CMakePresets.json", "LICENSE", "AUTHORS", "README.md", "pyproject.toml",
    "requirements.txt", "requirements",          # the converter's Python requirements (documentation)
    "convert_hf_to_gguf.py", "conversion", "gguf-py",  # HF -> GGUF converter (imports conversion/ and gguf-py/)
    "cmake", "ggml", "src", "include", "common", "tools", "vendor", "licenses",
    "app",                                       # tiny; top-level CMakeLists adds it when LLAMA_BUILD_APP (default ON)
    "scripts",                                   # pruned below to the CMake helper the UI target runs
}
KEEP_SCRIPTS = {"ui-assets.cmake", "sync-ggml.last"}
# ggml backends: only these two are kept (ggml_add_backend adds a backend's folder only when it is enabled).
KEEP_BACKENDS = {"ggml-cpu", "ggml-cuda"}
# tools/: tools/CMakeLists.txt adds these unconditionally (or under LLAMA_BUILD_SERVER / GGML_CPU), so they stay;
# rpc (GGML_RPC) and tuning (GGML_METAL) go.
DROP_TOOLS = {"rpc", "tuning"}
# tools/ui: the Svelte sources go; CMake needs only these (with LLAMA_BUILD_UI=OFF and LLAMA_USE_PREBUILT_UI=OFF
# the server embeds an empty asset table: no web UI, the HTTP API is unaffected).
KEEP_UI = {"CMakeLists.txt", "sources.cmake", "ui.cpp.in", "ui.h.in"}
# Deleted anywhere below the kept entries (test data, media, nested test suites, docs).
DROP_NAMES = {"tests", "test", ".github", ".devops", "docs", "media", "bench", "examples", "legacy-models"}
DROP_SUFFIXES = {".mp3", ".mp4", ".jpeg", ".jpg", ".png", ".gif", ".webp", ".wav", ".gguf"}
KEEP_DROP_EXCEPTIONS = {"gguf-py/gguf"}  # never prune inside the gguf package itself by these names


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def du(path: Path) -> int:
    if path.is_file() or path.is_symlink():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() or p.is_symlink())


def download_sdist(version: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
           f"llama-cpp-python=={version}", "-d", str(dest)]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    found = sorted(dest.glob(f"llama_cpp_python-{version}.tar.gz")) + sorted(dest.glob(f"llama-cpp-python-{version}.tar.gz"))
    if not found:
        raise SystemExit(f"no sdist for llama-cpp-python=={version} in {dest}: {os.listdir(dest)}")
    return found[0]


def extract_vendor(sdist: Path, work: Path) -> Path:
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers() if "/vendor/llama.cpp/" in m.name + "/"
                   or m.name.count("/") == 1 and m.name.endswith(("/CHANGELOG.md", "/PKG-INFO"))]
        tf.extractall(work, members=members, filter="data")
    trees = list(work.glob("*/vendor/llama.cpp"))
    if len(trees) != 1:
        raise SystemExit(f"{sdist}: expected one vendor/llama.cpp, found {trees}")
    return trees[0]


def _remove(path: Path, root: Path, stripped: dict[str, int]) -> None:
    stripped[str(path.relative_to(root))] = du(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def strip(tree: Path) -> dict[str, int]:
    """Delete what the build does not need; returns {relative path: bytes} of what went."""
    stripped: dict[str, int] = {}
    for p in sorted(tree.iterdir()):
        if p.name not in KEEP_TOP:
            _remove(p, tree, stripped)
    for p in sorted((tree / "scripts").iterdir()):
        if p.name not in KEEP_SCRIPTS:
            _remove(p, tree, stripped)
    for p in sorted((tree / "ggml" / "src").iterdir()):
        if p.is_dir() and p.name.startswith("ggml-") and p.name not in KEEP_BACKENDS:
            _remove(p, tree, stripped)
    for name in sorted(DROP_TOOLS):
        if (tree / "tools" / name).exists():
            _remove(tree / "tools" / name, tree, stripped)
    ui = tree / "tools" / "ui"
    for p in sorted(ui.iterdir()):
        if p.name not in KEEP_UI:
            _remove(p, tree, stripped)
    # nested test suites, docs and media anywhere else (not inside the gguf Python package)
    for p in sorted(tree.rglob("*"), key=lambda q: len(q.parts)):
        if not p.exists() and not p.is_symlink():
            continue
        rel = p.relative_to(tree).as_posix()
        if any(rel == k or rel.startswith(k + "/") for k in KEEP_DROP_EXCEPTIONS):
            continue
        if (p.is_dir() and p.name in DROP_NAMES) or (p.is_file() and p.suffix.lower() in DROP_SUFFIXES) \
                or p.name in (".gitignore", ".gitmodules", ".git"):
            _remove(p, tree, stripped)
    return stripped


def _cmake_set(text: str, var: str) -> str | None:
    m = re.search(rf"set\({var}\s+([^)\s]+)\)", text)
    return m.group(1) if m else None


def versions(sdist_root: Path, tree: Path) -> dict:
    out: dict = {}
    changelog = sdist_root / "CHANGELOG.md"
    if changelog.is_file():
        text = changelog.read_text(errors="replace")
        # the first release section's "update llama.cpp to ggml-org/llama.cpp@<commit>"
        sec = re.search(r"^## \[(\d[^\]]*)\]\s*$(.*?)(?=^## \[|\Z)", text, re.M | re.S)
        if sec:
            m = re.search(r"llama\.cpp@([0-9a-f]{7,40})", sec.group(2))
            out["sdist_changelog_release"] = sec.group(1)
            out["llama_cpp_commit"] = m.group(1) if m else None
            out["llama_cpp_commit_from"] = f"llama-cpp-python CHANGELOG.md, section [{sec.group(1)}]"
    ggml_cm = (tree / "ggml" / "CMakeLists.txt").read_text()
    llama_cm = (tree / "CMakeLists.txt").read_text()
    out["ggml_version"] = ".".join(str(_cmake_set(ggml_cm, f"GGML_VERSION_{k}")) for k in ("MAJOR", "MINOR", "PATCH"))
    out["llama_version"] = ".".join(str(_cmake_set(llama_cm, f"LLAMA_VERSION_{k}")) for k in ("MAJOR", "MINOR", "PATCH"))
    last = tree / "scripts" / "sync-ggml.last"
    out["ggml_sync_commit"] = last.read_text().strip() if last.is_file() else None
    out["git_metadata_in_tree"] = False
    return out


def pack(tree: Path, top: str, tarball: Path) -> None:
    """Deterministic tar.xz: sorted names, zeroed owners and times."""
    tarball.parent.mkdir(parents=True, exist_ok=True)
    tmp = tarball.with_suffix(".part")

    def info(p: Path) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(f"{top}/{p.relative_to(tree).as_posix()}" if p != tree else top)
        st = p.lstat()
        ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname = 0, 0, 0, "", ""
        if p.is_symlink():
            ti.type, ti.linkname = tarfile.SYMTYPE, os.readlink(p)
        elif p.is_dir():
            ti.type, ti.mode = tarfile.DIRTYPE, 0o755
        else:
            ti.size, ti.mode = st.st_size, (0o755 if st.st_mode & 0o111 else 0o644)
        return ti

    with lzma.open(tmp, "wb", preset=9 | lzma.PRESET_EXTREME) as xz, tarfile.open(fileobj=xz, mode="w",
                                                                                  format=tarfile.PAX_FORMAT) as tf:
        paths = [tree] + sorted(tree.rglob("*"), key=lambda q: q.relative_to(tree).as_posix())
        for p in paths:
            ti = info(p)
            if ti.isreg():
                with open(p, "rb") as f:
                    tf.addfile(ti, f)
            else:
                tf.addfile(ti)
    tmp.replace(tarball)


CHECK_FLAGS = ["-DGGML_CUDA=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DLLAMA_BUILD_UI=OFF"]


def check_configure(tree: Path, build: Path) -> bool:
    cmd = ["cmake", "-S", str(tree), "-B", str(build), *CHECK_FLAGS]
    if shutil.which("ninja"):
        cmd += ["-G", "Ninja"]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd).returncode == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default="0.3.36", help="llama-cpp-python sdist version (default 0.3.36)")
    ap.add_argument("--out", type=Path, default=ROOT / ".carry" / "llama.cpp")
    ap.add_argument("--sdist", type=Path, help="use this sdist instead of downloading it")
    ap.add_argument("--keep-tree", type=Path, help="also leave the stripped tree here (for a local build)")
    ap.add_argument("--check", action="store_true", help="configure the stripped tree for the CPU afterwards")
    a = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="llama-cpp-src-") as td:
        td = Path(td)
        sdist = a.sdist or download_sdist(a.version, td / "dl")
        print(f"sdist {sdist.name} sha256 {sha256(sdist)}", flush=True)
        tree = extract_vendor(sdist, td / "x")
        before = du(tree)
        stripped = strip(tree)
        after = du(tree)
        info = versions(tree.parents[1], tree)
        top = f"llama.cpp-{a.version}"
        tarball = a.out / f"{top}.tar.xz"
        pack(tree, top, tarball)
        size = tarball.stat().st_size
        big = sorted(stripped.items(), key=lambda kv: -kv[1])
        source = {
            "schema": "atomflow-bench/llama-cpp-source/1",
            "sdist": sdist.name,
            "sdist_sha256": sha256(sdist),
            "sdist_url_hint": f"https://pypi.org/project/llama-cpp-python/{a.version}/",
            "llama_cpp_python_version": a.version,
            "tree": "vendor/llama.cpp of the sdist",
            **info,
            "tarball": tarball.name,
            "tarball_top": top,
            "tarball_sha256": sha256(tarball),
            "tarball_bytes": size,
            "tree_bytes_before": before,
            "tree_bytes_after": after,
            "kept_top_level": sorted(KEEP_TOP),
            "kept_ggml_backends": sorted(KEEP_BACKENDS),
            "edited_files": [],
            "stripped_rules": {
                "top_level": "everything not in kept_top_level (docs, models, tests, examples, pocs, benches, media, "
                             "ci, .github, .devops, skills, grammars, other convert_* scripts, dotfiles)",
                "scripts": f"all but {sorted(KEEP_SCRIPTS)}",
                "ggml/src": f"every ggml-* backend folder but {sorted(KEEP_BACKENDS)}",
                "tools": f"{sorted(DROP_TOOLS)}; tools/ui all but {sorted(KEEP_UI)} (server has no web UI)",
                "anywhere": f"folders named {sorted(DROP_NAMES)}, files {sorted(DROP_SUFFIXES)}, .git* files",
            },
            "stripped": {k: v for k, v in big},
            "build_notes": "configure with -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF "
                           "-DLLAMA_USE_PREBUILT_UI=OFF (else the UI step tries to download assets) "
                           "-DLLAMA_OPENSSL=OFF; pass -DLLAMA_BUILD_COMMIT=<llama_cpp_commit> (no git in the tree); "
                           "extract outside any git checkout.",
            "created": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        (a.out / "SOURCE.json").write_text(json.dumps(source, indent=2) + "\n")
        print(f"{tarball}: {size / 1e6:.2f} MB ({before / 1e6:.1f} MB tree -> {after / 1e6:.1f} MB stripped); "
              f"llama.cpp commit {info.get('llama_cpp_commit')}, ggml {info['ggml_version']}", flush=True)
        if size > 60e6:
            print("ERROR: tarball over 60 MB", file=sys.stderr)
            return 1
        if a.keep_tree:
            if a.keep_tree.exists():
                shutil.rmtree(a.keep_tree)
            shutil.copytree(tree, a.keep_tree, symlinks=True)
        if a.check:
            target = a.keep_tree or tree
            if not check_configure(target, td / "build" if not a.keep_tree else Path("/tmp/lc-build")):
                print("ERROR: the stripped tree did not configure", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
