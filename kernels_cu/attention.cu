// attention.cu — GQA attention of one query token over the contiguous KV cache, split over the
// sequence (flash-decoding) with the split-combine fused into the same launch.
//
// Computes   for q head hq (kv head j = hq / G, G = n_heads / n_kv), L = *pos + 1 cached positions:
//              out[hq] = sum_t softmax_t(q[hq] . K[t, j] * scale) V[t, j]       (fp32 math, fp16 out)
// Scheme     block (j, s) handles kv head j and split s of the L positions for all G q heads that share it
//            (each K/V row is read once for the whole group). Up to max_splits (= grid.y) a split is one
//            32-position sub-chunk; beyond that (long contexts) split s takes an even, contiguous share of the
//            ceil(L / 32) sub-chunks. Inside a block each warp walks its own passes of the split (4 positions
//            at hd 128, 8 at hd 64: lanes own 16-byte slices, the hd/8 lanes of a position reduce its score
//            with shuffles) with an online softmax whose state (max, sum, o) stays in registers — no block
//            barrier inside the walk — and the next pass's K/V loads in flight while the current one is
//            scored; the warps' states are merged through shared memory at the end. The launch caps the
//            splits at ~4 blocks per SM (all resident: <= 128 registers per thread at G <= 3).
//            With one split the block writes `out` directly. Otherwise it writes (max, sum, o[hd]) partials;
//            the last block of head j to finish (acq_rel atomic ticket) rescales and sums them into `out`
//            (the first round of float4 partial-o L2 loads, ATT_COMBINE_LOADS in flight per thread, goes out
//            together with the one round of all (max, sum) pairs; further rounds follow) and resets its ticket.
//            Blocks whose split is empty at this L exit at once, so one launch shape (captured in the graph)
//            serves every position < max_seq.
//            History (results/PERF_NOTES.md v8-v8.2): a block-wide walk (3 block barriers per 32 positions)
//            was latency-bound — 1 block/SM with 64 KB in flight was slowest — which this warp-level walk removes.
// Layouts    q fp16 [n_heads*hd] (post-RoPE, start of the qkv buffer); k_cache/v_cache: this layer's slab
//            fp16 [max_seq][n_kv*hd]; part_ml fp32 [n_heads][max_splits][2]; part_o fp32
//            [n_heads][max_splits][hd]; counters uint32 [n_kv]; out fp16 [n_heads*hd].
// Bytes      2 * L * n_kv * hd * 2 (K and V, each read once) + partials n_heads * splits * (hd + 2) * 4 * 2.
// Launch     attention_decode_hd{64,128}_g{1,2,3,4,8}: grid = (n_kv, max_splits), block = 128, dyn. smem =
//            max(warp states, combine scratch) (step.py attention_smem).
// Code       the work item is attention_common.cuh.
#include "attention_common.cuh"

#define ATT_THREADS 128

// Resident blocks per SM the register budget must allow: 4 (<= 128 registers per thread) for G <= 3, 3 for
// G = 4, 2 for G = 8 (the o[G][8] accumulators grow with G; sm_120 spills G = 4 at 128 registers).
#define ATT_MIN_BLOCKS(G) ((G) > 4 ? 2 : (G) == 4 ? 3 : 4)

// One kernel per (head_dim, q heads per kv head): G is a compile-time constant so the per-head register
// arrays are exactly sized (no dead registers, no spills). Block (j, s) = item (kv head j, split s).
#define ATTENTION_INSTANCE(HD, G)                                                                         \
  extern "C" __global__ void __launch_bounds__(ATT_THREADS, ATT_MIN_BLOCKS(G))                           \
      attention_decode_hd##HD##_g##G(                                                                     \
      const __half* __restrict__ q, const __half* __restrict__ k_cache, const __half* __restrict__ v_cache, \
      const int* __restrict__ pos_ptr, float* part_ml, float* part_o, unsigned int* counters,             \
      __half* __restrict__ out, int n_kv, int max_splits, float scale) {                                  \
    AF_TIMELINE_BLOCK;                                                                                    \
    extern __shared__ float smem[];                                                                       \
    /* pos was written by the previous step's argmax, complete before this step's first kernel: readable */ \
    /* before the PDL wait, and so are the K/V rows before pos (attention_item waits before row pos and q) */ \
    attention_item<HD, G, ATT_THREADS>(q, k_cache, v_cache, *pos_ptr + 1, blockIdx.x, blockIdx.y, part_ml, \
                                       part_o, counters, out, n_kv, max_splits, scale, smem, PdlSync{});  \
  }

ATTENTION_INSTANCE(64, 1)
ATTENTION_INSTANCE(64, 2)
ATTENTION_INSTANCE(64, 3)
ATTENTION_INSTANCE(64, 4)
ATTENTION_INSTANCE(64, 8)
ATTENTION_INSTANCE(128, 1)
ATTENTION_INSTANCE(128, 2)
ATTENTION_INSTANCE(128, 3)
ATTENTION_INSTANCE(128, 4)
ATTENTION_INSTANCE(128, 8)
