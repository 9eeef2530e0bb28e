"""The tiled GEMV launch plans (CPU): ring depth, blocks per SM and shared memory per launch.

gemv_ws_plan (the ws form, sm_90+): the warp-specialised kernels (gemv_ws.cuh gemv_tiled_ws) read their
ring depth back from the dynamic shared memory, so the plan must size it exactly: x + partial sums + barriers +
slots. gemv_plan (the ring form; the only one before sm_90): an fp8 launch runs the kernel of its ring depth (gemv_fp8.cu
gemv_f8_<variant>_r<depth>), whose layout (gemv_tiled_async) needs exactly x + partial sums + depth ring slots.
These tests pin the plans of the catalog shapes and that every plan fits the SM (gpu/ops/gemv.py)."""
from __future__ import annotations

import pytest

from atomflow_bench.config import CATALOG, get_preset
from atomflow_bench.errors import AtomflowError
from atomflow_bench.gpu.device import SMEM_H100, blocks_fit
from atomflow_bench.gpu.ops.gemv import (GEMV_RING_DEPTHS, GEMV_WARPS, GEMV_WS_MAX, gemv_plan, gemv_ws_plan,
                                         linear_regions)

N_SM = 132


def plans(model: str, fmt: str) -> dict:
    cfg = get_preset(model).config
    return {role: gemv_plan(fmt, rows // 16, k, N_SM)[:2] for role, (rows, k) in linear_regions(cfg).items()}


def smem_layout(k: int, depth: int) -> int:
    """gemv_tiled_async's shared memory: x (fp16, K), partial sums [2][warps][16] + 32 floats, then per warp and
    slot one group of 16 rows x 128 fp8 (2 KB) and its scales (32 lanes x 8 bytes)."""
    return k * 2 + (2 * GEMV_WARPS * 16 + 32) * 4 + depth * GEMV_WARPS * (2048 + 32 * 8)


def test_3b_fp8_plan():
    # QKV's 320 tiles: one per block at 3 blocks/SM (ring 3); the rest: 2 blocks/SM with the 5-deep ring
    assert plans("llama-3.2-3b", "fp8") == {"wqkv": (3, 3), "wo": (5, 2), "wgu": (5, 2), "wd": (5, 2)}


def test_8b_down_projection_keeps_two_blocks_with_a_shallower_ring():
    p = plans("llama-3.1-8b", "fp8")
    assert p["wd"] == (4, 2)  # K = 14336: 28 KB of x; 5 slots would leave room for 1 block per SM
    assert p["wqkv"] == (3, 3)  # 384 tiles <= 3 x 132


def test_register_path_has_no_ring():
    assert set(plans("llama-3.2-3b", "fp16").values()) == {(0, 2)}


# hidden <= 8192: two blocks per SM keep their staging (Llama-3.1-405B's 16384 leaves room for one: its own test)
@pytest.mark.parametrize("model", sorted(m for m in CATALOG if CATALOG[m].config.hidden_size <= 8192))
def test_norm_prologue_parks_h_and_norm_w_in_shared_memory_on_the_register_path(model):
    """fp16 norm GEMVs (QKV, gate/up) get h (fp32) and norm_w (fp16) staging: k * 6 bytes more, 2 blocks/SM kept."""
    k = CATALOG[model].config.hidden_size
    plain, norm = gemv_plan("fp16", 256, k, N_SM), gemv_plan("fp16", 256, k, N_SM, norm=True)
    assert norm[2] - plain[2] == k * 6 and norm[:2] == plain[:2] == (0, 2)
    assert gemv_plan("fp8", 256, k, N_SM, norm=True) == gemv_plan("fp8", 256, k, N_SM)  # fp8: registers


def test_forced_depth():
    assert gemv_plan("fp8", 192, 8192, N_SM, depth=2)[:2] == (2, 1)
    with pytest.raises(AtomflowError, match="ring depth 7"):
        gemv_plan("fp8", 192, 8192, N_SM, depth=7)


def test_smaller_shared_memory_gives_fewer_blocks_not_a_failed_launch():
    sm89 = (99 * 1024, 100 * 1024, 1024)  # sm_89: 99 KB per block, 100 KB per SM
    depth, per_sm, shmem = gemv_plan("fp8", 512, 8192, 58, smem=sm89)
    assert (depth, per_sm) == (4, 1) and shmem <= sm89[0]  # the deepest ring of one block
    assert gemv_plan("fp8", 512, 3072, 58, smem=sm89)[:2] == (2, 2)  # blocks per SM first, then depth
    with pytest.raises(AtomflowError, match="no ring"):
        gemv_plan("fp8", 512, 65536, 58, smem=sm89)


def test_residual_gemv_never_follows_a_writer_of_h():
    """The residual GEMVs read h before their PDL wait: the step order must keep a non-writer in between."""
    from atomflow_bench.gpu.step import check_residual_order

    layer = ["gemv_f8_qkv_rope_r3", "attention_decode_hd128_g3", "gemv_f8_resid_r5", "gemv_f8_norm_swiglu_r5",
             "gemv_f8_resid_r5"]
    check_residual_order(["embed_lookup"] + layer * 3 + ["gemv_fp16_f32_argmax"])
    with pytest.raises(AtomflowError, match="right after embed_lookup"):
        check_residual_order(["embed_lookup", "gemv_f16_resid"])
    with pytest.raises(AtomflowError, match="right after gemv_f8_resid_r5"):
        check_residual_order(["gemv_f8_resid_r5", "gemv_f8_resid_r4"])


# ---- the warp-specialised plan (gemv_ws_plan) ----------------------------------------------------------

def ws_plans(model: str, fmt: str) -> dict:
    cfg = get_preset(model).config
    return {role: gemv_ws_plan(fmt, rows // 16, k, N_SM)[:2]
            for role, (rows, k) in linear_regions(cfg).items()}


def ws_layout(k: int, fmt: str, slots: int) -> int:
    """gemv_tiled_ws's shared memory: x (fp16, K), partial sums [2][8][16] + 32 floats, full and empty mbarriers
    for GEMV_WS_MAX slots and the `go` one (padded to 16 bytes), up to 128 bytes to align the ring, then the slots (16 KB of weights, fp8 + 8 groups x 64 bytes of scales)."""
    return k * 2 + (2 * GEMV_WARPS * 16 + 32) * 4 + (2 * GEMV_WS_MAX + 2) * 8 + 128 + slots * (16384 + (512 if fmt == "fp8" else 0))


def test_ws_3b_plans():
    # QKV (320 tiles): one tile per block at 3 blocks/SM, a ring of its 3 (fp8) / 6 (fp16, 4 fit) slots;
    # o_proj (192 tiles, 1 per block): no deeper than its tile; gate/up and down: the deepest ring <= 6 that fits 2
    assert ws_plans("llama-3.2-3b", "fp8") == {"wqkv": (3, 3), "wo": (3, 2), "wgu": (6, 2), "wd": (5, 2)}
    assert ws_plans("llama-3.2-3b", "fp16") == {"wqkv": (4, 3), "wo": (6, 2), "wgu": (6, 2), "wd": (5, 2)}


@pytest.mark.parametrize("model", sorted(CATALOG))
@pytest.mark.parametrize("fmt", ["fp8", "fp16"])
@pytest.mark.parametrize("ws", [False, True], ids=["ring", "ws"])
def test_every_plan_fits_and_sizes_its_ring(model, fmt, ws):
    """Every plan (gemv_plan, gemv_ws_plan) fits the SM, and its shared memory is exactly the kernel's layout for
    the ring depth it encodes."""
    for rows, k in linear_regions(CATALOG[model].config).values():
        depth, per_sm, shmem = (gemv_ws_plan if ws else gemv_plan)(fmt, rows // 16, k, N_SM)
        assert blocks_fit(shmem, SMEM_H100) >= per_sm >= 1
        if ws:
            per_tile = -(-(-(-k // 128)) // (8 if fmt == "fp8" else 4))
            assert shmem == ws_layout(k, fmt, depth)
            assert 1 <= depth <= GEMV_WS_MAX and (depth >= 2 or per_tile == 1)
        elif fmt == "fp8":
            assert depth in GEMV_RING_DEPTHS and shmem == smem_layout(k, depth)


def test_ws_forced_depth_and_small_shared_memory():
    assert gemv_ws_plan("fp16", 192, 8192, N_SM, depth=1)[:2] == (1, 1)
    with pytest.raises(AtomflowError, match="1 to 16"):
        gemv_ws_plan("fp16", 192, 8192, N_SM, depth=17)
    sm_small = (99 * 1024, 100 * 1024, 1024)
    slots, per_sm, shmem = gemv_ws_plan("fp16", 512, 8192, 58, smem=sm_small)
    assert (slots, per_sm) == (5, 1) and shmem <= sm_small[0]  # 2 blocks would leave 1 slot each
    with pytest.raises(AtomflowError, match="not even a ring of 2 slots"):
        gemv_ws_plan("fp16", 512, 49152, 58, smem=sm_small)


def test_ws_solo_grid_gets_the_whole_sm():
    # 1B down projection: 128 tiles on 132 SMs, one block per SM anyway -> 13 slots (208 KB) instead of 5
    assert gemv_ws_plan("fp16", 128, 8192, N_SM)[:2] == (13, 1)
    assert gemv_ws_plan("fp16", 133, 8192, N_SM)[:2] == (5, 2)


def test_norm_prologue_at_hidden_16384_fits_one_block_per_sm():
    """Llama-3.1-405B: h (fp32) + norm_w (fp16) + x staging of K = 16384 leave one fp16 norm GEMV block per SM."""
    k = CATALOG["llama-3.1-405b"].config.hidden_size
    norm = gemv_plan("fp16", 256, k, N_SM, norm=True)
    assert norm[:2] == (0, 1) and blocks_fit(norm[2], SMEM_H100) == 1


def test_head_l2_asks_the_first_slot_of_every_first_round_tile():
    """What a summing GEMV asks into L2 while it waits (ops/gemv.py head_l2): per first-round tile of the next GEMV,
    its first ring slot (16 KB) and, fp8, that slot's scales; one tile per block of the next launch's grid."""
    import numpy as np

    from atomflow_bench.gpu.ops.gemv import GEMV_WS_SLOT, gemv_grid, head_l2

    w8 = np.zeros((14336, 8192), np.uint8)  # 70B TP4 gate/up, fp8
    s8 = np.zeros((14336, 64), np.float32)
    got = head_l2("fp8", "norm_swiglu", w8, s8, N_SM, True, 1, smem=SMEM_H100)
    assert got[2:] == (16 * 8192, GEMV_WS_SLOT, 64 * 16 * 4, 8 * 16 * 4, gemv_grid("fp8", "norm_swiglu", 14336, 8192,
                                                                                    N_SM, True, smem=SMEM_H100)[2])
    assert got[6] == 2 * N_SM  # 896 tiles, two blocks per SM
    w16 = np.zeros((2560, 8192), np.float16)  # 70B TP4 QKV, fp16: no scales; 160 tiles, one per block
    got = head_l2("fp16", "qkv_rope", w16, None, N_SM, True, 2, smem=SMEM_H100)
    assert got[2:] == (16 * 8192 * 2, 2 * GEMV_WS_SLOT, 0, 0, 160)
    small = head_l2("fp8", "resid", np.zeros((48, 96), np.uint8), np.zeros((48, 1), np.float32), N_SM, False, 4,
                    smem=SMEM_H100)
    assert small[2:] == (16 * 96, 16 * 96, 64, 64, 3)  # a whole (small) tile and its one group's scales
    assert head_l2("fp8", "resid", w8, s8, N_SM, True, 0, smem=SMEM_H100) is None
