"""The lab's prefill attention versions on the GPU (lab/kernels/attention_prefill_v*.cu, each variant of
lab/scripts/prefill_att_ab.py that names a lab file, built and launched as that script does): the product's kernel
checks (tests/test_prefill_attention.py check_prefill_kernel: every element against float64 NumPy, poisoned cache
rows, columns and out, a replay identical) over the product test's chunks and the catalog's shapes. A variant whose
block does not fit this GPU's shared memory is skipped (three stages at hd 128 need 112 KB: not on sm_89)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from test_prefill_attention import CHUNKS, check_prefill_kernel

pytestmark = pytest.mark.gpu
SCRIPT = Path(__file__).resolve().parents[1] / "lab" / "scripts" / "prefill_att_ab.py"


def load_ab():
    spec = importlib.util.spec_from_file_location("prefill_att_ab", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ab = load_ab()
LAB_VARIANTS = [n for n, v in ab.VARIANTS.items() if v["file"]]


def rows_of(name: str) -> int:
    """Variant `name`'s stacked query rows a block (its grid's x: ceil(M G / rows))."""
    return ab.variant_defines(ab.variant_source(name))["ATP_ROWS"]


@pytest.fixture(scope="module")
def variant_libs(tmp_path_factory):
    """name -> (its KernelLib, its launch factory), built on first use."""
    tmp, libs = tmp_path_factory.mktemp("prefill_att_variants"), {}

    def get(name: str, hd: int):
        from atomflow_bench.gpu.device import blocks_fit, smem_limits
        from atomflow_bench.gpu.ops.attention_prefill import SMEM_HEADROOM

        from atomflow_bench.gpu.device import compute_capability

        if not ab.builds_for(name, f"sm_{compute_capability()}"):  # a version for one arch (wgmma: sm_90a)
            pytest.skip(f"{name} is built for {ab.VARIANTS[name]['arch']} only (this GPU: sm_{compute_capability()})")
        need = ab.variant_smem(ab.variant_defines(ab.variant_source(name)), hd) + SMEM_HEADROOM
        if not blocks_fit(need, smem_limits()):
            pytest.skip(f"{name} at hd {hd} needs {need} bytes of shared memory a block (this GPU: {smem_limits()[0]})")
        if name not in libs:
            libs[name] = (ab.variant_lib(name, tmp), ab.variant_launch(name))
        return libs[name]

    return get


@pytest.mark.parametrize("name", LAB_VARIANTS)
@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("start, m", CHUNKS)
def test_lab_prefill_attention(variant_libs, name, hd, group, start, m):
    lib, factory = variant_libs(name, hd)
    check_prefill_kernel(lib, hd, group, 2, start, m, factory=factory, rows=rows_of(name))


@pytest.mark.parametrize("name", LAB_VARIANTS)
@pytest.mark.parametrize("n_kv, group, hd", [(8, 4, 64), (8, 3, 128), (8, 4, 128), (2, 16, 128), (2, 2, 64)])
@pytest.mark.parametrize("start, m", [(0, 512), (512, 256), (70, 130)])
def test_lab_prefill_attention_shapes(variant_libs, name, n_kv, group, hd, start, m):
    """The catalog's shapes and the remaining groups, q and out contiguous."""
    lib, factory = variant_libs(name, hd)
    check_prefill_kernel(lib, hd, group, n_kv, start, m, fused=False, out_pad=0, factory=factory, rows=rows_of(name))
