// attention.cu — GQA attention of one query token over the contiguous KV cache, split over the
// sequence (flash-decoding) with the split-combine fused into the same launch.
//
// Computes   for q head hq (kv head j = hq / G, G = n_heads / n_kv), L = *pos + 1 cached positions:
//              out[hq] = sum_t softmax_t(q[hq] . K[t, j] * scale) V[t, j]       (fp32 math, fp16 out)
// Scheme     block (j, s) handles kv head j and split s of the L positions for all G q heads that share it
//            (each K/V row is read once for the whole group). Up to max_splits (= grid.y) a split is one
//            32-position sub-chunk; beyond that (long contexts) split s takes an even, contiguous share of the
//            ceil(L / 32) sub-chunks and walks them with an online softmax, the next sub-chunk's K/V loads in
//            flight (registers) while the current one is scored, so a block keeps ~16 KB outstanding and the
//            number of partials to combine stays <= max_splits (the launch caps it at ~4 blocks per SM).
//            Thread (p, l) owns 16-byte slice l of positions p, p + P, ... of a sub-chunk; scores are reduced
//            over the hd/8 lanes of a position with shuffles; one warp per head does the sub-chunk softmax
//            (32 positions = 32 lanes) and rescales the running sums; P.V partial sums are reduced through
//            shared memory. With one split the block writes `out` directly. Otherwise it writes (max, sum,
//            o[hd]) partials; the last block of head j to finish (acq_rel atomic ticket) rescales and sums
//            them into `out` (float4 L2 loads, ATT_COMBINE_LOADS in flight per thread) and resets its ticket.
//            Blocks whose split is empty at this L exit at once, so one launch shape (captured in the graph)
//            serves every position < max_seq. Optional (knob ATT_PREFETCH_NEXT): every block, including the
//            idle ones, asks L2 to prefetch its share of the next kernel's weights (cp.async.bulk.prefetch.L2),
//            using DRAM time the latency-bound attention leaves idle at short contexts.
// Layouts    q fp16 [n_heads*hd] (post-RoPE, start of the qkv buffer); k_cache/v_cache: this layer's slab
//            fp16 [max_seq][n_kv*hd]; part_ml fp32 [n_heads][max_splits][2]; part_o fp32
//            [n_heads][max_splits][hd]; counters uint32 [n_kv]; out fp16 [n_heads*hd].
// Bytes      2 * L * n_kv * hd * 2 (K and V, each read once) + partials n_heads * splits * (hd + 2) * 4 * 2.
// Launch     attention_decode_hd{64,128}_g{1,2,3,4,8}: grid = (n_kv, max_splits), block = 128, dyn. smem =
//            4 * (G*32 + max(P.V partials, combine weights + sums)) bytes (step.py attention_smem).
// Code       the work item is attention_common.cuh.
#include "attention_common.cuh"

#define ATT_THREADS 128

#ifndef ATT_PREFETCH_NEXT
#define ATT_PREFETCH_NEXT 0
#endif
#define ATT_PF_CHUNK 4096  // bytes per L2 prefetch instruction
// Resident blocks per SM the register budget must allow: 4 (<= 128 registers per thread) for G <= 3, 3 for
// G = 4, 2 for G = 8 (the o[G][8] accumulators grow with G; sm_120 spills G = 4 at 128 registers).
#define ATT_MIN_BLOCKS(G) ((G) > 4 ? 2 : (G) == 4 ? 3 : 4)

// Bulk L2 prefetch of this block's share of [pf, pf + pf_bytes) (16-byte multiple), no registers or shared
// memory held; sm_90+ only (elsewhere a no-op).
__device__ __forceinline__ void prefetch_share_l2(const unsigned char* pf, unsigned long long pf_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned long long nb = (unsigned long long)gridDim.x * gridDim.y;
  const unsigned long long b = (unsigned long long)blockIdx.y * gridDim.x + blockIdx.x;
  for (unsigned long long off = (b * blockDim.x + threadIdx.x) * ATT_PF_CHUNK; off < pf_bytes;
       off += nb * blockDim.x * ATT_PF_CHUNK) {
    const unsigned int size = (unsigned int)min((unsigned long long)ATT_PF_CHUNK, pf_bytes - off);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(pf + off), "r"(size) : "memory");
  }
#endif
}

// One kernel per (head_dim, q heads per kv head): G is a compile-time constant so the per-head register
// arrays are exactly sized (no dead registers, no spills). Block (j, s) = item (kv head j, split s).
#define ATTENTION_INSTANCE(HD, G)                                                                         \
  extern "C" __global__ void __launch_bounds__(ATT_THREADS, ATT_MIN_BLOCKS(G))                           \
      attention_decode_hd##HD##_g##G(                                                                     \
      const __half* __restrict__ q, const __half* __restrict__ k_cache, const __half* __restrict__ v_cache, \
      const int* __restrict__ pos_ptr, float* part_ml, float* part_o, unsigned int* counters,             \
      __half* __restrict__ out, int n_kv, int max_splits, float scale, const unsigned char* pf,            \
      unsigned long long pf_bytes) {                                                                      \
    extern __shared__ float smem[];                                                                       \
    if (ATT_PREFETCH_NEXT) prefetch_share_l2(pf, pf_bytes);                                               \
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
