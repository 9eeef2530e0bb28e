"""The tiled GEMV launch plans (CPU): ring depth, blocks per SM and shared memory per launch.

step.gemv_ws_plan (sm_90+, the default): the warp-specialised kernels (gemv_common.cuh gemv_tiled_ws) read their
ring depth back from the dynamic shared memory, so the plan must size it exactly: x + partial sums + barriers +
slots. step.gemv_plan (GEMV_WS=0, sm_89): an fp8 launch runs the kernel of its ring depth (gemv_fp8.cu
gemv_f8_<variant>_r<depth>), whose layout (gemv_tiled_async) needs exactly x + partial sums + depth ring slots.
These tests pin the plans of the catalog shapes, that every plan fits the SM, and the knobs that change them."""
from __future__ import annotations

import pytest

from atomflow_bench.arena import linear_regions
from atomflow_bench.config import CATALOG, get_preset
from atomflow_bench.errors import AtomflowError
from atomflow_bench.kernels import KERNELS_DIR
from atomflow_bench.step import (GEMV_RING_DEPTHS, GEMV_WARPS, GEMV_WS_MAX, GEMV_WS_SLOT, SMEM_H100, blocks_fit,
                                 gemv_dyn_plan, gemv_plan, gemv_ws, gemv_ws_plan)

N_SM = 132


def plans(model: str, fmt: str, defines: tuple = ()) -> dict:
    cfg = get_preset(model).config
    return {role: gemv_plan(fmt, rows // 16, k, N_SM, defines)[:2] for role, (rows, k) in linear_regions(cfg).items()}


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


@pytest.mark.parametrize("model", sorted(CATALOG))
def test_norm_prologue_parks_h_and_norm_w_in_shared_memory_on_the_register_path(model):
    """fp16 norm GEMVs (QKV, gate/up) get h (fp32) and norm_w (fp16) staging: k * 6 bytes more, 2 blocks/SM kept."""
    k = CATALOG[model].config.hidden_size
    plain, norm = gemv_plan("fp16", 256, k, N_SM), gemv_plan("fp16", 256, k, N_SM, norm=True)
    assert norm[2] - plain[2] == k * 6 and norm[:2] == plain[:2] == (0, 2)
    assert gemv_plan("fp8", 256, k, N_SM, norm=True) == gemv_plan("fp8", 256, k, N_SM)  # fp8: registers


def test_knobs_change_the_plan():
    assert plans("llama-3.2-3b", "fp8", ("GEMV_STAGES=4",)) == {"wqkv": (3, 3), "wo": (4, 2), "wgu": (4, 2),
                                                                "wd": (4, 2)}
    assert plans("llama-3.2-3b", "fp8", ("GEMV_ONE_WAVE=0",))["wqkv"] == (5, 2)


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
    from atomflow_bench.step import check_residual_order

    layer = ["gemv_f8_qkv_rope_r3", "attention_decode_hd128_g3", "gemv_f8_resid_r5", "gemv_f8_norm_swiglu_r5",
             "gemv_f8_resid_r5"]
    check_residual_order(["embed_lookup"] + layer * 3 + ["rmsnorm_f32_f16"])
    with pytest.raises(AtomflowError, match="right after embed_lookup"):
        check_residual_order(["embed_lookup", "gemv_f16_resid"])
    with pytest.raises(AtomflowError, match="right after gemv_f8_resid_r5"):
        check_residual_order(["gemv_f8_resid_r5", "gemv_f8_resid_r4"])


# ---- the warp-specialised plan (gemv_ws_plan) ----------------------------------------------------------

def ws_plans(model: str, fmt: str, defines: tuple = ()) -> dict:
    cfg = get_preset(model).config
    return {role: gemv_ws_plan(fmt, rows // 16, k, N_SM, defines)[:2]
            for role, (rows, k) in linear_regions(cfg).items()}


def ws_layout(k: int, fmt: str, slots: int) -> int:
    """gemv_tiled_ws's shared memory: x (fp16, K), partial sums [2][8][16] + 32 floats, full and empty mbarriers
    for GEMV_WS_MAX slots and the `go` one (padded to 16 bytes), up to 128 bytes to align the ring, then the slots (16 KB of weights, fp8 + 8 groups x 64 bytes of scales)."""
    return k * 2 + (2 * GEMV_WARPS * 16 + 32) * 4 + (2 * GEMV_WS_MAX + 2) * 8 + 128 + slots * (16384 + (512 if fmt == "fp8" else 0))


def test_ws_constants_mirror_the_kernel():
    src = (KERNELS_DIR / "gemv_common.cuh").read_text()
    assert f"#define GEMV_WS_SLOT {GEMV_WS_SLOT} " in src and f"#define GEMV_WS_MAX {GEMV_WS_MAX} " in src


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


def test_ws_knobs_forced_depth_and_small_shared_memory():
    assert ws_plans("llama-3.2-3b", "fp8", ("GEMV_WS_SLOTS=3",)) == {"wqkv": (3, 3), "wo": (3, 2), "wgu": (3, 2),
                                                                     "wd": (3, 2)}
    assert ws_plans("llama-3.2-3b", "fp8", ("GEMV_ONE_WAVE=0",))["wqkv"] == (6, 2)
    assert gemv_ws_plan("fp16", 192, 8192, N_SM, depth=1)[:2] == (1, 1)
    with pytest.raises(AtomflowError, match="1 to 16"):
        gemv_ws_plan("fp16", 192, 8192, N_SM, depth=17)
    sm_small = (99 * 1024, 100 * 1024, 1024)
    slots, per_sm, shmem = gemv_ws_plan("fp16", 512, 8192, 58, smem=sm_small)
    assert (slots, per_sm) == (5, 1) and shmem <= sm_small[0]  # 2 blocks would leave 1 slot each
    with pytest.raises(AtomflowError, match="not even a ring of 2 slots"):
        gemv_ws_plan("fp16", 512, 49152, 58, smem=sm_small)


def test_ws_needs_sm90_and_the_knob():
    assert gemv_ws("fp16", (), cc=90) and gemv_ws("fp16", (), cc=120)
    assert not gemv_ws("fp8", (), cc=90)  # fp8 keeps its per-warp ring unless GEMV_WS=2
    assert gemv_ws("fp8", ("GEMV_WS=2",), cc=90)
    assert not gemv_ws("fp16", (), cc=89) and not gemv_ws("fp8", ("GEMV_WS=2",), cc=89)
    assert not gemv_ws("fp16", ("GEMV_WS=0",), cc=90)


def test_ws_solo_grid_gets_the_whole_sm():
    # 1B down projection: 128 tiles on 132 SMs, one block per SM anyway -> 13 slots (208 KB) instead of 5
    assert gemv_ws_plan("fp16", 128, 8192, N_SM)[:2] == (13, 1)
    assert gemv_ws_plan("fp16", 128, 8192, N_SM, ("GEMV_WS_SOLO=0",))[:2] == (5, 2)
    assert gemv_ws_plan("fp16", 133, 8192, N_SM)[:2] == (5, 2)


def dyn_layout(k: int, fmt: str, slots: int) -> int:
    """The DYN kernels' shared memory (gemv_tiled_ws with DYN): ws_layout plus a `done` mbarrier and a unit id per
    GEMV_WS_MAX slot, and per slot its partial sums [8 warps][16] f32 after the ring."""
    return ws_layout(k, fmt, slots) + GEMV_WS_MAX * (8 + 4) + slots * GEMV_WARPS * 16 * 4


@pytest.mark.parametrize("model", sorted(CATALOG))
@pytest.mark.parametrize("fmt", ["fp8", "fp16"])
def test_dyn_plans_fit_and_size_the_ring(model, fmt):
    """Every DYN plan: 2 blocks per SM (the launch bounds of the 352-thread kernel), the deepest ring
    <= GEMV_WS_SLOTS that fits, the layout exactly the kernel's, and a grid of every resident block (fewer only
    when there are fewer units: tiles x slots per tile)."""
    for rows, k in linear_regions(CATALOG[model].config).values():
        slots, per_sm, shmem, grid = gemv_dyn_plan(fmt, rows // 16, k, N_SM)
        assert per_sm == 2 and blocks_fit(shmem, SMEM_H100) >= 2
        assert shmem == dyn_layout(k, fmt, slots) and 2 <= slots <= 6
        units = rows // 16 * -(-(-(-k // 128)) // (8 if fmt == "fp8" else 4))
        assert grid == min(units, 2 * N_SM)


def test_dyn_plan_knobs_and_small_grids():
    assert gemv_dyn_plan("fp8", 192, 3072, N_SM)[:2] == (6, 2)
    assert gemv_dyn_plan("fp8", 192, 3072, N_SM, ("GEMV_WS_SLOTS=3",))[0] == 3
    assert gemv_dyn_plan("fp8", 192, 3072, N_SM, ("GEMV_DYN_PER_SM=1",))[1:4:2] == (1, N_SM)
    assert gemv_dyn_plan("fp8", 2, 96, N_SM)[3] == 2  # one unit per tile: the grid is the unit count
    assert gemv_dyn_plan("fp16", 2, 1056, N_SM)[3] == 2 * 3  # 9 groups of 128: 3 units of 4 groups per tile
    with pytest.raises(AtomflowError, match="not even a ring of 2 slots"):
        gemv_dyn_plan("fp8", 192, 3072, N_SM, smem=(40_000, 80_000, 1024))
