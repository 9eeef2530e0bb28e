// attention_short.cu — GQA attention of one query token over a short contiguous KV cache: one block per kv
// head, the head's whole K/V range staged in shared memory before the PDL wait, no split combine.
//
// Computes   for q head hq (kv head j = hq / G, G = n_heads / n_kv), L = *pos + 1 cached positions:
//              out[hq] = sum_t softmax_t(q[hq] . K[t, j] * scale) V[t, j]   (fp16 in, fp32 scores and sums, fp16 out)
//            — the same result as attention.cu, which splits the positions over many blocks and combines the
//            splits through global partials and an atomic ticket (2-4 dependent L2 rounds after the release).
// Scheme     block j = kv head j, all G q heads. Before the PDL wait the block cp.asyncs K and V rows
//            0 .. L-2 (written by earlier steps; at most `cap`, the rows that fit) into shared memory; after it
//            only q and row L-1 (this step's QKV kernel appends it) are read: one L2 round. Then, per chunk of
//            at most min(cap, 512) positions (one chunk whenever L <= cap, which is when the engine uses it), on
//            the tensor cores (mma m16n8k16, fp16 x fp16 -> fp32; the G q heads padded to the mma's N = 8):
//              scores    S[pos][head] = K q^T: warp w takes 16-position groups w, w + 8, ... (K by ldmatrix, q's
//                        fragments loaded once), times scale in fp32;
//              softmax   one block max per head (a barrier), P = exp(S - max) rounded to fp16, stored head-major,
//                        the sums taken over the rounded values;
//              P.V       O^T[dim][head] = V^T P^T: warp w takes the 16-dim tile w % (hd/16) over every
//                        (8 / (hd/16))-th 16-position step (V by ldmatrix.trans), the phases summed at the end.
//            Chunks after the first (L > cap: tests only) are loaded after the wait and folded in with the
//            online-softmax rescale. K/V rows sit in shared memory with their 16-byte pieces XOR-swizzled by the
//            row (piece c of row t at c ^ (t & 7)): ldmatrix reads 8 rows of one piece without bank conflicts.
//            Why tensor cores: on the FP32 pipes (a thread per position) the scores alone take 5.2 µs at L = 305
//            (hd 128, G = 3).
// Layouts    q fp16 [n_heads*hd] (post-RoPE, start of the qkv buffer); k_cache/v_cache: this layer's slab
//            fp16 [max_seq][n_kv*hd]; out fp16 [n_heads*hd]. Dynamic shared memory (ops/attention.py
//            attention_short_smem, cap16 = cap rounded up to 16): K [cap16][hd] fp16 (at the end the phases'
//            reduction scratch [8 warps][16][8] fp32), V [cap16][hd] fp16, P fp16 [8][cap16 + 8].
// Bytes      2 * L * n_kv * hd * 2 (K and V, each read once) + q and out.
// Launch     attention_short_hd{64,128}_g{1,2,3,4,8,16}: grid = (n_kv * V) (V = 2 for G = 16), block = 256,
//            dyn. smem = all a block may have (ops/attention.py attention_short_launch; short_smem(hd, cap) is what
//            cap needs), so that no other kernel's block shares the SM: the next GEMV's early blocks' weight loads
//            would stall this block's shared-memory traffic; <= 128 registers per thread.
#include "attention_short.cuh"

// The kernels' wait: for the QKV kernel (programmatic dependent launch), then the next kernel may launch.
struct AtsPdlWait {
  __device__ __forceinline__ void operator()() const {
    pdl_wait_unless_instrument<2>();  // AF_NO_WAIT (common.cuh)
    pdl_launch_dependents();
  }
};

// One kernel per (head_dim, q heads per kv head), like attention.cu. Block j = kv head j; with G > ATS_HEADS (16:
// Llama-3.1-405B over 8 GPUs) G / ATS_HEADS blocks per kv head, each taking ATS_HEADS of its q heads.
#define ATS_BG(G) ((G) > ATS_HEADS ? ATS_HEADS : (G))
#define ATS_BV(G) ((G) > ATS_HEADS ? (G) / ATS_HEADS : 1)
#define ATTENTION_SHORT_INSTANCE(NAME, HD, G)                                                             \
  extern "C" __global__ void __launch_bounds__(ATS_THREADS, ATS_MIN_BLOCKS)                              \
      NAME(                                                                                               \
      const __half* __restrict__ q, const __half* __restrict__ k_cache, const __half* __restrict__ v_cache, \
      const int* __restrict__ pos_ptr, __half* __restrict__ out, int n_kv, int cap, float scale) {        \
    AF_TIMELINE_BLOCK;                                                                                    \
    extern __shared__ __align__(16) char ats_smem[];                                                      \
    /* pos was written by the previous step's argmax, complete before this step's first kernel */        \
    attention_short_item<HD, ATS_BG(G), ATS_THREADS, ATS_BV(G), 0>(q, k_cache, v_cache, *pos_ptr + 1, blockIdx.x, out, \
                                                                n_kv, cap, scale, ats_smem, AtsPdlWait{});  \
  }

ATTENTION_SHORT_INSTANCE(attention_short_hd64_g1, 64, 1)
ATTENTION_SHORT_INSTANCE(attention_short_hd64_g2, 64, 2)
ATTENTION_SHORT_INSTANCE(attention_short_hd64_g3, 64, 3)
ATTENTION_SHORT_INSTANCE(attention_short_hd64_g4, 64, 4)
ATTENTION_SHORT_INSTANCE(attention_short_hd64_g8, 64, 8)
ATTENTION_SHORT_INSTANCE(attention_short_hd64_g16, 64, 16)
ATTENTION_SHORT_INSTANCE(attention_short_hd128_g1, 128, 1)
ATTENTION_SHORT_INSTANCE(attention_short_hd128_g2, 128, 2)
ATTENTION_SHORT_INSTANCE(attention_short_hd128_g3, 128, 3)
ATTENTION_SHORT_INSTANCE(attention_short_hd128_g4, 128, 4)
ATTENTION_SHORT_INSTANCE(attention_short_hd128_g8, 128, 8)
ATTENTION_SHORT_INSTANCE(attention_short_hd128_g16, 128, 16)
