"""One home per op (CPU): every constant an ops/ module mirrors from its kernels equals the `#define` in its .cu, and
the package's imports form no cycle between its parts; the lab is never imported by the product."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from atomflow_bench.gpu.nvrtc import KERNELS_DIR, kernel_names, ring_depths

OPS = ("ops.gemv", "ops.attention", "ops.lm_head", "ops.small", "tp.sums")
PKG = Path(__file__).resolve().parents[1] / "atomflow_bench"


def defines(files) -> dict[str, int]:
    out = {}
    for f in files:
        for name, value in re.findall(r"^\s*#\s*define\s+(\w+)\s+\(?(\d+)\)?\s*(?://.*)?$", (KERNELS_DIR / f).read_text(),
                                      re.M):
            out[name] = int(value)
    return out


@pytest.mark.parametrize("op", OPS)
def test_mirrored_constants_equal_the_kernels_defines(op):
    mod = importlib.import_module(f"atomflow_bench.gpu.{op}")
    found = defines(mod.CU_FILES)
    for name, value in getattr(mod, "CU_DEFINES", {}).items():
        assert name in found, f"{op}: #define {name} not in {mod.CU_FILES}"
        assert found[name] == value, f"{op}: {name} = {value} in Python, {found[name]} in the kernels"


def test_the_check_can_fail(tmp_path, monkeypatch):
    (tmp_path / "x.cu").write_text("#define GEMV_THREADS 128  // changed\n")
    monkeypatch.setattr("test_op_constants.KERNELS_DIR", tmp_path)
    assert defines(["x.cu"]) == {"GEMV_THREADS": 128}


def test_every_kernel_the_ops_name_exists():
    """The kernel names the launch factories build (ring depths, variants, attention instances) exist in a .cu."""
    from atomflow_bench.gpu.ops import attention, gemv

    names = {n for f in KERNELS_DIR.glob("*.cu") for n in kernel_names(f)}
    assert ring_depths(KERNELS_DIR / "gemv_fp8.cu") == gemv.GEMV_RING_DEPTHS
    for fmt, prefix in (("fp16", "gemv_f16"), ("fp8", "gemv_f8")):
        for variant in gemv.VARIANT_PAIRING:
            assert f"{prefix}_{variant}_ws" in names
            if fmt == "fp8":
                assert all(f"{prefix}_{variant}_r{d}" in names for d in gemv.GEMV_RING_DEPTHS)
            else:
                assert f"{prefix}_{variant}" in names
    for hd in attention.HEAD_DIMS:
        for g in attention.GROUPS:
            assert {f"attention_decode_hd{hd}_g{g}", f"attention_short_hd{hd}_g{g}"} <= names
    assert {"gemv_f16_f32", "gemv_f16_f32_argmax", "embed_lookup", "quantize_fp8", "spin_ns", "tp_allreduce_add",
            "tp_argmax_combine"} <= names
    assert not any(n.endswith("_dyn") for n in names)  # removed forms stay removed
    assert "probe_stream" not in names  # the lab's kernels are not the product's


def _imports(path: Path) -> set[str]:
    """Modules of atomflow_bench that `path` imports (absolute names), at any depth of the file."""
    rel = path.relative_to(PKG.parent).with_suffix("")
    pkg = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = pkg[: len(pkg) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            if not mod.startswith("atomflow_bench"):
                continue
            for a in node.names:  # "from . import x" may name a module
                cand = f"{mod}.{a.name}"
                out.add(cand if (PKG.parent / cand.replace(".", "/")).with_suffix(".py").is_file()
                        or (PKG.parent / cand.replace(".", "/")).is_dir() else mod)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("atomflow_bench")}
    return out


def _part(mod: str) -> str:
    parts = mod.split(".")
    if parts[1:3] == ["gpu", "tp"]:  # the tensor-parallel wing: it plugs into gpu and measure, they don't import it
        return "gpu.tp"
    return parts[1] if len(parts) > 2 else mod  # atomflow_bench.gpu.x -> gpu; top-level modules stand alone


def test_no_import_cycles_between_parts_and_no_lab_in_the_product():
    graph: dict[str, set[str]] = {}
    for f in PKG.rglob("*.py"):
        me = ".".join(f.relative_to(PKG.parent).with_suffix("").parts)
        for dep in _imports(f):
            a, b = _part(me), _part(dep)
            if a != b:
                graph.setdefault(a, set()).add(b)
    assert "lab" not in {d for src, deps in graph.items() if src != "lab" for d in deps}, graph
    seen, stack = set(), []

    def visit(n):
        if n in stack:
            raise AssertionError(f"import cycle: {' -> '.join(stack[stack.index(n):] + [n])}")
        if n in seen:
            return
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            visit(d)
        stack.pop()
        seen.add(n)

    for n in sorted(graph):
        visit(n)
    assert {"gpu", "measure", "store", "validate"} <= set(graph)  # the walk saw the parts
