"""`atomflow-bench doctor`: what this machine has for the main job, in one table, and whether something it needs is
missing (then the exit code is non-zero: 3 when the GPU stack is missing, 1 when something else the main job needs is).

Checks: the package and its kernel sources; the NVIDIA driver and the CUDA version it supports; CuPy and the CUDA it was
built for; each GPU (compute capability, which weight formats it runs, free memory); NVRTC compiling one kernel; nvcc
(optional: the CPU tests and scripts/ptx_compare.py use it); peer access and an NCCL all-reduce between the GPUs when
there are several (tensor parallel needs them); free disk under $ATOMFLOW_HOME against the default model; the copy
bandwidth of GPU 0 (the roofline `run` divides by, measured again in every run).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass

from . import envs
from .output import Num

OK, WARN, FAIL = "ok", "warn", "FAIL"
# compute capability each weight format's kernels need: fp16 mma.m16n8k16 and cp.async (sm_80); the fp8 path's
# hardware fp8x2 -> half2 conversion (sm_89); the warp-specialised forms and TMA (sm_90)
FORMAT_CC = {"fp16": 80, "fp8": 89}


@dataclass
class Check:
    name: str
    status: str
    detail: str | Num  # a Num where the check is a measurement: its figure is the data in csv and json
    gpu: bool = False  # a failure of the GPU stack (exit 3) rather than of something else (exit 1)


def _first(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def run_checks(bandwidth: bool = True) -> list[Check]:
    from . import __version__
    from .config import DEFAULT_MODEL, get_preset
    from .gpu.device import driver_cuda_version, gpu_problem
    from .gpu.nvrtc import KERNELS_DIR
    from .store.store import home

    out: list[Check] = []
    cus = sorted(KERNELS_DIR.glob("*.cu")) if KERNELS_DIR.is_dir() else []
    out.append(Check("atomflow-bench", OK if cus else FAIL,
                     f"{__version__}; kernels {KERNELS_DIR} ({len(cus)} .cu files)" if cus
                     else f"{__version__}; kernel sources not found at {KERNELS_DIR} (set ATOMFLOW_KERNELS_DIR)"))
    drv = driver_cuda_version()
    out.append(Check("NVIDIA driver", OK if drv else FAIL,
                     f"supports CUDA {drv // 1000}.{drv % 1000 // 10}" if drv else "libcuda.so.1 not found", gpu=True))
    try:
        import cupy

        try:
            rt = cupy.cuda.runtime.runtimeGetVersion()
            built = f", CUDA runtime {rt // 1000}.{rt % 1000 // 10}"
        except Exception:  # noqa: BLE001
            built = ""
        out.append(Check("CuPy", OK, f"{cupy.__version__}{built}", gpu=True))
    except ImportError:
        out.append(Check("CuPy", FAIL, "not installed: pip install 'atomflow-bench[cuda13]' (or [cuda12])", gpu=True))
    problem = gpu_problem()
    if problem and drv and "CuPy is not installed" not in problem:
        out.append(Check("CUDA", FAIL, problem, gpu=True))
    n_gpu = 0
    if not problem:
        import cupy

        n_gpu = cupy.cuda.runtime.getDeviceCount()
        for i in range(n_gpu):
            with cupy.cuda.Device(i):
                p = cupy.cuda.runtime.getDeviceProperties(i)
                name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
                cc = p["major"] * 10 + p["minor"]
                free, total = cupy.cuda.runtime.memGetInfo()
                fmts = [f for f, need in FORMAT_CC.items() if cc >= need]
                extra = "; ws forms, TMA" if cc >= 90 else ""
                out.append(Check(f"GPU {i}", OK if fmts else FAIL,
                                 f"{name}, sm_{cc}, {p['multiProcessorCount']} SMs; formats: "
                                 f"{', '.join(fmts) or 'none (needs sm_80+)'}{extra}; free {free / 2**30:.1f} of "
                                 f"{total / 2**30:.1f} GiB", gpu=True))
        out.append(_nvrtc_check())
    out.append(_nvcc_check())
    if n_gpu > 1:
        out += _multi_gpu_checks(n_gpu)
    need = get_preset(DEFAULT_MODEL).config.weight_bytes("fp16")
    h = home()
    probe = h if h.exists() else next((p for p in h.parents if p.exists()), h)
    free = shutil.disk_usage(probe).free
    writable = os.access(probe, os.W_OK) and probe.is_dir()  # a file where the store would be: nothing can be made
    why = "" if writable else f" ({probe} is not a directory)" if not probe.is_dir() else " (not writable)"
    out.append(Check("disk", OK if free > 1.2 * need and writable else FAIL,
                     f"{free / 2**30:.1f} GiB free under {h}{why}"
                     f"; the default model ({DEFAULT_MODEL}) needs {need / 2**30:.1f} GiB"))
    if bandwidth and not problem:
        from .measure.timing import copy_bandwidth

        out.append(bandwidth_check(copy_bandwidth(nbytes=256 << 20, reps=10, warmup=3)))
    return out


def bandwidth_check(bw: dict) -> Check:
    """GPU 0's copy bandwidth (timing.copy_bandwidth of 256 MiB x 10): the median in GB/s."""
    return Check("copy bandwidth", OK, Num(bw["median"], f"GPU 0: {bw['median']:.0f} GB/s (device-to-device, read + "
                                                         "write, 256 MiB x 10)"))


def _nvrtc_check() -> Check:
    from .gpu.ops import kernel_lib

    try:
        t0 = time.perf_counter()
        kernel_lib()["embed_lookup"]
        return Check("NVRTC", OK, f"compiled embedding.cu in {time.perf_counter() - t0:.1f} s", gpu=True)
    except Exception as e:  # noqa: BLE001
        return Check("NVRTC", FAIL, f"cannot compile the kernels: {_first(e)}", gpu=True)


def _nvcc_check() -> Check:
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if not nvcc:
        return Check("nvcc", WARN, "not found (optional: only the repository's nvcc tests and PTX comparison use it)")
    try:
        v = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
        rel = next((ln.split("release")[1].split(",")[0].strip() for ln in v.splitlines() if "release" in ln), "?")
        return Check("nvcc", OK, f"{nvcc}, release {rel}")
    except (OSError, subprocess.SubprocessError) as e:
        return Check("nvcc", WARN, f"{nvcc}: {_first(e)}")


def _multi_gpu_checks(n: int) -> list[Check]:
    import cupy

    rt = cupy.cuda.runtime
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    missing = [f"{i}->{j}" for i, j in pairs if not rt.deviceCanAccessPeer(i, j)]
    out = [Check("peer access", OK if not missing else WARN,
                 f"all {len(pairs)} pairs" if not missing else f"missing for {', '.join(missing)}")]
    envs.set_default("NCCL_NVLS_ENABLE")  # no NVLink multicast (it can take a shared host's GPUs down)
    try:
        from cupy.cuda import nccl

        comms = nccl.NcclCommunicator.initAll(list(range(n)))
        bufs = []
        for i in range(n):
            with cupy.cuda.Device(i):
                bufs.append(cupy.full(4096, i + 1, dtype=cupy.float32))
        nccl.groupStart()
        for i, c in enumerate(comms):
            with cupy.cuda.Device(i):
                c.allReduce(bufs[i].data.ptr, bufs[i].data.ptr, bufs[i].size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                            cupy.cuda.Stream.null.ptr)
        nccl.groupEnd()
        want = n * (n + 1) / 2
        ok = True
        for i in range(n):
            with cupy.cuda.Device(i):
                cupy.cuda.Device(i).synchronize()
                ok &= bool((bufs[i] == want).all())
        out.append(Check("NCCL", OK if ok else FAIL, f"{nccl.get_version()}: all-reduce over {n} GPUs "
                                                     + ("gives the sum" if ok else "gives a wrong sum")))
    except Exception as e:  # noqa: BLE001 - ImportError without NCCL, NcclError
        out.append(Check("NCCL", WARN, f"unavailable ({_first(e)}): tensor parallel needs it"))
    return out


def exit_code(checks: list[Check]) -> int:
    fails = [c for c in checks if c.status == FAIL]
    if not fails:
        return 0
    return 3 if any(c.gpu for c in fails) else 1
