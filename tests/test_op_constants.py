"""One home per op (CPU): every constant an ops/ module mirrors from its kernels equals the `#define` in its .cu, every
kernel a launch factory builds is in its module's KERNELS (tests/test_nvcc.py checks those lists against what nvcc
finds in each .cu), and the package's imports form no cycle between its parts (that the product never imports the lab:
test_lab_local.py)."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from atomflow_bench.gpu.nvrtc import KERNELS_DIR
from atomflow_bench.gpu.ops import declared_kernels

OPS = ("ops.gemv", "ops.attention", "ops.attention_prefill", "ops.lm_head", "ops.prefill_gemm", "ops.prefill_rows",
       "ops.small", "ops.untile",
       "tp.sums")
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


def test_every_kernel_the_ops_build_is_declared():
    """The kernel names the launch factories build (variants, ring depths, forms, attention instances) are in their
    module's KERNELS, under the .cu that defines them; every .cu of kernels_cu/ is some module's, each kernel is
    declared once, and the lab's kernels are not the product's."""
    from atomflow_bench.gpu.ops import attention, attention_prefill, gemv, prefill_gemm
    from atomflow_bench.gpu.tp import sums

    files = {**declared_kernels(), **sums.KERNELS}
    names = [n for cu in files.values() for n in cu]
    assert len(names) == len(set(names)), "a kernel declared twice"
    assert set(files) == {p.name for p in KERNELS_DIR.glob("*.cu")}
    fp16, fp8 = set(files["gemv_fp16.cu"]), set(files["gemv_fp8.cu"])
    for variant in gemv.VARIANT_PAIRING:
        assert {gemv.kernel_name("fp16", variant, False), gemv.kernel_name("fp16", variant, True)} <= fp16
        assert gemv.kernel_name("fp8", variant, True) in fp8
        assert {gemv.kernel_name("fp8", variant, False, d) for d in gemv.GEMV_RING_DEPTHS} <= fp8
    assert gemv.kernel_name("fp8", "resid", False, 3) == "gemv_f8_resid_r3"
    assert gemv.kernel_name("fp16", "resid", False, 0) == "gemv_f16_resid"
    assert gemv.kernel_name("fp8", "qkv_rope", True) == "gemv_f8_qkv_rope_ws"
    for hd in attention.HEAD_DIMS:
        for g in attention.GROUPS:
            assert attention.split_kernel(hd, g) in files["attention.cu"]
            assert attention.short_kernel(hd, g) in files["attention_short.cu"]
    assert attention.split_kernel(128, 4) == "attention_decode_hd128_g4"
    assert set(files["attention_prefill.cu"]) == {attention_prefill.prefill_kernel(hd, g)
                                                  for hd in attention_prefill.HEAD_DIMS for g in attention_prefill.GROUPS}
    assert attention_prefill.prefill_kernel(128, 4) == "attention_prefill_hd128_g4"
    assert set(files["prefill_gemm.cu"]) == {prefill_gemm.gemm_kernel(f, e) for f in prefill_gemm.FORMATS
                                             for e in prefill_gemm.EPILOGUES}
    assert prefill_gemm.gemm_kernel("fp8", "resid") == "prefill_gemm_f8_resid"
    assert set(files["lm_head.cu"]) == {"gemv_f16_f32", "gemv_f16_f32_argmax"}
    assert {"embed_lookup", "quantize_fp8", "spin_ns", "tp_allreduce_add", "tp_argmax_combine"} <= set(names)
    assert "probe_stream" not in names


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
