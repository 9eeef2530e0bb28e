"""A layer weight from the decode GEMV's tiled layout back to row-major fp16 (kernels_cu/untile.cu): the prefill's
staged form (gpu/prefill.py) fills its scratch with it before each GEMM."""
from __future__ import annotations

from ...errors import AtomflowError
from ..launch import Launch, i32
from ..nvrtc import KernelLib
from .gemv import check_tiled

UNTILE_THREADS = 256  # untile.cu UNTILE_THREADS
CU_FILES = ("untile.cu",)
CU_DEFINES = {"UNTILE_THREADS": UNTILE_THREADS}
KERNELS = {"untile.cu": ("untile_f16", "untile_f8")}
PAIRING_CODE = {"none": 0, "halves": 1, "rope": 2}  # untile.cu untile_row's `pairing`


def untile_launch(lib: KernelLib, fmt: str, w, scales, out, pairing: str, half: int) -> Launch:
    """out (fp16 [rows, K], row-major) = the tiled weight `w` (fp16, or fp8 codes with their tiled group `scales`
    dequantised as gpu/prefill.py row_major does)."""
    rows, k = w.shape
    check_tiled(rows, k, pairing, half)
    if out.shape != (rows, k):
        raise AtomflowError(f"untile: out {out.shape} for a weight of {(rows, k)}")
    per_piece = 8 if fmt == "fp16" else 16  # weights per 16-byte piece: one thread each
    grid = (-(-rows * k // per_piece // UNTILE_THREADS),)
    tail = (out, i32(rows), i32(k), i32(PAIRING_CODE[pairing]), i32(half))
    if fmt == "fp16":
        return Launch(lib["untile_f16"], "untile_f16", grid, (UNTILE_THREADS,), (w, *tail), 0, {}, rows * k * 4,
                      f"untile fp16 {rows}x{k}")
    return Launch(lib["untile_f8"], "untile_f8", grid, (UNTILE_THREADS,), (w, scales, *tail), 0, {},
                  rows * k * 3 + scales.nbytes, f"untile fp8 {rows}x{k}")
