// attention.cu — GQA attention of one query token over the contiguous KV cache, split over the
// sequence (flash-decoding) with the split-combine fused into the same launch.
//
// Computes   for q head hq (kv head j = hq / G, G = n_heads / n_kv), L = *pos + 1 cached positions:
//              out[hq] = sum_t softmax_t(q[hq] . K[t, j] * scale) V[t, j]       (fp32 math, fp16 out)
// Scheme     block (j, s) handles kv head j and positions [64 s, 64 s + 64) for all G q heads sharing
//            it (each K/V row is read once for the whole group): scores -> chunk max/sum -> P.V. With
//            one chunk it writes `out` directly. Otherwise it writes (max, sum, o[hd]) partials; the
//            last block of head j to finish (atomic ticket after __threadfence) rescales and sums the
//            partials into `out` and resets its counter. Blocks whose chunk lies beyond L exit at once,
//            so one launch shape (captured in the graph) serves every position up to max_seq.
// Layouts    q fp16 [n_heads*hd] (post-RoPE); k_cache/v_cache: this layer's slab fp16 [max_seq][n_kv*hd];
//            part_ml fp32 [n_heads][max_splits][2]; part_o fp32 [n_heads][max_splits][hd];
//            counters uint32 [n_kv]; out fp16 [n_heads*hd].
// Bytes      2 * L * n_kv * hd * 2 (K and V, each read once) + partials (n_heads * splits * (hd+2) * 4 * 2).
// Launch     attention_decode_hd64 / _hd128: grid = (n_kv, max_splits), block = 128,
//            dyn. smem = 4 * (G*64 + (128/(hd/8))*G*hd + G*max_splits) bytes; hd in {64, 128}, G <= 8.
#include "common.cuh"

#define ATT_CHUNK 64
#define ATT_THREADS 128
#define ATT_MAXG 8

template <int HD>
__device__ __forceinline__ void attention_impl(const __half* __restrict__ q, const __half* __restrict__ k_cache,
                                               const __half* __restrict__ v_cache, const int* __restrict__ pos_ptr,
                                               float* part_ml, float* part_o, unsigned int* counters,
                                               __half* __restrict__ out, int n_kv, int G, int max_splits,
                                               float scale) {
  constexpr int hd = HD;
  const int j = blockIdx.x, split = blockIdx.y;
  const int len = *pos_ptr + 1;
  const int n_splits = (len + ATT_CHUNK - 1) / ATT_CHUNK;
  if (split >= n_splits) return;
  const int t0 = split * ATT_CHUNK;
  const int n = min(len - t0, ATT_CHUNK);
  const size_t kv_dim = (size_t)n_kv * hd;
  const int lane = threadIdx.x % AF_WARP, warp = threadIdx.x / AF_WARP;
  constexpr int dgroups = hd / 8;               // 16-byte slices of a head row
  constexpr int tslots = ATT_THREADS / dgroups; // positions processed side by side in P.V

  extern __shared__ float smem[];
  float* sc = smem;                             // [G][ATT_CHUNK] scores, then probabilities
  float* acc = sc + G * ATT_CHUNK;              // [tslots][G][hd] partial P.V sums
  float* coef = acc + tslots * G * hd;          // [G][max_splits] combine weights
  __shared__ float s_m[ATT_MAXG], s_l[ATT_MAXG];
  __shared__ bool last;

  // ---- scores: a group of `dgroups` lanes per position, 8 elements per lane ----
  {
    constexpr int ppw = AF_WARP / dgroups;
    const int sub = lane / dgroups, l = lane % dgroups;
    float qf[ATT_MAXG][8];
#pragma unroll
    for (int g = 0; g < ATT_MAXG; ++g) {
      if (g < G) {
        const uint4 u = *reinterpret_cast<const uint4*>(q + (size_t)(j * G + g) * hd + l * 8);
        const float2 a = h2_to_f2(u.x), b = h2_to_f2(u.y), c = h2_to_f2(u.z), d = h2_to_f2(u.w);
        qf[g][0] = a.x * scale; qf[g][1] = a.y * scale; qf[g][2] = b.x * scale; qf[g][3] = b.y * scale;
        qf[g][4] = c.x * scale; qf[g][5] = c.y * scale; qf[g][6] = d.x * scale; qf[g][7] = d.y * scale;
      }
    }
    for (int base = warp * ppw; base < n; base += (ATT_THREADS / AF_WARP) * ppw) {
      const int t = base + sub;
      float kf[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      if (t < n) {
        const uint4 u = ld_stream(k_cache + (size_t)(t0 + t) * kv_dim + (size_t)j * hd + l * 8);
        const float2 a = h2_to_f2(u.x), b = h2_to_f2(u.y), c = h2_to_f2(u.z), d = h2_to_f2(u.w);
        kf[0] = a.x; kf[1] = a.y; kf[2] = b.x; kf[3] = b.y; kf[4] = c.x; kf[5] = c.y; kf[6] = d.x; kf[7] = d.y;
      }
#pragma unroll
      for (int g = 0; g < ATT_MAXG; ++g) {
        if (g < G) {
          float s = 0.f;
#pragma unroll
          for (int e = 0; e < 8; ++e) s = fmaf(qf[g][e], kf[e], s);
#pragma unroll
          for (int o = dgroups / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
          if (t < n && l == 0) sc[g * ATT_CHUNK + t] = s;
        }
      }
    }
  }
  __syncthreads();

  // ---- chunk softmax statistics: one warp per q head ----
  for (int g = warp; g < G; g += ATT_THREADS / AF_WARP) {
    float m = -AF_INF;
    for (int t = lane; t < n; t += AF_WARP) m = fmaxf(m, sc[g * ATT_CHUNK + t]);
    m = warp_max(m);
    float l = 0.f;
    for (int t = lane; t < n; t += AF_WARP) {
      const float p = __expf(sc[g * ATT_CHUNK + t] - m);
      sc[g * ATT_CHUNK + t] = p;
      l += p;
    }
    l = warp_sum(l);
    if (lane == 0) { s_m[g] = m; s_l[g] = l; }
  }
  __syncthreads();

  // ---- P.V: thread (ts, dg) accumulates 8 output dims over positions ts, ts + tslots, ... ----
  {
    const int dg = threadIdx.x % dgroups, ts = threadIdx.x / dgroups;
    float o[ATT_MAXG][8];
#pragma unroll
    for (int g = 0; g < ATT_MAXG; ++g)
#pragma unroll
      for (int e = 0; e < 8; ++e) o[g][e] = 0.f;
    for (int t = ts; t < n; t += tslots) {
      const uint4 u = ld_stream(v_cache + (size_t)(t0 + t) * kv_dim + (size_t)j * hd + dg * 8);
      const float2 a = h2_to_f2(u.x), b = h2_to_f2(u.y), c = h2_to_f2(u.z), d = h2_to_f2(u.w);
      const float vf[8] = {a.x, a.y, b.x, b.y, c.x, c.y, d.x, d.y};
#pragma unroll
      for (int g = 0; g < ATT_MAXG; ++g) {
        if (g < G) {
          const float p = sc[g * ATT_CHUNK + t];
#pragma unroll
          for (int e = 0; e < 8; ++e) o[g][e] = fmaf(p, vf[e], o[g][e]);
        }
      }
    }
#pragma unroll
    for (int g = 0; g < ATT_MAXG; ++g)
      if (g < G)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[((size_t)ts * G + g) * hd + dg * 8 + e] = o[g][e];
  }
  __syncthreads();

  const int gh = G * hd;
  if (n_splits == 1) {  // the whole context fits one chunk: finish here
    for (int i = threadIdx.x; i < gh; i += ATT_THREADS) {
      float s = 0.f;
      for (int ts = 0; ts < tslots; ++ts) s += acc[ts * gh + i];
      out[(size_t)j * gh + i] = __float2half(s / s_l[i / hd]);
    }
    return;
  }

  for (int i = threadIdx.x; i < gh; i += ATT_THREADS) {
    float s = 0.f;
    for (int ts = 0; ts < tslots; ++ts) s += acc[ts * gh + i];
    const int g = i / hd, d = i % hd;
    part_o[((size_t)(j * G + g) * max_splits + split) * hd + d] = s;
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
    const int g = i / hd, d = i % hd;
    const float* po = part_o + (size_t)(j * G + g) * max_splits * hd + d;
    float s = 0.f;
    for (int sp = 0; sp < n_splits; ++sp) s = fmaf(coef[g * max_splits + sp], __ldcg(po + (size_t)sp * hd), s);
    out[(size_t)j * gh + i] = __float2half(s);
  }
  if (threadIdx.x == 0) counters[j] = 0u;
}

#define ATTENTION_INSTANCE(HD)                                                                            \
  extern "C" __global__ void __launch_bounds__(ATT_THREADS) attention_decode_hd##HD(                      \
      const __half* __restrict__ q, const __half* __restrict__ k_cache, const __half* __restrict__ v_cache, \
      const int* __restrict__ pos_ptr, float* part_ml, float* part_o, unsigned int* counters,             \
      __half* __restrict__ out, int n_kv, int G, int max_splits, float scale) {                           \
    attention_impl<HD>(q, k_cache, v_cache, pos_ptr, part_ml, part_o, counters, out, n_kv, G, max_splits, \
                       scale);                                                                            \
  }

ATTENTION_INSTANCE(64)
ATTENTION_INSTANCE(128)
