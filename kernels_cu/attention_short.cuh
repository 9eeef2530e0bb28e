// attention_short.cuh — the short attention's device functions (attention_short.cu's kernels and the lab's persistent
// step, lab/kernels/decode_persist.cu, run them): one block's GQA attention of one query token over a short
// contiguous KV cache.
//
// Computes   what attention_short.cu's header says, for one head group j of the block.
// Layouts    as attention_short.cu: K, V, P in the dynamic shared memory the caller hands over.
// Bytes      2 * L * hd * 2 per kv head (K and V) + q and out.
// Launch     inside a kernel, by its first T threads (a block of T, or the consumers of a warp-specialised block).
#pragma once
#include "common.cuh"

#define ATS_THREADS 256
#define ATS_HEADS 8        // the mma's N: q heads of one kv head, padded to 8 (G <= 8)
#define ATS_GROUPS 4       // 16-position score groups per warp per chunk
#define ATS_CHUNK_MAX (16 * (ATS_THREADS / AF_WARP) * ATS_GROUPS)  // 512 positions per chunk (ops/attention.py)
#define ATS_MIN_BLOCKS 2  // <= 128 registers: the block has its SM to itself (attention_short.cu, Launch)
#define ATS_BATCH 4       // ldmatrix loads issued before their mmas (scores: k-steps; P.V: 16-position steps)

// rows [t0, t1) of kv head j's K and V -> ks/vs rows [t0 - base, t1 - base), one cp.async group, committed
template <int HD, int T>
__device__ __forceinline__ void ats_stage(const __half* k_cache, const __half* v_cache, size_t kv_dim, int j, int t0,
                                          int t1, int base, char* ks, char* vs) {
  constexpr int DG = HD / 8;
  for (int i = t0 * DG + (int)threadIdx.x; i < t1 * DG; i += T) {
    const int t = i / DG, c = i % DG;
    const size_t src = (size_t)t * kv_dim + (size_t)j * HD + c * 8;
    cp_async16(ks + swz16<HD>(t - base, c), k_cache + src);
    cp_async16(vs + swz16<HD>(t - base, c), v_cache + src);
  }
  cp_async_commit();
}

// V rows [n, n rounded up to 16) -> 0: the last 16-position P.V step reads them (with P = 0 there)
template <int HD, int T>
__device__ __forceinline__ void ats_zero_tail(char* vs, int n) {
  constexpr int DG = HD / 8;
  for (int i = n * DG + (int)threadIdx.x; i < ((n + 15) & ~15) * DG; i += T)
    *reinterpret_cast<uint4*>(vs + swz16<HD>(i / DG, i % DG)) = make_uint4(0, 0, 0, 0);
}

// Block j = head group j: kv head j / V, its q heads [j * G, (j + 1) * G) (V blocks share a kv head when it has more
// q heads than the mma's N: ATTENTION_SHORT_INSTANCE).
// `wait()` runs between the staging of the earlier rows and the first read of this step's q and row L-1: the PDL
// wait in attention_short.cu's kernels, a wait for the QKV tiles in the persistent step. The block's first T threads
// run it and meet at barriers sync_n<BAR>: the whole block (0) in attention_short.cu, named barrier 1 of T threads in
// the persistent step, whose producer warp never joins.
template <int HD, int G, int T, int V, int BAR, class Wait>
__device__ __forceinline__ void attention_short_item(const __half* q, const __half* k_cache, const __half* v_cache,
                                                     int len, int j, __half* out, int n_kv, int cap, float scale,
                                                     char* smem, const Wait& wait) {
  constexpr int DG = HD / 8;          // 16-byte pieces per row
  constexpr int NW = T / AF_WARP;
  constexpr int DT = HD / 16;         // P.V: 16-dim tiles; NW / DT warps (phases) per tile
  constexpr int WPT = NW / DT;
  static_assert(G <= ATS_HEADS && NW % DT == 0 && DT % ATS_BATCH == 0, "shape");
  const size_t kv_dim = (size_t)n_kv * HD;
  const int kvh = j / V;  // the kv head whose K/V this block reads
  const int tid = threadIdx.x, lane = tid % AF_WARP, warp = tid / AF_WARP;
  const int gid = lane >> 2, tig = lane & 3;  // mma fragment coordinates
  const int cap16 = (cap + 15) & ~15;
  const int psb = (cap16 + 8) * 2;            // bytes per head row of P (padded: ldmatrix without bank conflicts)
  const int kbytes = max(cap16 * HD * 2, NW * 16 * ATS_HEADS * 4);  // K, or the final reduction scratch
  char* ks = smem;
  char* vs = smem + kbytes;
  char* pt = vs + cap16 * HD * 2;             // P fp16 [ATS_HEADS][cap16 (+8)]: head-major (the P.V B operand)

  // ---- before the wait: rows 0 .. min(L - 1, cap) - 1 (row L-1 is the previous kernel's) ----
  ats_stage<HD, T>(k_cache, v_cache, kv_dim, kvh, 0, min(len - 1, cap), 0, ks, vs);
  wait();

  __shared__ __align__(16) __half q_h[ATS_HEADS * HD];  // q fp16 [8][HD] (rows >= G zero), rows swizzled
  __shared__ float w_red[NW][ATS_HEADS];               // per-warp max (each chunk), then per-warp sums (end)
  for (int i = tid; i < ATS_HEADS * DG; i += T) {
    const int r = i / DG, c = i % DG;
    const uint4 u = r < G ? ld_cg16(q + ((size_t)j * G + r) * HD + c * 8) : make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(reinterpret_cast<char*>(q_h) + swz16<HD>(r, c)) = u;
  }
  if (len - 1 < cap && tid < 2 * DG) {  // row L-1, appended by the QKV kernel: after the wait, through L2
    const int c = tid % DG;
    const size_t src = (size_t)(len - 1) * kv_dim + (size_t)kvh * HD + c * 8;
    const uint4 u = ld_cg16((tid < DG ? k_cache : v_cache) + src);
    *reinterpret_cast<uint4*>((tid < DG ? ks : vs) + swz16<HD>(len - 1, c)) = u;
  }
  ats_zero_tail<HD, T>(vs, min(cap, len));
  cp_async_wait<0>();
  sync_n<BAR>();
  AF_TL_MARK(0);  // timeline: q and the first chunk in shared memory

  unsigned qb[DT][2];  // q as the scores' B operand ([n = head][k = dim]), all HD/16 k-steps
#pragma unroll
  for (int kk = 0; kk < DT; ++kk)
    ldmatrix_x2(qb[kk], reinterpret_cast<char*>(q_h) + swz16<HD>(lane & 7, 2 * kk + ((lane >> 3) & 1)));

  // this thread's heads: 2 tig and 2 tig + 1 (score fragments and P.V accumulator columns alike)
  float m_run[2] = {-AF_INF, -AF_INF}, lsum[2] = {0.f, 0.f}, o[4] = {0.f, 0.f, 0.f, 0.f};
  for (int c0 = 0; c0 < len; c0 += min(cap, ATS_CHUNK_MAX)) {
    const int n = min(min(cap, ATS_CHUNK_MAX), len - c0);
    if (c0 > 0) {  // a later chunk (L > cap: tests only): everyone is done with the previous one, then load it
      sync_n<BAR>();
      ats_stage<HD, T>(k_cache, v_cache, kv_dim, kvh, c0, c0 + n, c0, ks, vs);
      ats_zero_tail<HD, T>(vs, n);
      cp_async_wait<0>();
      sync_n<BAR>();
    }
    // ---- scores S[pos][head] = K q^T on the tensor cores: warp w takes 16-position groups w, w + NW, ... ----
    float s[ATS_GROUPS][4], mx[2] = {-AF_INF, -AF_INF};
#pragma unroll
    for (int i = 0; i < ATS_GROUPS; ++i) {
      const int p0 = (warp + NW * i) * 16;
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      if (p0 < n) {  // warp-uniform; ATS_BATCH ldmatrix issued back to back, then their mmas (the asm is volatile:
                     // program order is issue order, so one load per mma would wait out every load's latency)
#pragma unroll
        for (int k0 = 0; k0 < DT; k0 += ATS_BATCH) {
          unsigned a[ATS_BATCH][4];
#pragma unroll
          for (int u = 0; u < ATS_BATCH; ++u)
            ldmatrix_x4(a[u], ks + swz16<HD>(p0 + (lane & 15), 2 * (k0 + u) + (lane >> 4)));
#pragma unroll
          for (int u = 0; u < ATS_BATCH; ++u)
            mma_16816(d, a[u][0], a[u][1], a[u][2], a[u][3], qb[k0 + u][0], qb[k0 + u][1]);
        }
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {  // d[e]: position p0 + gid (+8 for e >= 2), head 2 tig + (e & 1)
        const bool ok = p0 + gid + (e >> 1) * 8 < n && 2 * tig + (e & 1) < G;
        s[i][e] = ok ? d[e] * scale : -AF_INF;
        mx[e & 1] = fmaxf(mx[e & 1], s[i][e]);
      }
    }
    // ---- the chunk's max per head (block-wide), the running max, the rescale of what came before ----
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int x = 4; x < AF_WARP; x <<= 1) mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], x));
    }
    if (gid == 0) { w_red[warp][2 * tig] = mx[0]; w_red[warp][2 * tig + 1] = mx[1]; }
    sync_n<BAR>();
    AF_TL_MARK(1);  // timeline: every warp's scores and maxima done
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = m_run[h];
#pragma unroll
      for (int w = 0; w < NW; ++w) m = fmaxf(m, w_red[w][2 * tig + h]);
      alpha[h] = m == -AF_INF ? 1.f : __expf(m_run[h] - m);  // 0 on the first chunk; heads >= G stay -inf
      m_run[h] = m;
      lsum[h] *= alpha[h];
    }
    o[0] *= alpha[0]; o[1] *= alpha[1]; o[2] *= alpha[0]; o[3] *= alpha[1];
    // ---- P = exp(S - max) as fp16, head-major; the sums of the rounded values ----
#pragma unroll
    for (int i = 0; i < ATS_GROUPS; ++i) {
      const int p0 = (warp + NW * i) * 16;
      if (p0 < n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const __half ph = __float2half(s[i][e] == -AF_INF ? 0.f : __expf(s[i][e] - m_run[e & 1]));
          lsum[e & 1] += __half2float(ph);
          *reinterpret_cast<__half*>(pt + (2 * tig + (e & 1)) * psb + (p0 + gid + (e >> 1) * 8) * 2) = ph;
        }
      }
    }
    sync_n<BAR>();  // P complete; w_red free again
    AF_TL_MARK(2);  // timeline: probabilities stored
    // ---- O^T[dim][head] += V^T P^T on the tensor cores: warp w takes dim tile w % DT, positions phase w / DT ----
    // (ATS_BATCH steps' ldmatrix back to back, then their mmas; V rows and P past n up to the 16-boundary are 0)
    for (int p0 = (warp / DT) * 16; p0 < n; p0 += ATS_BATCH * WPT * 16) {
      unsigned a[ATS_BATCH][4], b[ATS_BATCH][2];
#pragma unroll
      for (int u = 0; u < ATS_BATCH; ++u) {
        const int pu = p0 + u * WPT * 16;
        if (pu < n) {  // warp-uniform
          ldmatrix_x4_trans(a[u], vs + swz16<HD>(pu + (lane & 7) + ((lane >> 4) << 3), 2 * (warp % DT) + ((lane >> 3) & 1)));
          ldmatrix_x2(b[u], pt + (lane & 7) * psb + (pu + ((lane >> 3) & 1) * 8) * 2);
        }
      }
#pragma unroll
      for (int u = 0; u < ATS_BATCH; ++u)
        if (p0 + u * WPT * 16 < n) mma_16816(o, a[u][0], a[u][1], a[u][2], a[u][3], b[u][0], b[u][1]);
    }
  }
  AF_TL_MARK(3);  // timeline: P.V done

  // ---- the phases' O summed through shared memory, the sums per head, out = O / sum ----
  float* red = reinterpret_cast<float*>(ks);  // [NW][16 dims][8 heads]: K is dead (its last reads preceded barriers)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int x = 4; x < AF_WARP; x <<= 1) lsum[h] += __shfl_xor_sync(0xffffffffu, lsum[h], x);
  }
  if (gid == 0) { w_red[warp][2 * tig] = lsum[0]; w_red[warp][2 * tig + 1] = lsum[1]; }
  float* rw = red + warp * 16 * ATS_HEADS;
  rw[gid * ATS_HEADS + 2 * tig] = o[0];
  rw[gid * ATS_HEADS + 2 * tig + 1] = o[1];
  rw[(gid + 8) * ATS_HEADS + 2 * tig] = o[2];
  rw[(gid + 8) * ATS_HEADS + 2 * tig + 1] = o[3];
  sync_n<BAR>();
  for (int i = tid; i < G * HD; i += T) {
    const int g = i / HD, d = i % HD;
    float acc = 0.f, l = 0.f;
#pragma unroll
    for (int ph = 0; ph < WPT; ++ph) acc += red[((ph * DT + d / 16) * 16 + d % 16) * ATS_HEADS + g];
#pragma unroll
    for (int w = 0; w < NW; ++w) l += w_red[w][g];
    out[(size_t)j * G * HD + i] = __float2half(acc / l);
  }
}

