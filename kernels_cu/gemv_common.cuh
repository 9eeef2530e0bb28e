// gemv_common.cuh — the one GEMV skeleton shared by gemv_fp16.cu and gemv_fp8.cu (M = 1: y = W · x).
//
// Layout: W row-major [rows, K]; every 16-byte chunk of a row is one load (8 fp16 or 16 fp8 weights).
// Launch: 1-D grid of blocks of 256 threads (8 warps), at most 4 resident blocks per SM (launch bounds);
// a warp owns one output at a time (R = 1 or 2 weight rows) and walks its row(s) with 16-byte streaming
// loads, GEMV_LOADS chunks per lane in flight; grid-stride over outputs (the host launches at most one
// resident wave). Shared memory: K halves for the input vector + 32 floats for reductions.
//
// Latency hiding: the warp's first batch of weight loads is issued BEFORE the prologue (weights do not
// depend on x), so the prologue's L2 round trips overlap the DRAM latency of the weights, and, under
// programmatic dependent launch, before waiting for the previous kernel to finish.
// (Tried and measured slower end to end, results/PERF_NOTES.md v2: x staged as fp32, two-stage load
// pipelining over a flattened (output, chunk-group) walk.)
//
// Fusions (each removes a launch and a round trip of an activation vector):
//   PRO_NORM   prologue: x = RMSNorm(h_fp32) * w_norm computed per block straight into shared memory
//              (replaces a separate RMSNorm kernel before QKV and gate/up).
//   EPI_RESID  epilogue: h_fp32[o] += W·x (residual add after o_proj and down_proj).
//   EPI_SWIGLU epilogue: the warp computes rows o (gate) and o + n_out (up) of the stacked [gate; up]
//              weight and writes y[o] = silu(gate) * up; the 2·I intermediate never exists.
//   EPI_ROPE   epilogue of the stacked q|k|v projection: the warp computes rows i and i + hd/2 of one head,
//              rotates q and k heads (RoPE, HF rotate_half convention; cos/sin of pos * inv_freq[i] from a
//              host-computed table, so no sincosf slow path in the kernel),
//              writes them to y and appends k and v to the KV cache at pos (replaces rope + KV-append).
//   EPI_F32    plain fp32 store (lm_head logits); EPI_STORE plain fp16 store.
//
// Kernel signature for every instantiation (unused arguments are 0):
//   (W, scales, x, norm_w, eps, y, n_out, K)            + for EPI_ROPE: (cos_sin, pos, k_cache, v_cache,
//                                                                       n_q_heads, n_kv_heads, hd)
//   x: const float* (fp32 residual) with PRO_NORM, else const half*;  y: half* / float* per epilogue.
#pragma once
#include "common.cuh"

#define GEMV_THREADS 256
#define GEMV_MIN_BLOCKS 4   // resident blocks per SM the register budget is planned for (<= 64 regs/thread)
#define GEMV_LOADS 8        // 16-byte loads in flight per lane per iteration (split over the R rows)

enum { PRO_PLAIN = 0, PRO_NORM = 1 };
enum { EPI_STORE = 0, EPI_F32 = 1, EPI_RESID = 2, EPI_SWIGLU = 3, EPI_ROPE = 4 };

struct RopeArgs {
  const float2* cos_sin;  // [max_seq][hd/2] (cos, sin) of pos * inv_freq[i], precomputed by the host
  const int* pos;
  __half* k_cache;  // this layer's [max_seq][n_kv * hd]
  __half* v_cache;
  int n_q, n_kv, hd;
};

// Weight-format policies: how many weights a 16-byte chunk holds and its dot product with x.
struct Fp16W {
  static constexpr int PER_CHUNK = 8;
  static constexpr bool SCALED = false;
  // 8 fp16 weights · 8 fp16 activations, accumulated in fp32.
  __device__ __forceinline__ static float dot(uint4 w, const __half* xs, int k) {
    const uint4 xv = *reinterpret_cast<const uint4*>(xs + k);
    float2 a = h2_to_f2(w.x), b = h2_to_f2(w.y), c = h2_to_f2(w.z), d = h2_to_f2(w.w);
    float2 p = h2_to_f2(xv.x), q = h2_to_f2(xv.y), r = h2_to_f2(xv.z), s = h2_to_f2(xv.w);
    float acc = a.x * p.x;
    acc = fmaf(a.y, p.y, acc); acc = fmaf(b.x, q.x, acc); acc = fmaf(b.y, q.y, acc);
    acc = fmaf(c.x, r.x, acc); acc = fmaf(c.y, r.y, acc); acc = fmaf(d.x, s.x, acc);
    acc = fmaf(d.y, s.y, acc);
    return acc;
  }
};

struct Fp8W {
  static constexpr int PER_CHUNK = 16;
  static constexpr bool SCALED = true;  // the caller multiplies by the row's group scale (group = 128 inputs)
  // 16 FP8-E4M3 weights (dequantised in registers only: hardware fp8x2->half2, then fp32 FMA) times
  // 16 fp16 activations, before the group scale.
  __device__ __forceinline__ static float dot(uint4 w, const __half* xs, int k) {
    const uint4 x0 = *reinterpret_cast<const uint4*>(xs + k);
    const uint4 x1 = *reinterpret_cast<const uint4*>(xs + k + 8);
    const unsigned int wv[4] = {w.x, w.y, w.z, w.w};
    const unsigned int xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 w0 = e4m3x2_to_f2((unsigned short)(wv[i] & 0xffffu));
      float2 w1 = e4m3x2_to_f2((unsigned short)(wv[i] >> 16));
      float2 xa = h2_to_f2(xv[2 * i]), xb = h2_to_f2(xv[2 * i + 1]);
      acc = fmaf(w0.x, xa.x, acc); acc = fmaf(w0.y, xa.y, acc);
      acc = fmaf(w1.x, xb.x, acc); acc = fmaf(w1.y, xb.y, acc);
    }
    return acc;
  }
};

// Weight row r (0..R-1) of output o.
template <int EPI>
__device__ __forceinline__ size_t gemv_row(int o, int r, int n_out, int half_d) {
  if (EPI == EPI_SWIGLU) return (size_t)o + (size_t)r * n_out;
  if (EPI == EPI_ROPE) return (size_t)(o / half_d) * (2 * half_d) + (o % half_d) + (size_t)r * half_d;
  return (size_t)o;
}

// One GEMV's operands (unused ones 0). x: const float* (fp32 residual) with PRO_NORM, else const half*.
struct GemvArgs {
  const unsigned char* W;
  const float* scales;
  const void* x;
  const __half* norm_w;
  float eps;
  void* y;
  int n_out, K;
};

// The epilogue of output o (lane 0 of the warp that computed it): acc0 = row 0, acc1 = row R-1 (R = 2:
// gate and up, or RoPE pair rows i and i + hd/2).
template <int EPI>
__device__ __forceinline__ void gemv_epilogue(const GemvArgs& a, const RopeArgs& rope, int o, float acc0, float acc1) {
  const int half_d = EPI == EPI_ROPE ? rope.hd / 2 : 1;
  if (EPI == EPI_STORE) {
    reinterpret_cast<__half*>(a.y)[o] = __float2half(acc0);
  } else if (EPI == EPI_F32) {
    reinterpret_cast<float*>(a.y)[o] = acc0;
  } else if (EPI == EPI_RESID) {
    float* hp = reinterpret_cast<float*>(a.y) + o;
    *hp = __ldcg(hp) + acc0;
  } else if (EPI == EPI_SWIGLU) {  // HF rounds gate and up to fp16, then silu(gate) * up in fp16
    const float g = __half2float(__float2half(acc0));
    const float u = __half2float(__float2half(acc1));
    const float s = __half2float(__float2half(g / (1.f + __expf(-g))));
    reinterpret_cast<__half*>(a.y)[o] = __float2half(s * u);
  } else {  // EPI_ROPE: rows i and i + hd/2 of head `head`; the projection is rounded to fp16 first (HF)
    const int head = o / half_d, i = o % half_d;
    float x0 = __half2float(__float2half(acc0)), x1 = __half2float(__float2half(acc1));
    const int pos = *rope.pos;
    if (head < rope.n_q + rope.n_kv) {
      const float2 cs = rope.cos_sin[(size_t)pos * half_d + i];
      const float r0 = x0 * cs.x - x1 * cs.y, r1 = x1 * cs.x + x0 * cs.y;
      x0 = r0;
      x1 = r1;
    }
    const __half h0 = __float2half(x0), h1 = __float2half(x1);
    __half* out = reinterpret_cast<__half*>(a.y) + (size_t)head * rope.hd + i;
    out[0] = h0;
    out[half_d] = h1;
    if (head >= rope.n_q) {
      const int kvh = head - rope.n_q;  // k heads first, then v heads
      __half* cache = kvh < rope.n_kv ? rope.k_cache : rope.v_cache;
      __half* dst = cache + (size_t)pos * rope.n_kv * rope.hd + (size_t)(kvh % rope.n_kv) * rope.hd + i;
      dst[0] = h0;
      dst[half_d] = h1;
    }
  }
}

// x staged in shared memory as fp16 by the AF_CTA_THREADS threads: RMSNorm(h_fp32) * norm_w (PRO_NORM) or
// a copy of the fp16 input, read through L2 (in the persistent kernel other blocks just wrote it).
template <int PRO>
__device__ __forceinline__ void gemv_stage_x(const GemvArgs& a, __half* xs, float* red) {
  if (PRO == PRO_NORM) {
    rmsnorm_to_half(reinterpret_cast<const float*>(a.x), a.norm_w, a.eps, a.K, xs, red);
  } else {
    const __half* src = reinterpret_cast<const __half*>(a.x);
    for (int i = threadIdx.x; i < a.K / 8; i += AF_CTA_THREADS) reinterpret_cast<uint4*>(xs)[i] = ld_cg16(src + 8 * i);
  }
  AF_CTA_SYNC();
}

// The GEMV as one phase: every warp of the grid owns outputs gw, gw + n_warps, ... . The first batch of
// the warp's weight loads is issued before sync.arrive_wait() (weights never depend on the previous
// phase); then the prologue stages x in shared memory and the warp walks its outputs.
// (Measured and removed: an L2 prefetch look-ahead of the next outputs' rows, results/PERF_NOTES.md v5.1.)
template <class WF, int PRO, int EPI, int LOADS, class Sync>
__device__ __forceinline__ void gemv_phase(const GemvArgs a, const RopeArgs rope, const Sync sync,
                                           unsigned char* smem_raw) {
  const int K = a.K, n_out = a.n_out;
  __half* xs = reinterpret_cast<__half*>(smem_raw);
  float* red = reinterpret_cast<float*>(smem_raw + ((K * sizeof(__half) + 15) & ~15));

  constexpr int R = (EPI == EPI_SWIGLU || EPI == EPI_ROPE) ? 2 : 1;  // weight rows per output
  constexpr int U = LOADS / R;                                        // chunks per row per iteration
  constexpr int BYTES_PER_W = 16 / WF::PER_CHUNK;
  const int lane = threadIdx.x % AF_WARP;
  const int nwarps = blockDim.x / AF_WARP;
  const int stride = gridDim.x * nwarps;
  const int nchunks = K / WF::PER_CHUNK;
  const int ngroups = (K + 127) >> 7;
  const int half_d = EPI == EPI_ROPE ? rope.hd / 2 : 1;
  const size_t row_bytes = (size_t)K * BYTES_PER_W;

  // Prefetch the first iteration's weights of this warp's first output, then sync and run the prologue.
  int o = blockIdx.x * nwarps + threadIdx.x / AF_WARP;
  uint4 wv[R][U];
  if (o < n_out) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const unsigned char* wrow = a.W + gemv_row<EPI>(o, r, n_out, half_d) * row_bytes;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = lane + u * AF_WARP;
        wv[r][u] = c < nchunks ? ld_stream(wrow + (size_t)c * 16) : make_uint4(0, 0, 0, 0);
      }
    }
  }
  sync.arrive_wait();  // weights above may be read early; x / h / pos only once the previous phase is done
  gemv_stage_x<PRO>(a, xs, red);

  bool prefetched = true;
  for (; o < n_out; o += stride) {
    const unsigned char* wrow[R];
    const float* srow[R];
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const size_t row = gemv_row<EPI>(o, r, n_out, half_d);
      wrow[r] = a.W + row * row_bytes;
      srow[r] = a.scales ? a.scales + row * ngroups : nullptr;
      acc[r] = 0.f;
    }
    for (int c0 = lane; c0 < nchunks; c0 += AF_WARP * U) {
      if (!prefetched) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int c = c0 + u * AF_WARP;
#pragma unroll
          for (int r = 0; r < R; ++r)
            wv[r][u] = c < nchunks ? ld_stream(wrow[r] + (size_t)c * 16) : make_uint4(0, 0, 0, 0);
        }
      }
      prefetched = false;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + u * AF_WARP;
        if (c < nchunks) {
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const float d = WF::dot(wv[r][u], xs, c * WF::PER_CHUNK);
            acc[r] += WF::SCALED ? d * __ldg(srow[r] + ((c * WF::PER_CHUNK) >> 7)) : d;
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);

    if (lane == 0) gemv_epilogue<EPI>(a, rope, o, acc[0], acc[R - 1]);
  }
}

#define GEMV_INSTANCE(NAME, WF, PRO, EPI)                                                                 \
  extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_BLOCKS)                            \
  NAME(const unsigned char* __restrict__ W, const float* __restrict__ scales, const void* __restrict__ x, \
       const __half* __restrict__ norm_w, float eps, void* __restrict__ y, int n_out, int K) {            \
    extern __shared__ __align__(16) unsigned char smem_raw[];                                             \
    PdlSync sync;                                                                                         \
    gemv_phase<WF, PRO, EPI, GEMV_LOADS>(GemvArgs{W, scales, x, norm_w, eps, y, n_out, K}, RopeArgs{}, \
                                            sync, smem_raw);                                              \
  }

// The QKV projection with RoPE and the KV-cache append in its epilogue.
#define GEMV_ROPE_INSTANCE(NAME, WF)                                                                      \
  extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_BLOCKS)                            \
  NAME(const unsigned char* __restrict__ W, const float* __restrict__ scales, const void* __restrict__ x, \
       const __half* __restrict__ norm_w, float eps, void* __restrict__ y, int n_out, int K,              \
       const float2* __restrict__ cos_sin, const int* __restrict__ pos, __half* __restrict__ k_cache,     \
       __half* __restrict__ v_cache, int n_q, int n_kv, int hd) {                                        \
    extern __shared__ __align__(16) unsigned char smem_raw[];                                             \
    PdlSync sync;                                                                                         \
    gemv_phase<WF, PRO_NORM, EPI_ROPE, GEMV_LOADS>(GemvArgs{W, scales, x, norm_w, eps, y, n_out, K},     \
                                                      RopeArgs{cos_sin, pos, k_cache, v_cache, n_q, n_kv, hd}, \
                                                      sync, smem_raw);                                    \
  }
