// gemv_common.cuh — the one GEMV skeleton shared by gemv_fp16.cu and gemv_fp8.cu (M = 1: y = W · x).
//
// Layout: W row-major [rows, K]; every 16-byte chunk of a row is one load (8 fp16 or 16 fp8 weights).
// Launch: 1-D grid of blocks of 256 threads (8 warps); a warp owns one output at a time and walks its
// row(s) with 16-byte streaming loads, UNROLL chunks per row in flight before any is used; grid-stride
// over outputs so the host may launch at most one resident wave ("persistent" grid).
// Shared memory: K halves for the input vector + 32 floats for reductions.
//
// Fusions (each removes a launch and a round trip of the activation vector through DRAM/L2):
//   PRO_NORM   prologue: x = RMSNorm(h_fp32) * w_norm, computed per block straight into shared memory
//              (replaces a separate RMSNorm kernel before QKV and gate/up).
//   EPI_RESID  epilogue: h_fp32[o] += W·x  (residual add after o_proj and down_proj).
//   EPI_SWIGLU epilogue: the warp computes rows o (gate) and o + n_out (up) of the stacked [gate; up]
//              weight and writes y[o] = silu(gate) * up, so the 2·I intermediate never exists.
//   EPI_F32    plain store in fp32 (lm_head logits); EPI_STORE plain fp16 store.
//
// Uniform kernel signature for every instantiation (unused arguments are 0):
//   (W, scales, x, norm_w, eps, y, n_out, K)
//   x: const float* (fp32 residual) with PRO_NORM, else const half*;  y: half* / float* per epilogue.
#pragma once
#include "common.cuh"

#define GEMV_THREADS 256
#define GEMV_UNROLL 4

enum { PRO_PLAIN = 0, PRO_NORM = 1 };
enum { EPI_STORE = 0, EPI_F32 = 1, EPI_RESID = 2, EPI_SWIGLU = 3 };

// Weight-format policies: how many weights a 16-byte chunk holds and its dot product with x.
struct Fp16W {
  static constexpr int PER_CHUNK = 8;
  // 8 fp16 weights · 8 fp16 activations, accumulated in fp32.
  __device__ __forceinline__ static float dot(uint4 w, const __half* xs, int k, const float*) {
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
  // 16 FP8-E4M3 weights (dequantised in registers only: hardware fp8x2->half2, then fp32 FMA) times
  // 16 fp16 activations, scaled by the row's group scale (group = 128 inputs = 8 chunks).
  __device__ __forceinline__ static float dot(uint4 w, const __half* xs, int k, const float* srow) {
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
    return acc * __ldg(srow + (k >> 7));
  }
};

template <class WF, int PRO, int EPI>
__device__ __forceinline__ void gemv_impl(const unsigned char* __restrict__ W, const float* __restrict__ scales,
                                          const void* __restrict__ x, const __half* __restrict__ norm_w,
                                          float eps, void* __restrict__ y, int n_out, int K) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* xs = reinterpret_cast<__half*>(smem_raw);
  float* red = reinterpret_cast<float*>(smem_raw + ((K * sizeof(__half) + 15) & ~15));

  if (PRO == PRO_NORM) {
    rmsnorm_to_half(reinterpret_cast<const float*>(x), norm_w, eps, K, xs, red);
  } else {
    const uint4* src = reinterpret_cast<const uint4*>(x);
    for (int i = threadIdx.x; i < K / 8; i += blockDim.x) reinterpret_cast<uint4*>(xs)[i] = src[i];
  }
  __syncthreads();

  constexpr int R = (EPI == EPI_SWIGLU) ? 2 : 1;  // rows per output
  constexpr int BYTES_PER_W = 16 / WF::PER_CHUNK;
  const int lane = threadIdx.x % AF_WARP;
  const int nwarps = blockDim.x / AF_WARP;
  const int nchunks = K / WF::PER_CHUNK;
  const int ngroups = (K + 127) >> 7;
  const size_t row_bytes = (size_t)K * BYTES_PER_W;

  for (int o = blockIdx.x * nwarps + threadIdx.x / AF_WARP; o < n_out; o += gridDim.x * nwarps) {
    const unsigned char* wrow[R];
    const float* srow[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const size_t row = (size_t)o + (size_t)r * n_out;
      wrow[r] = W + row * row_bytes;
      srow[r] = scales ? scales + row * ngroups : nullptr;
    }
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;

    for (int c0 = lane; c0 < nchunks; c0 += AF_WARP * GEMV_UNROLL) {
      uint4 wv[R][GEMV_UNROLL];
#pragma unroll
      for (int u = 0; u < GEMV_UNROLL; ++u) {
        const int c = c0 + u * AF_WARP;
#pragma unroll
        for (int r = 0; r < R; ++r)
          wv[r][u] = c < nchunks ? ld_stream(wrow[r] + (size_t)c * 16) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < GEMV_UNROLL; ++u) {
        const int c = c0 + u * AF_WARP;
        if (c < nchunks) {
#pragma unroll
          for (int r = 0; r < R; ++r) acc[r] += WF::dot(wv[r][u], xs, c * WF::PER_CHUNK, srow[r]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);

    if (lane == 0) {
      if (EPI == EPI_STORE) {
        reinterpret_cast<__half*>(y)[o] = __float2half(acc[0]);
      } else if (EPI == EPI_F32) {
        reinterpret_cast<float*>(y)[o] = acc[0];
      } else if (EPI == EPI_RESID) {
        reinterpret_cast<float*>(y)[o] += acc[0];
      } else {  // EPI_SWIGLU: HF rounds gate and up to fp16, then silu(gate) * up in fp16 arithmetic
        const float g = __half2float(__float2half(acc[0]));
        const float u = __half2float(__float2half(acc[R - 1]));
        const float s = __half2float(__float2half(g / (1.f + __expf(-g))));
        reinterpret_cast<__half*>(y)[o] = __float2half(s * u);
      }
    }
  }
}

#define GEMV_INSTANCE(NAME, WF, PRO, EPI)                                                                 \
  extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                             \
  NAME(const unsigned char* __restrict__ W, const float* __restrict__ scales, const void* __restrict__ x, \
       const __half* __restrict__ norm_w, float eps, void* __restrict__ y, int n_out, int K) {            \
    gemv_impl<WF, PRO, EPI>(W, scales, x, norm_w, eps, y, n_out, K);                                     \
  }
