// attention_common.cuh — the GQA decode-attention work item of attention.cu (one launch per layer).
// See attention.cu for the scheme and layouts.
#pragma once
#include "common.cuh"

#define ATT_CHUNK 32

__device__ __forceinline__ void f8_from_u4(uint4 u, float* f) {
  const float2 a = h2_to_f2(u.x), b = h2_to_f2(u.y), c = h2_to_f2(u.z), d = h2_to_f2(u.w);
  f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y; f[4] = c.x; f[5] = c.y; f[6] = d.x; f[7] = d.y;
}

// Shared memory (floats) one item needs: scores [G][ATT_CHUNK] + P.V partials [T / (HD/8)][G][HD]
// (the latter reused for the [G][max_splits] combine weights).
template <int HD, int G, int T>
__host__ __device__ constexpr int attention_smem_floats() { return G * ATT_CHUNK + (T / (HD / 8)) * G * HD; }

// One work item: kv head j, positions [32 split, 32 split + 32) of the len cached ones, all G q heads.
// Called by all T threads of the block. K/V (written by earlier launches) use the streaming read-only path,
// q a plain load; partials (written by other blocks of this launch) are always .cg.
// sync.arrive_wait() separates what the item may read before the previous kernel (the QKV GEMV) is done —
// the K/V rows before position len - 1, written by earlier steps — from q and the row at len - 1.
template <int HD, int G, int T, class Sync>
__device__ __forceinline__ void attention_item(const __half* q, const __half* k_cache, const __half* v_cache,
                                               int len, int j, int split, float* part_ml, float* part_o,
                                               unsigned int* counters, __half* out, int n_kv, int max_splits,
                                               float scale, float* smem, const Sync sync) {
  constexpr int DG = HD / 8;                 // 16-byte slices per head row = lanes per position
  constexpr int PG = T / DG;                 // positions processed side by side
  constexpr int PPT = ATT_CHUNK / PG;        // positions per thread
  static_assert(PPT >= 1 && ATT_CHUNK % PG == 0, "chunk must cover the block's position groups");
  const int n_splits = (len + ATT_CHUNK - 1) / ATT_CHUNK;
  const int t0 = split * ATT_CHUNK;
  const int n = min(len - t0, ATT_CHUNK);
  const size_t kv_dim = (size_t)n_kv * HD;
  const int lane = threadIdx.x % AF_WARP, warp = threadIdx.x / AF_WARP;
  const int l = threadIdx.x % DG, pg = threadIdx.x / DG;

  // ---- all K and V loads of this thread, issued before anything else (rows before len - 1: before the wait) ----
  uint4 kr[PPT], vr[PPT];
#pragma unroll
  for (int i = 0; i < PPT; ++i) {
    const int t = pg + i * PG;
    const size_t off = (size_t)(t0 + t) * kv_dim + (size_t)j * HD + l * 8;
    const bool older = t < n && t0 + t < len - 1;
    kr[i] = older ? ld_stream(k_cache + off) : make_uint4(0, 0, 0, 0);
    vr[i] = older ? ld_stream(v_cache + off) : make_uint4(0, 0, 0, 0);
  }
  sync.arrive_wait();  // q and the K/V row at len - 1 come from the previous kernel
#pragma unroll
  for (int i = 0; i < PPT; ++i) {
    const int t = pg + i * PG;
    if (t < n && t0 + t == len - 1) {
      const size_t off = (size_t)(t0 + t) * kv_dim + (size_t)j * HD + l * 8;
      kr[i] = ld_stream(k_cache + off);
      vr[i] = ld_stream(v_cache + off);
    }
  }

  float* sc = smem;                          // [G][ATT_CHUNK] scores, then probabilities
  float* acc = sc + G * ATT_CHUNK;           // [PG][G][HD] partial P.V sums; later [G][max_splits] weights
  __shared__ float s_m[G], s_l[G];
  __shared__ bool last;

  // ---- scores ----
  {
    float qf[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const __half* qp = q + (size_t)(j * G + g) * HD + l * 8;
        f8_from_u4(*reinterpret_cast<const uint4*>(qp), qf[g]);
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
  for (int g = warp; g < G; g += T / AF_WARP) {
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
    for (int i = threadIdx.x; i < gh; i += T) {
      float s = 0.f;
#pragma unroll
      for (int p = 0; p < PG; ++p) s += acc[p * gh + i];
      out[(size_t)j * gh + i] = __float2half(s / s_l[i / HD]);
    }
    return;
  }

  for (int i = threadIdx.x; i < gh; i += T) {
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
  __syncthreads();  // all partials of this block written; thread 0's acq_rel ticket publishes them
  if (threadIdx.x == 0) last = atom_add_acq_rel_gpu(counters + j, 1u) == (unsigned int)n_splits - 1;
  __syncthreads();
  if (!last) return;  // the last block acquired every other block's partials through its ticket

  // ---- combine (last block of kv head j): weights exp(m_s - M) / sum_s l_s exp(m_s - M) ----
  float* coef = acc;  // P.V partials are written out; reuse their shared memory
  for (int g = warp; g < G; g += T / AF_WARP) {
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
  for (int i = threadIdx.x; i < gh; i += T) {
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

