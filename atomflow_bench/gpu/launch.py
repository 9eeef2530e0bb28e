"""One kernel launch: `Launch` (grid, block, arguments, shared memory), the unit every step is built from.

A Launch runs on CuPy's current stream, eagerly or under stream capture (graph.py). Launches after the first of a
step carry programmatic dependent launch (PDL, Hopper+): CuPy's RawKernel cannot pass launch attributes, so those go
to the driver's cuLaunchKernelEx directly (ctypes; layouts from cuda.h of CUDA 12/13). Under stream capture the PDL
attribute becomes a programmatic graph edge. Also here: the tensor maps (cuTensorMapEncodeTiled) that the TMA forms
read, and the opt-in to more than 48 KB of dynamic shared memory.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np

from ..errors import AtomflowError

NULL = np.uint64(0)  # a null pointer argument


def i32(v) -> np.int32:
    return np.int32(v)


class _AttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("value", ctypes.c_int)]


class _Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("numAttrs", ctypes.c_uint)]


CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_libcuda = None


def driver():
    """libcuda through ctypes (the calls CuPy does not expose)."""
    global _libcuda
    if _libcuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                         ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        _libcuda = lib
    return _libcuda


def _c_arg(a):
    """A kernel argument as the ctypes object whose address goes into kernelParams."""
    if hasattr(a, "data") and hasattr(a.data, "ptr"):  # cupy.ndarray
        return ctypes.c_void_p(a.data.ptr)
    if isinstance(a, np.int32):
        return ctypes.c_int32(int(a))
    if isinstance(a, np.float32):
        return ctypes.c_float(float(a))
    if isinstance(a, np.uint32):
        return ctypes.c_uint32(int(a))
    if isinstance(a, np.uint64):
        return ctypes.c_uint64(int(a))
    raise TypeError(f"unsupported kernel argument type {type(a).__name__}")


class PdlLauncher:
    """A pre-built cuLaunchKernelEx call of one Launch with the PDL attribute (argument storage kept alive with it)."""

    def __init__(self, fn, grid, block, args, shmem):
        self._args = [_c_arg(a) for a in args]
        self._params = (ctypes.c_void_p * len(self._args))(*[ctypes.addressof(a) for a in self._args])
        self._attrs = (_Attr * 1)()
        self._attrs[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        self._attrs[0].value.value = 1
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        self._cfg = _LaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], shmem, None, self._attrs, 1)
        self._func = fn.kernel.ptr
        self._launch = driver().cuLaunchKernelEx

    def __call__(self):
        import cupy

        self._cfg.hStream = cupy.cuda.get_current_stream().ptr
        rc = self._launch(ctypes.byref(self._cfg), self._func, self._params, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc}")


@dataclass
class Launch:
    """One kernel launch of the decode step (runs on CuPy's current stream).

    `taps` maps probe names to the device views that hold them once this launch has run (validate copies them);
    `bytes_moved` is the least DRAM traffic the launch needs (per-kernel bandwidth in `profile`); `label` is what
    `profile` groups by, e.g. "gemv fp8 wqkv 5120x3072".
    """

    fn: object
    name: str
    grid: tuple
    block: tuple
    args: tuple
    shmem: int = 0
    taps: dict = field(default_factory=dict)
    bytes_moved: int = 0
    label: str = ""
    pdl: bool = False  # set by enable_pdl(): launched with programmatic stream serialization
    _pdl_launcher: PdlLauncher | None = None

    def __call__(self):
        if self._pdl_launcher is not None:
            self._pdl_launcher()
        else:
            self.fn(self.grid, self.block, self.args, shared_mem=self.shmem)

    def enable_pdl(self) -> None:
        self.pdl = True
        self._pdl_launcher = PdlLauncher(self.fn, self.grid, self.block, self.args, self.shmem)


def with_last_arg(ln: Launch, arg) -> Launch:
    """A copy of `ln` whose last kernel argument is `arg` (e.g. a step's `advance` flag), PDL as `ln` had it."""
    import dataclasses

    out = dataclasses.replace(ln, args=ln.args[:-1] + (arg,), pdl=False, _pdl_launcher=None)
    if ln.pdl:
        out.enable_pdl()
    return out


def allow_dynamic_smem(fn, shmem: int) -> None:
    """Opt `fn` in to `shmem` bytes of dynamic shared memory when beyond the default 48 KB per block."""
    if shmem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = max(fn.max_dynamic_shared_size_bytes, shmem)


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
    rc = driver().cuTensorMapEncodeTiled(  # returns a CUresult (ctypes' default int)
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
    maps = cp.asarray(np.frombuffer(blob, dtype=np.uint8))
    cp.cuda.Device().synchronize()  # landed before any stream's kernel reads them (a pageable copy returns early)
    return maps
