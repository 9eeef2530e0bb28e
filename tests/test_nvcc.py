"""Every kernels_cu/*.cu compiles with nvcc for sm_89, sm_90 and sm_120 (an arch-specific `*_sm90a.cu` for sm_90a
only, as nvrtc.file_arch builds it) with warnings as errors, defines exactly the kernels the op modules declare for it
(their KERNELS), and the register report shows no local-memory spills (no stack frame) in any kernel (CPU: needs nvcc
only)."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from atomflow_bench.gpu.nvrtc import KERNELS_DIR, file_arch
from atomflow_bench.gpu.ops import declared_kernels
from atomflow_bench.gpu.tp import sums

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
SOURCES = sorted(KERNELS_DIR.glob("*.cu"))
DECLARED = {**declared_kernels(), **sums.KERNELS}  # the one-GPU ops' and the tensor-parallel wing's


def target(src, arch: str) -> list[str]:
    """nvcc's target flags for `src` where the tests build it for `arch`: an arch-specific source's own target."""
    own = file_arch(src.name)
    return [f"-arch={arch}"] if own is None else ["-gencode", f"arch=compute_{own[3:]},code={own}"]


def compile_report(src, arch: str, tmp_path, defines=()) -> str:
    out = subprocess.run([NVCC, *target(src, arch), "-std=c++17", "-Werror", "all-warnings", "-Xptxas", "-v",
                          *[f"-D{d}" for d in defines], "-c", str(src), "-o", str(tmp_path / f"{src.stem}-{arch}.o")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{src.name} ({arch}) failed:\n{out.stderr[-3000:]}"
    return out.stderr


def frames_of(report: str) -> list[tuple[str, str, str]]:
    """Per kernel of an `-Xptxas -v` report: (stack frame, spill stores, spill loads) bytes."""
    return re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)


def local_memory(frames) -> list:
    """The frames of `frames_of` with any stack or spill bytes."""
    return [f for f in frames if any(int(v) for v in f)]


def ptx_of(path, defines=()) -> str:
    """The sm_90 (sm_90a) PTX of one source with `defines`."""
    out = subprocess.run([NVCC, *target(path, "sm_90"), "-std=c++17", *[f"-D{d}" for d in defines], "-ptx", str(path), "-o", "-"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.parametrize("arch", ["sm_89", "sm_90", "sm_120"])
@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_compiles_without_spills(src, arch, tmp_path):
    if file_arch(src.name) and file_arch(src.name).rstrip("a") != arch:
        pytest.skip(f"{src.name} is built for {file_arch(src.name)} only")
    report = compile_report(src, arch, tmp_path)
    entries = re.findall(r"Compiling entry function '(\w+)'", report)
    declared = DECLARED.get(src.name, ())
    assert sorted(entries) == sorted(declared), (
        f"{src.name} defines {sorted(set(entries) - set(declared))} beyond the op modules' KERNELS and lacks "
        f"{sorted(set(declared) - set(entries))}")
    frames = frames_of(report)
    assert len(frames) == len(entries)
    assert not local_memory(frames), f"local memory use (stack/spills) in {list(zip(entries, frames))}"


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.name)
def test_timeline_build_compiles_without_spills(src, tmp_path):
    """The timeline instrument (-DAF_TIMELINE, `profile --timeline`) must not push a kernel into local memory,
    or the instrumented step would time something else."""
    from lab.timeline import DEFINE

    report = compile_report(src, "sm_90", tmp_path, defines=(DEFINE,))
    frames = frames_of(report)
    assert frames and not local_memory(frames)


def test_attention_tma_form_compiles_without_spills(tmp_path):
    """attention.cu's sm_90 staging form ATT_TMA=1 (2D tensor copies; the host's default on sm_90+) compiles without
    local memory; below sm_90 it refuses to compile."""
    src = KERNELS_DIR / "attention.cu"
    report = compile_report(src, "sm_90", tmp_path, defines=("ATT_TMA=1",))
    frames = frames_of(report)
    assert len(frames) == len(DECLARED["attention.cu"]) and not local_memory(frames)
    out = subprocess.run([NVCC, "-arch=sm_89", "-std=c++17", "-DATT_TMA=1", "-c", str(src), "-o", str(tmp_path / "x.o")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode != 0 and "needs sm_90+" in out.stderr


def test_only_the_kept_knobs_remain():
    """The kernels read exactly these -D knobs: GEMV_BULK (the portable ring), ATT_TMA (the portable K/V staging) and
    the timing instruments AF_TIMELINE, AF_NO_WAIT, AF_NO_SCALES; every measured-slower form or value is gone or a
    fixed constant."""
    knobs = set()
    for src in sorted(KERNELS_DIR.glob("*.cu")) + sorted(KERNELS_DIR.glob("*.cuh")):
        knobs |= set(re.findall(r"^\s*#\s*if(?:n?def)\s+(\w+)", src.read_text(), re.M))
    assert knobs == {"GEMV_BULK", "ATT_TMA", "AF_TIMELINE", "AF_NO_WAIT", "AF_NO_SCALES"}


def test_every_source_has_a_header():
    """Every .cu, and every GEMV header (gemv_*.cuh: the pieces the GEMV kernels are built from), opens with a header
    naming it and saying what it computes, its layouts, the bytes it moves and how it is launched."""
    for src in SOURCES + sorted(KERNELS_DIR.glob("gemv_*.cuh")):
        text = src.read_text()
        assert text.splitlines()[0].startswith(f"// {src.name} —"), f"{src.name}: first line must name the op"
        header = text[: text.index("#")]
        for key in ("Computes", "Layout", "Bytes", "Launch"):
            assert f"// {key}" in header, f"{src.name}: header lacks '{key}'"


@pytest.mark.parametrize("src", ["gemv_fp8.cu", "gemv_fp16.cu", "attention_short.cu", "attention.cu"])
def test_no_wait_instrument_compiles_without_spills(src, tmp_path):
    """The timing instrument AF_NO_WAIT (common.cuh) with every bit set compiles without local
    memory, and it does remove the waits: fewer griddepcontrol.wait in the PTX than the default build."""
    path = KERNELS_DIR / src
    frames = frames_of(compile_report(path, "sm_90", tmp_path, defines=("AF_NO_WAIT=15",)))
    assert frames and not local_memory(frames)

    def waits(defines):
        return ptx_of(path, defines).count("griddepcontrol.wait")

    assert waits(("AF_NO_WAIT=15",)) < waits(())


@pytest.mark.parametrize("src", ["gemv_fp8.cu", "gemv_fp16.cu"])
def test_l2_prefetch_only_in_the_qkv_and_summing_kernels(src):
    """The L2 bulk prefetches of later weights (gemv_epilogue.cuh): next_weights_l2 in the QKV kernels (the host's
    next_bytes = 0 asks nothing) after the block's last epilogue: o_proj's head (l2_head:
    weights and scales) and the range (one); and the next GEMV's head in the summing kernels (resid_tp,
    tp_sum_finish: weights and scales); no other kernel asks L2 for anything."""
    kernels = re.split(r"\.entry\s+", ptx_of(KERNELS_DIR / src))[1:]
    prefetching = {k.split("(", 1)[0].strip(): k.count("cp.async.bulk.prefetch.L2") for k in kernels
                   if "cp.async.bulk.prefetch.L2" in k}
    qkv = {k: v for k, v in prefetching.items() if "qkv_rope" in k}
    summing = {k: v for k, v in prefetching.items() if "resid_tp" in k}
    assert qkv and summing and len(qkv) + len(summing) == len(prefetching), prefetching
    assert set(qkv.values()) == {3} and set(summing.values()) == {2}, prefetching


@pytest.mark.parametrize("src", ["gemv_fp8.cu", "gemv_fp16.cu"])
def test_every_bulk_weight_copy_is_evict_first(src):
    """The tiled GEMVs' bulk weight and scale copies (gemv_tiled.cuh gemv_w_copy) all carry
    the L2 evict-first policy: no bulk copy without the cache hint."""
    ptx = ptx_of(KERNELS_DIR / src)
    copies = [ln for ln in ptx.splitlines() if "cp.async.bulk.shared::cluster.global" in ln]
    assert copies and all("L2::cache_hint" in ln for ln in copies)
    assert ptx.count("createpolicy.fractional.L2::evict_first") > 0


def test_no_scales_instrument_drops_only_the_scale_copies(tmp_path):
    """The timing instrument AF_NO_SCALES (common.cuh) compiles without local memory and removes exactly the fp8
    scale copies: the bulk copies of the fp8 kernels drop, the fp16 kernels are untouched."""
    fp8, fp16 = KERNELS_DIR / "gemv_fp8.cu", KERNELS_DIR / "gemv_fp16.cu"
    frames = frames_of(compile_report(fp8, "sm_90", tmp_path, defines=("AF_NO_SCALES=1",)))
    assert frames and not local_memory(frames)
    bulk = "cp.async.bulk.shared::cluster.global"
    assert ptx_of(fp8, ("AF_NO_SCALES=1",)).count(bulk) < ptx_of(fp8).count(bulk)
    assert ptx_of(fp16, ("AF_NO_SCALES=1",)) == ptx_of(fp16)


def test_arch_specific_sources_are_named_by_their_target():
    """A source's own target is read from its name (KernelLib compiles it for that target alone); only the wgmma
    attention has one today, and its op module launches it where that target runs."""
    assert [file_arch(n) for n in ("attention_prefill_sm90a.cu", "attention_prefill.cu", "x_sm100a.cu", "sm90a.cu")] \
        == ["sm_90a", None, "sm_100a", None]
    assert [p.name for p in SOURCES if file_arch(p.name)] == ["attention_prefill_sm90a.cu"]
    assert target(KERNELS_DIR / "attention_prefill_sm90a.cu", "sm_89") == ["-gencode", "arch=compute_90a,code=sm_90a"]
