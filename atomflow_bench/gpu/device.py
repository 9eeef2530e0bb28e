"""The GPU the engine runs on: whether there is one, what it is, and the limits every launch plan reads."""
from __future__ import annotations

import ctypes
import functools

from ..errors import GpuUnavailable

# Shared memory of an H100 (sm_90): (per block with opt-in, per SM, reserved per resident block). The plans take the
# current device's figures (smem_limits); this triple is the default of the pure-Python plan functions and tests.
SMEM_H100 = (227 * 1024, 228 * 1024, 1024)
SMEM_SM89 = (99 * 1024, 100 * 1024, 1024)  # the same for sm_89 (L40S, RTX 4090): the plans must fit it too


def driver_cuda_version() -> int | None:
    """The CUDA version the NVIDIA driver supports (e.g. 13000), from libcuda itself; None without a driver."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    v = ctypes.c_int(0)
    return v.value if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 else None


def gpu_problem() -> str | None:
    """Why this machine has no usable GPU (one line naming the cause), or None when it has one."""
    driver = driver_cuda_version()
    if driver is None:
        return ("no NVIDIA driver (libcuda.so.1 not found): the GPU commands need an NVIDIA GPU; the NumPy reference "
                "runs on the CPU with `generate` and `validate --backend numpy`")
    try:
        import cupy
    except ImportError:
        major = driver // 1000
        return (f"CuPy is not installed: pip install 'atomflow-bench[cuda{major if major in (12, 13) else 13}]' "
                f"(the driver supports CUDA {driver // 1000}.{driver % 1000 // 10})")
    try:
        runtime = cupy.cuda.runtime.runtimeGetVersion()
    except Exception:  # noqa: BLE001 - a CuPy that cannot load its runtime
        runtime = None
    if runtime and runtime // 1000 > driver // 1000:
        return (f"CUDA major mismatch: the driver supports CUDA {driver // 1000}.{driver % 1000 // 10}, CuPy "
                f"{cupy.__version__} was built for CUDA {runtime // 1000}: install cupy-cuda{driver // 1000}x "
                f"(pip install 'atomflow-bench[cuda{driver // 1000}]') or update the driver")
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - CUDARuntimeError: no device, driver/runtime trouble
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return f"the CUDA driver reports no usable device ({first})"
    if n == 0:
        return "no CUDA device visible (check CUDA_VISIBLE_DEVICES)"
    return None


def require_gpu():
    """CuPy with a usable CUDA device, else GpuUnavailable naming the cause (one line; the CLI exits 3)."""
    problem = gpu_problem()
    if problem:
        raise GpuUnavailable(problem)
    import cupy

    return cupy


def gpu_info() -> dict:
    cupy = require_gpu()
    rt = cupy.cuda.runtime
    dev = cupy.cuda.Device()
    p = rt.getDeviceProperties(dev.id)
    name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
    dv, rv = rt.driverGetVersion(), rt.runtimeGetVersion()
    return {"name": name, "cc": f"{p['major']}.{p['minor']}", "sms": int(p["multiProcessorCount"]),
            "l2_bytes": int(p["l2CacheSize"]), "memory_bytes": int(p["totalGlobalMem"]),
            "cuda_driver": f"{dv // 1000}.{dv % 1000 // 10}", "cuda_runtime": f"{rv // 1000}.{rv % 1000 // 10}",
            "cupy": cupy.__version__}


@functools.lru_cache(maxsize=None)
def compute_capability() -> int:
    """The current device's compute capability as an integer (90 for sm_90)."""
    import cupy as cp

    return int(cp.cuda.Device().compute_capability)


@functools.lru_cache(maxsize=None)
def smem_limits() -> tuple[int, int, int]:
    """(per block with opt-in, per SM, reserved per block) shared memory bytes of the current device."""
    import cupy as cp

    rt, dev = cp.cuda.runtime, cp.cuda.Device().id
    return tuple(rt.deviceGetAttribute(a, dev) for a in (rt.cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                                          rt.cudaDevAttrMaxSharedMemoryPerMultiprocessor,
                                                          rt.cudaDevAttrReservedSharedMemoryPerBlock))


def blocks_fit(shmem: int, smem: tuple = SMEM_H100) -> int:
    """Blocks of `shmem` dynamic shared memory bytes that one SM holds at once (0: not even one)."""
    per_block, per_sm, reserved = smem
    return 0 if shmem > per_block else per_sm // (shmem + reserved)
