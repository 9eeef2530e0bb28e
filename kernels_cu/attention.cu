// attention.cu — GQA attention of one query token over the contiguous KV cache, split over the
// sequence (flash-decoding) with the split-combine fused into the same launch.
//
// Computes   for q head hq (kv head j = hq / G, G = n_heads / n_kv), L = *pos + 1 cached positions:
//              out[hq] = sum_t softmax_t(q[hq] . K[t, j] * scale) V[t, j]       (fp32 math, fp16 out)
// Scheme     block (j, s) handles kv head j and the 32 positions [32 s, 32 s + 32) for all G q heads that
//            share it (each K/V row is read once for the whole group). Latency first: every thread
//            issues ALL its K and V loads (16 bytes each, streaming) before any math, so a block costs
//            about one DRAM latency. Thread (p, l) owns 16-byte slice l of positions p, p + P, ...;
//            scores are reduced over the hd/8 lanes of a position with shuffles; one warp per head does
//            the chunk softmax (32 positions = 32 lanes); P.V partial sums are reduced through shared
//            memory. With one chunk the block writes `out` directly. Otherwise it writes (max, sum,
//            o[hd]) partials; the last block of head j to finish (atomic ticket after __threadfence)
//            rescales and sums them into `out` and resets its ticket. Blocks whose chunk lies beyond L
//            exit at once, so one launch shape (captured in the graph) serves every position < max_seq.
// Layouts    q fp16 [n_heads*hd] (post-RoPE, start of the qkv buffer); k_cache/v_cache: this layer's slab
//            fp16 [max_seq][n_kv*hd]; part_ml fp32 [n_heads][max_splits][2]; part_o fp32
//            [n_heads][max_splits][hd]; counters uint32 [n_kv]; out fp16 [n_heads*hd].
// Bytes      2 * L * n_kv * hd * 2 (K and V, each read once) + partials n_heads * splits * (hd + 2) * 4 * 2.
// Launch     attention_decode_hd{64,128}_g{1,2,3,4,8}: grid = (n_kv, ceil(max_seq / 32)), block = 128,
//            dyn. smem = 4 * (G*32 + G*1024) bytes (1024 >= max_splits: max_seq <= 32768).
#include "common.cuh"

#define ATT_CHUNK 32
#define ATT_THREADS 128

__device__ __forceinline__ void f8_from_u4(uint4 u, float* f) {
  const float2 a = h2_to_f2(u.x), b = h2_to_f2(u.y), c = h2_to_f2(u.z), d = h2_to_f2(u.w);
  f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y; f[4] = c.x; f[5] = c.y; f[6] = d.x; f[7] = d.y;
}

template <int HD, int G>
__device__ __forceinline__ void attention_impl(const __half* __restrict__ q, const __half* __restrict__ k_cache,
                                               const __half* __restrict__ v_cache, const int* __restrict__ pos_ptr,
                                               float* part_ml, float* part_o, unsigned int* counters,
                                               __half* __restrict__ out, int n_kv, int max_splits, float scale) {
  constexpr int DG = HD / 8;                 // 16-byte slices per head row = lanes per position
  constexpr int PG = ATT_THREADS / DG;       // positions processed side by side
  constexpr int PPT = ATT_CHUNK / PG;        // positions per thread
  const int j = blockIdx.x, split = blockIdx.y;
  pdl_wait();  // q and the K/V row at pos come from the QKV kernel
  pdl_launch_dependents();
  const int len = *pos_ptr + 1;
  const int n_splits = (len + ATT_CHUNK - 1) / ATT_CHUNK;
  if (split >= n_splits) return;
  const int t0 = split * ATT_CHUNK;
  const int n = min(len - t0, ATT_CHUNK);
  const size_t kv_dim = (size_t)n_kv * HD;
  const int lane = threadIdx.x % AF_WARP, warp = threadIdx.x / AF_WARP;
  const int l = threadIdx.x % DG, pg = threadIdx.x / DG;

  // ---- all K and V loads of this thread, issued before anything else ----
  uint4 kr[PPT], vr[PPT];
#pragma unroll
  for (int i = 0; i < PPT; ++i) {
    const int t = pg + i * PG;
    const size_t off = (size_t)(t0 + t) * kv_dim + (size_t)j * HD + l * 8;
    kr[i] = t < n ? ld_stream(k_cache + off) : make_uint4(0, 0, 0, 0);
    vr[i] = t < n ? ld_stream(v_cache + off) : make_uint4(0, 0, 0, 0);
  }

  extern __shared__ float smem[];
  float* sc = smem;                          // [G][ATT_CHUNK] scores, then probabilities
  float* acc = sc + G * ATT_CHUNK;           // [PG][G][HD] partial P.V sums; later [G][max_splits] weights
  __shared__ float s_m[G], s_l[G];
  __shared__ bool last;

  // ---- scores ----
  {
    float qf[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        f8_from_u4(*reinterpret_cast<const uint4*>(q + (size_t)(j * G + g) * HD + l * 8), qf[g]);
#pragma unroll
        for (int e = 0; e < 8; ++e) qf[g][e] *= scale;
      }
#pragma unroll
    for (int i = 0; i < PPT; ++i) {
      const int t = pg + i * PG;
      float kf[8];
      f8_from_u4(kr[i], kf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) s = fmaf(qf[g][e], kf[e], s);
#pragma unroll
        for (int o = DG / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (t < n && l == 0) sc[g * ATT_CHUNK + t] = s;
      }
    }
  }
  __syncthreads();

  // ---- chunk softmax statistics: one warp per q head, one lane per position ----
  for (int g = warp; g < G; g += ATT_THREADS / AF_WARP) {
    const float s = lane < n ? sc[g * ATT_CHUNK + lane] : -AF_INF;
    const float m = warp_max(s);
    const float p = lane < n ? __expf(s - m) : 0.f;
    sc[g * ATT_CHUNK + lane] = p;
    const float sum = warp_sum(p);
    if (lane == 0) { s_m[g] = m; s_l[g] = sum; }
  }
  __syncthreads();

  // ---- P.V from the V rows already in registers ----
  {
    float o[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int e = 0; e < 8; ++e) o[g][e] = 0.f;
#pragma unroll
    for (int i = 0; i < PPT; ++i) {
      const int t = pg + i * PG;
      if (t < n) {
        float vf[8];
        f8_from_u4(vr[i], vf);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float p = sc[g * ATT_CHUNK + t];
#pragma unroll
          for (int e = 0; e < 8; ++e) o[g][e] = fmaf(p, vf[e], o[g][e]);
        }
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[((size_t)pg * G + g) * HD + l * 8 + e] = o[g][e];
  }
  __syncthreads();

  const int gh = G * HD;
  if (n_splits == 1) {  // the whole context fits one chunk: finish here
    for (int i = threadIdx.x; i < gh; i += ATT_THREADS) {
      float s = 0.f;
#pragma unroll
      for (int p = 0; p < PG; ++p) s += acc[p * gh + i];
      out[(size_t)j * gh + i] = __float2half(s / s_l[i / HD]);
    }
    return;
  }

  for (int i = threadIdx.x; i < gh; i += ATT_THREADS) {
    float s = 0.f;
#pragma unroll
    for (int p = 0; p < PG; ++p) s += acc[p * gh + i];
    part_o[((size_t)(j * G + i / HD) * max_splits + split) * HD + i % HD] = s;
  }
  if (threadIdx.x < G) {
    float* ml = part_ml + ((size_t)(j * G + threadIdx.x) * max_splits + split) * 2;
    ml[0] = s_m[threadIdx.x];
    ml[1] = s_l[threadIdx.x];
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counters + j, 1u) == (unsigned int)n_splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();

  // ---- combine (last block of kv head j): weights exp(m_s - M) / sum_s l_s exp(m_s - M) ----
  float* coef = acc;  // P.V partials are written out; reuse their shared memory
  for (int g = warp; g < G; g += ATT_THREADS / AF_WARP) {
    const float* ml = part_ml + (size_t)(j * G + g) * max_splits * 2;
    float M = -AF_INF;
    for (int s = lane; s < n_splits; s += AF_WARP) M = fmaxf(M, __ldcg(ml + 2 * s));
    M = warp_max(M);
    float L = 0.f;
    for (int s = lane; s < n_splits; s += AF_WARP) {
      const float w = __expf(__ldcg(ml + 2 * s) - M);
      coef[g * max_splits + s] = w;
      L += w * __ldcg(ml + 2 * s + 1);
    }
    L = warp_sum(L);
    __syncwarp();
    for (int s = lane; s < n_splits; s += AF_WARP) coef[g * max_splits + s] /= L;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < gh; i += ATT_THREADS) {
    const int g = i / HD, d = i % HD;
    const float* po = part_o + (size_t)(j * G + g) * max_splits * HD + d;
    // 8 independent accumulators: the 8 L2 loads of a round are issued back to back instead of one
    // dependent load per split (at ctx 8192 there are 256 splits).
    float s8[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int sp = 0;
    for (; sp + 8 <= n_splits; sp += 8) {
#pragma unroll
      for (int u = 0; u < 8; ++u)
        s8[u] = fmaf(coef[g * max_splits + sp + u], __ldcg(po + (size_t)(sp + u) * HD), s8[u]);
    }
    for (; sp < n_splits; ++sp) s8[0] = fmaf(coef[g * max_splits + sp], __ldcg(po + (size_t)sp * HD), s8[0]);
    const float s = ((s8[0] + s8[1]) + (s8[2] + s8[3])) + ((s8[4] + s8[5]) + (s8[6] + s8[7]));
    out[(size_t)j * gh + i] = __float2half(s);
  }
  if (threadIdx.x == 0) counters[j] = 0u;
}

// One kernel per (head_dim, q heads per kv head): G is a compile-time constant so the per-head register
// arrays are exactly sized (no dead registers, no spills).
#define ATTENTION_INSTANCE(HD, G)                                                                         \
  extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_decode_hd##HD##_g##G(               \
      const __half* __restrict__ q, const __half* __restrict__ k_cache, const __half* __restrict__ v_cache, \
      const int* __restrict__ pos_ptr, float* part_ml, float* part_o, unsigned int* counters,             \
      __half* __restrict__ out, int n_kv, int max_splits, float scale) {                                  \
    attention_impl<HD, G>(q, k_cache, v_cache, pos_ptr, part_ml, part_o, counters, out, n_kv, max_splits, \
                          scale);                                                                         \
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
