"""CPU: the attention launch plan (gpu/ops/attention.py: splits, shared memory, the short kernel's capacity) for
every supported shape."""
import pytest

from atomflow_bench.gpu.ops.attention import (ATS_CHUNK_MAX, ATS_HEADS, ATS_THREADS, ATT_BLOCKS_PER_SM, ATT_CHUNK,
                                              ATT_RING_BYTES, ATT_THREADS, BLOCK_HEADS, GROUPS, attention_smem,
                                              attention_splits, blocks_per_kv, short_capacity, short_smem,
                                              short_static)
from atomflow_bench.gpu.device import SMEM_H100


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


def test_block_budget_argument():
    assert attention_splits(32768, 8, 132, blocks_per_sm=4) == 66
    assert attention_splits(32768, 8, 132) == -(-ATT_BLOCKS_PER_SM * 132 // 8)


def test_sixteen_heads_per_kv_head_take_two_blocks():
    """16 q heads per kv head (Llama-3.1-405B): two blocks of 8 heads share the kv head; the split cap counts both."""
    assert [blocks_per_kv(g) for g in GROUPS] == [1, 1, 1, 1, 1, 2] and BLOCK_HEADS == ATS_HEADS == 8
    assert attention_splits(32768, 1, 132, group=16) == attention_splits(32768, 2, 132)
    assert attention_splits(160, 1, 132, group=16) == 5  # short contexts: still one split per chunk
    assert attention_smem(16, 128, 64) == attention_smem(8, 128, 64)  # a block holds 8 heads' states


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
    # ATT_TMA: 1 KB more to align the rings for the 128-byte swizzle; two blocks per SM still fit
    tma = attention_smem(group, hd, attention_splits(32768, 8, 132), defines=("ATT_TMA=1",))
    assert tma == warps * ATT_RING_BYTES + 1024 and 2 * (tma + 1024) <= 228 * 1024


def test_a_combine_that_does_not_fit_is_refused():
    from atomflow_bench.errors import AtomflowError

    with pytest.raises(AtomflowError, match="do not fit"):
        attention_smem(8, 128, 4096)
    largest = max(n for n in range(1, 5000) if 4 * (-(-2 * 8 * n // 4) * 4 + 2 * 8 * 128) <= 4 * ATT_RING_BYTES)
    assert attention_smem(8, 128, largest) == 4 * ATT_RING_BYTES  # the last split count that fits is accepted
    with pytest.raises(AtomflowError, match="do not fit"):
        attention_smem(8, 128, largest + 1)


# ---- the short-context kernel (attention_short.cu) and the engine's buckets --------------------------------

@pytest.mark.parametrize("hd", [64, 128])
def test_short_attention_capacity_fits_one_block(hd):
    top = short_capacity(hd)
    room = SMEM_H100[0] - short_static(hd)
    assert top % ATT_CHUNK == 0 and short_smem(hd, top) <= room
    # the largest that fits, or the kernel's chunk (its scores cover ATS_CHUNK_MAX positions per chunk)
    assert top == ATS_CHUNK_MAX or short_smem(hd, top + ATT_CHUNK) > room
    # K and V rows, P fp16 for 8 heads (+ 8 positions of padding); never less than the final reduction scratch
    assert short_smem(hd, 256) == 256 * hd * 4 + ATS_HEADS * (256 + 8) * 2
    assert short_smem(hd, 7) == max(16 * hd * 2, (ATS_THREADS // 32) * 16 * 8 * 4) + 16 * hd * 2 + 8 * 24 * 2
    assert top == (416 if hd == 128 else 512)  # the 3B/8B bench's 384 positions fit


def test_short_attention_capacity_on_smaller_gpus():
    assert short_capacity(128, smem=(48 * 1024, 100 * 1024, 1024)) == 32 * 2
    assert short_capacity(128, smem=(8 * 1024, 100 * 1024, 1024)) == 0  # not even one chunk: the split kernel only


@pytest.mark.parametrize("cc, given, added", [
    (90, (), ("ATT_TMA=1",)),                       # sm_90+: K/V by 2D tensor copies
    (100, ("GEMV_BULK=1",), ("ATT_TMA=1",)),        # other defines leave it on
    (89, (), ()),                                   # no tensor copies before sm_90: the cp.async form
    (90, ("ATT_TMA=0",), ()),                       # the run's own value wins
])
def test_arch_defines_turn_tensor_copies_on_where_they_exist(cc, given, added):
    from atomflow_bench.gpu.nvrtc import arch_defines
    from atomflow_bench.gpu.ops.attention import att_tma

    assert arch_defines(cc, given) == added
    assert att_tma(given + added) == (added == ("ATT_TMA=1",))
