// gemv_common.cuh — the one GEMV skeleton shared by gemv_fp16.cu and gemv_fp8.cu (M = 1: y = W · x).
//
// Layout: W row-major [rows, K]; every 16-byte chunk of a row is one load (8 fp16 or 16 fp8 weights).
// Launch: 1-D grid of blocks of 256 threads (8 warps), at most 4 resident blocks per SM (launch bounds);
// a warp owns one output at a time (R = 1 or 2 weight rows) and walks its row(s) with 16-byte streaming
// loads; grid-stride over outputs (the host launches at most one resident wave). Shared memory: the input
// vector as fp32 (K * 4 bytes, chunk-interleaved, see xs_index) + 32 floats for reductions.
//
// Latency hiding: the warp's work is software-pipelined over two register stages of GEMV_STAGE_LOADS
// loads per lane: the next stage's loads (next chunks, or the first chunks of the warp's next output) are
// issued before the current stage's math, so DRAM never waits for the fp8/fp16 conversions. The first
// stage is issued BEFORE the prologue (weights do not depend on x), hiding the prologue's L2 round trips,
// and, under programmatic dependent launch, before waiting for the previous kernel to finish.
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
// Experiment knobs (results/PERF_NOTES.md v2.2), set with -D by the loader (ATOMFLOW_KERNEL_DEFINES):
//   GEMV_X_F32    1: x staged in shared memory as fp32, 0: as fp16 (both chunk-interleaved, conflict-free)
//   GEMV_PIPELINE 1: two register stages of 4 loads per lane, next stage issued before the current math;
//                 0: one batch of 8 loads per lane, issued, then used
#ifndef GEMV_X_F32
#define GEMV_X_F32 1
#endif
#ifndef GEMV_PIPELINE
#define GEMV_PIPELINE 1
#endif
#define GEMV_STAGE_LOADS (GEMV_PIPELINE ? 4 : 8)  // 16-byte loads per lane per stage (split over the R rows)
#if GEMV_X_F32
typedef float xs_t;
#else
typedef __half xs_t;
#endif

enum { PRO_PLAIN = 0, PRO_NORM = 1 };
enum { EPI_STORE = 0, EPI_F32 = 1, EPI_RESID = 2, EPI_SWIGLU = 3, EPI_ROPE = 4 };

struct RopeArgs {
  const float2* cos_sin;  // [max_seq][hd/2] (cos, sin) of pos * inv_freq[i], precomputed by the host
  const int* pos;
  __half* k_cache;  // this layer's [max_seq][n_kv * hd]
  __half* v_cache;
  int n_q, n_kv, hd;
};

// x lives in shared memory as fp32, chunk-interleaved: the j-th float4 of weight chunk c sits at float4
// index j * nchunks + c, so when the 32 lanes of a warp work on 32 consecutive chunks every 16-byte
// shared load they issue is contiguous across the warp (no bank conflicts; a plain layout would put the
// lanes 32 or 64 bytes apart: 2- to 4-way conflicts on every load).
// (With fp16 x the unit is 8 halves instead of 4 floats.)
__device__ __forceinline__ int xs_index(int k, int per_chunk, int nchunks) {
  constexpr int V = 16 / sizeof(xs_t);  // elements per 16-byte vector
  const int c = k / per_chunk, e = k % per_chunk;
  return ((e / V) * nchunks + c) * V + (e % V);
}

// 8 consecutive x values of chunk c, vector j (fp32 layout: 2 float4; fp16 layout: half of one uint4).
__device__ __forceinline__ void x8(const uint4* xv, int c, int nchunks, int j, float* f) {
#if GEMV_X_F32
  const float4 p = reinterpret_cast<const float4*>(xv)[(2 * j) * nchunks + c];
  const float4 q = reinterpret_cast<const float4*>(xv)[(2 * j + 1) * nchunks + c];
  f[0] = p.x; f[1] = p.y; f[2] = p.z; f[3] = p.w; f[4] = q.x; f[5] = q.y; f[6] = q.z; f[7] = q.w;
#else
  const uint4 u = xv[j * nchunks + c];
  const float2 a = h2_to_f2(u.x), b = h2_to_f2(u.y), cc = h2_to_f2(u.z), d = h2_to_f2(u.w);
  f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y; f[4] = cc.x; f[5] = cc.y; f[6] = d.x; f[7] = d.y;
#endif
}

// Weight-format policies: how many weights a 16-byte chunk holds and its dot product with x (fp32, so
// only the weights need converting).
struct Fp16W {
  static constexpr int PER_CHUNK = 8;
  // 8 fp16 weights . 8 activations, fp32 FMA.
  __device__ __forceinline__ static float dot(uint4 w, const uint4* xv, int c, int nchunks, const float*) {
    float x[8];
    x8(xv, c, nchunks, 0, x);
    const float2 w0 = h2_to_f2(w.x), w1 = h2_to_f2(w.y), w2 = h2_to_f2(w.z), w3 = h2_to_f2(w.w);
    float acc = w0.x * x[0];
    acc = fmaf(w0.y, x[1], acc); acc = fmaf(w1.x, x[2], acc); acc = fmaf(w1.y, x[3], acc);
    acc = fmaf(w2.x, x[4], acc); acc = fmaf(w2.y, x[5], acc); acc = fmaf(w3.x, x[6], acc);
    acc = fmaf(w3.y, x[7], acc);
    return acc;
  }
};

struct Fp8W {
  static constexpr int PER_CHUNK = 16;
  // 16 FP8-E4M3 weights (dequantised in registers only: hardware fp8x2->half2, then fp32 FMA) times
  // 16 activations, scaled by the row's group scale (group = 128 inputs = 8 chunks).
  __device__ __forceinline__ static float dot(uint4 w, const uint4* xv, int c, int nchunks, const float* srow) {
    const unsigned int wv[4] = {w.x, w.y, w.z, w.w};
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float x[8];
      x8(xv, c, nchunks, j, x);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const unsigned int u = wv[2 * j + i];
        const float2 w0 = e4m3x2_to_f2((unsigned short)(u & 0xffffu));
        const float2 w1 = e4m3x2_to_f2((unsigned short)(u >> 16));
        acc = fmaf(w0.x, x[4 * i], acc); acc = fmaf(w0.y, x[4 * i + 1], acc);
        acc = fmaf(w1.x, x[4 * i + 2], acc); acc = fmaf(w1.y, x[4 * i + 3], acc);
      }
    }
    return acc * __ldg(srow + (c >> 3));  // 8 chunks of 16 = one group of 128
  }
};

// Weight row r (0..R-1) of output o.
template <int EPI>
__device__ __forceinline__ size_t gemv_row(int o, int r, int n_out, int half_d) {
  if (EPI == EPI_SWIGLU) return (size_t)o + (size_t)r * n_out;
  if (EPI == EPI_ROPE) return (size_t)(o / half_d) * (2 * half_d) + (o % half_d) + (size_t)r * half_d;
  return (size_t)o;
}

// The warp's work is a flat sequence of steps: step s = (output o0 + (s / n_it) * stride, chunk group
// s % n_it); a group is U chunks of each of the R rows, U * 32 chunks per row.
struct GemvWalk {
  const unsigned char* W;
  const float* scales;
  size_t row_bytes;
  int o0, stride, n_out, n_it, nchunks, ngroups, half_d, lane;
};

template <class WF, int EPI, int R, int U>
__device__ __forceinline__ void gemv_load(const GemvWalk& g, int s, uint4 (&buf)[R][U]) {
  const int o = g.o0 + (s / g.n_it) * g.stride, it = s % g.n_it;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const unsigned char* wrow = g.W + gemv_row<EPI>(o, r, g.n_out, g.half_d) * g.row_bytes;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = g.lane + (it * U + u) * AF_WARP;
      buf[r][u] = c < g.nchunks ? ld_stream(wrow + (size_t)c * 16) : make_uint4(0, 0, 0, 0);
    }
  }
}

template <class WF, int EPI, int R>
__device__ __forceinline__ void gemv_epilogue(int o, const float (&acc)[R], void* y, int n_out, const RopeArgs& rope,
                                              int half_d) {
  if (EPI == EPI_STORE) {
    reinterpret_cast<__half*>(y)[o] = __float2half(acc[0]);
  } else if (EPI == EPI_F32) {
    reinterpret_cast<float*>(y)[o] = acc[0];
  } else if (EPI == EPI_RESID) {
    reinterpret_cast<float*>(y)[o] += acc[0];
  } else if (EPI == EPI_SWIGLU) {  // HF rounds gate and up to fp16, then silu(gate) * up in fp16
    const float g = __half2float(__float2half(acc[0]));
    const float u = __half2float(__float2half(acc[R - 1]));
    const float s = __half2float(__float2half(g / (1.f + __expf(-g))));
    reinterpret_cast<__half*>(y)[o] = __float2half(s * u);
  } else {  // EPI_ROPE: rows i and i + hd/2 of head `head`; the projection is rounded to fp16 first (HF)
    const int head = o / half_d, i = o % half_d;
    float x0 = __half2float(__float2half(acc[0])), x1 = __half2float(__float2half(acc[R - 1]));
    const int pos = *rope.pos;
    if (head < rope.n_q + rope.n_kv) {
      const float2 cs = rope.cos_sin[(size_t)pos * half_d + i];
      const float r0 = x0 * cs.x - x1 * cs.y, r1 = x1 * cs.x + x0 * cs.y;
      x0 = r0;
      x1 = r1;
    }
    const __half h0 = __float2half(x0), h1 = __float2half(x1);
    __half* out = reinterpret_cast<__half*>(y) + (size_t)head * rope.hd + i;
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

template <class WF, int EPI, int R, int U>
__device__ __forceinline__ void gemv_compute(const GemvWalk& g, int s, const uint4 (&buf)[R][U], const xs_t* xs,
                                             float (&acc)[R], void* y, const RopeArgs& rope) {
  const int o = g.o0 + (s / g.n_it) * g.stride, it = s % g.n_it;
  if (it == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float* srow = g.scales ? g.scales + gemv_row<EPI>(o, r, g.n_out, g.half_d) * g.ngroups : nullptr;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = g.lane + (it * U + u) * AF_WARP;
      if (c < g.nchunks) acc[r] += WF::dot(buf[r][u], reinterpret_cast<const uint4*>(xs), c, g.nchunks, srow);
    }
  }
  if (it == g.n_it - 1) {
    float tot[R];
#pragma unroll
    for (int r = 0; r < R; ++r) tot[r] = warp_sum(acc[r]);
    if (g.lane == 0) gemv_epilogue<WF, EPI, R>(o, tot, y, g.n_out, rope, g.half_d);
  }
}

template <class WF, int PRO, int EPI>
__device__ __forceinline__ void gemv_impl(const unsigned char* __restrict__ W, const float* __restrict__ scales,
                                          const void* __restrict__ x, const __half* __restrict__ norm_w,
                                          float eps, void* __restrict__ y, int n_out, int K,
                                          const RopeArgs rope) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  xs_t* xs = reinterpret_cast<xs_t*>(smem_raw);
  float* red = reinterpret_cast<float*>(smem_raw + ((K * sizeof(xs_t) + 15) & ~15));

  constexpr int R = (EPI == EPI_SWIGLU || EPI == EPI_ROPE) ? 2 : 1;  // weight rows per output
  constexpr int U = GEMV_STAGE_LOADS / R;                             // chunks per row per step
  GemvWalk g;
  g.W = W;
  g.scales = scales;
  g.row_bytes = (size_t)K * (16 / WF::PER_CHUNK);
  g.nchunks = K / WF::PER_CHUNK;
  g.ngroups = (K + 127) >> 7;
  g.n_it = (g.nchunks + U * AF_WARP - 1) / (U * AF_WARP);
  g.half_d = EPI == EPI_ROPE ? rope.hd / 2 : 1;
  g.lane = threadIdx.x % AF_WARP;
  g.n_out = n_out;
  g.o0 = blockIdx.x * (blockDim.x / AF_WARP) + threadIdx.x / AF_WARP;
  g.stride = gridDim.x * (blockDim.x / AF_WARP);
  const int n_steps = g.o0 < n_out ? ((n_out - 1 - g.o0) / g.stride + 1) * g.n_it : 0;

  // Two register stages: while one is being multiplied, the other's loads are in flight. The first
  // stage is issued before the prologue, which then runs under the weights' DRAM latency.
  uint4 a[R][U], b[R][U];
  if (n_steps > 0) gemv_load<WF, EPI, R, U>(g, 0, a);
  pdl_wait();  // weights above may be read early; x / h / pos only after the predecessor finished
  pdl_launch_dependents();
  if (PRO == PRO_NORM) {
    const float* h = reinterpret_cast<const float*>(x);
    const float inv = rms_inv(h, eps, K, red);
    for (int k = threadIdx.x; k < K; k += blockDim.x)
      xs[xs_index(k, WF::PER_CHUNK, g.nchunks)] = (xs_t)rmsnorm_elem(h[k], inv, norm_w[k]);
  } else {
    const __half* src = reinterpret_cast<const __half*>(x);
    for (int k = threadIdx.x; k < K; k += blockDim.x) xs[xs_index(k, WF::PER_CHUNK, g.nchunks)] = (xs_t)src[k];
  }
  __syncthreads();

  float acc[R];
#if GEMV_PIPELINE
  for (int s = 0; s < n_steps; s += 2) {
    if (s + 1 < n_steps) gemv_load<WF, EPI, R, U>(g, s + 1, b);
    gemv_compute<WF, EPI, R, U>(g, s, a, xs, acc, y, rope);
    if (s + 2 < n_steps) gemv_load<WF, EPI, R, U>(g, s + 2, a);
    if (s + 1 < n_steps) gemv_compute<WF, EPI, R, U>(g, s + 1, b, xs, acc, y, rope);
  }
#else
  (void)b;
  for (int s = 0; s < n_steps; ++s) {
    if (s > 0) gemv_load<WF, EPI, R, U>(g, s, a);
    gemv_compute<WF, EPI, R, U>(g, s, a, xs, acc, y, rope);
  }
#endif
}

#define GEMV_INSTANCE(NAME, WF, PRO, EPI)                                                                 \
  extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_BLOCKS)                            \
  NAME(const unsigned char* __restrict__ W, const float* __restrict__ scales, const void* __restrict__ x, \
       const __half* __restrict__ norm_w, float eps, void* __restrict__ y, int n_out, int K) {            \
    gemv_impl<WF, PRO, EPI>(W, scales, x, norm_w, eps, y, n_out, K, RopeArgs{});                         \
  }

// The QKV projection with RoPE and the KV-cache append in its epilogue.
#define GEMV_ROPE_INSTANCE(NAME, WF)                                                                      \
  extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_BLOCKS)                            \
  NAME(const unsigned char* __restrict__ W, const float* __restrict__ scales, const void* __restrict__ x, \
       const __half* __restrict__ norm_w, float eps, void* __restrict__ y, int n_out, int K,              \
       const float2* __restrict__ cos_sin, const int* __restrict__ pos, __half* __restrict__ k_cache,     \
       __half* __restrict__ v_cache, int n_q, int n_kv, int hd) {                                        \
    gemv_impl<WF, PRO_NORM, EPI_ROPE>(W, scales, x, norm_w, eps, y, n_out, K,                            \
                                      RopeArgs{cos_sin, pos, k_cache, v_cache, n_q, n_kv, hd});         \
  }
