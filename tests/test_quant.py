"""FP8-E4M3 W8A16 quantizer against an independent, brute-force E4M3 round-to-nearest-even in pure NumPy."""
from __future__ import annotations

import math

import numpy as np
import pytest

from atomflow_bench.config import GROUP
from atomflow_bench.quant import dequantize_fp8, e4m3_decode, e4m3_encode, quantize_fp8


# ---- independent reference: decode the 256 codes by hand, pick the nearest, ties to even -------------
def _code_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man / 8 * 2.0 ** -6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


CODE_VALUES = np.array([_code_value(c) for c in range(256)])
POS_CODES = np.arange(0x7F)           # 0x00..0x7E: the finite non-negative codes, increasing in value
POS_VALUES = CODE_VALUES[POS_CODES]


def ref_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> E4M3 code by exhaustive nearest search; saturate at 448; ties to the even code; sign kept."""
    x = np.asarray(x, dtype=np.float32).ravel()
    out = np.empty(x.size, dtype=np.uint8)
    for s in range(0, x.size, 8192):
        a = np.minimum(np.abs(x[s:s + 8192]).astype(np.float64), 448.0)
        dist = np.abs(a[:, None] - POS_VALUES[None, :])
        best = dist.min(axis=1, keepdims=True)
        tied = dist == best                                  # one or two adjacent codes
        even = tied & (POS_CODES[None, :] % 2 == 0)
        pick = np.where(even.any(axis=1), even.argmax(axis=1), tied.argmax(axis=1))
        out[s:s + 8192] = POS_CODES[pick] | (np.signbit(x[s:s + 8192]).astype(np.uint8) << 7)
    return out


def ref_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The documented algorithm, written out group by group."""
    w32 = np.asarray(w).astype(np.float32)
    n, k = w32.shape
    q = np.empty((n, k), np.uint8)
    scales = np.empty((n, math.ceil(k / GROUP)), np.float32)
    for g, c0 in enumerate(range(0, k, GROUP)):
        blk = w32[:, c0:c0 + GROUP]
        scale = np.abs(blk).max(axis=1) / np.float32(448.0)
        scale = np.where(scale == 0, np.float32(1.0), scale).astype(np.float32)
        q[:, c0:c0 + GROUP] = ref_encode(blk / scale[:, None]).reshape(blk.shape)
        scales[:, g] = scale
    return q, scales


def test_reference_decoding_table():
    assert CODE_VALUES[0x7E] == 448.0 and CODE_VALUES[0x01] == 2.0 ** -9 and CODE_VALUES[0x08] == 2.0 ** -6
    assert np.isnan(CODE_VALUES[0x7F]) and np.isnan(CODE_VALUES[0xFF])
    assert np.all(np.diff(POS_VALUES) > 0)
    # ml_dtypes agrees with the hand-written table on every code
    np.testing.assert_array_equal(e4m3_decode(np.arange(256, dtype=np.uint8)), CODE_VALUES.astype(np.float32))


# ---- the element cast ---------------------------------------------------------------------------
def _halfway_points() -> np.ndarray:
    mids = (POS_VALUES[:-1] + POS_VALUES[1:]) / 2
    return np.concatenate([mids, -mids]).astype(np.float32)


def test_encode_ties_to_even():
    x = _halfway_points()
    mids = (POS_VALUES[:-1] + POS_VALUES[1:]) / 2
    assert np.all(x.astype(np.float64) == np.concatenate([mids, -mids]))  # midpoints are exact in float32
    got = e4m3_encode(x)
    np.testing.assert_array_equal(got, ref_encode(x))
    assert np.all(got & 1 == 0)  # every exact tie lands on an even mantissa


def test_encode_subnormals_and_zero():
    x = np.array([0.0, -0.0, 2**-10, 3 * 2**-10, 5 * 2**-10, 2**-11, 2**-20, -2**-11, 2**-9, 7 * 2**-9,
                  2**-6 - 2**-10, 1e-30, -1e-30], dtype=np.float32)
    got = e4m3_encode(x)
    np.testing.assert_array_equal(got, ref_encode(x))
    assert got[0] == 0x00 and got[1] == 0x80           # signed zero kept, as the CUDA cast does
    assert got[2] == 0x00 and got[3] == 0x02 and got[4] == 0x02  # 2^-10 -> 0, 3*2^-10 -> 2^-8, 5*2^-10 -> 2^-8


def test_encode_saturates_never_nan():
    x = np.array([448, 448.5, 449, 463.9, 464, 464.1, 480, 1e6, 3e38, -449, -464.1, -3e38], np.float32)
    got = e4m3_encode(x)
    np.testing.assert_array_equal(got, [0x7E] * 9 + [0xFE] * 3)
    # the reason for clipping: ml_dtypes alone turns large finite values into NaN
    import ml_dtypes
    assert np.isnan(np.float32(480).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))


def test_encode_random_matches_reference():
    rng = np.random.default_rng(1)
    x = np.concatenate([
        rng.uniform(-460, 460, 50_000),
        rng.standard_normal(50_000) * 10.0 ** rng.uniform(-5, 2.6, 50_000),
    ]).astype(np.float32)
    np.testing.assert_array_equal(e4m3_encode(x), ref_encode(x))


# ---- the matrix quantizer -----------------------------------------------------------------------
def _weights(rng, n, k, kind="normal"):
    if kind == "normal":
        w = rng.standard_normal((n, k)) * 0.02
    elif kind == "heavy":  # per-row magnitudes over many decades plus outliers
        w = rng.standard_t(2, (n, k)) * 10.0 ** rng.uniform(-4, 0, (n, 1))
    else:
        raise ValueError(kind)
    return w.astype(np.float16)


@pytest.mark.parametrize("k", [3072, 8192, 576, 1536, 100, 200, 1])
def test_quantize_bit_exact_against_reference(k):
    rng = np.random.default_rng(k)
    for kind in ("normal", "heavy"):
        w = _weights(rng, 6, k, kind)
        q, s = quantize_fp8(w)
        rq, rs = ref_quantize(w)
        assert q.dtype == np.uint8 and q.shape == (6, k)
        assert s.dtype == np.float32 and s.shape == (6, math.ceil(k / GROUP))
        np.testing.assert_array_equal(s, rs)
        np.testing.assert_array_equal(q, rq)
        assert not np.any((q & 0x7F) == 0x7F), "NaN code produced"


def test_quantize_halfway_and_subnormal_groups():
    # amax 448 makes scale exactly 1.0, so every element meets the cast unchanged (all values exact in fp16)
    mids = (POS_VALUES[:-1] + POS_VALUES[1:]) / 2
    row = np.concatenate([[448.0], mids, -mids[:100], [2**-12, -2**-12, 0.0, -0.0]])
    k = len(row)
    w = np.stack([row, row[::-1]]).astype(np.float16)
    assert np.all(w.astype(np.float64)[0] == row)
    q, s = quantize_fp8(w)
    assert s[0, 0] == 1.0
    rq, rs = ref_quantize(w)
    np.testing.assert_array_equal(q, rq)
    np.testing.assert_array_equal(s, rs)
    np.testing.assert_array_equal(q[0, 1:len(mids) + 1] & 1, 0)  # ties to even
    assert k % GROUP != 0


def test_quantize_amax_overshoot_saturates():
    # amax / (amax / 448) rounds above 448 in float32 for some fp16 amax: must give 0x7E, never NaN
    amaxes = np.arange(1, 30000, dtype=np.uint16).view(np.float16)
    amaxes = amaxes[np.isfinite(amaxes) & (amaxes > 0)]
    a32 = amaxes.astype(np.float32)
    over = a32 / (a32 / np.float32(448.0)) > 448.0
    assert over.any()
    w = np.zeros((int(over.sum()), GROUP), np.float16)
    w[:, 0] = amaxes[over]
    w[:, 1] = -amaxes[over]
    q, _ = quantize_fp8(w)
    assert np.all(q[:, 0] == 0x7E) and np.all(q[:, 1] == 0xFE)


def test_zero_rows_and_groups():
    w = np.zeros((3, 300), np.float16)
    w[1, 130:140] = 0.5  # row 1: only its second group is non-zero
    q, s = quantize_fp8(w)
    assert np.all(q[0] == 0) and np.all(s[0] == 1.0)
    assert s[1, 0] == 1.0 and s[1, 1] == np.float32(0.5) / np.float32(448) and s[1, 2] == 1.0
    assert not np.isnan(dequantize_fp8(q, s)).any()
    np.testing.assert_array_equal(dequantize_fp8(q, s), w.astype(np.float32))


def test_rejects_non_finite():
    w = np.ones((2, 8), np.float16)
    w[1, 3] = np.inf
    with pytest.raises(ValueError):
        quantize_fp8(w)


@pytest.mark.parametrize("k", [3072, 8192, 576, 1536, 100])
def test_dequantize_error_bound(k):
    """|w - dq| <= 2^-4 |w| (normal range) + 2^-10 scale (subnormal range), with float32 rounding slack."""
    rng = np.random.default_rng(100 + k)
    for kind in ("normal", "heavy"):
        w = _weights(rng, 16, k, kind)
        q, s = quantize_fp8(w)
        dq = dequantize_fp8(q, s)
        assert dq.dtype == np.float32 and dq.shape == w.shape and np.isfinite(dq).all()
        w64 = w.astype(np.float64)
        scale = np.repeat(s.astype(np.float64), GROUP, axis=1)[:, :k]
        err = np.abs(w64 - dq)
        bound = (2.0 ** -4 * np.abs(w64) + 2.0 ** -10 * scale) * (1 + 2.0 ** -20)
        assert np.all(err <= bound), float((err / bound).max())
        # per group: the largest error is at most 2^-4 of the group's amax
        amax = np.repeat(s.astype(np.float64) * 448.0, GROUP, axis=1)[:, :k]
        assert np.all(err <= 2.0 ** -4 * amax * (1 + 2.0 ** -20))
        # the group maximum itself is reproduced to float32 rounding (it maps to exactly ±448)
        rows = np.arange(16)
        for c0 in range(0, k, GROUP):
            blk = np.abs(w64[:, c0:c0 + GROUP])
            j = c0 + blk.argmax(axis=1)
            np.testing.assert_allclose(np.abs(dq[rows, j]), blk.max(axis=1), rtol=1e-6)


def test_dequantize_k_trims_and_validates():
    rng = np.random.default_rng(5)
    w = _weights(rng, 4, 256)
    q, s = quantize_fp8(w)
    np.testing.assert_array_equal(dequantize_fp8(q, s, k=200), dequantize_fp8(q, s)[:, :200])
    with pytest.raises(ValueError):
        dequantize_fp8(q, s[:, :1])
    with pytest.raises(ValueError):
        dequantize_fp8(q, s, k=257)


def test_row_chunking_matches_single_pass(monkeypatch):
    import atomflow_bench.quant as quant
    rng = np.random.default_rng(9)
    w = _weights(rng, 37, 1000, "heavy")
    q1, s1 = quantize_fp8(w)
    monkeypatch.setattr(quant, "_CHUNK_ELEMS", 3000)  # forces 2-3 rows per chunk
    q2, s2 = quant.quantize_fp8(w)
    np.testing.assert_array_equal(q1, q2)
    np.testing.assert_array_equal(s1, s2)
    np.testing.assert_array_equal(quant.dequantize_fp8(q1, s1), dequantize_fp8(q1, s1))
