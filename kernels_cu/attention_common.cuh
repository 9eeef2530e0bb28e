// attention_common.cuh — the GQA decode-attention work item of attention.cu (one launch per layer).
// See attention.cu for the scheme and layouts.
#pragma once
#include "common.cuh"

#define ATT_CHUNK 32  // positions per sub-chunk: the unit splits are cut in (arena.py ATT_CHUNK)
#ifndef ATT_PASS_ROWS
#define ATT_PASS_ROWS 2  // positions per lane per warp pass (x 32 / (hd/8) lanes side by side: 4 at hd 128, 8 at hd 64)
#endif

#ifndef ATT_COMBINE_LOADS
#define ATT_COMBINE_LOADS 8  // independent 16-byte partial loads per thread per round of the split combine
#endif

__device__ __forceinline__ void f8_from_u4(uint4 u, float* f) {
  const float2 a = h2_to_f2(u.x), b = h2_to_f2(u.y), c = h2_to_f2(u.z), d = h2_to_f2(u.w);
  f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y; f[4] = c.x; f[5] = c.y; f[6] = d.x; f[7] = d.y;
}

// Splits of kv head j at context length len: one per ATT_CHUNK-position sub-chunk up to max_splits (the
// launch's grid.y), beyond that each split takes a contiguous, even share of the sub-chunks.
__device__ __forceinline__ int attention_splits(int len, int max_splits) {
  return min((len + ATT_CHUNK - 1) / ATT_CHUNK, max_splits);
}

// Dynamic shared memory of one item (fp32): the larger of the warps' (o[G][HD]) states [T/32][G][HD] and the
// split combine's scratch (m and l [2][G][max_splits], rounded to 4, + float4 sums [R][G*HD/4]).
// step.py attention_smem computes the same.

// One work item: kv head j, split `split` of the len cached positions, all G q heads. Called by all T threads
// of the block. Each warp walks its own passes (4 positions at hd 128, 8 at hd 64) of the split (passes w,
// w + T/32, ...) with its own
// online-softmax state in registers — no block barrier inside the walk — and the warps' states are merged
// through shared memory at the end. K/V (written by earlier launches) use the streaming read-only path, the
// next pass's slices in flight while the current one is scored; q a plain load; partials (written by other
// blocks of this launch) are always read .cg.
// sync.arrive_wait() separates what the item may read before the previous kernel (the QKV GEMV) is done —
// the K/V rows before position len - 1, written by earlier steps — from q and the row at len - 1.
template <int HD, int G, int T, class Sync>
__device__ __forceinline__ void attention_item(const __half* q, const __half* k_cache, const __half* v_cache,
                                               int len, int j, int split, float* part_ml, float* part_o,
                                               unsigned int* counters, __half* out, int n_kv, int max_splits,
                                               float scale, float* smem, const Sync sync) {
  constexpr int DG = HD / 8;                 // 16-byte slices per head row = lanes per position
  constexpr int PW = AF_WARP / DG;           // positions side by side in a warp
  constexpr int I = ATT_PASS_ROWS;           // positions per lane per pass
  constexpr int PASS = PW * I;               // positions per warp pass
  constexpr int NW = T / AF_WARP;
  static_assert(ATT_CHUNK % PASS == 0, "a sub-chunk must hold whole passes");
  const int n_sub = (len + ATT_CHUNK - 1) / ATT_CHUNK;
  const int n_splits = attention_splits(len, max_splits);
  if (split >= n_splits) return;             // nothing at this context length (before any barrier)
  const int p0 = (int)((long long)split * n_sub / n_splits) * ATT_CHUNK;
  const int p1 = min((int)((long long)(split + 1) * n_sub / n_splits) * ATT_CHUNK, len);
  const size_t kv_dim = (size_t)n_kv * HD;
  const int lane = threadIdx.x % AF_WARP, warp = threadIdx.x / AF_WARP;
  const int l = lane % DG, h = lane / DG;
  const size_t col = (size_t)j * HD + l * 8;

  // this lane's K and V slices of the pass at `base` (positions base + h + PW * i); rows >= len are zeros
  // (masked below); before the PDL wait the row at len - 1 is skipped (the QKV kernel is still writing it)
  auto load = [&](int base, uint4* kk, uint4* vv, bool before_wait) {
#pragma unroll
    for (int i = 0; i < I; ++i) {
      const int t = base + h + PW * i;
      const bool ok = t < p1 && !(before_wait && t == len - 1);
      kk[i] = ok ? ld_stream(k_cache + (size_t)t * kv_dim + col) : make_uint4(0, 0, 0, 0);
      vv[i] = ok ? ld_stream(v_cache + (size_t)t * kv_dim + col) : make_uint4(0, 0, 0, 0);
    }
  };

  // this warp's first pass is requested before the PDL wait (kr/vr: current pass, kn/vn: the next). Requesting
  // the second pass there too was measured slower (results/PERF_NOTES.md v9.3: register pressure at 127 of 128).
  int base = p0 + warp * PASS;
  uint4 kr[I], vr[I], kn[I], vn[I];
  load(base, kr, vr, true);
  sync.arrive_wait();  // q and the K/V row at len - 1 come from the previous kernel
#pragma unroll
  for (int i = 0; i < I; ++i) {
    const int t = base + h + PW * i;
    if (t == len - 1) {
      kr[i] = ld_stream(k_cache + (size_t)t * kv_dim + col);
      vr[i] = ld_stream(v_cache + (size_t)t * kv_dim + col);
    }
  }

  __shared__ __align__(16) float q_s[G * HD];  // q * scale (fp32), read by every warp
  __shared__ float w_m[NW][G], w_l[NW][G];     // each warp's final running max and sum
  __shared__ bool last;
  for (int i = threadIdx.x; i < G * HD / 8; i += T) {
    float f[8];
    f8_from_u4(*reinterpret_cast<const uint4*>(q + (size_t)j * G * HD + i * 8), f);
#pragma unroll
    for (int e = 0; e < 8; ++e) q_s[i * 8 + e] = f[e] * scale;
  }
  __syncthreads();
  AF_TL_MARK(0);  // timeline: q in shared memory (the first L2 round after the wait)
  load(base + NW * PASS, kn, vn, false);

  float m[G], lsum[G], o[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -AF_INF;
    lsum[g] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) o[g][e] = 0.f;
  }

  // ---- this warp's passes: scores, online softmax, P.V; the next pass's loads are in flight meanwhile ----
  for (; base < p1; base += NW * PASS) {
    const int next = base + NW * PASS;

    float s[I][G];
#pragma unroll
    for (int i = 0; i < I; ++i) {
      float kf[8];
      f8_from_u4(kr[i], kf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float4 qa = *reinterpret_cast<const float4*>(q_s + g * HD + l * 8);
        const float4 qb = *reinterpret_cast<const float4*>(q_s + g * HD + l * 8 + 4);
        float d = qa.x * kf[0];
        d = fmaf(qa.y, kf[1], d); d = fmaf(qa.z, kf[2], d); d = fmaf(qa.w, kf[3], d);
        d = fmaf(qb.x, kf[4], d); d = fmaf(qb.y, kf[5], d); d = fmaf(qb.z, kf[6], d); d = fmaf(qb.w, kf[7], d);
#pragma unroll
        for (int x = DG / 2; x > 0; x >>= 1) d += __shfl_xor_sync(0xffffffffu, d, x);
        s[i][g] = base + h + PW * i < p1 ? d : -AF_INF;
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mx = s[0][g];
#pragma unroll
      for (int i = 1; i < I; ++i) mx = fmaxf(mx, s[i][g]);
#pragma unroll
      for (int x = DG; x < AF_WARP; x <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, x));
      const float m_new = fmaxf(m[g], mx);    // finite: every pass has a position < p1
      const float a = __expf(m[g] - m_new);   // 0 on the first pass (m = -inf)
      float ps = 0.f;
#pragma unroll
      for (int i = 0; i < I; ++i) { s[i][g] = __expf(s[i][g] - m_new); ps += s[i][g]; }
#pragma unroll
      for (int x = DG; x < AF_WARP; x <<= 1) ps += __shfl_xor_sync(0xffffffffu, ps, x);
      lsum[g] = lsum[g] * a + ps;
      m[g] = m_new;
#pragma unroll
      for (int e = 0; e < 8; ++e) o[g][e] *= a;
    }
#pragma unroll
    for (int i = 0; i < I; ++i) {
      float vf[8];
      f8_from_u4(vr[i], vf);
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int e = 0; e < 8; ++e) o[g][e] = fmaf(s[i][g], vf[e], o[g][e]);
    }
    if (next < p1) {
#pragma unroll
      for (int i = 0; i < I; ++i) { kr[i] = kn[i]; vr[i] = vn[i]; }
      if (next + NW * PASS < p1) load(next + NW * PASS, kn, vn, false);  // the pass after, during the next one
    }
  }

  AF_TL_MARK(1);  // timeline: this thread's (warp 0's) passes done
  // ---- merge: the lanes' position groups, then the warps (weights exp(m_w - M)) ----
  float* wo = smem;                          // [NW][G][HD] each warp's o (relative to its own m)
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < 8; ++e) {
#pragma unroll
      for (int x = DG; x < AF_WARP; x <<= 1) o[g][e] += __shfl_xor_sync(0xffffffffu, o[g][e], x);
    }
  if (h == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float4* dst = reinterpret_cast<float4*>(wo + ((size_t)warp * G + g) * HD + l * 8);
      dst[0] = make_float4(o[g][0], o[g][1], o[g][2], o[g][3]);
      dst[1] = make_float4(o[g][4], o[g][5], o[g][6], o[g][7]);
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) { w_m[warp][g] = m[g]; w_l[warp][g] = lsum[g]; }
  }
  __syncthreads();
  const int gh = G * HD;
  __shared__ float s_m[G], s_l[G], s_w[NW][G];  // block max and sum per head, each warp's weight
  if (threadIdx.x < G) {
    const int g = threadIdx.x;
    float M = -AF_INF;
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, w_m[w][g]);
    float L = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float a = __expf(w_m[w][g] - M);  // 0 for a warp that had no pass (m = -inf)
      s_w[w][g] = a;
      L += a * w_l[w][g];
    }
    s_m[g] = M;
    s_l[g] = L;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < gh; i += T) {
    const int g = i / HD;
    float acc = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) acc = fmaf(s_w[w][g], wo[(size_t)w * gh + i], acc);
    if (n_splits == 1) out[(size_t)j * gh + i] = __float2half(acc / s_l[g]);  // one split: finish here
    else part_o[((size_t)(j * G + g) * max_splits + split) * HD + i % HD] = acc;
  }
  if (n_splits == 1) return;
  if (threadIdx.x < G) {
    float* ml = part_ml + ((size_t)(j * G + threadIdx.x) * max_splits + split) * 2;
    ml[0] = s_m[threadIdx.x];
    ml[1] = s_l[threadIdx.x];
  }
  __syncthreads();  // all partials of this block written; thread 0's acq_rel ticket publishes them
  AF_TL_MARK(2);  // timeline: merged, partials stored
  if (threadIdx.x == 0) last = atom_add_acq_rel_gpu(counters + j, 1u) == (unsigned int)n_splits - 1;
  __syncthreads();
  AF_TL_MARK(3);  // timeline: ticket back
  if (!last) return;  // the last block acquired every other block's partials through its ticket

  // ---- combine (last block of kv head j): weights exp(m_s - M) / sum_s l_s exp(m_s - M) ----
  // out[g][d..d+3] = sum_s coef[g][s] * part_o[g][s][d..d+3]: a thread per (float4 column, split phase r of R),
  // ATT_COMBINE_LOADS independent 16-byte L2 loads in flight per thread (one dependent round per that many
  // splits instead of one per split). The first round of a thread's first column is requested before the
  // (m, l) round: up to ATT_COMBINE_LOADS * R splits the combine costs one dependent L2 round, not two.
  constexpr int COLS = G * HD / 4;
  constexpr int R = T > COLS ? T / COLS : 1;
  auto col_of = [&](int i, int& cidx, int& r) -> const float4* {
    cidx = i % COLS;
    r = i / COLS;
    const int g = cidx * 4 / HD;
    return reinterpret_cast<const float4*>(part_o + (size_t)(j * G + g) * max_splits * HD + cidx * 4 % HD);
  };
  float4 pre[ATT_COMBINE_LOADS];
  if (threadIdx.x < R * COLS) {
    int cidx, r;
    const float4* po = col_of(threadIdx.x, cidx, r);
#pragma unroll
    for (int u = 0; u < ATT_COMBINE_LOADS; ++u)
      pre[u] = r + u * R < n_splits ? __ldcg(po + (size_t)(r + u * R) * (HD / 4)) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  float* coef = smem;                        // [G][max_splits]: m_s, then the weights (wo is dead)
  float* l_s = coef + G * max_splits;       // [G][max_splits]: l_s
  for (int i = threadIdx.x; i < G * n_splits; i += T) {  // every (m, l) pair in one round of L2 loads
    const int g = i / n_splits, sp = i % n_splits;
    const float2 ml = __ldcg(reinterpret_cast<const float2*>(part_ml) + (size_t)(j * G + g) * max_splits + sp);
    coef[g * max_splits + sp] = ml.x;
    l_s[g * max_splits + sp] = ml.y;
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
      L += w * l_s[g * max_splits + sp];
    }
    L = warp_sum(L);
    __syncwarp();
    for (int sp = lane; sp < n_splits; sp += AF_WARP) coef[g * max_splits + sp] /= L;
  }
  __syncthreads();
  float4* red = reinterpret_cast<float4*>(coef + ((2 * G * max_splits + 3) & ~3));  // [R][COLS]
  for (int i = threadIdx.x; i < R * COLS; i += T) {
    int cidx, r;
    const float4* po = col_of(i, cidx, r);
    const float* cf = coef + cidx * 4 / HD * max_splits;
    float4 a[ATT_COMBINE_LOADS];
#pragma unroll
    for (int u = 0; u < ATT_COMBINE_LOADS; ++u) a[u] = make_float4(0.f, 0.f, 0.f, 0.f);
    int sp = r;
    if (i == threadIdx.x) {  // the first column: its first round is already in registers
#pragma unroll
      for (int u = 0; u < ATT_COMBINE_LOADS; ++u) {
        const float w = sp + u * R < n_splits ? cf[sp + u * R] : 0.f;
        a[u].x = w * pre[u].x; a[u].y = w * pre[u].y; a[u].z = w * pre[u].z; a[u].w = w * pre[u].w;
      }
      sp += ATT_COMBINE_LOADS * R;
    }
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
