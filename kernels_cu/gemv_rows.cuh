// gemv_rows.cuh — the lm_head GEMV over row-major fp16 weights (shared with the embedding table when tied, as HF
// stores them): a warp per output row, with the final RMSNorm as its prologue and the greedy argmax in its epilogue.
//
// Computes   y[o] = W[o, :] · x in fp32 (8 fp16 products per 16-byte chunk, fp32 accumulation, a warp sum); with
//            ARGMAX also the greedy token and the step's bookkeeping (argmax_common.cuh argmax_finish).
// Layouts    W fp16 row-major [n_out, K] (HF [out, in]); x fp16 [K], or the fp32 residual [K] with norm_w; y fp32.
//            It keeps the plain layout because it already streams at about the copy bandwidth (128256 x 3072).
// Requires   K % 8 == 0 (16-byte rows).
// Bytes      n_out * K * 2 (weights, streamed once without L1 allocation) + K * 2..4 (x) per block + n_out * 4.
// Launch     block = GEMV_THREADS, up to ROWS_MIN_BLOCKS per SM, grid-stride over rows; dynamic shared memory
//            K * 2, or K * 8 + 128 with the RMSNorm prologue (x, h fp32 and norm_w parked; ops/lm_head.py).
#pragma once
#include "argmax_common.cuh"
#include "gemv_epilogue.cuh"
#include "gemv_prologue.cuh"

// 8 16-byte loads in flight per lane and 4 blocks per SM (<= 64 registers) already stream at about the copy bandwidth.
#define ROWS_MIN_BLOCKS 4
#define ROWS_LOADS 8

// 8 fp16 weights · 8 fp16 activations, accumulated in fp32.
__device__ __forceinline__ float dot8_f16(uint4 w, const __half* xs, int k) {
  const uint4 xv = *reinterpret_cast<const uint4*>(xs + k);
  float2 a = h2_to_f2(w.x), b = h2_to_f2(w.y), c = h2_to_f2(w.z), d = h2_to_f2(w.w);
  float2 p = h2_to_f2(xv.x), q = h2_to_f2(xv.y), r = h2_to_f2(xv.z), s = h2_to_f2(xv.w);
  float acc = a.x * p.x;
  acc = fmaf(a.y, p.y, acc); acc = fmaf(b.x, q.x, acc); acc = fmaf(b.y, q.y, acc);
  acc = fmaf(c.x, r.x, acc); acc = fmaf(c.y, r.y, acc); acc = fmaf(d.x, s.x, acc);
  acc = fmaf(d.y, s.y, acc);
  return acc;
}

// y[o] (EPI) = W[o, :] · x for fp16 row-major W, x fp16: every warp owns outputs gw, gw + n_warps, ... .
// With a.norm_w (the final RMSNorm as the lm_head's prologue): x = RMSNorm(a.x) * norm_w by norm_x_parked, bit-identical
// to rms_inv then rmsnorm_elem at 256 threads (h parked in `hs`, norm_w copied to `nws` before the PDL wait; shared memory
// K * 8 + 128 bytes, else K * 2); block 0 also stores x to `x_out` (the `final_norm` probe) when given.
// ARGMAX: each warp also keeps the best (y[o], o) of its outputs, and the block ends with argmax_finish
// (argmax_common.cuh): the greedy token and the step's bookkeeping without a kernel of their own.
template <int EPI, class Sync, bool ARGMAX = false>
__device__ __forceinline__ void gemv_rows(const GemvArgs a, const Sync sync, unsigned char* smem_raw,
                                          __half* x_out, const ArgmaxArgs am = {}) {
  const int K = a.K, n_out = a.n_out;
  __half* xs = reinterpret_cast<__half*>(smem_raw);
  float* hs = reinterpret_cast<float*>(smem_raw + (size_t)K * 2);
  __half* nws = reinterpret_cast<__half*>(smem_raw + (size_t)K * 6);
  float* red = reinterpret_cast<float*>(smem_raw + (size_t)K * 8);
  const bool norm = a.norm_w != nullptr;
  const int lane = threadIdx.x % AF_WARP;
  const int nwarps = blockDim.x / AF_WARP;
  const int stride = gridDim.x * nwarps;
  const int nchunks = K / 8;
  const size_t row_bytes = (size_t)K * 2;

  int o = blockIdx.x * nwarps + threadIdx.x / AF_WARP;
  uint4 wv[ROWS_LOADS];
  if (o < n_out) {  // the first iteration's weights of this warp's first output, before the sync
    const unsigned char* wrow = a.W + (size_t)o * row_bytes;
#pragma unroll
    for (int u = 0; u < ROWS_LOADS; ++u) {
      const int c = lane + u * AF_WARP;
      wv[u] = c < nchunks ? ld_stream(wrow + (size_t)c * 16) : make_uint4(0, 0, 0, 0);
    }
  }
  if (norm) stage_norm_w_async(a, nws);  // constant: before the wait
  sync.arrive_wait();
  if (norm) {
    norm_x_parked<0>(a, red, hs, nws, [&](int p, unsigned v) { reinterpret_cast<unsigned*>(xs)[p] = v; });
  } else {
    const __half* src = reinterpret_cast<const __half*>(a.x);
    for (int i = threadIdx.x; i < K / 8; i += blockDim.x) reinterpret_cast<uint4*>(xs)[i] = ld_cg16(src + 8 * i);
  }
  __syncthreads();
  if (x_out != nullptr && blockIdx.x == 0)
    for (int i = threadIdx.x; i < K / 8; i += blockDim.x)
      reinterpret_cast<uint4*>(x_out)[i] = reinterpret_cast<const uint4*>(xs)[i];

  bool prefetched = true;
  float bv = -AF_INF;  // ARGMAX: this warp's best (value, index) so far (the same in every lane)
  int bi = 0x7fffffff;
  for (; o < n_out; o += stride) {
    const unsigned char* wrow = a.W + (size_t)o * row_bytes;
    float acc = 0.f;
    for (int c0 = lane; c0 < nchunks; c0 += AF_WARP * ROWS_LOADS) {
      if (!prefetched) {
#pragma unroll
        for (int u = 0; u < ROWS_LOADS; ++u) {
          const int c = c0 + u * AF_WARP;
          wv[u] = c < nchunks ? ld_stream(wrow + (size_t)c * 16) : make_uint4(0, 0, 0, 0);
        }
      }
      prefetched = false;
#pragma unroll
      for (int u = 0; u < ROWS_LOADS; ++u) {
        const int c = c0 + u * AF_WARP;
        if (c < nchunks) acc += dot8_f16(wv[u], xs, c * 8);
      }
    }
    acc = warp_sum(acc);
    if (lane == 0) gemv_epilogue<EPI>(a, RopeArgs{}, o, acc, acc);
    if (ARGMAX) better(bv, bi, acc, o);  // acc is what EPI_F32 stored
  }
  if (ARGMAX) argmax_finish(bv, bi, am);
}

// x_out: where block 0 stores x (0: nowhere); with norm_w the final norm's output (the `final_norm` probe).
#define GEMV_ROWS_INSTANCE(NAME, EPI)                                                                     \
  extern "C" __global__ void __launch_bounds__(GEMV_THREADS, ROWS_MIN_BLOCKS)                            \
  NAME(const unsigned char* __restrict__ W, const float* __restrict__ scales, const void* __restrict__ x, \
       const __half* __restrict__ norm_w, float eps, void* __restrict__ y, int n_out, int K,              \
       __half* __restrict__ x_out) {                                                                      \
    AF_TIMELINE_BLOCK;                                                                                    \
    extern __shared__ __align__(16) unsigned char smem_raw[];                                             \
    gemv_rows<EPI>(GemvArgs{W, scales, x, norm_w, eps, y, n_out, K}, PdlSync{}, smem_raw, x_out);        \
  }
// The lm_head with the greedy argmax and the step's bookkeeping in its epilogue (fp32 logits, EPI_F32).
#define GEMV_ROWS_ARGMAX_INSTANCE(NAME)                                                                   \
  extern "C" __global__ void __launch_bounds__(GEMV_THREADS, ROWS_MIN_BLOCKS)                            \
  NAME(const unsigned char* __restrict__ W, const float* __restrict__ scales, const void* __restrict__ x, \
       const __half* __restrict__ norm_w, float eps, void* __restrict__ y, int n_out, int K,              \
       __half* __restrict__ x_out, float* part_val, int* part_idx, unsigned int* counter, int* pos,       \
       int* cur_token, const int* __restrict__ prompt, const int* __restrict__ prompt_len, int* out_tokens, \
       int advance) {                                                                                     \
    AF_TIMELINE_BLOCK;                                                                                    \
    extern __shared__ __align__(16) unsigned char smem_raw[];                                             \
    gemv_rows<EPI_F32, PdlSync, true>(GemvArgs{W, scales, x, norm_w, eps, y, n_out, K}, PdlSync{}, smem_raw, \
                                      x_out, ArgmaxArgs{part_val, part_idx, counter, pos, cur_token, prompt,     \
                                                 prompt_len, out_tokens, advance});                       \
  }
