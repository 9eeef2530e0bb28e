// quantize_fp8.cu — fp16 weights -> W8A16 FP8-E4M3 with one fp32 scale per group of 128 inputs.
// Runs once at load time (not in the decode step); bit-exact with atomflow_bench.quant.quantize_fp8.
//
// Computes   for row n, group g (inputs [128 g, min(128 g + 128, K))):
//              amax = max |W[n, k]|;  scale = amax / 448 (1 when amax == 0);
//              Q[n, k] = e4m3_rn_satfinite(float(W[n, k]) / scale);  S[n, g] = scale
// Layouts    W fp16 [N, K], Q uint8 [N, K], S fp32 [N, ceil(K/128)].
// Bytes      N*K*2 read, N*K + N*ceil(K/128)*4 written.
// Launch     one warp per (row, group): grid = ceil(N * ceil(K/128) / 8), block = 256.
#include "common.cuh"

extern "C" __global__ void quantize_fp8(const __half* __restrict__ W, unsigned char* __restrict__ Q,
                                        float* __restrict__ S, int N, int K) {
  const int groups = (K + 127) / 128;
  const long long item = (long long)blockIdx.x * (blockDim.x / AF_WARP) + threadIdx.x / AF_WARP;
  if (item >= (long long)N * groups) return;
  const int lane = threadIdx.x % AF_WARP;
  const int n = (int)(item / groups), g = (int)(item % groups);
  const size_t base = (size_t)n * K;
  float v[4];
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int k = g * 128 + lane * 4 + j;
    v[j] = k < K ? __half2float(W[base + k]) : 0.f;
    amax = fmaxf(amax, fabsf(v[j]));
  }
  amax = warp_max(amax);
  const float scale = amax > 0.f ? amax / 448.0f : 1.0f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int k = g * 128 + lane * 4 + j;
    if (k < K) Q[base + k] = (unsigned char)__nv_cvt_float_to_fp8(v[j] / scale, __NV_SATFINITE, __NV_E4M3);
  }
  if (lane == 0) S[(size_t)n * groups + g] = scale;
}
