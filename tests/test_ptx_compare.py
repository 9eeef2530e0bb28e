"""scripts/ptx_compare.py (CPU): PTX entries compared modulo nvcc's register and label numbering."""
from __future__ import annotations

import shutil
import subprocess

import pytest
from helpers_scripts import SCRIPTS, load_script

from atomflow_bench.gpu.nvrtc import KERNELS_DIR
from atomflow_bench.gpu.ops import declared_kernels


@pytest.fixture(scope="module")
def pc():
    return load_script("ptx_compare")


A = """
//
.version 8.8
.visible .entry k_one(
\t.param .u64 k_one_param_0
)
{
\t.reg .b32 \t%r<9>;
\tmov.u32 \t%r5, %tid.x;  // thread
\t.loc 1 10 3
\tadd.s32 \t%r7, %r5, 1;
$L__BB0_2:
\tst.global.u32 \t[%rd1], %r7;
\tbra.uni \t$L__BB0_2;
}
.visible .entry k_two(
\t.param .u64 k_two_param_0
)
{
\tmov.u32 \t%r1, 3;
}
"""


def test_renumbering_reads_same(pc):
    b = (A.replace("%r5", "%r40").replace("%r7", "%r41").replace("$L__BB0_2", "$L__BB0_9")
         .replace("\t.loc 1 10 3\n", "\t.loc 1 12 7\n").replace("// thread", "// x"))
    rows = pc.compare(pc.entries(A), pc.entries(b))
    assert rows == [("k_one", "same", 0), ("k_two", "same", 0)]


def test_changed_instruction_and_missing_kernel(pc):
    b = A.replace("add.s32 \t%r7, %r5, 1;", "add.s32 \t%r7, %r5, 2;")
    b = b[: b.index(".visible .entry k_two")] + ".visible .entry k_three(\n)\n{\n}\n"
    rows = {k: (state, n) for k, state, n in pc.compare(pc.entries(A), pc.entries(b))}
    assert rows == {"k_one": ("differs", 2), "k_two": ("only old", 0), "k_three": ("only new", 0)}
    # the same register used in a different role is a change, not a renumbering
    c = A.replace("add.s32 \t%r7, %r5, 1;", "add.s32 \t%r7, %r7, 1;")
    assert pc.compare(pc.entries(A), pc.entries(c))[0][1] == "differs"


def test_a_renamed_kernel_reads_renamed(pc):
    """A kernel only old and one only new with the same code, their own names aside, are one kernel renamed; with
    other code they stay two."""
    b = A.replace("k_one", "k_uno")
    assert pc.compare(pc.entries(A), pc.entries(b)) == [("k_two", "same", 0), ("k_uno", "renamed from k_one", 0)]
    c = b.replace("add.s32 \t%r7, %r5, 1;", "add.s32 \t%r7, %r5, 2;")
    rows = {k: state for k, state, _ in pc.compare(pc.entries(A), pc.entries(c))}
    assert rows == {"k_one": "only old", "k_uno": "only new", "k_two": "same"}


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("git") is None, reason="needs nvcc and git")
def test_real_source_against_head(pc):
    src = KERNELS_DIR / "embedding.cu"
    got = pc.entries(pc.ptx(src, KERNELS_DIR, "sm_90", []))
    assert sorted(got) == sorted(declared_kernels()["embedding.cu"])
    out = subprocess.run(["python3", str(SCRIPTS / "ptx_compare.py"), "no-such-revision", "embedding.cu"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 1 and out.stderr.startswith("error: git archive 'no-such-revision'")


def test_a_local_static_compares_by_its_own_name(pc):
    """A template parameter added to a device function changes its statics' mangled names, not the code."""
    old = "mov.u32 \t%r3, _ZZ14attention_itemILi128ELi2EEvPK6__halfS2_PcE3w_m;"
    new = "mov.u32 \t%r3, _ZZ14attention_itemILi128ELi2ELi1EEvPK6__halfS2_PcE3w_m;"
    other = "mov.u32 \t%r3, _ZZ14attention_itemILi128ELi2ELi1EEvPK6__halfS2_PcE3w_l;"
    assert pc.normalize(old) == pc.normalize(new) != pc.normalize(other)
