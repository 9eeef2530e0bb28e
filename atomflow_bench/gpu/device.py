"""The GPU the engine runs on: whether there is one, what it is, and the limits every launch plan reads."""
from __future__ import annotations

import functools

from ..errors import GpuUnavailable

# Shared memory of an H100 (sm_90): (per block with opt-in, per SM, reserved per resident block). The plans take the
# current device's figures (smem_limits); this triple is the default of the pure-Python plan functions and tests.
SMEM_H100 = (227 * 1024, 228 * 1024, 1024)


def require_gpu():
    """Import CuPy and check a CUDA device exists; raise GpuUnavailable with one line otherwise."""
    try:
        import cupy
    except ImportError:
        raise GpuUnavailable("CuPy is not installed (pip install 'atomflow-bench[cuda12]' or '[cuda13]')") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError when there is no driver
        raise GpuUnavailable(f"no CUDA device available ({type(e).__name__}: {e})") from None
    if n == 0:
        raise GpuUnavailable("no CUDA device available")
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
