"""CPU: the attention launch plan (arena.attention_splits, step.attention_smem) for every supported shape."""
import pytest

from atomflow_bench.arena import ATT_BLOCKS_PER_SM, ATT_CHUNK, attention_splits, plan_arena
from atomflow_bench.config import get_preset
from atomflow_bench.step import ATT_RING_BYTES, ATT_THREADS, attention_smem


@pytest.mark.parametrize("n_kv", [1, 3, 8])
def test_short_contexts_get_one_split_per_chunk(n_kv):
    for max_seq in (1, 31, 32, 33, 160):
        assert attention_splits(max_seq, n_kv, 132) == -(-max_seq // ATT_CHUNK)


@pytest.mark.parametrize("n_kv,n_sm", [(1, 132), (3, 132), (8, 132), (8, 78), (8, 170)])
def test_long_contexts_are_capped_near_the_block_budget(n_kv, n_sm):
    s = attention_splits(32768, n_kv, n_sm)
    assert s == -(-ATT_BLOCKS_PER_SM * n_sm // n_kv)
    assert (s - 1) * n_kv < ATT_BLOCKS_PER_SM * n_sm <= s * n_kv
    assert s * ATT_CHUNK < 32768  # so splits really walk several sub-chunks there


def test_block_budget_knob(monkeypatch):
    monkeypatch.setenv("ATOMFLOW_KERNEL_DEFINES", "GEMV_STAGES=5 ATT_BLOCKS_PER_SM=4")
    assert attention_splits(32768, 8, 132) == 66
    cfg = get_preset("llama-3.2-3b").config
    assert plan_arena(cfg, "fp8", 8192 + 64, 132).regions["att_ml"].shape == (cfg.num_attention_heads, 66, 2)
    monkeypatch.delenv("ATOMFLOW_KERNEL_DEFINES")
    assert attention_splits(32768, 8, 132) == -(-ATT_BLOCKS_PER_SM * 132 // 8)


@pytest.mark.parametrize("c", [8, 16])
def test_clusters_round_the_splits_down_to_whole_clusters(c):
    d = (f"ATT_CLUSTER={c}",)
    for max_seq, n_kv, n_sm in [(1, 8, 132), (100, 8, 132), (8192 + 64, 8, 132), (32768, 3, 132), (32768, 1, 170)]:
        plain, s = attention_splits(max_seq, n_kv, n_sm), attention_splits(max_seq, n_kv, n_sm, defines=d)
        assert s % c == 0 and s >= c  # whole clusters, at least one
        assert s == max(c, plain // c * c)  # never more blocks than the plan without clusters (but one cluster)
    assert attention_splits(8192 + 64, 8, 132, defines=("ATT_CLUSTER=8",)) == 32  # 3B at ctx 8192: 33 -> 4 x 8


def test_cluster_plan_holds_a_ticket_per_slice_and_the_block_state(monkeypatch):
    cfg = get_preset("llama-3.2-3b").config
    monkeypatch.setenv("ATOMFLOW_KERNEL_DEFINES", "ATT_CLUSTER=8")
    plan = plan_arena(cfg, "fp8", 8192 + 64, 132)
    assert plan.regions["att_counters"].shape == (cfg.num_hidden_layers, cfg.num_key_value_heads * 8)
    assert plan.regions["att_ml"].shape == (cfg.num_attention_heads, 32, 2)
    monkeypatch.delenv("ATOMFLOW_KERNEL_DEFINES")
    assert plan_arena(cfg, "fp8", 8192 + 64, 132).regions["att_counters"].shape == (cfg.num_hidden_layers,
                                                                                     cfg.num_key_value_heads)
    # the warps' O plus the block's o for its cluster fit the rings at the largest group
    assert attention_smem(8, 128, 32, defines=("ATT_CLUSTER=16",)) >= 4 * (4 + 1) * 8 * 128
    from atomflow_bench.errors import AtomflowError

    for bad in (2, 12, 32):
        with pytest.raises(AtomflowError, match="8 or 16"):
            attention_splits(8192, 8, 132, defines=(f"ATT_CLUSTER={bad}",))


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("hd", [64, 128])
def test_shared_memory_covers_rings_warp_states_and_the_combine(group, hd):
    splits = attention_splits(32768, 1, 170, blocks_per_sm=4)  # more splits than any default plan asks for
    smem = attention_smem(group, hd, splits)
    warps = ATT_THREADS // 32
    assert smem == warps * ATT_RING_BYTES  # every warp's K/V ring; the end of the kernel reuses them
    assert ATT_RING_BYTES // (2 * 16 * hd * 2) == (3 if hd == 128 else 6)  # 16-position groups of K and V per ring
    assert smem >= 4 * warps * group * hd  # the warps' O at the merge
    # the combine: (m, l) per split, the float4 sums, and at least one split's partial o
    assert smem >= 4 * (-(-2 * group * splits // 4) * 4 + 2 * group * hd)
    # two blocks per SM (the split cap's assumption) fit the H100's 228 KB with their static shared memory
    assert 2 * (attention_smem(group, hd, attention_splits(32768, 8, 132)) + 1024) <= 228 * 1024
    assert attention_smem(group, hd, 8, defines=("ATT_RING_BYTES=8192",)) == warps * 8192  # the knob
    # ATT_TMA: 1 KB more to align the rings for the 128-byte swizzle; two blocks per SM still fit
    tma = attention_smem(group, hd, attention_splits(32768, 8, 132), defines=("ATT_TMA=1",))
    assert tma == warps * ATT_RING_BYTES + 1024 and 2 * (tma + 1024) <= 228 * 1024


def test_a_combine_that_does_not_fit_is_refused():
    from atomflow_bench.errors import AtomflowError

    with pytest.raises(AtomflowError, match="do not fit"):
        attention_smem(8, 128, 4096)
    with pytest.raises(AtomflowError, match="do not fit"):
        attention_smem(8, 128, 600, defines=("ATT_RING_BYTES=8192",))  # smaller rings (knob) hold fewer splits
    assert attention_smem(8, 128, 300, defines=("ATT_RING_BYTES=8192",)) == 4 * 8192


# ---- the short-context kernel (attention_short.cu) and the engine's buckets --------------------------------

@pytest.mark.parametrize("hd", [64, 128])
def test_short_attention_capacity_fits_one_block(hd):
    from atomflow_bench.step import (ATS_CHUNK_MAX, ATS_HEADS, ATS_THREADS, SMEM_H100, attention_short_cap,
                                     attention_short_smem, attention_short_static)

    top = attention_short_cap(hd)
    room = SMEM_H100[0] - attention_short_static(hd)
    assert top % ATT_CHUNK == 0 and attention_short_smem(hd, top) <= room
    # the largest that fits, or the kernel's chunk (its scores cover ATS_CHUNK_MAX positions per chunk)
    assert top == ATS_CHUNK_MAX or attention_short_smem(hd, top + ATT_CHUNK) > room
    # K and V rows, P fp16 for 8 heads (+ 8 positions of padding); never less than the final reduction scratch
    assert attention_short_smem(hd, 256) == 256 * hd * 4 + ATS_HEADS * (256 + 8) * 2
    assert attention_short_smem(hd, 7) == max(16 * hd * 2, (ATS_THREADS // 32) * 16 * 8 * 4) + 16 * hd * 2 + 8 * 24 * 2
    assert top == (416 if hd == 128 else 512)  # the 3B/8B bench's 384 positions fit


def test_short_attention_capacity_and_the_knobs(monkeypatch):
    from atomflow_bench.step import attention_short_cap

    assert attention_short_cap(128) == 416
    assert attention_short_cap(64) == 512  # the chunk the kernel's scores cover
    assert attention_short_cap(128, defines=("ATT_SHORT=0",)) == 0
    assert attention_short_cap(128, defines=("ATT_SHORT_MAX=256",)) == 256
    assert attention_short_cap(128, smem=(48 * 1024, 100 * 1024, 1024)) == 32 * 2  # small GPUs
    assert attention_short_cap(128, smem=(8 * 1024, 100 * 1024, 1024)) == 0  # not even one chunk
    monkeypatch.setenv("ATOMFLOW_KERNEL_DEFINES", "ATT_SHORT=0")
    assert attention_short_cap(128) == 0


@pytest.mark.parametrize("cc, given, added", [
    (90, (), ("ATT_TMA=1",)),                       # sm_90+: K/V by 2D tensor copies (v23.5)
    (100, ("GEMV_WS=2",), ("ATT_TMA=1",)),          # other knobs leave it on
    (89, (), ()),                                   # no tensor copies before sm_90: the cp.async form
    (90, ("ATT_TMA=0",), ()),                       # the run's own value wins
    (90, ("ATT_BULK=1",), ()),                      # forms attention.cu refuses beside TMA (#error)
    (90, ("ATT_CLUSTER=8",), ()),
    (90, ("ATT_THREADS=256",), ()),
    (90, ("ATT_BULK=0", "ATT_CLUSTER=1"), ("ATT_TMA=1",)),
])
def test_arch_defines_turn_tensor_copies_on_where_they_exist(cc, given, added):
    from atomflow_bench.kernels import arch_defines
    from atomflow_bench.step import att_tma

    assert arch_defines(cc, given) == added
    assert att_tma(given + added) == (added == ("ATT_TMA=1",))
