"""The lab's prefill attention versions without a GPU (lab/kernels/attention_prefill_v2.cu, _v3.cu, as
lab/scripts/prefill_att_ab.py builds them): their cp.async pipelines simulated (lab/scripts/pipeline_check.py) for
blocks of 1-8 tiles, with kernels one line wrong refused; v11's warp-specialised barrier protocol explored over every
interleaving (lab/scripts/ws_protocol_check.py), its model's lines found in the kernel's source; each variant's source, as KernelLib hands it to NVRTC (its
local includes inlined), compiles with nvcc for sm_89, sm_90 and sm_120 into the product's kernel names without local
memory; the shared memory the script launches with is the product's formula for the product and fits two blocks in
an H100/H200 SM for every variant built for two."""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from atomflow_bench.gpu.device import SMEM_H100, blocks_fit
from atomflow_bench.gpu.nvrtc import KERNELS_DIR, expand_source
from atomflow_bench.gpu.ops.attention_prefill import KERNELS, SMEM_HEADROOM, prefill_smem

SCRIPTS = Path(__file__).resolve().parents[1] / "lab" / "scripts"
NVCC = shutil.which("nvcc")


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


pc = load("pipeline_check")
ab = load("prefill_att_ab")
ws = load("ws_protocol_check")
LAB_VARIANTS = [n for n, v in ab.VARIANTS.items() if v["file"]]


@pytest.mark.parametrize("name, stages", [(n, s) for n, (_, ss) in pc.SCHEDULES.items() for s in ss])
def test_pipelines_hold(name, stages):
    for n_tiles in range(1, 9):
        pc.check(name, stages, n_tiles)


@pytest.mark.parametrize("name, stages, mut", pc.MUTATIONS)
def test_the_check_refuses_a_kernel_one_line_wrong(name, stages, mut):
    caught = 0
    for n_tiles in range(1, 9):
        try:
            pc.check(name, stages, n_tiles, mut)
        except pc.PipelineError:
            caught += 1
    assert caught


@pytest.mark.parametrize("pingpong, intra", [(True, False), (False, False), (True, True)])
def test_ws_protocol_holds(pingpong, intra):
    """v11 (v11-free without the turns, v11-ia with the scores as the older wgmma group): no deadlock, no stage read
    before its tile lands or refilled while read, the turns alternating, nothing left armed, for blocks of 1-6 tiles
    whichever consumer stops taking tiles first."""
    for n_tiles in range(1, 7):
        assert ws.check(n_tiles, pingpong, intra=intra) > 0


@pytest.mark.parametrize("mut", [m for m, _ in ws.MUTATIONS])
def test_ws_protocol_refuses_a_kernel_one_line_wrong(mut):
    caught = 0
    for n_tiles in range(1, 5):
        try:
            ws.check(n_tiles, True, mut)
        except ws.ProtocolError:
            caught += 1
    assert caught


def test_ws_protocol_model_is_the_kernels():
    """The lines the model replays, as they stand in v11's source: the stages, the empty barrier's count, the
    producer's wait, the consumers' waits, turns and releases."""
    src = (Path(ab.ROOT) / ab.V11).read_text()
    assert re.search(rf"^#define ATP_STAGES {ws.STAGES} ", src, re.M)
    for line in (f"mbar_init(&empty[s], {ws.EMPTY_COUNT});",
                 "if (kt >= ATP_STAGES) mbar_wait(&empty[s], (kt / ATP_STAGES - 1) & 1);",
                 "if (c == 1) pp_pass(c);",
                 "mbar_wait(&full[0], 0);",
                 "mbar_wait(&full[(kt + 1) % ATP_STAGES], ((kt + 1) / ATP_STAGES) & 1);",
                 "if (next || c == 0) pp_pass(c);",
                 "if (lane == 0) mbar_arrive(&empty[kt % ATP_STAGES]);"):
        assert line in src, line
    body = src[src.index("for (int kt = 0; kt < n_tiles; ++kt) {\n    const bool next"):]
    order = [body.index(x) for x in ("pp_wait(c);", "wgmma_rs(o,", "mbar_wait(&full", "issue_s(kt + 1)",
                                     "wgmma_commit();", "pp_pass(c);", "wgmma_wait0();", "mbar_arrive(&empty")]
    assert order == sorted(order)
    intra = src[src.index("#else\n  unsigned pb"):src.index("#endif\n  named_sync(1 + c, 128);")]
    marks = ("pp_wait(c);", "mbar_wait(&full", "issue_s(kt + 1)", "wgmma_commit();", "wgmma_rs(o,", "pp_pass(c);",
             "wgmma_wait1();", "wgmma_wait0();", "mbar_arrive(&empty")
    order, at = [], 0
    for x in marks:  # each after the one before (the second commit closes the P.V's group)
        at = intra.index(x, at + 1 if order else 0)
        order.append(at)
    assert order == sorted(order)


def test_the_rules_each_refuse():
    """Each rule of the simulated shared memory, broken alone."""
    p = pc.Pipeline()
    p.copy("a", 1)
    p.commit()
    with pytest.raises(pc.PipelineError, match="while 1 is written"):
        p.read("a", 1)  # committed, not waited for
    p.wait(0)
    with pytest.raises(pc.PipelineError, match="while 1 is written"):
        p.read("a", 1)  # landed for this thread, no barrier yet
    p.barrier()
    p.read("a", 1)
    with pytest.raises(pc.PipelineError, match="holds 1"):
        p.read("a", 2)
    with pytest.raises(pc.PipelineError, match="where a warp reads it"):
        p.copy("a", 2)
    p.barrier()
    p.copy("a", 2)
    with pytest.raises(pc.PipelineError, match="still being written"):
        p.copy("a", 3)
    p.commit()
    with pytest.raises(pc.PipelineError, match="in flight"):
        p.end()


def nvrtc_source(name: str, tmp_path: Path) -> str:
    """Variant `name`'s attention_prefill.cu in a copy of kernels_cu/, with its local includes inlined (KernelLib)."""
    d = tmp_path / "kernels"
    shutil.copytree(KERNELS_DIR, d)
    (d / "attention_prefill.cu").write_text(ab.variant_source(name))
    return expand_source(d / "attention_prefill.cu")


def test_variant_sources_apply_their_defines():
    """Each variant's source carries its file's #defines with its overrides, and a lab version's include points at
    the copy's common.cuh; the smem formula is the product's for the product."""
    product = ab.variant_defines(ab.variant_source("product"))
    assert product["ATP_STAGES"] == 2 and product["ATP_ROWS"] == 64
    for hd in (64, 128):
        assert ab.variant_smem(product, hd) == prefill_smem(hd)
    for name, v in ab.VARIANTS.items():
        src = ab.variant_source(name)
        base = ab.variant_defines((Path(ab.ROOT) / v["file"]).read_text() if v["file"] else
                                  (KERNELS_DIR / "attention_prefill.cu").read_text())
        assert ab.variant_defines(src) == {**base, **v["defines"]}, name
        assert ab.LAB_INCLUDE not in src and re.search(r'^#include "(common|attention_prefill)\.cuh"$', src, re.M)


@pytest.mark.parametrize("name", [n for n, v in ab.VARIANTS.items() if v["file"]])
def test_lab_sources_inline_their_includes(name, tmp_path):
    """NVRTC gets no quoted include to resolve: neither from the variant's copy nor from the lab file where it lies
    (tests/test_kernels_gpu.py compiles every lab/kernels/*.cu)."""
    for text in (nvrtc_source(name, tmp_path), expand_source(Path(ab.ROOT) / ab.VARIANTS[name]["file"])):
        assert not re.search(r'^\s*#\s*include\s+"', text, re.M)
        assert "__device__ __forceinline__ void pdl_wait()" in text  # common.cuh, inlined


@pytest.mark.parametrize("name", list(ab.VARIANTS))
def test_variant_shared_memory_fits(name):
    """112 KB at hd 128 with three stages: two blocks of it (with the launch factory's headroom) fit an H100/H200 SM,
    as ATP_MIN_BLOCKS 2 assumes."""
    d = ab.variant_defines(ab.variant_source(name))
    for hd in (64, 128):
        need = ab.variant_smem(d, hd)
        assert blocks_fit(need + SMEM_HEADROOM, SMEM_H100) >= d["ATP_MIN_BLOCKS"], (name, hd, need)
    if d["ATP_STAGES"] == 3 and d["ATP_ROWS"] == 64:
        assert (ab.variant_smem(d, 64), ab.variant_smem(d, 128)) == (56 * 1024, 112 * 1024)


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("arch", ["sm_89", "sm_90", "sm_120"])
@pytest.mark.parametrize("name", LAB_VARIANTS)
def test_lab_versions_compile_without_spills(name, arch, tmp_path):
    """As tests/test_nvcc.py compiles the product's kernels: warnings as errors, the product's kernel names, no stack
    frame or spills in any of them (a variant marked `spills_at_hd`: none at the other head_dim)."""
    only = ab.VARIANTS[name].get("arch")  # a version for one arch (wgmma: sm_90a) builds there only
    if not ab.builds_for(name, arch):
        pytest.skip(f"{name} is built for {only} only")
    target = ["-gencode", f"arch=compute_{only[3:]},code={only}"] if only else [f"-arch={arch}"]
    src = tmp_path / "attention_prefill.cu"
    src.write_text(nvrtc_source(name, tmp_path).replace("#pragma once", ""))  # the host compiler warns in a main file
    out = subprocess.run([NVCC, *target, "-std=c++17", "-Werror", "all-warnings", "-Xptxas", "-v", "-c",
                          str(src), "-o", str(tmp_path / "a.o")],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    entries = re.findall(r"Compiling entry function '(\w+)'", out.stderr)
    assert sorted(entries) == sorted(KERNELS["attention_prefill.cu"])
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", out.stderr)
    assert len(frames) == len(entries)
    allowed = ab.VARIANTS[name].get("spills_at_hd")  # a variant that says it spills, only at that head_dim
    bad = [(e, f) for e, f in zip(entries, frames) if any(int(x) for x in f) and f"_hd{allowed}_" not in e]
    assert not bad, bad
