"""The prefill's row-wise ops (kernels_cu/prefill_rows.cu) and its GEMMs (cuBLAS through CuPy): launch factories.

The GEMMs run on row-major fp16 layer weights (gpu/prefill.py: copies made once, or a scratch staged before each
GEMM): Y[M][N] = X[M][K] W^T by cublasGemmEx with fp32 accumulation, fp16 out, or (o_proj, down) fp32 out added into
the residual (beta = 1), so the residual is summed in fp32 as the decode step's epilogue does (a tensor-parallel
rank other than 0: stored, for the sum across ranks).
"""
from __future__ import annotations

import numpy as np

from ...errors import AtomflowError
from ..launch import Launch, i32
from ..nvrtc import KernelLib

PREFILL_THREADS = 256  # prefill_rows.cu PREFILL_THREADS
RMS_ROW_VECS = (4, 16)  # prefill_rows.cu rmsnorm_rows_<V>: float4s of its row a thread holds, the smallest that fits
CU_FILES = ("prefill_rows.cu",)
CU_DEFINES = {"PREFILL_THREADS": PREFILL_THREADS}
KERNELS = {"prefill_rows.cu": ("embed_rows", *(f"rmsnorm_rows_{v}" for v in RMS_ROW_VECS), "rope_kv_rows",
                               "swiglu_rows")}

# cublas_api.h / library_types.h
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUDA_R_32F, CUDA_R_16F = 0, 2
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1


def embed_rows_launch(lib: KernelLib, tokens, emb, h, m: int) -> Launch:
    H = emb.shape[1]
    return Launch(lib["embed_rows"], "embed_rows", (m,), (PREFILL_THREADS,), (tokens, emb, h, i32(H)), 0, {},
                  m * H * 6, f"prefill embed {m} rows")


SWIGLU_VEC = 8  # elements a thread of swiglu_rows: one 16-byte load of gate, of up, one store


def rmsnorm_rows_launch(lib: KernelLib, h, w, x, m: int, eps: float) -> Launch:
    H = w.shape[0]
    most = 4 * RMS_ROW_VECS[-1] * PREFILL_THREADS
    if H % 4 or H > most:
        raise AtomflowError(f"rmsnorm_rows holds a row in registers, 4 elements a load: hidden size {H} must be a "
                            f"multiple of 4 and at most {most}")
    v = next(v for v in RMS_ROW_VECS if H <= 4 * v * PREFILL_THREADS)
    return Launch(lib[f"rmsnorm_rows_{v}"], "rmsnorm_rows", (m,), (PREFILL_THREADS,),
                  (h, w, x, i32(H), np.float32(eps)), 0, {}, m * H * 6, f"prefill rmsnorm {m} rows")


def rope_kv_rows_launch(lib: KernelLib, qkv, cos_sin, k_cache, v_cache, n_q: int, n_kv: int, hd: int, start: int,
                        m: int) -> Launch:
    if hd % 4:
        raise AtomflowError(f"rope_kv_rows rotates two pairs a thread: head_dim {hd} is not a multiple of 4")
    return Launch(lib["rope_kv_rows"], "rope_kv_rows", (m,), (PREFILL_THREADS,),
                  (qkv, cos_sin, k_cache, v_cache, i32(n_q), i32(n_kv), i32(hd), i32(start)), 0, {},
                  m * (n_q + 2 * n_kv) * hd * 2 * 2, f"prefill rope + kv {m} rows")


def swiglu_rows_launch(lib: KernelLib, gu, act, m: int) -> Launch:
    inter = act.shape[-1]
    if inter % SWIGLU_VEC:
        raise AtomflowError(f"swiglu_rows reads {SWIGLU_VEC} elements a thread: intermediate size {inter} is not a "
                            f"multiple of {SWIGLU_VEC}")
    return Launch(lib["swiglu_rows"], "swiglu_rows", (-(-inter // (PREFILL_THREADS * SWIGLU_VEC)), m), (PREFILL_THREADS,),
                  (gu, act, i32(inter)), 0, {}, m * inter * 6, f"prefill swiglu {m} rows")


def libcublas():
    """The cuBLAS library CuPy loaded, through ctypes: CuPy's own binding refuses every call while a stream is being
    captured, and the prefill captures its chunks into graphs (cuBLAS itself supports capture)."""
    import ctypes

    from cupy_backends.cuda.libs import cublas  # noqa: F401  (loads the library into the process first)

    for name in ("libcublas.so.13", "libcublas.so.12", "libcublas.so"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise AtomflowError("cuBLAS not found (libcublas.so.13 / .12)")
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.cublasSetStream_v2.argtypes = [p, p]
    lib.cublasGemmEx.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
    return lib


class Gemm:
    """Y[M][N] (+)= X[M][K] W[N][K]^T on cuBLAS (gemmEx: fp16 inputs, fp32 accumulation), on CuPy's current
    stream; Y fp16 or fp32 (its dtype). `accumulate`: Y is fp32 and the product is added to it (beta = 1), else Y is
    overwritten (fp32: a tensor-parallel rank's partial product of o_proj or down)."""

    def __init__(self):
        import cupy

        self._lib = libcublas()
        self._cupy = cupy
        self._one = np.ones(1, np.float32)
        self._zero = np.zeros(1, np.float32)

    def __call__(self, x, w, y, m: int, accumulate: bool = False) -> None:
        n, k = w.shape
        out32 = y.dtype == np.float32
        if accumulate and not out32:
            raise AtomflowError(f"GEMM accumulating into {y.dtype}: fp32 only")
        lib = self._lib
        handle = self._cupy.cuda.device.get_cublas_handle()
        rc = lib.cublasSetStream_v2(handle, self._cupy.cuda.get_current_stream().ptr)
        # row-major Y = X W^T is column-major Y^T = W X^T: A = W (row-major [N][K] read transposed), B = X
        rc = rc or lib.cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, self._one.ctypes.data, w.data.ptr,
                                    CUDA_R_16F, k, x.data.ptr, CUDA_R_16F, k,
                                    (self._one if accumulate else self._zero).ctypes.data, y.data.ptr,
                                    CUDA_R_32F if out32 else CUDA_R_16F, n, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT)
        if rc:
            raise AtomflowError(f"cublasGemmEx failed (cublasStatus {rc}) for [{m}, {k}] x [{n}, {k}]^T")
