"""Stage 4 of the decode path: the CUDA kernels, compiled from `kernels_cu/*.cu` with NVRTC via CuPy.

Each `.cu` file is one op (see its header). `KernelLib` compiles a file the first time one of its kernels
is asked for, for the device's own architecture (CuPy picks sm_XY from the current device), and CuPy's
on-disk cache (~/.cupy/kernel_cache, keyed by source + options + arch) makes a second process skip NVRTC.
Local `#include "x.cuh"` lines are inlined here so that the cache key covers the headers too.

Also `Launch`: one kernel launch with its grid/block/args, the unit from which the step is built, run
eagerly or captured into a CUDA Graph (no duplicated launch boilerplate anywhere else).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import AtomflowError

KERNELS_DIR = Path(os.environ.get("ATOMFLOW_KERNELS_DIR", Path(__file__).resolve().parent.parent / "kernels_cu"))
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(')
_DEFINE = re.compile(r"^[ \t]*#[ \t]*define(?:[^\n]*\\\n)*[^\n]*", re.M)  # a #define with continuations
GEMV_RING_DEPTHS = (2, 3, 4, 5)  # fp8 GEMV ring depths with a kernel each (gemv_common.cuh GEMV_RING_INSTANCES)
_MACRO_INSTANCE = re.compile(r"^(?:GEMV_(?:ROPE_|ROWS_|ROWS_ARGMAX_|WS_|WS_ROPE_|DYN_|DYN_ROPE_)?INSTANCE\((\w+)[,)]"  # NAME
                             r"|GEMV_(?:ROPE_)?RING_INSTANCES\((\w+)[,)]"  # NAME_r<depth> for every depth
                             r"|ATTENTION_(SHORT_)?INSTANCE\((\d+), (\d+)\))", re.M)  # attention_{decode,short}_hd<HD>_g<G>


def expand_source(path: Path, seen: set | None = None) -> str:
    """The source of `path` with local quoted includes inlined (each header once)."""
    seen = set() if seen is None else seen
    text = path.read_text()

    def repl(m):
        inc = (path.parent / m.group(1)).resolve()
        if inc in seen:
            return ""
        seen.add(inc)
        return expand_source(inc, seen)

    return _INCLUDE.sub(repl, text)


def kernel_names(path: Path) -> list[str]:
    """The extern "C" kernels a .cu file defines (directly or through the instance macros)."""
    text = _DEFINE.sub("", path.read_text())
    names = _KERNEL.findall(text)
    for gemv, ring, short, hd, g in _MACRO_INSTANCE.findall(text):
        if ring:
            names += [f"{ring}_r{d}" for d in GEMV_RING_DEPTHS]
        else:
            names.append(gemv or f"attention_{'short' if short else 'decode'}_hd{hd}_g{g}")
    return names


def cuda_include_dirs() -> list[str]:
    """Directories holding cuda_fp16.h / cuda_fp8.h for NVRTC (toolkit, or the nvidia-* pip wheels)."""
    cands = []
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            cands.append(Path(os.environ[var]) / "include")
    cands += [Path("/usr/local/cuda/include")]
    for sp in sys.path:
        nv = Path(sp) / "nvidia"
        if nv.is_dir():
            cands += sorted(nv.glob("cu*/include")) + sorted(nv.glob("cuda_runtime/include"))
    out = []
    for c in cands:
        if (c / "cuda_fp8.h").is_file() and str(c) not in out:
            out.append(str(c))
    return out


def knob(name: str, default: int, defines: tuple | None = None) -> int:
    """The integer NAME=V of ATOMFLOW_KERNEL_DEFINES (or of `defines`), else `default`: compile-time -D knobs
    that the host-side launch and arena rules must follow too."""
    for d in defines if defines is not None else os.environ.get("ATOMFLOW_KERNEL_DEFINES", "").split():
        if d.startswith(name + "="):
            return int(d.split("=", 1)[1])
    return default


# Compile-time knobs that are timing instruments, not kernel variants: with a non-zero value the step computes wrong
# results on purpose (AF_NO_WAIT, AF_NO_SCALES: common.cuh, results/PERF_NOTES.md v28, v36). `run` marks its record
# with them, `compare` refuses such a record and `validate` refuses to start.
INSTRUMENT_KNOBS = ("AF_NO_WAIT", "AF_NO_SCALES")


def instrument_defines(defines: tuple | None = None) -> list[str]:
    """The NAME=V of `defines` (default, as for `knob`: ATOMFLOW_KERNEL_DEFINES) that switch a timing instrument on."""
    return [f"{n}={knob(n, 0, defines)}" for n in INSTRUMENT_KNOBS if knob(n, 0, defines)]


@functools.lru_cache(maxsize=None)
def compute_capability() -> int:
    """The current device's compute capability as an integer (90 for sm_90)."""
    import cupy as cp

    return int(cp.cuda.Device().compute_capability)


def arch_defines(cc: int, defines: tuple) -> tuple:
    """Knob values that depend on the GPU, added to a KernelLib's defines where the run does not set them: on sm_90+
    attention.cu stages K/V groups by 2D tensor copies (ATT_TMA=1; results/PERF_NOTES.md v23.5), except beside the
    forms it excludes (ATT_BULK, ATT_CLUSTER > 1, ATT_THREADS != 128: attention.cu's #error). The source default
    (ATT_TMA 0) stays the portable form for older GPUs and nvcc."""
    if any(d.startswith("ATT_TMA=") for d in defines) or cc < 90:
        return ()
    if knob("ATT_BULK", 0, defines) or knob("ATT_CLUSTER", 1, defines) > 1 or knob("ATT_THREADS", 128, defines) != 128:
        return ()
    return ("ATT_TMA=1",)


class KernelLib:
    """Compiled kernels by name, one cupy.RawModule per .cu file, compiled on first use."""

    OPTIONS = ("-std=c++17",)

    def __init__(self, kernels_dir: Path = KERNELS_DIR, extra_defines: tuple = ()):
        import cupy  # noqa: F401  (fail here, clearly, when CuPy is missing)

        self.dir = Path(kernels_dir)
        self._file_of: dict[str, Path] = {}
        for f in sorted(self.dir.glob("*.cu")):
            for name in kernel_names(f):
                self._file_of[name] = f
        self._modules: dict[Path, object] = {}
        self._kernels: dict[str, object] = {}
        # extra -D macros for A/B experiments (ATOMFLOW_KERNEL_DEFINES="NAME=VALUE ..."), recorded in run results
        # plus `extra_defines` from the caller (e.g. the timeline instrument, AF_TIMELINE=<slots>)
        # plus the GPU's own defaults (arch_defines), so that the launch rules reading lib.defines see them
        given = tuple(os.environ.get("ATOMFLOW_KERNEL_DEFINES", "").split()) + tuple(extra_defines)
        self.defines = given + arch_defines(compute_capability(), given)
        self.options = (self.OPTIONS + tuple(f"-D{d}" for d in self.defines)
                        + tuple(f"-I{d}" for d in cuda_include_dirs()))

    def define(self, name: str, default: int) -> int:
        """An integer -D override from ATOMFLOW_KERNEL_DEFINES (A/B knobs read by the launch rules too)."""
        return knob(name, default, self.defines)

    def module(self, path: Path):
        import cupy

        if path not in self._modules:
            self._modules[path] = cupy.RawModule(code=expand_source(path), options=self.options,
                                                 name_expressions=None)
        return self._modules[path]

    def __getitem__(self, name: str):
        if name not in self._kernels:
            try:
                f = self._file_of[name]
            except KeyError:
                raise KeyError(f"no kernel {name!r} in {self.dir}") from None
            self._kernels[name] = self.module(f).get_function(name)
        return self._kernels[name]

    def compile_all(self) -> None:
        for name in self._file_of:
            self[name]


# ---- launches with attributes through the driver's cuLaunchKernelEx ---------------------------------------
# CuPy's RawKernel cannot pass launch attributes, so programmatic dependent launch (PDL) goes to libcuda
# directly (ctypes; layouts from cuda.h of CUDA 12/13). Under stream capture the PDL attribute becomes a
# programmatic graph edge.

class _AttrValue(ctypes.Union):
    # programmatic stream serialization: an int; cluster dimension: three unsigned ints (x, y, z)
    _fields_ = [("pad", ctypes.c_char * 64), ("value", ctypes.c_int), ("dim", ctypes.c_uint * 3)]


class _Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("numAttrs", ctypes.c_uint)]


CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
PORTABLE_CLUSTER = 8  # larger clusters (up to 16 on H100) need the function's non-portable attribute
_libcuda = None


def _driver():
    global _libcuda
    if _libcuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                         ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        lib.cuFuncSetAttribute.restype = ctypes.c_int
        lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        _libcuda = lib
    return _libcuda


# ---- the L2 set-aside for persisting lines (the lm_head's evict-last rows, knob LMHEAD_L2_KEEP) -------------------
CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 6  # = cudaLimitPersistingL2CacheSize


def persisting_l2() -> int:
    """The bytes of L2 set aside for persisting lines now (cudaDeviceGetLimit); 0 where the limit cannot be read (GPUs
    before sm_80, MIG instances and MPS clients have no set-aside of their own)."""
    import cupy

    try:
        return int(cupy.cuda.runtime.deviceGetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE))
    except cupy.cuda.runtime.CUDARuntimeError:
        return 0


def set_persisting_l2(nbytes: int) -> int:
    """Sets aside `nbytes` of L2 for persisting lines (the driver rounds up to its granularity and clamps to the
    device's maximum); 0 also turns every persisting line back into a normal one. Returns the set-aside now."""
    import cupy

    cupy.cuda.runtime.deviceSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE, nbytes)
    if nbytes == 0:
        err = _driver().cuCtxResetPersistingL2Cache()
        if err:
            raise RuntimeError(f"cuCtxResetPersistingL2Cache failed: CUresult {err}")
    return persisting_l2()


@contextlib.contextmanager
def no_persisting_l2():
    """Within: no L2 set aside and no persisting line — how the copy roofline is measured: on the H100 a set-aside
    slows a plain copy (31.25 MiB: 3.0 -> 1.17 TB/s, results/PERF_NOTES.md v35), and the roofline is the hardware's copy
    bandwidth. After: the set-aside as it was (its lines come back with the next steps)."""
    before = persisting_l2()
    if before:
        set_persisting_l2(0)
    try:
        yield
    finally:
        if before:
            set_persisting_l2(before)


CU_TENSOR_MAP_DATA_TYPE_FLOAT16 = 6  # cuda.h enums (CUDA 12/13)
CU_TENSOR_MAP_SWIZZLE_128B = 3
CU_TENSOR_MAP_L2_PROMOTION_L2_256B = 3
TENSOR_MAP_BYTES = 128


def tensor_map_2d(arr, box: tuple[int, int]) -> bytes:
    """The CUtensorMap (128 bytes) of a C-contiguous 2D fp16 device array [rows][cols] for tiled copies of boxes
    `box` = (cols, rows), 128-byte swizzle in shared memory, out-of-bounds rows read as zeros
    (cuTensorMapEncodeTiled; sm_90+). The kernel reads it from device memory (see tensor_maps)."""
    if arr.ndim != 2 or arr.dtype != np.float16 or not arr.flags.c_contiguous:
        raise AtomflowError(f"tensor map: need a C-contiguous 2D fp16 array, got {arr.dtype} {arr.shape}")
    raw = ctypes.create_string_buffer(2 * TENSOR_MAP_BYTES)  # the struct is declared 128-byte aligned
    base = -ctypes.addressof(raw) % TENSOR_MAP_BYTES
    dims = (ctypes.c_uint64 * 2)(arr.shape[1], arr.shape[0])
    strides = (ctypes.c_uint64 * 1)(arr.strides[0])
    boxd = (ctypes.c_uint32 * 2)(*box)
    ones = (ctypes.c_uint32 * 2)(1, 1)
    rc = _driver().cuTensorMapEncodeTiled(  # returns a CUresult (ctypes' default int)
        ctypes.c_void_p(ctypes.addressof(raw) + base), ctypes.c_int(CU_TENSOR_MAP_DATA_TYPE_FLOAT16), ctypes.c_uint32(2),
        ctypes.c_void_p(arr.data.ptr), dims, strides, boxd, ones, ctypes.c_int(0),  # interleave: none
        ctypes.c_int(CU_TENSOR_MAP_SWIZZLE_128B), ctypes.c_int(CU_TENSOR_MAP_L2_PROMOTION_L2_256B), ctypes.c_int(0))
    if rc != 0:
        raise AtomflowError(f"cuTensorMapEncodeTiled failed (CUresult {rc}) for {arr.shape} box {box}")
    return raw.raw[base:base + TENSOR_MAP_BYTES]


def tensor_maps(arrays, box: tuple[int, int]):
    """The tensor maps of `arrays` (tensor_map_2d each) back to back in one device array (128 bytes apart, the
    allocation 256-byte aligned: the copies need 64)."""
    import cupy as cp

    blob = b"".join(tensor_map_2d(a, box) for a in arrays)
    return cp.asarray(np.frombuffer(blob, dtype=np.uint8))


def allow_dynamic_smem(fn, shmem: int) -> None:
    """Opt `fn` in to `shmem` bytes of dynamic shared memory when beyond the default 48 KB per block."""
    if shmem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = max(fn.max_dynamic_shared_size_bytes, shmem)


def _c_arg(a):
    """A kernel argument as the ctypes object whose address goes into kernelParams."""
    if hasattr(a, "data") and hasattr(a.data, "ptr"):  # cupy.ndarray
        return ctypes.c_void_p(a.data.ptr)
    if isinstance(a, np.int32):
        return ctypes.c_int32(int(a))
    if isinstance(a, np.float32):
        return ctypes.c_float(float(a))
    if isinstance(a, np.uint64):
        return ctypes.c_uint64(int(a))
    raise TypeError(f"unsupported kernel argument type {type(a).__name__}")


class ExLauncher:
    """Pre-built cuLaunchKernelEx call for one Launch with launch attributes — PDL and/or a thread block cluster
    of `cluster` blocks along grid.y (argument storage kept alive with it)."""

    def __init__(self, fn, grid, block, args, shmem, pdl: bool = True, cluster: int = 1):
        self._args = [_c_arg(a) for a in args]
        self._params = (ctypes.c_void_p * len(self._args))(*[ctypes.addressof(a) for a in self._args])
        self._attrs = (_Attr * 2)()
        n = 0
        if pdl:
            self._attrs[n].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            self._attrs[n].value.value = 1
            n += 1
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        if cluster > 1:
            if g[1] % cluster:
                raise ValueError(f"grid.y {g[1]} is not a multiple of the cluster size {cluster}")
            self._attrs[n].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            self._attrs[n].value.dim[:] = (1, cluster, 1)
            n += 1
            if cluster > PORTABLE_CLUSTER:
                rc = _driver().cuFuncSetAttribute(fn.kernel.ptr, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
                if rc != 0:
                    raise RuntimeError(f"cuFuncSetAttribute (non-portable cluster size) failed with CUresult {rc}")
        self._cfg = _LaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], shmem, None, self._attrs, n)
        self._func = fn.kernel.ptr
        self._launch = _driver().cuLaunchKernelEx

    def __call__(self):
        import cupy

        self._cfg.hStream = cupy.cuda.get_current_stream().ptr
        rc = self._launch(ctypes.byref(self._cfg), self._func, self._params, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc}")


@dataclass
class Launch:
    """One kernel launch of the decode step (runs on CuPy's current stream).

    `taps` maps probe names to the device views that hold them once this launch has run;
    `bytes_moved` is the least DRAM traffic the launch needs (for per-kernel bandwidth in `profile`).
    """

    fn: object
    name: str
    grid: tuple
    block: tuple
    args: tuple
    shmem: int = 0
    taps: dict = field(default_factory=dict)
    bytes_moved: int = 0
    label: str = ""  # what `profile` groups by, e.g. "gemv fp8 qkv 5120x3072"
    pdl: bool = False  # set by enable_pdl(): launch with programmatic stream serialization
    cluster: int = 1   # blocks per thread block cluster along grid.y (sm_90+; 1 = no cluster launch)
    _ex: ExLauncher | None = None

    def __post_init__(self):
        if self.cluster > 1:
            self._ex = ExLauncher(self.fn, self.grid, self.block, self.args, self.shmem, pdl=False,
                                  cluster=self.cluster)

    def __call__(self):
        if self._ex is not None:
            self._ex()
        else:
            self.fn(self.grid, self.block, self.args, shared_mem=self.shmem)

    def enable_pdl(self) -> None:
        self.pdl = True
        self._ex = ExLauncher(self.fn, self.grid, self.block, self.args, self.shmem, cluster=self.cluster)
