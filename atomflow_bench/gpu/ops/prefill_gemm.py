"""The prefill projections (a chunk of M tokens through a layer's QKV, o_proj, gate/up or down at once): everything the
host knows about kernels_cu/prefill_gemm.cu — constants, the kernels by name, the grid, shared memory, the checks and
the launch factory.

Y [M][N] = X [M][K] . W^T over the weights in the decode GEMVs' TILED layout (ops/gemv.py tile_view, any pairing:
Y comes out in the row-major weight's row order), fp16 weights or fp8 with per-128-input group scales (W8A16: the
decode GEMV's group arithmetic). X fp16 [M][x_stride]; epilogues store16 (Y fp16), store32 (Y fp32), resid
(h [M][y_stride] fp32 += Y).
"""
from __future__ import annotations

import numpy as np

from ...config import GROUP
from ...errors import AtomflowError, VerifyError
from ..device import SMEM_H100, smem_limits
from ..launch import NULL, Launch, allow_dynamic_smem, i32
from ..nvrtc import KernelLib
from .gemv import check_tiled

# = the kernel's #defines (tests/test_op_constants.py reads them from the .cu file)
PG_THREADS = 256     # prefill_gemm.cu PG_THREADS: 8 warps, 4 (weight rows) x 2 (tokens)
PG_BM = 128          # prefill_gemm.cu PG_BM: weight rows per block (8 tiles of 16)
PG_BN = 128          # prefill_gemm.cu PG_BN: tokens per block
PG_BK = 128          # prefill_gemm.cu PG_BK: inputs per K step (one fp8 scale group)
PG_STAGES_F16 = 3    # prefill_gemm.cu PG_STAGES_F16: ring stages with fp16 weights
PG_STAGES_F8 = 4     # prefill_gemm.cu PG_STAGES_F8: ring stages with fp8 weights
EPILOGUES = ("store16", "store32", "resid")  # prefill_gemm.cu PG_EPI_STORE16 / STORE32 / RESID
CU_FILES = ("prefill_gemm.cu",)
CU_DEFINES = {"PG_THREADS": PG_THREADS, "PG_BM": PG_BM, "PG_BN": PG_BN, "PG_BK": PG_BK,
              "PG_STAGES_F16": PG_STAGES_F16, "PG_STAGES_F8": PG_STAGES_F8,
              **{f"PG_EPI_{e.upper()}": i for i, e in enumerate(EPILOGUES)}}
PAIRING_CODE = {"none": 0, "halves": 1, "rope": 2}  # prefill_gemm.cu pg_row
SMEM_HEADROOM = 1024  # static shared memory beside the dynamic (the timeline instrument's, the compiler's)
FORMATS = ("fp16", "fp8")


def gemm_kernel(fmt: str, epilogue: str) -> str:
    """prefill_gemm_{f16,f8}_{store16,store32,resid}."""
    return f"prefill_gemm_{'f8' if fmt == 'fp8' else 'f16'}_{epilogue}"


# The kernels this module launches, by the .cu that defines them (as ops/gemv.py KERNELS).
KERNELS = {"prefill_gemm.cu": tuple(gemm_kernel(f, e) for f in FORMATS for e in EPILOGUES)}


def original_row(tile: int, r: int, pairing: str, n: int, half: int = 0) -> int:
    """The row-major weight row that row r (0..15) of tile `tile` holds under `pairing` (ops/gemv.py _tile_rows): where
    the kernel's epilogue stores that row's outputs (prefill_gemm.cu pg_row, the same arithmetic)."""
    g, rh = r & 7, r >> 3
    if pairing == "halves":
        return rh * (n >> 1) + 8 * tile + g
    if pairing == "rope":
        head, i8 = divmod(tile, half >> 3)
        return head * 2 * half + rh * half + 8 * i8 + g
    return 16 * tile + r


def pg_stages(fmt: str) -> int:
    return PG_STAGES_F8 if fmt == "fp8" else PG_STAGES_F16


def pg_stage_bytes(fmt: str) -> int:
    """One ring stage: the X step [PG_BN][PG_BK] fp16, the block's weight step (PG_BM rows x PG_BK inputs) and, fp8,
    its scales (PG_BM x 4 bytes). 64 KB fp16, 48.5 KB fp8."""
    w = PG_BM * PG_BK * (1 if fmt == "fp8" else 2)
    return PG_BN * PG_BK * 2 + w + (PG_BM * 4 if fmt == "fp8" else 0)


def pg_smem(fmt: str) -> int:
    """Dynamic shared memory of a launch: the ring (192 KB fp16 at 3 stages, 194 KB fp8 at 4)."""
    return pg_stages(fmt) * pg_stage_bytes(fmt)


def pg_grid(m: int, n: int) -> tuple[int, int]:
    """(token blocks, weight blocks): blockIdx.x walks the tokens, so the blocks sharing a weight block run side by
    side and read it from DRAM once."""
    return -(-m // PG_BN), -(-n // PG_BM)


def pg_bytes(fmt: str, epilogue: str, m: int, n: int, k: int) -> int:
    """The least DRAM traffic: the weights (fp8: and scales) once, X once, Y written (resid: h read and written)."""
    w = n * k * 2 if fmt == "fp16" else n * k + n * (k // GROUP) * 4
    y = m * n * (2 if epilogue == "store16" else 4) * (2 if epilogue == "resid" else 1)
    return w + m * k * 2 + y


def pg_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def check_prefill_gemm(fmt: str, epilogue: str, m: int, n: int, k: int, x_stride: int, y_stride: int,
                       pairing: str = "none", half: int = 0, smem: tuple = SMEM_H100) -> None:
    """Refuses (one line) what the kernel does not take: an unknown format, epilogue or pairing, m < 1, N not whole
    tiles (pairing's rules as ops/gemv.py check_tiled), K not a multiple of PG_BK (SmolLM2's 576: the decode GEMVs
    take it, this kernel does not), an x stride that is not a multiple of 8 elements (the 16-byte copies) or narrower
    than K, a y stride narrower than N, or a ring larger than a block of this GPU (`smem`) may have."""
    if fmt not in FORMATS:
        raise AtomflowError(f"prefill GEMM: format {fmt!r} unsupported (fp16 or fp8)")
    if epilogue not in EPILOGUES:
        raise AtomflowError(f"prefill GEMM: epilogue {epilogue!r} unsupported ({', '.join(EPILOGUES)})")
    if m < 1:
        raise AtomflowError(f"prefill GEMM: needs m >= 1 tokens, got {m}")
    try:
        check_tiled(n, k, pairing, half)
    except VerifyError as e:
        raise AtomflowError(f"prefill GEMM: {e}") from None
    if k % PG_BK:
        raise AtomflowError(f"prefill GEMM: K {k} unsupported (a multiple of {PG_BK})")
    if x_stride % 8 or x_stride < k:
        raise AtomflowError(f"prefill GEMM: x_stride {x_stride} must be a multiple of 8 and at least K {k}")
    if y_stride < n:
        raise AtomflowError(f"prefill GEMM: y_stride {y_stride} must be at least N {n}")
    need = pg_smem(fmt) + SMEM_HEADROOM
    if need > smem[0]:
        raise AtomflowError(f"prefill GEMM {fmt} needs {need} bytes of shared memory per block (this GPU: {smem[0]})")


def _rows_ok(a, rows: int, cols: int, stride: int) -> bool:
    """`a` is a 2-D view of rows `stride` elements apart, or a flat buffer holding `rows` rows of the stride."""
    item = a.dtype.itemsize
    if a.ndim == 2:
        return a.shape[0] >= rows and a.shape[1] >= cols and a.strides == (item * stride, item)
    return a.ndim == 1 and a.strides == (item,) and a.size >= (rows - 1) * stride + cols


def _check_arrays(fmt: str, epilogue: str, w, scales, x, y, m: int, n: int, k: int, x_stride: int,
                  y_stride: int) -> None:
    """The arrays against the shape: weights [N][K] (fp16, or fp8 codes as uint8) and fp8 scales [N][K/128] fp32,
    both contiguous; x fp16 and y (fp16 for store16, else fp32) as _rows_ok; device pointers 16-byte aligned (NumPy
    arrays in the CPU tests have none)."""
    wdt = np.uint8 if fmt == "fp8" else np.float16
    if w.dtype != wdt or tuple(w.shape) != (n, k) or not w.flags.c_contiguous:
        raise AtomflowError(f"prefill GEMM: weights must be a contiguous [{n}, {k}] {np.dtype(wdt).name} array, got "
                            f"{w.dtype} {tuple(w.shape)}")
    if fmt == "fp8" and (scales is None or scales.dtype != np.float32 or tuple(scales.shape) != (n, k // GROUP)
                         or not scales.flags.c_contiguous):
        raise AtomflowError(f"prefill GEMM: fp8 needs contiguous float32 scales [{n}, {k // GROUP}]")
    ydt = np.float16 if epilogue == "store16" else np.float32
    for name, a, dt, rows, cols, stride in (("x", x, np.float16, m, k, x_stride), ("y", y, ydt, m, n, y_stride)):
        if a.dtype != dt:
            raise AtomflowError(f"prefill GEMM: {name} must be {np.dtype(dt).name} ({epilogue}), got {a.dtype}")
        if not _rows_ok(a, rows, cols, stride):
            raise AtomflowError(f"prefill GEMM: {name} {tuple(a.shape)} (strides {tuple(a.strides)} bytes) does not "
                                f"hold {rows} rows of {cols} elements {stride} apart")
    for name, a in (("weights", w), ("scales", scales), ("x", x)):
        ptr = getattr(getattr(a, "data", None), "ptr", None)
        if ptr is not None and ptr % 16:
            raise AtomflowError(f"prefill GEMM: {name} must start 16-byte aligned")


def prefill_gemm_launch(lib: KernelLib, fmt: str, w, scales, x, y, m: int, n: int, k: int, x_stride: int,
                        y_stride: int, epilogue: str, pairing: str = "none", half: int = 0, role: str = "",
                        smem: tuple | None = None, taps=None) -> Launch:
    """Y = X . W^T for the chunk's m tokens: w [n, k] in the tiled layout with `pairing` (half = head_dim / 2 for
    rope), fp8 `scales` [n, k / 128] tiled alike (None for fp16), x fp16 rows `x_stride` apart, y rows `y_stride`
    apart: fp16 (store16), fp32 (store32) or the residual h (resid: h += Y). `m` is a plain kernel argument, the
    grid covers it: a captured graph replays the chunk size it was captured with. `smem`: this GPU's shared memory
    limits (device.smem_limits, the default)."""
    check_prefill_gemm(fmt, epilogue, m, n, k, x_stride, y_stride, pairing, half,
                       smem_limits() if smem is None else smem)
    _check_arrays(fmt, epilogue, w, scales, x, y, m, n, k, x_stride, y_stride)
    fn = lib[gemm_kernel(fmt, epilogue)]
    shmem = pg_smem(fmt)
    allow_dynamic_smem(fn, shmem)
    return Launch(fn, f"prefill_gemm_{fmt}_{epilogue}", pg_grid(m, n), (PG_THREADS,),
                  (w, scales if fmt == "fp8" else NULL, x, y, i32(m), i32(n), i32(k), i32(x_stride), i32(y_stride),
                   i32(PAIRING_CODE[pairing]), i32(half)), shmem, taps or {}, pg_bytes(fmt, epilogue, m, n, k),
                  f"prefill gemm {fmt} {role or epilogue} {n}x{k} {m} rows")
