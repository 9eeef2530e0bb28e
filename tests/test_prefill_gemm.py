"""The prefill GEMM (kernels_cu/prefill_gemm.cu) and its op module (gpu/ops/prefill_gemm.py).

CPU: the constants and kernel names, the grid, the shared memory (a block fits an H100/H200's 227 KB; an sm_89 GPU's
99 KB is refused in one line), the bytes, the one-line refusals of what the kernel does not take, the launch the
factory builds, the epilogue's row mapping against the tiled layout's own row order (ops/gemv.py tile_view) for
every pairing, and the error bound on a NumPy model of the kernel's fp32 accumulation.

GPU (@pytest.mark.gpu, skipped without a device): the kernel against float64 NumPy from the same fp16 inputs (fp8:
the dequantised weights, quant.dequantize_fp8, as tests/test_kernels_gpu.py's GEMV tests; the weights are its
gemv_weights, tiled as the loader writes them), M in {1, 7, 64, 100, 512}, the catalog layers' shapes (3B's o_proj
3072x3072, gate/up 16384x3072 with the halves pairing, down 3072x8192, QKV 5120x3072 with the rope pairing), both
formats, every epilogue. Fresh random inputs every run (the seed is printed). y is NaN-poisoned (resid: random h)
before the launch, one row longer than the chunk and wider than N: every element of the chunk's [M][N] is checked,
the row past the chunk and the columns past N must stay untouched; x rows are `x_stride` apart with NaN between.
A replay gives the identical result.

Error bound, every element, S = sum_k |x_k| |w_k| (the row's |w|.|x| sum, float64): products are exact (fp16 x fp16,
E4M3 -> fp16 exact, into fp32); each mma adds 16 products to the fp32 sum, and a tensor core aligns the 17 terms
to the largest before adding, truncating: each loses < 2^-23 of the step's largest magnitude, itself <= S, so the
K/16 steps lose < 17 (K/16) 2^-23 S ~ K 2^-23 S (9.8e-4 S at K = 8192, 3.7e-4 S at K = 3072). fp8 adds one
fp32 rounding per group for d * scale and the running sum's fmaf (K/128 of them, 2^-24 S each) and the reference's
fp32 dequantisation (2^-24 S): under 2 K/128 2^-24 S, folded in as K 2^-22 S in all. store16 rounds Y to fp16
(2^-11 |Y| <= 2^-11 S); resid rounds h + Y in fp32 (2^-24 |h + Y|). Bound = K 2^-22 S + those. The relative L2
error is also held to tests/test_kernels_gpu.py's bounds (fp32 outputs 1e-4, fp16 2e-3), which catches a wrong
element far below the worst case.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from atomflow_bench.errors import AtomflowError
from atomflow_bench.gpu.device import SMEM_H100, SMEM_SM89, blocks_fit
from atomflow_bench.gpu.ops.gemv import _tile_rows
from atomflow_bench.gpu.ops.prefill_gemm import (EPILOGUES, KERNELS, PG_BK, PG_BM, PG_BN, PG_THREADS, SMEM_HEADROOM,
                                                 check_prefill_gemm, gemm_kernel, original_row, pg_bytes, pg_grid,
                                                 pg_smem, pg_stage_bytes, pg_stages, prefill_gemm_launch)

# conftest.compiled_kernels compiles these before the first GPU test
KERNEL_BUILDS = [(None, (), ("prefill_gemm.cu",))]
FP16_TOL, FP32_TOL = 2e-3, 1e-4  # relative L2 error (tests/test_kernels_gpu.py)


def bound(k: int, epilogue: str, s: np.ndarray, ref: np.ndarray, h0=None) -> np.ndarray:
    """The per-element error bound of the module docstring."""
    out = k * 2.0 ** -22 * s
    if epilogue == "store16":
        out = out + 2.0 ** -11 * s
    if epilogue == "resid":
        out = out + 2.0 ** -24 * np.abs(h0 + ref)
    return out


# ---- CPU ------------------------------------------------------------------------------------------------------------
def test_constants_and_kernel_names():
    assert PG_THREADS == 8 * 32 and PG_BM == 4 * 2 * 16 and PG_BN == 2 * 64 and PG_BK == 128  # 4 x 2 warps
    assert KERNELS == {"prefill_gemm.cu": tuple(f"prefill_gemm_{f}_{e}" for f in ("f16", "f8")
                                                for e in ("store16", "store32", "resid"))}
    assert gemm_kernel("fp8", "store32") == "prefill_gemm_f8_store32"
    assert gemm_kernel("fp16", "resid") == "prefill_gemm_f16_resid"


@pytest.mark.parametrize("m, n, grid", [(1, 16, (1, 1)), (7, 3072, (1, 24)), (128, 128, (1, 1)), (129, 144, (2, 2)),
                                        (512, 16384, (4, 128)), (2048, 5120, (16, 40))])
def test_grid(m, n, grid):
    """A block per 128 tokens (x) and 128 weight rows (y); partial blocks at both ends."""
    assert pg_grid(m, n) == grid


def test_shared_memory_fits_h100_and_h200():
    """The ring: 3 stages of 64 KB (fp16), 4 of 48.5 KB (fp8); one block per SM of an H100/H200 (227 KB)."""
    assert pg_stage_bytes("fp16") == 128 * 128 * 2 + 128 * 128 * 2 and pg_stages("fp16") == 3
    assert pg_stage_bytes("fp8") == 128 * 128 * 2 + 128 * 128 + 128 * 4 and pg_stages("fp8") == 4
    assert pg_smem("fp16") == 196608 and pg_smem("fp8") == 198656
    for fmt in ("fp16", "fp8"):
        assert pg_smem(fmt) + SMEM_HEADROOM <= SMEM_H100[0] and blocks_fit(pg_smem(fmt) + SMEM_HEADROOM, SMEM_H100) == 1
        check_prefill_gemm(fmt, "store16", 512, 3072, 3072, 3072, 3072, smem=SMEM_H100)
        with pytest.raises(AtomflowError, match=f"needs {pg_smem(fmt) + SMEM_HEADROOM} bytes of shared memory") as e:
            check_prefill_gemm(fmt, "store16", 512, 3072, 3072, 3072, 3072, smem=SMEM_SM89)
        assert "\n" not in str(e.value)


def test_bytes_moved():
    assert pg_bytes("fp16", "store16", 10, 32, 256) == 32 * 256 * 2 + 10 * 256 * 2 + 10 * 32 * 2
    assert pg_bytes("fp8", "store32", 10, 32, 256) == 32 * 256 + 32 * 2 * 4 + 10 * 256 * 2 + 10 * 32 * 4
    assert pg_bytes("fp8", "resid", 10, 32, 256) == 32 * 256 + 32 * 2 * 4 + 10 * 256 * 2 + 10 * 32 * 4 * 2


@pytest.mark.parametrize("pairing, rows, half", [("none", 64, 0), ("halves", 96, 0), ("rope", 256, 64),
                                                 ("rope", 192, 32)])
def test_epilogue_row_mapping_is_the_tiled_layouts(pairing, rows, half):
    """original_row (= the kernel's pg_row) inverts the tiled layout's row order: tile T's row rh*8 + g of
    ops/gemv.py _tile_rows is the row-major row original_row(T, rh*8 + g); every row exactly once."""
    view = _tile_rows(np.arange(rows)[:, None], pairing, half).reshape(rows // 16, 16)
    got = np.array([[original_row(t, r, pairing, rows, half) for r in range(16)] for t in range(rows // 16)])
    np.testing.assert_array_equal(got, view)
    assert sorted(got.ravel()) == list(range(rows))


class _NoLib:
    """A KernelLib stand-in that fails the test if the factory asks it for a kernel (it must refuse before)."""

    def __getitem__(self, name):
        raise AssertionError(f"the factory asked for {name} before refusing")


def _arrays(fmt="fp8", epilogue="store16", m=10, n=256, k=384, x_stride=None, y_stride=None):
    w = np.zeros((n, k), np.uint8 if fmt == "fp8" else np.float16)
    s = np.zeros((n, k // 128), np.float32) if fmt == "fp8" else None
    x = np.zeros((m, x_stride or k), np.float16)
    y = np.zeros((m, y_stride or n), np.float16 if epilogue == "store16" else np.float32)
    return w, s, x, y


@pytest.mark.parametrize("change, match", [
    ({"fmt": "int4"}, "format 'int4' unsupported"),
    ({"epilogue": "swiglu"}, "epilogue 'swiglu' unsupported"),
    ({"m": 0}, "needs m >= 1"),
    ({"n": 72}, r"rows % 16 == 0"),
    ({"k": 576}, "K 576 unsupported"),
    ({"x_stride": 388}, "x_stride 388 must be a multiple of 8"),
    ({"x_stride": 256}, "x_stride 256 must be a multiple of 8 and at least K 384"),
    ({"y_stride": 200}, "y_stride 200 must be at least N 256"),
    ({"pairing": "rope", "half": 12}, "RoPE tiles need"),
    ({"smem": SMEM_SM89}, "bytes of shared memory per block"),
    ({"w_dtype": np.float16}, r"weights must be a contiguous \[256, 384\] uint8 array"),
    ({"no_scales": True}, "fp8 needs contiguous float32 scales"),
    ({"y_dtype": np.float32}, "y must be float16 \\(store16\\)"),
    ({"x_rows": 9}, r"x \(9, 384\)"),
])
def test_refuses_in_one_line(change, match):
    args = {"fmt": "fp8", "epilogue": "store16", "m": 10, "n": 256, "k": 384, "x_stride": 384, "y_stride": 256,
            "pairing": "none", "half": 0}
    args.update({k: v for k, v in change.items() if k in args})
    w, s, x, y = _arrays("fp8" if args["fmt"] == "int4" else args["fmt"], "store16", 10, 256, 384)
    if "w_dtype" in change:
        w = w.astype(change["w_dtype"])
    if change.get("no_scales"):
        s = None
    if "y_dtype" in change:
        y = y.astype(change["y_dtype"])
    if "x_rows" in change:
        x = x[:change["x_rows"]]
    with pytest.raises(AtomflowError, match=match) as err:
        prefill_gemm_launch(_NoLib(), args["fmt"], w, s, x, y, args["m"], args["n"], args["k"], args["x_stride"],
                            args["y_stride"], args["epilogue"], args["pairing"], args["half"],
                            smem=change.get("smem", SMEM_H100))
    assert "\n" not in str(err.value)


def test_launch_the_factory_builds():
    """Grid, block, shared memory (opted in), arguments (x a view of a wider buffer), bytes and label."""
    m, n, k = 100, 5120, 3072
    w, s, _, _ = _arrays("fp8", "store16", m, n, k)
    xbuf = np.zeros((m, k + 64), np.float16)
    y = np.zeros((m, n), np.float16)
    fn = SimpleNamespace(max_dynamic_shared_size_bytes=0)
    ln = prefill_gemm_launch({gemm_kernel("fp8", "store16"): fn}, "fp8", w, s, xbuf[:, :k], y, m, n, k, k + 64, n,
                             "store16", "rope", 64, role="wqkv", smem=SMEM_H100)
    assert ln.fn is fn and ln.grid == (1, 40) and ln.block == (PG_THREADS,) and ln.shmem == pg_smem("fp8")
    assert fn.max_dynamic_shared_size_bytes == pg_smem("fp8")
    assert [int(a) for a in ln.args[4:]] == [m, n, k, k + 64, n, 2, 64]
    assert ln.bytes_moved == pg_bytes("fp8", "store16", m, n, k)
    assert ln.label == "prefill gemm fp8 wqkv 5120x3072 100 rows" and ln.name == "prefill_gemm_fp8_store16"
    ln16 = prefill_gemm_launch({gemm_kernel("fp16", "resid"): fn}, "fp16", *_arrays("fp16", "resid", 7, 256, 256),
                               7, 256, 256, 256, 256, "resid", smem=SMEM_H100)
    assert int(ln16.args[1]) == 0 and ln16.grid == (1, 2)  # no scales: a null pointer


def kernel_model(fmt: str, x16: np.ndarray, w: np.ndarray, scales: np.ndarray | None = None) -> np.ndarray:
    """The kernel's accumulation in NumPy (not its code): exact products, each 16-input k-tile's sum added to the fp32
    sum (rounded to nearest: the model of a correctly rounding tensor core); fp8: per 128-input group d in fp32, then
    fmaf(d, scale, acc)."""
    x = x16.astype(np.float64)
    m, k = x.shape
    acc = np.zeros((m, w.shape[0]), np.float32)
    d = np.zeros_like(acc)
    for k0 in range(0, k, 16):
        d = (d.astype(np.float64) + x[:, k0:k0 + 16] @ w[:, k0:k0 + 16].T).astype(np.float32)
        if scales is not None and (k0 + 16) % 128 == 0:
            acc = (acc.astype(np.float64) + d.astype(np.float64) * scales[:, k0 // 128]).astype(np.float32)
            d[:] = 0
    return acc if scales is not None else d


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_error_bound_holds_for_the_models_roundings(fmt):
    """The stated bound has ample room for fp32 accumulation (store32 on a model of the kernel's sums)."""
    from atomflow_bench.quant import dequantize_fp8, e4m3_decode, quantize_fp8

    rng = np.random.default_rng(7)
    m, n, k = 9, 32, 1024
    w16 = (rng.standard_normal((n, k), dtype=np.float32) * 0.02).astype(np.float16)
    x16 = rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)
    if fmt == "fp8":
        q, sc = quantize_fp8(w16)
        got = kernel_model(fmt, x16, e4m3_decode(q).astype(np.float64), sc.astype(np.float64))
        w_eff = dequantize_fp8(q, sc).astype(np.float64)
    else:
        w_eff = w16.astype(np.float64)
        got = kernel_model(fmt, x16, w_eff)
    ref = x16.astype(np.float64) @ w_eff.T
    s = np.abs(x16.astype(np.float64)) @ np.abs(w_eff).T
    err = np.abs(got - ref)
    assert (err <= bound(k, "store32", s, ref) / 16).all(), (err / s).max()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < FP32_TOL / 10


# ---- GPU ------------------------------------------------------------------------------------------------------------
_abs_w: dict = {}


def check_gemm(kernel_lib, fmt: str, n: int, k: int, m: int, epilogue: str, pairing: str = "none", half: int = 0,
               x_pad: int = 0, y_pad: int = 8) -> None:
    """One launch against the float64 reference (the module docstring's checks), then a replay."""
    import cupy as cp
    from test_kernels_gpu import gemv_weights, rng_for

    w_dev, s_dev, w_eff = gemv_weights(fmt, n, k, pairing, half)
    key = (fmt, n, k, pairing, half)
    if key not in _abs_w:  # the catalog shapes' |w| take ~1.4 GB of host memory in all
        _abs_w[key] = np.abs(w_eff)
    rng = rng_for("prefill_gemm", fmt, n, k, m, epilogue, pairing)
    x_stride, y_stride = k + x_pad, n + y_pad
    x = np.full((m + 2, x_stride), np.nan, np.float16)
    x[:m, :k] = rng.standard_normal((m, k), dtype=np.float32) * rng.uniform(0.5, 2)
    x64 = x[:m, :k].astype(np.float64)
    ref = x64 @ w_eff.T
    s = np.abs(x64) @ _abs_w[key].T
    if epilogue == "resid":
        h0 = rng.standard_normal((m + 1, y_stride), dtype=np.float32)
        y_dev = cp.asarray(h0)
    else:
        h0 = None
        y_dev = cp.full((m + 1, y_stride), np.nan, dtype=cp.float16 if epilogue == "store16" else cp.float32)
    launch = prefill_gemm_launch(kernel_lib, fmt, w_dev, s_dev, cp.asarray(x), y_dev, m, n, k, x_stride, y_stride,
                                 epilogue, pairing, half)
    launch()
    first = y_dev.get()
    if epilogue == "resid":
        assert np.array_equal(first[:, n:], h0[:, n:]) and np.array_equal(first[m:], h0[m:]), "h written outside"
        got = first[:m, :n].astype(np.float64) - h0[:m, :n]
    else:
        assert np.isnan(first[:, n:]).all() and np.isnan(first[m:]).all(), "written outside the chunk's [M][N]"
        got = first[:m, :n].astype(np.float64)
    assert np.isfinite(got).all(), f"{np.count_nonzero(~np.isfinite(got))} elements unwritten or not finite"
    err = np.abs(got - ref)
    lim = bound(k, epilogue, s, ref, None if h0 is None else h0[:m, :n].astype(np.float64))
    worst = np.unravel_index((err / lim).argmax(), err.shape)
    assert (err <= lim).all(), (f"|err| {err[worst]:.3g} > bound {lim[worst]:.3g} (S {s[worst]:.3g}) at token "
                                f"{worst[0]}, row {worst[1]}; {np.count_nonzero(err > lim)} elements over")
    tol = FP16_TOL if epilogue == "store16" else FP32_TOL
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel <= tol, f"relative L2 error {rel:.3g} > {tol}"
    if epilogue != "resid":
        y_dev.fill(np.nan)
        launch()  # a replay gives the identical result
        np.testing.assert_array_equal(y_dev.get(), first)


# 3B's layers: o_proj, gate/up (halves), down; every M with the epilogues in rotation
LAYERS = [(3072, 3072, "none"), (16384, 3072, "halves"), (3072, 8192, "none")]
MS = [1, 7, 64, 100, 512]


@pytest.mark.gpu
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n, k, pairing", LAYERS, ids=["o_proj", "gate_up", "down"])
@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_prefill_gemm_layers(kernel_lib, fmt, n, k, pairing, m):
    epilogue = EPILOGUES[(MS.index(m) + [lay[0:2] for lay in LAYERS].index((n, k))) % 3]
    check_gemm(kernel_lib, fmt, n, k, m, epilogue, pairing)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_prefill_gemm_every_epilogue(kernel_lib, fmt, epilogue):
    check_gemm(kernel_lib, fmt, 3072, 3072, 100, epilogue)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("m", [64, 300])
def test_prefill_gemm_qkv_rope_pairing(kernel_lib, fmt, m):
    """3B's QKV (head_dim 128) in the rope pairing: Y in the row-major q|k|v order."""
    check_gemm(kernel_lib, fmt, 5120, 3072, m, "store16", "rope", 64)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("epilogue", EPILOGUES)
def test_prefill_gemm_partial_blocks_and_strides(kernel_lib, fmt, epilogue):
    """N = 400 (25 tiles: the last block holds one), K = 256 (2 steps, fewer than the ring's stages), 130 tokens (a
    second block of 2), x rows 24 elements apart beyond K, y 40 beyond N."""
    check_gemm(kernel_lib, fmt, 400, 256, 130, epilogue, x_pad=24, y_pad=40)
