// prefill_rows.cu — the prefill's row-wise ops over a chunk of M prompt tokens (gpu/prefill.py): what the decode
// step's fused prologues and epilogues do for one token, done for M rows between the chunk's GEMMs.
//
// Computes   embed_rows    h[r][k] = float(emb[tokens[r]][k])
//            rmsnorm_rows_4, rmsnorm_rows_16 (by the row's width)
//                          x[r][k] = fp16(fp16(h[r][k] * rsqrt(mean_k(h[r]^2) + eps)) * w[k]) (rmsnorm_elem, as the
//                          GEMVs' prologue)
//            rope_kv_rows  row r is position start + r: q and k heads rotated in place (HF rotate_half: pairs i,
//                          i + hd/2, cos/sin of the host table), then k and v appended to the layer's cache at that
//                          position (as the QKV GEMV's epilogue, from fp16 projections)
//            swiglu_rows   act[r][j] = fp16(fp16(silu(g)) * u) with g = gu[r][j], u = gu[r][I + j] (gate | up
//                          stacked, as the gate/up GEMV's epilogue)
// Layouts    h fp32 [M][H]; x fp16 [M][H]; qkv fp16 [M][qkv_dim] = q heads | k heads | v heads per row; caches
//            fp16 [max_seq][n_kv * hd]; cos_sin [max_seq][hd / 2] float2; gu fp16 [M][2 I]; act fp16 [M][I].
// Bytes      each reads and writes its rows once (rope_kv_rows: + 2 * M * n_kv * hd * 2 into the cache).
// Launch     a block of 256 threads per row (embed_rows; rmsnorm_rows_4: H % 4 == 0 and H <= 4096,
//            rmsnorm_rows_16: H <= 16384; rope_kv_rows: hd % 4 == 0),
//            grid (ceil(I / 2048), M) of 256 threads, 8 elements each, for swiglu_rows (I % 8 == 0); no
//            programmatic dependent launch (the prefill runs eagerly, one chunk at a time).
#include "common.cuh"

#define PREFILL_THREADS 256

extern "C" __global__ void embed_rows(const int* __restrict__ tokens, const __half* __restrict__ emb,
                                      float* __restrict__ h, int H) {
  const size_t r = blockIdx.x, base = (size_t)tokens[r] * H;
  for (int k = threadIdx.x; k < H; k += blockDim.x) h[r * H + k] = __half2float(emb[base + k]);
}

// rmsnorm_rows_<V>: a thread holds V float4s of its row in registers, so rows up to PREFILL_THREADS * 4 * V wide.
// Two instances: V = 4 for rows up to 4096 (the register file holds 5 blocks of 256 threads an SM), 16 up to 16384.
template <int V>
__device__ __forceinline__ void rmsnorm_row(const float* __restrict__ h, const __half* __restrict__ w,
                                            __half* __restrict__ x, int H, float eps) {
  // The row is read once, as the decode GEMVs' one-pass norm prologue reads it (row_chunks_sq): each thread keeps
  // its float4s in registers across the block's sum instead of reading the row again after it, and the sum runs in
  // rms_inv's order, so both paths normalise alike. 16-byte loads of h, 8-byte loads of w and stores of x.
  __shared__ float red[PREFILL_THREADS / AF_WARP];
  const int n4 = H / 4;
  float4 v[V];
  const float ss = row_chunks_sq(reinterpret_cast<const float4*>(h + (size_t)blockIdx.x * H), n4, PREFILL_THREADS, v);
  const float inv = rsqrtf(block_sum<PREFILL_THREADS>(ss, red) / (float)H + eps);
  uint2* xr = reinterpret_cast<uint2*>(x + (size_t)blockIdx.x * H);
#pragma unroll
  for (int i = 0; i < V; i++) {
    const int k = threadIdx.x + i * PREFILL_THREADS;
    if (k < n4) {
      const uint2 wv = reinterpret_cast<const uint2*>(w)[k];
      const __half2 w01 = *reinterpret_cast<const __half2*>(&wv.x), w23 = *reinterpret_cast<const __half2*>(&wv.y);
      const __half2 o01 = __floats2half2_rn(rmsnorm_elem(v[i].x, inv, __low2half(w01)),
                                            rmsnorm_elem(v[i].y, inv, __high2half(w01)));
      const __half2 o23 = __floats2half2_rn(rmsnorm_elem(v[i].z, inv, __low2half(w23)),
                                            rmsnorm_elem(v[i].w, inv, __high2half(w23)));
      xr[k] = make_uint2(*reinterpret_cast<const unsigned*>(&o01), *reinterpret_cast<const unsigned*>(&o23));
    }
  }
}

extern "C" __global__ void rmsnorm_rows_4(const float* __restrict__ h, const __half* __restrict__ w,
                                          __half* __restrict__ x, int H, float eps) {
  rmsnorm_row<4>(h, w, x, H, eps);
}

extern "C" __global__ void rmsnorm_rows_16(const float* __restrict__ h, const __half* __restrict__ w,
                                           __half* __restrict__ x, int H, float eps) {
  rmsnorm_row<16>(h, w, x, H, eps);
}

extern "C" __global__ void rope_kv_rows(__half* __restrict__ qkv, const float2* __restrict__ cos_sin,
                                        __half* __restrict__ k_cache, __half* __restrict__ v_cache, int n_q,
                                        int n_kv, int hd, int start) {
  // Two adjacent pairs (i, i + 1 with their partners i + hd/2, i + hd/2 + 1) a thread: 4-byte accesses of q/k and
  // the cache, one 16-byte load of their cos/sin, where one pair a thread (2-byte accesses) left the row at ~43% of
  // the copy bandwidth; each element's arithmetic is the one-pair form's, so the bits are too.
  const int half_d = hd / 2, pos = start + blockIdx.x;
  const int qkv_dim = (n_q + 2 * n_kv) * hd, kv_dim = n_kv * hd;
  __half* row = qkv + (size_t)blockIdx.x * qkv_dim;
  const int per_head = half_d / 2;  // pairs of pairs a head (hd % 4 == 0)
  for (int p = threadIdx.x; p < (n_q + n_kv) * per_head; p += blockDim.x) {
    const int head = p / per_head, i = 2 * (p % per_head);
    __half2* a = reinterpret_cast<__half2*>(row + (size_t)head * hd + i);
    __half2* b = reinterpret_cast<__half2*>(row + (size_t)head * hd + i + half_d);
    const float2 x0 = __half22float2(*a), x1 = __half22float2(*b);
    const float4 cs = *reinterpret_cast<const float4*>(cos_sin + (size_t)pos * half_d + i);  // (cos, sin) of i, i + 1
    const __half2 h0 = __halves2half2(__float2half(x0.x * cs.x - x1.x * cs.y), __float2half(x0.y * cs.z - x1.y * cs.w));
    const __half2 h1 = __halves2half2(__float2half(x1.x * cs.x + x0.x * cs.y), __float2half(x1.y * cs.z + x0.y * cs.w));
    *a = h0;
    *b = h1;
    if (head >= n_q) {
      __half* dst = k_cache + (size_t)pos * kv_dim + (size_t)(head - n_q) * hd + i;
      *reinterpret_cast<__half2*>(dst) = h0;
      *reinterpret_cast<__half2*>(dst + half_d) = h1;
    }
  }
  // v as projected, 16 bytes at a time (kv_dim % 8 == 0)
  const uint4* vs = reinterpret_cast<const uint4*>(row + (size_t)(n_q + n_kv) * hd);
  uint4* vd = reinterpret_cast<uint4*>(v_cache + (size_t)pos * kv_dim);
  for (int e = threadIdx.x; e < kv_dim / 8; e += blockDim.x) vd[e] = vs[e];
}

extern "C" __global__ void swiglu_rows(const __half* __restrict__ gu, __half* __restrict__ act, int I) {
  // 8 elements a thread (I % 8 == 0): 16-byte loads of gate and up and a 16-byte store
  const int j = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
  if (j >= I) return;
  const size_t r = blockIdx.y;
  const uint4 gv = *reinterpret_cast<const uint4*>(gu + r * 2 * I + j);
  const uint4 uv = *reinterpret_cast<const uint4*>(gu + r * 2 * I + I + j);
  const __half* g = reinterpret_cast<const __half*>(&gv);
  const __half* u = reinterpret_cast<const __half*>(&uv);
  uint4 out;
  __half* o = reinterpret_cast<__half*>(&out);
#pragma unroll
  for (int e = 0; e < 8; e++) {
    const float gf = __half2float(g[e]);
    const float s = __half2float(__float2half(gf / (1.f + __expf(-gf))));
    o[e] = __float2half(s * __half2float(u[e]));
  }
  *reinterpret_cast<uint4*>(act + r * I + j) = out;
}
