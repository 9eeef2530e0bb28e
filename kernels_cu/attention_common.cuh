// attention_common.cuh — the GQA decode-attention work item of attention.cu (one launch per layer).
// See attention.cu for the scheme and layouts.
#pragma once
#include "common.cuh"

#define ATT_CHUNK 32  // positions per sub-chunk: one position per lane in the softmax warps

#ifndef ATT_STAGES
#define ATT_STAGES 2  // sub-chunks of K/V in flight per block (per-thread cp.async ring in shared memory)
#endif
#ifndef ATT_COMBINE_LOADS
#define ATT_COMBINE_LOADS 8  // independent 16-byte partial loads per thread per round of the split combine
#endif

__device__ __forceinline__ void f8_from_u4(uint4 u, float* f) {
  const float2 a = h2_to_f2(u.x), b = h2_to_f2(u.y), c = h2_to_f2(u.z), d = h2_to_f2(u.w);
  f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y; f[4] = c.x; f[5] = c.y; f[6] = d.x; f[7] = d.y;
}

// Shared memory of one item (dynamic, in this order): the K/V ring [ATT_STAGES][K|V][ATT_CHUNK][HD] fp16, scores
// [G][ATT_CHUNK] fp32, then the larger of the P.V partials [T / (HD/8)][G][HD] fp32 and the combine's scratch
// (maxima and weights [2][G][max_splits], float4 sums [R][G*HD/4]). step.py attention_smem computes the same.

// Splits of kv head j at context length len: one per ATT_CHUNK-position sub-chunk up to max_splits (the
// launch's grid.y), beyond that each split takes a contiguous, even share of the sub-chunks.
__device__ __forceinline__ int attention_splits(int len, int max_splits) {
  return min((len + ATT_CHUNK - 1) / ATT_CHUNK, max_splits);
}

// One work item: kv head j, split `split` of the len cached positions, all G q heads. Called by all T threads
// of the block. K/V (written by earlier launches) arrive through the cp.async ring (L2 -> shared, .cg), q by
// a plain load; partials (written by other blocks of this launch) are always read .cg.
// sync.arrive_wait() separates what the item may read before the previous kernel (the QKV GEMV) is done —
// the K/V rows before position len - 1, written by earlier steps — from q and the row at len - 1.
template <int HD, int G, int T, class Sync>
__device__ __forceinline__ void attention_item(const __half* q, const __half* k_cache, const __half* v_cache,
                                               int len, int j, int split, float* part_ml, float* part_o,
                                               unsigned int* counters, __half* out, int n_kv, int max_splits,
                                               float scale, float* smem, const Sync sync) {
  constexpr int DG = HD / 8;                 // 16-byte slices per head row = lanes per position
  constexpr int PG = T / DG;                 // positions processed side by side
  constexpr int PPT = ATT_CHUNK / PG;        // positions per thread per sub-chunk
  static_assert(PPT >= 1 && ATT_CHUNK % PG == 0, "chunk must cover the block's position groups");
  const int n_sub = (len + ATT_CHUNK - 1) / ATT_CHUNK;
  const int n_splits = attention_splits(len, max_splits);
  if (split >= n_splits) return;             // nothing at this context length (before any barrier)
  const int c0 = (int)((long long)split * n_sub / n_splits);
  const int c1 = (int)((long long)(split + 1) * n_sub / n_splits);
  const size_t kv_dim = (size_t)n_kv * HD;
  const int lane = threadIdx.x % AF_WARP, warp = threadIdx.x / AF_WARP;
  const int l = threadIdx.x % DG, pg = threadIdx.x / DG;
  const size_t col = (size_t)j * HD + l * 8;

  // The K/V ring: thread (pg, l) copies (cp.async, no registers held) exactly the 16-byte slices it later
  // reads — slice l of positions pg, pg + PG, ... of each sub-chunk — so a thread's own wait_group is the only
  // synchronisation the ring needs. Stage c % ATT_STAGES holds sub-chunk c; one commit group per sub-chunk.
  uint4* ring = reinterpret_cast<uint4*>(smem);
  auto slot = [&](int c, int kv, int i) {
    return ring + ((size_t)((c % ATT_STAGES) * 2 + kv) * ATT_CHUNK + pg + i * PG) * DG + l;
  };
  // rows >= len are not copied (their slots are masked below); before the PDL wait the row at len - 1 is
  // skipped (the QKV kernel is still writing it)
  auto issue = [&](int c, bool before_wait) {
    if (c < c1) {
#pragma unroll
      for (int i = 0; i < PPT; ++i) {
        const int t = c * ATT_CHUNK + pg + i * PG;
        if (t < len && !(before_wait && t == len - 1)) {
          cp_async16(slot(c, 0, i), k_cache + (size_t)t * kv_dim + col);
          cp_async16(slot(c, 1, i), v_cache + (size_t)t * kv_dim + col);
        }
      }
    }
    cp_async_commit();  // one group per sub-chunk, empty past c1: wait_group counts stay uniform
  };

#pragma unroll
  for (int s = 0; s < ATT_STAGES; ++s) issue(c0 + s, true);
  sync.arrive_wait();  // q and the K/V row at len - 1 come from the previous kernel
  if (c1 == n_sub && c1 - 1 < c0 + ATT_STAGES) {  // row len - 1 sits in a stage requested before the wait
#pragma unroll
    for (int i = 0; i < PPT; ++i) {
      const int t = (c1 - 1) * ATT_CHUNK + pg + i * PG;
      if (t == len - 1) {
        *slot(c1 - 1, 0, i) = ld_stream(k_cache + (size_t)t * kv_dim + col);
        *slot(c1 - 1, 1, i) = ld_stream(v_cache + (size_t)t * kv_dim + col);
      }
    }
  }

  float* sc = smem + ATT_STAGES * 2 * ATT_CHUNK * HD / 2;  // [G][ATT_CHUNK] scores, then probabilities
  float* acc = sc + G * ATT_CHUNK;           // [PG][G][HD] partial P.V sums; later the combine's scratch
  __shared__ float s_m[G], s_l[G], s_a[G];   // running max, running sum, this sub-chunk's rescale factor
  __shared__ __align__(16) float q_s[G * HD];  // q * scale (fp32), shared by the block's position groups
  __shared__ bool last;
  if (threadIdx.x < G) { s_m[threadIdx.x] = -AF_INF; s_l[threadIdx.x] = 0.f; }
  for (int i = threadIdx.x; i < G * HD / 8; i += T) {
    float f[8];
    f8_from_u4(*reinterpret_cast<const uint4*>(q + (size_t)j * G * HD + i * 8), f);
#pragma unroll
    for (int e = 0; e < 8; ++e) q_s[i * 8 + e] = f[e] * scale;
  }
  __syncthreads();

  float o[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < 8; ++e) o[g][e] = 0.f;

  // ---- sub-chunks c0 .. c1-1, online softmax; ATT_STAGES - 1 later sub-chunks stay in flight meanwhile ----
  for (int c = c0; c < c1; ++c) {
    const int n = min(len - c * ATT_CHUNK, ATT_CHUNK);
    cp_async_wait<ATT_STAGES - 1>();  // this thread's copies of sub-chunk c have landed
    uint4 kr[PPT], vr[PPT];
#pragma unroll
    for (int i = 0; i < PPT; ++i) { kr[i] = *slot(c, 0, i); vr[i] = *slot(c, 1, i); }
    issue(c + ATT_STAGES, false);  // refill the stage just read (only this thread touches its slots)

    // scores
#pragma unroll
    for (int i = 0; i < PPT; ++i) {
      const int t = pg + i * PG;
      float kf[8];
      f8_from_u4(kr[i], kf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float4 qa = *reinterpret_cast<const float4*>(q_s + g * HD + l * 8);
        const float4 qb = *reinterpret_cast<const float4*>(q_s + g * HD + l * 8 + 4);
        float s = qa.x * kf[0];
        s = fmaf(qa.y, kf[1], s); s = fmaf(qa.z, kf[2], s); s = fmaf(qa.w, kf[3], s);
        s = fmaf(qb.x, kf[4], s); s = fmaf(qb.y, kf[5], s); s = fmaf(qb.z, kf[6], s); s = fmaf(qb.w, kf[7], s);
#pragma unroll
        for (int x = DG / 2; x > 0; x >>= 1) s += __shfl_xor_sync(0xffffffffu, s, x);
        if (t < n && l == 0) sc[g * ATT_CHUNK + t] = s;
      }
    }
    __syncthreads();

    // softmax statistics: one warp per q head, one lane per position; rescale the running sums
    for (int g = warp; g < G; g += T / AF_WARP) {
      const float s = lane < n ? sc[g * ATT_CHUNK + lane] : -AF_INF;
      const float m_old = s_m[g];
      const float m_new = fmaxf(m_old, warp_max(s));
      const float p = lane < n ? __expf(s - m_new) : 0.f;
      sc[g * ATT_CHUNK + lane] = p;
      const float sum = warp_sum(p);
      if (lane == 0) {
        const float a = __expf(m_old - m_new);  // 0 on the first sub-chunk (m_old = -inf)
        s_a[g] = a;
        s_l[g] = s_l[g] * a + sum;
        s_m[g] = m_new;
      }
    }
    __syncthreads();

    // P.V from the V rows in registers
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float a = s_a[g];
#pragma unroll
      for (int e = 0; e < 8; ++e) o[g][e] *= a;
    }
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
    __syncthreads();  // sc and s_a are rewritten by the next sub-chunk
  }
  cp_async_wait<0>();  // no copy outlives the item (the trailing groups are empty)

#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[((size_t)pg * G + g) * HD + l * 8 + e] = o[g][e];
  __syncthreads();

  const int gh = G * HD;
  if (n_splits == 1) {  // the whole context is one split: finish here
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
  float* coef = acc;                         // [G][max_splits]: m_s, then the weights
  float* lsum = coef + G * max_splits;       // [G][max_splits]: l_s
  for (int i = threadIdx.x; i < G * n_splits; i += T) {  // every (m, l) pair in one round of L2 loads
    const int g = i / n_splits, sp = i % n_splits;
    const float2 ml = __ldcg(reinterpret_cast<const float2*>(part_ml) + (size_t)(j * G + g) * max_splits + sp);
    coef[g * max_splits + sp] = ml.x;
    lsum[g * max_splits + sp] = ml.y;
  }
  __syncthreads();
  for (int g = warp; g < G; g += T / AF_WARP) {
    float M = -AF_INF;
    for (int sp = lane; sp < n_splits; sp += AF_WARP) M = fmaxf(M, coef[g * max_splits + sp]);
    M = warp_max(M);
    float L = 0.f;
    for (int sp = lane; sp < n_splits; sp += AF_WARP) {
      const float w = __expf(coef[g * max_splits + sp] - M);
      coef[g * max_splits + sp] = w;
      L += w * lsum[g * max_splits + sp];
    }
    L = warp_sum(L);
    __syncwarp();
    for (int sp = lane; sp < n_splits; sp += AF_WARP) coef[g * max_splits + sp] /= L;
  }
  __syncthreads();
  // out[g][d..d+3] = sum_s coef[g][s] * part_o[g][s][d..d+3]: a thread per (float4 column, split phase r of R),
  // ATT_COMBINE_LOADS independent 16-byte L2 loads in flight per thread (one dependent round per that many
  // splits instead of one per split)
  constexpr int COLS = G * HD / 4;
  constexpr int R = T > COLS ? T / COLS : 1;
  float4* red = reinterpret_cast<float4*>(coef + ((2 * G * max_splits + 3) & ~3));  // [R][COLS]
  for (int i = threadIdx.x; i < R * COLS; i += T) {
    const int cidx = i % COLS, r = i / COLS, g = cidx * 4 / HD;
    const float4* po = reinterpret_cast<const float4*>(part_o + (size_t)(j * G + g) * max_splits * HD + cidx * 4 % HD);
    const float* cf = coef + g * max_splits;
    float4 a[ATT_COMBINE_LOADS];
#pragma unroll
    for (int u = 0; u < ATT_COMBINE_LOADS; ++u) a[u] = make_float4(0.f, 0.f, 0.f, 0.f);
    int sp = r;
    for (; sp + (ATT_COMBINE_LOADS - 1) * R < n_splits; sp += ATT_COMBINE_LOADS * R) {
#pragma unroll
      for (int u = 0; u < ATT_COMBINE_LOADS; ++u) {
        const float w = cf[sp + u * R];
        const float4 v = __ldcg(po + (size_t)(sp + u * R) * (HD / 4));
        a[u].x = fmaf(w, v.x, a[u].x); a[u].y = fmaf(w, v.y, a[u].y);
        a[u].z = fmaf(w, v.z, a[u].z); a[u].w = fmaf(w, v.w, a[u].w);
      }
    }
    for (; sp < n_splits; sp += R) {
      const float w = cf[sp];
      const float4 v = __ldcg(po + (size_t)sp * (HD / 4));
      a[0].x = fmaf(w, v.x, a[0].x); a[0].y = fmaf(w, v.y, a[0].y);
      a[0].z = fmaf(w, v.z, a[0].z); a[0].w = fmaf(w, v.w, a[0].w);
    }
#pragma unroll
    for (int u = 1; u < ATT_COMBINE_LOADS; ++u) {
      a[0].x += a[u].x; a[0].y += a[u].y; a[0].z += a[u].z; a[0].w += a[u].w;
    }
    red[r * COLS + cidx] = a[0];
  }
  __syncthreads();
  for (int cidx = threadIdx.x; cidx < COLS; cidx += T) {
    float4 s = red[cidx];
#pragma unroll
    for (int r = 1; r < R; ++r) {
      const float4 v = red[r * COLS + cidx];
      s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
    }
    __half2* dst = reinterpret_cast<__half2*>(out + (size_t)j * gh + cidx * 4);
    dst[0] = __floats2half2_rn(s.x, s.y);
    dst[1] = __floats2half2_rn(s.z, s.w);
  }
  if (threadIdx.x == 0) counters[j] = 0u;
}
