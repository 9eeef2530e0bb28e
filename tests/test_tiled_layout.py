"""The tiled weight layout of the layer GEMVs (weights.tile_view) against the PTX ISA's mma.m16n8k16 fragment
layout, on the CPU: every byte the kernel (kernels_cu/gemv_tiled.cuh) hands to an mma as fragment
element a_i of lane l must be the weight at the (row, column) the ISA assigns to that element, for every
pairing of rows the epilogues rely on; and the fragment-ordered x in shared memory must give each lane the
B elements the ISA assigns to it.

PTX ISA, "Matrix fragments for mma.m16n8k16 with floating point type" (f16 A, row-major):
  groupID = lane / 4, t = lane % 4;  a0,a1: (row groupID, col 2t, 2t+1)   a2,a3: (row groupID+8, col 2t, 2t+1)
                                      a4,a5: (row groupID, col 2t+8, +9)   a6,a7: (row groupID+8, col 2t+8, +9)
  B (16x8, "col"): b0,b1: (k 2t, 2t+1; n groupID)   b2,b3: (k 2t+8, 2t+9; n groupID)
Kernel convention checked here: fp16 unit = one k-tile, lane's 16 bytes = a0..a7 in order; fp8 unit = two
k-tiles, lane's bytes 8j..8j+7 = a0..a7 of k-tile j (cvt fp8x2 -> half2 puts the low byte in the low half).
"""
from __future__ import annotations

import numpy as np
import pytest

from atomflow_bench.gpu.arena import plan_arena
from atomflow_bench.config import ModelConfig
from atomflow_bench.errors import AtomflowError, VerifyError
from atomflow_bench.gpu.ops.gemv import ROLE_PAIRING, check_tiled, tiled, tiled_scales

A_ELEM = [(0, 0), (0, 1), (8, 0), (8, 1), (0, 8), (0, 9), (8, 8), (8, 9)]  # a_i -> (row - groupID, col - 2t)


def weight_row(pairing: str, tile: int, r: int, rows: int, half: int) -> int:
    """The weight row the kernel's epilogue treats as tile row r (gemv_tiled.cuh gemv_tiled + gemv_epilogue.cuh gemv_epilogue)."""
    if pairing == "none":
        return tile * 16 + r  # output tile*16 + r
    o, rh = tile * 8 + r % 8, r // 8  # output o: acc0 = tile row r (< 8), acc1 = tile row r + 8
    if pairing == "halves":
        return o + rh * (rows // 2)  # gate row o, up row o + n_out
    return (o // half) * 2 * half + o % half + rh * half  # RoPE pair: rows i and i + hd/2 of head o // half


def untile_by_isa(t: np.ndarray, fmt: str, pairing: str, half: int) -> np.ndarray:
    """Row-major weights rebuilt from the tiled bytes using only the ISA fragment map."""
    rows, k = t.shape
    ku = 32 if fmt == "fp8" else 16
    flat = t.reshape(-1)
    out = np.full_like(t, 0)
    seen = np.zeros(t.shape, bool)
    per_lane = 16 if fmt == "fp8" else 8  # elements per lane per unit
    for tile in range(rows // 16):
        for u in range(k // ku):
            for lane in range(32):
                g, tq = lane // 4, lane % 4
                base = ((tile * (k // ku) + u) * 32 + lane) * per_lane
                for e in range(per_lane):
                    j, i = divmod(e, 8)  # fp8: k-tile j of the unit; fp16: j = 0
                    dr, dc = A_ELEM[i]
                    row = weight_row(pairing, tile, g + dr, rows, half)
                    col = u * ku + 16 * j + 2 * tq + dc
                    out[row, col] = flat[base + e]
                    seen[row, col] = True
    assert seen.all()
    return out


CASES = [("none", 48, 96, 0), ("halves", 32, 160, 0), ("rope", 2 * 3 * 16, 64, 16), ("rope", 64, 288, 32)]


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("pairing,rows,k,half", CASES)
def test_tiles_are_isa_fragments(fmt, pairing, rows, k, half):
    rng = np.random.default_rng()
    if fmt == "fp8":
        w = rng.integers(0, 256, (rows, k), dtype=np.uint8)
    else:
        w = rng.standard_normal((rows, k)).astype(np.float16)
    t = tiled(w, fmt, pairing, half)
    assert t.shape == w.shape and t.dtype == w.dtype
    assert not np.array_equal(t, w)  # the layout does move bytes
    np.testing.assert_array_equal(untile_by_isa(t, fmt, pairing, half), w)


@pytest.mark.parametrize("pairing,rows,k,half", CASES)
def test_scale_tiles(pairing, rows, k, half):
    """Scales [rows, groups] -> [tile][group][g][rh]: the kernel's float2 load at (tile*groups + G)*8 + g gives
    rows g (x) and g + 8 (y) of the tile."""
    groups = -(-k // 128)
    s = np.random.default_rng().standard_normal((rows, groups)).astype(np.float32)
    flat = tiled_scales(s, pairing, half).reshape(-1)
    for tile in range(rows // 16):
        for G in range(groups):
            for g in range(8):
                for rh in range(2):
                    row = weight_row(pairing, tile, g + 8 * rh, rows, half)
                    assert flat[((tile * groups + G) * 8 + g) * 2 + rh] == s[row, G]


def xs_pair(p: int) -> int:
    """kernels_cu/gemv_prologue.cuh xs_pair."""
    r = p & 15
    return (p & ~15) | ((r & 3) << 2) | ((r >> 3) << 1) | ((r >> 2) & 1)


def test_staged_x_gives_isa_b_fragments():
    k = 96
    x = np.arange(k)
    xs = np.empty(k, int)
    for p in range(k // 2):
        xs[2 * xs_pair(p): 2 * xs_pair(p) + 2] = x[2 * p: 2 * p + 2]
    for tq in range(4):
        b = [2 * tq, 2 * tq + 1, 2 * tq + 8, 2 * tq + 9]  # b0..b3 of k-tile
        for u in range(k // 32):  # fp8: one 16-byte read = B of k-tiles 2u, 2u + 1
            got = xs[u * 32 + tq * 8: u * 32 + tq * 8 + 8]
            np.testing.assert_array_equal(got, [u * 32 + c for c in b] + [u * 32 + 16 + c for c in b])
        for u in range(k // 16):  # fp16: one 8-byte read = B of k-tile u
            got = xs[(u >> 1) * 32 + tq * 8 + (u & 1) * 4:][:4]
            np.testing.assert_array_equal(got, [u * 16 + c for c in b])


@pytest.mark.parametrize("rows,k,pairing,half", [(40, 96, "none", 0), (32, 80, "none", 0), (64, 64, "rope", 12),
                                                 (64, 64, "rope", 48), (32, 64, "diagonal", 0)])
def test_untileable_shapes_refused(rows, k, pairing, half):
    with pytest.raises(VerifyError):
        check_tiled(rows, k, pairing, half)


def test_every_region_has_a_pairing_and_models_must_tile():
    assert set(ROLE_PAIRING) == {"wqkv", "wo", "wgu", "wd"}
    bad = ModelConfig(vocab_size=300, hidden_size=272, intermediate_size=512, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    with pytest.raises(AtomflowError, match="multiples of 32"):
        plan_arena(bad, "fp16", 64)
