// attention_short.cu — GQA attention of one query token over a short contiguous KV cache: one block per kv
// head, the head's whole K/V range staged in shared memory before the PDL wait, no split combine.
//
// Computes   for q head hq (kv head j = hq / G, G = n_heads / n_kv), L = *pos + 1 cached positions:
//              out[hq] = sum_t softmax_t(q[hq] . K[t, j] * scale) V[t, j]       (fp32 math, fp16 out)
//            — the same result as attention.cu, which splits the positions over many blocks and combines the
//            splits through global partials and an atomic ticket (2-4 dependent L2 rounds after the release).
// Scheme     block j = kv head j, all G q heads. Before the PDL wait the block cp.asyncs K and V rows
//            0 .. L-2 (written by earlier steps; at most `cap`, the rows that fit) into shared memory; after it
//            only q and row L-1 (this step's QKV kernel appends it) are read: one L2 round. Then, per chunk of
//            at most `cap` positions (one chunk whenever L <= cap, which is when the engine uses this kernel):
//              scores    a thread per position (two per pass), K rows read from shared memory in 16-byte
//                        pieces, q (fp32, pre-scaled) broadcast from shared memory;
//              softmax   one block max per q head (a barrier), p = exp(s - max) in place of the scores;
//              P.V       a thread per (8-byte piece of a V row, position phase), the phases summed at the end.
//            Chunks after the first (L > cap: tests only) are loaded after the wait and folded in with the
//            usual online-softmax rescale. Rows sit in shared memory with their 16-byte pieces XOR-swizzled by
//            the row (piece c of row t at c ^ (t & 7)): a thread per row (scores) and a thread per piece (P.V)
//            both read without bank conflicts.
// Layouts    q fp16 [n_heads*hd] (post-RoPE, start of the qkv buffer); k_cache/v_cache: this layer's slab
//            fp16 [max_seq][n_kv*hd]; out fp16 [n_heads*hd]. Dynamic shared memory (step.py
//            attention_short_smem): K [cap][hd] fp16 (also the phases' reduction scratch [NW][G][hd] fp32 at
//            the end), V [cap][hd] fp16, probabilities [cap][GP] fp32 (GP = G rounded up to 4).
// Bytes      2 * L * n_kv * hd * 2 (K and V, each read once) + q and out.
// Launch     attention_short_hd{64,128}_g{1,2,3,4,8}: grid = (n_kv), block = 256, dyn. smem =
//            attention_short_smem(G, hd, cap); 1 block per SM (the smem), <= 80 registers at G <= 4 so a block
//            fits beside two of the QKV GEMV's blocks while that kernel drains.
#include "common.cuh"

#define ATS_THREADS 256
// register budget: <= 80 per thread at G <= 4 on sm_90 (see Launch above); other targets' schedules, and the
// timeline instrument's slot register at G = 4, spill at 80
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && !defined(AF_TIMELINE)
#define ATS_MIN_BLOCKS(G) ((G) > 4 ? 1 : 3)
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
#define ATS_MIN_BLOCKS(G) ((G) > 4 ? 1 : (G) == 4 ? 2 : 3)
#else
#define ATS_MIN_BLOCKS(G) ((G) > 4 ? 1 : 2)
#endif
#define ATS_ROWS(G) ((G) < 4 ? 2 : 1)         // score rows per thread per pass (registers: 1 from G = 4)

// byte offset of 16-byte piece c of row t in a staged [rows][HD] fp16 array
template <int HD>
__device__ __forceinline__ int ats_swz(int t, int c) {
  return t * HD * 2 + ((c ^ (t & 7)) << 4);
}

// rows [t0, t1) of kv head j's K and V -> ks/vs rows [t0 - base, t1 - base), one cp.async group, committed
template <int HD, int T>
__device__ __forceinline__ void ats_stage(const __half* k_cache, const __half* v_cache, size_t kv_dim, int j, int t0,
                                          int t1, int base, char* ks, char* vs) {
  constexpr int DG = HD / 8;
  for (int i = t0 * DG + (int)threadIdx.x; i < t1 * DG; i += T) {
    const int t = i / DG, c = i % DG;
    const size_t src = (size_t)t * kv_dim + (size_t)j * HD + c * 8;
    cp_async16(ks + ats_swz<HD>(t - base, c), k_cache + src);
    cp_async16(vs + ats_swz<HD>(t - base, c), v_cache + src);
  }
  cp_async_commit();
}

template <int HD, int G, int T, int TP>
__device__ __forceinline__ void attention_short_item(const __half* q, const __half* k_cache, const __half* v_cache,
                                                     int len, int j, __half* out, int n_kv, int cap, float scale,
                                                     char* smem) {
  constexpr int DG = HD / 8;          // 16-byte pieces per row (staging, scores)
  constexpr int PD = HD / 4;          // 8-byte pieces per row (P.V: 4 outputs per q head per thread)
  constexpr int R = T / PD;           // P.V position phases
  constexpr int NW = T / AF_WARP;
  constexpr int GP = (G + 3) & ~3;    // probabilities per position, padded to float4
  constexpr int CU = G > 4 ? 1 : 4;   // score loop unrolling over the row's pieces (registers at G = 8)
  static_assert(T % PD == 0 && AF_WARP % PD == 0, "a warp must hold whole rows of 8-byte pieces");
  const size_t kv_dim = (size_t)n_kv * HD;
  const int tid = threadIdx.x, lane = tid % AF_WARP, warp = tid / AF_WARP;
  const int kbytes = max(cap * HD * 2, NW * G * HD * 4);  // K, or the final reduction scratch
  char* ks = smem;
  char* vs = smem + kbytes;
  float* ps = reinterpret_cast<float*>(vs + cap * HD * 2);  // [cap][GP]

  // ---- before the wait: rows 0 .. min(L - 1, cap) - 1 (row L-1 is the previous kernel's) ----
  ats_stage<HD, T>(k_cache, v_cache, kv_dim, j, 0, min(len - 1, cap), 0, ks, vs);
  pdl_wait();
  pdl_launch_dependents();

  __shared__ __align__(16) float q_s[G * HD];  // q * scale, fp32
  __shared__ float w_red[NW][G];               // per-warp max (each chunk), then per-warp sum (at the end)
  for (int i = tid; i < G * HD / 8; i += T) {
    float f[8];
    const uint4 u = ld_cg16(q + (size_t)j * G * HD + i * 8);
    const float2 a = h2_to_f2(u.x), b = h2_to_f2(u.y), c = h2_to_f2(u.z), d = h2_to_f2(u.w);
    f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y; f[4] = c.x; f[5] = c.y; f[6] = d.x; f[7] = d.y;
#pragma unroll
    for (int e = 0; e < 8; ++e) q_s[i * 8 + e] = f[e] * scale;
  }
  if (len - 1 < cap && tid < 2 * DG) {  // row L-1, appended by the QKV kernel: after the wait, through L2
    const int c = tid % DG;
    const size_t src = (size_t)(len - 1) * kv_dim + (size_t)j * HD + c * 8;
    const uint4 u = ld_cg16((tid < DG ? k_cache : v_cache) + src);
    *reinterpret_cast<uint4*>((tid < DG ? ks : vs) + ats_swz<HD>(len - 1, c)) = u;
  }
  cp_async_wait<0>();
  __syncthreads();
  AF_TL_MARK(0);  // timeline: q and the first chunk in shared memory

  float m_run[G], lsum[G], o[G][4];  // running max (same in every thread), this thread's sums, its P.V piece
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m_run[g] = -AF_INF;
    lsum[g] = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) o[g][e] = 0.f;
  }
  const int pc = tid % PD, pr = tid / PD;  // P.V: this thread's 8-byte piece and position phase

  for (int c0 = 0; c0 < len; c0 += cap) {
    const int n = min(cap, len - c0);
    if (c0 > 0) {  // a later chunk (L > cap): everyone is done with the previous one, then load it
      __syncthreads();
      ats_stage<HD, T>(k_cache, v_cache, kv_dim, j, c0, c0 + n, c0, ks, vs);
      cp_async_wait<0>();
      __syncthreads();
    }
    // ---- scores: positions t, t + T, ... (TP per pass: q's shared-memory reads shared by TP rows) ----
    float mx[G];
#pragma unroll
    for (int g = 0; g < G; ++g) mx[g] = -AF_INF;
    for (int t = tid; t < n; t += TP * T) {
      float sc[TP][G];
#pragma unroll
      for (int r = 0; r < TP; ++r)
#pragma unroll
        for (int g = 0; g < G; ++g) sc[r][g] = 0.f;
#pragma unroll CU
      for (int c = 0; c < DG; ++c) {
        unsigned u[TP][4];
#pragma unroll
        for (int r = 0; r < TP; ++r) {  // past the end: a duplicate of row n-1, its score not stored
          const uint4 k = *reinterpret_cast<const uint4*>(ks + ats_swz<HD>(min(t + r * T, n - 1), c));
          u[r][0] = k.x; u[r][1] = k.y; u[r][2] = k.z; u[r][3] = k.w;
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float4 qa = *reinterpret_cast<const float4*>(q_s + g * HD + c * 8);
          const float4 qb = *reinterpret_cast<const float4*>(q_s + g * HD + c * 8 + 4);
          const float qv[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
#pragma unroll
          for (int r = 0; r < TP; ++r)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float2 f = h2_to_f2(u[r][e]);
              sc[r][g] = fmaf(qv[2 * e], f.x, sc[r][g]);
              sc[r][g] = fmaf(qv[2 * e + 1], f.y, sc[r][g]);
            }
        }
      }
#pragma unroll
      for (int r = 0; r < TP; ++r) {
        if (t + r * T < n) {
          float* pt = ps + (size_t)(t + r * T) * GP;
#pragma unroll
          for (int g = 0; g < G; ++g) { pt[g] = sc[r][g]; mx[g] = fmaxf(mx[g], sc[r][g]); }
        }
      }
    }
    // ---- the chunk's max per q head (block-wide), the running max, the rescale of what came before ----
#pragma unroll
    for (int g = 0; g < G; ++g) mx[g] = warp_max(mx[g]);
    if (lane == 0) {
#pragma unroll
      for (int g = 0; g < G; ++g) w_red[warp][g] = mx[g];
    }
    __syncthreads();
    float alpha[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float m = m_run[g];
#pragma unroll
      for (int w = 0; w < NW; ++w) m = fmaxf(m, w_red[w][g]);
      alpha[g] = __expf(m_run[g] - m);  // 0 on the first chunk (m_run = -inf, m finite: n >= 1)
      m_run[g] = m;
      lsum[g] *= alpha[g];
#pragma unroll
      for (int e = 0; e < 4; ++e) o[g][e] *= alpha[g];
    }
    // ---- p = exp(s - max) in place (this thread's own positions) ----
    for (int t = tid; t < n; t += T) {
      float* p = ps + (size_t)t * GP;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float e = __expf(p[g] - m_run[g]);
        p[g] = e;
        lsum[g] += e;
      }
    }
    __syncthreads();  // every p written; w_red free again
    AF_TL_MARK(1);  // timeline: scores and probabilities done
    // ---- P.V: this thread's piece of V over positions pr, pr + R, ... ----
#pragma unroll 2
    for (int t = pr; t < n; t += R) {
      const uint2 v = *reinterpret_cast<const uint2*>(vs + ats_swz<HD>(t, pc / 2) + (pc % 2) * 8);
      const unsigned uv[2] = {v.x, v.y};
      float pg[GP];
#pragma unroll
      for (int g4 = 0; g4 < GP; g4 += 4) {
        const float4 f = *reinterpret_cast<const float4*>(ps + (size_t)t * GP + g4);
        pg[g4] = f.x; pg[g4 + 1] = f.y; pg[g4 + 2] = f.z; pg[g4 + 3] = f.w;
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float2 f = h2_to_f2(uv[e]);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          o[g][2 * e] = fmaf(pg[g], f.x, o[g][2 * e]);
          o[g][2 * e + 1] = fmaf(pg[g], f.y, o[g][2 * e + 1]);
        }
      }
    }
  }
  AF_TL_MARK(2);  // timeline: P.V done

  // ---- the phases' o summed (warp shuffles, then the warps through shared memory) and the sums ----
  float* red = reinterpret_cast<float*>(ks);  // [NW][G][HD]: K is dead (its last reads preceded a barrier)
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
#pragma unroll
      for (int x = PD; x < AF_WARP; x <<= 1) o[g][e] += __shfl_xor_sync(0xffffffffu, o[g][e], x);
    }
    lsum[g] = warp_sum(lsum[g]);
  }
  if (lane < PD) {
#pragma unroll
    for (int g = 0; g < G; ++g)
      *reinterpret_cast<float4*>(red + ((size_t)warp * G + g) * HD + pc * 4) = make_float4(o[g][0], o[g][1], o[g][2], o[g][3]);
  }
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) w_red[warp][g] = lsum[g];
  }
  __syncthreads();
  for (int i = tid; i < G * HD; i += T) {
    const int g = i / HD;
    float acc = 0.f, l = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      acc += red[(size_t)w * G * HD + i];
      l += w_red[w][g];
    }
    out[(size_t)j * G * HD + i] = __float2half(acc / l);
  }
}

// One kernel per (head_dim, q heads per kv head), like attention.cu. Block j = kv head j.
#define ATTENTION_SHORT_INSTANCE(HD, G)                                                                   \
  extern "C" __global__ void __launch_bounds__(ATS_THREADS, ATS_MIN_BLOCKS(G))                           \
      attention_short_hd##HD##_g##G(                                                                      \
      const __half* __restrict__ q, const __half* __restrict__ k_cache, const __half* __restrict__ v_cache, \
      const int* __restrict__ pos_ptr, __half* __restrict__ out, int n_kv, int cap, float scale) {        \
    AF_TIMELINE_BLOCK;                                                                                    \
    extern __shared__ __align__(16) char ats_smem[];                                                      \
    /* pos was written by the previous step's argmax, complete before this step's first kernel */        \
    attention_short_item<HD, G, ATS_THREADS, ATS_ROWS(G)>(q, k_cache, v_cache, *pos_ptr + 1, blockIdx.x, out, n_kv, cap, \
                                             scale, ats_smem);                                            \
  }

ATTENTION_SHORT_INSTANCE(64, 1)
ATTENTION_SHORT_INSTANCE(64, 2)
ATTENTION_SHORT_INSTANCE(64, 3)
ATTENTION_SHORT_INSTANCE(64, 4)
ATTENTION_SHORT_INSTANCE(64, 8)
ATTENTION_SHORT_INSTANCE(128, 1)
ATTENTION_SHORT_INSTANCE(128, 2)
ATTENTION_SHORT_INSTANCE(128, 3)
ATTENTION_SHORT_INSTANCE(128, 4)
ATTENTION_SHORT_INSTANCE(128, 8)
