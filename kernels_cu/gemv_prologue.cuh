// gemv_prologue.cuh — the GEMVs' prologue: x staged in shared memory, as a copy of the fp16 input or as
// RMSNorm(h) * norm_w (PRO_NORM), so that the RMSNorm before QKV, gate/up and the lm_head needs no kernel of its own.
//
// Computes   x[k] = fp16(h[k] * rsqrt(mean(h^2) + eps) * norm_w[k]), the sum of squares in rms_inv's order
//            (common.cuh rms_inv, rmsnorm_elem) whichever way it is staged; or x = the fp16 input.
// Layouts    h fp32 [K], norm_w fp16 [K]; x in shared memory: in fragment order for the tiled GEMVs (xs_pair: a lane
//            quad's 8 inputs of each 32 contiguous, one 16-byte load per mma pair), in input order for the lm_head.
// Bytes      per block K * 4 (h) + K * 2 (norm_w), or K * 2 (the fp16 input), through L2 (.cg: the previous kernel
//            wrote them).
// Launch     inside the GEMV kernels, by all their (consumer) threads; shared memory x [K] fp16, + h [K] fp32 and
//            norm_w [K] fp16 for STAGE_SMEM (the host's plans count them: ops/gemv.py gemv_plan, ops/lm_head.py).
#pragma once
#include "gemv_args.cuh"

// Where input pair p (inputs 2p, 2p + 1) lives in the fragment-ordered x (in pairs): within each block of
// 32 inputs, lane quad t = p % 4 reads its 8 inputs {2t, 2t+1, 2t+8, 2t+9, 2t+16, 2t+17, 2t+24, 2t+25}
// contiguously (one 16-byte load: the B fragments of two k-tiles).
__device__ __forceinline__ int xs_pair(int p) {
  const int r = p & 15;
  return (p & ~15) | ((r & 3) << 2) | ((r >> 3) << 1) | ((r >> 2) & 1);
}

// x staged in shared memory in fragment order as fp16 by the whole block: RMSNorm(h_fp32) * norm_w
// (PRO_NORM) or a copy of the fp16 input; read through L2 (.cg: written by the previous kernel).
// The norm prologue reads h through L2 once, not once for the sum of squares and again for x (each round through L2
// delays the block's first mma), in one of two ways:
// STAGE_REGS (the fp8 ring path and the warp-specialised consumers, whose registers are free here; K <= 4096): each
// thread keeps its float4 chunks of h in registers from the one round that also feeds the sum of squares, and its
// norm_w chunks, loaded before the PDL wait (norm_w_regs); STAGE_SMEM (the fp16
// register path, whose registers hold its weight batch): h is parked in shared memory `hs` (fp32 [K]) by that
// round and norm_w was copied to `nws` (fp16 [K]) by cp.async before the PDL wait (stage_norm_w_async). Either
// way the sums run in rms_inv's order: x is bit-identical to the two-round form, which remains for K > 4096 in
// STAGE_REGS.
#define STAGE_CHUNKS 4  // float4 chunks of h per thread in the one-pass prologue (K <= 4 * 4 * 256)
#define STAGE_LOADS 4   // 16-byte x loads in flight per thread when copying x (K <= 4 * 8 * 256 in one round)
enum { STAGE_REGS = 0, STAGE_SMEM = 1 };

// Before the wait (STAGE_SMEM): this thread's 16-byte pieces of norm_w -> nws, one cp.async group, committed.
__device__ __forceinline__ void stage_norm_w_async(const GemvArgs& a, __half* nws) {
  for (int c = threadIdx.x; c < a.K / 8; c += blockDim.x) cp_async16(nws + c * 8, a.norm_w + c * 8);
  cp_async_commit();
}

// x = RMSNorm(h_fp32) * norm_w with h parked: the (first NT) threads read h through L2 once into `hs` (fp32 [K]) while
// summing its squares in rms_inv's order, norm_w is in `nws` (stage_norm_w_async, before the wait); input pair p of
// x goes out as store(p, its two fp16 values packed). Used by stage_x_tiled (STAGE_SMEM) and the lm_head's prologue.
template <int NT, class Store>
__device__ __forceinline__ void norm_x_parked(const GemvArgs& a, float* red, float* hs, const __half* nws, Store store) {
  const int nth = nthreads<NT>();
  const float4* h4 = reinterpret_cast<const float4*>(a.x);
  float ss = 0.f;
  for (int c = threadIdx.x; c < a.K / 4; c += nth) {
    const float4 v = __ldcg(h4 + c);
    reinterpret_cast<float4*>(hs)[c] = v;
    ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
  }
  cp_async_wait<0>();  // this thread's norm_w pieces; block_sum's barriers publish everyone's hs and nws
  const float inv = rsqrtf(block_sum<NT>(ss, red) / (float)a.K + a.eps);  // = rms_inv's value, bit for bit
  for (int p = threadIdx.x; p < a.K / 2; p += nth) {
    const float2 hv = reinterpret_cast<const float2*>(hs)[p];
    store(p, norm_pair(hv.x, hv.y, inv, reinterpret_cast<const __half2*>(nws)[p]));
  }
}

// Whether the register prologue's norm runs in one pass (each of the nth staging threads holds <= STAGE_CHUNKS
// float4 chunks of h): the one test both norm_w_regs and stage_x_tiled branch on.
__device__ __forceinline__ bool norm_one_pass(int K, int nth) { return K <= STAGE_CHUNKS * 4 * nth; }

// The one-pass register prologue's norm_w chunks (STAGE_REGS, norm_one_pass), loaded into registers BEFORE the PDL
// wait (a weight: no kernel writes it), so the round after the wait reads only h. norm_w was last read a step (~3 GB of
// weights through the 50 MB L2) earlier, so it comes from HBM: loading it with h after the wait measured 3 to 10 µs
// slower per step (3B, 8B).
struct NormRegs {
  uint2 w[STAGE_CHUNKS];  // this thread's fp16 norm_w chunks c = threadIdx.x + i * threads (4 inputs each)
};
template <int PRO, int NT = 0>
__device__ __forceinline__ NormRegs norm_w_regs(const GemvArgs& a) {
  NormRegs r;
  const int nth = nthreads<NT>();
#pragma unroll
  for (int i = 0; i < STAGE_CHUNKS; ++i) {
    const int c = threadIdx.x + i * nth;
    r.w[i] = PRO == PRO_NORM && norm_one_pass(a.K, nth) && c < a.K / 4
                 ? reinterpret_cast<const uint2*>(a.norm_w)[c] : make_uint2(0u, 0u);
  }
  return r;
}

template <int PRO, int MODE, int NT = 0>
__device__ __forceinline__ void stage_x_tiled(const GemvArgs& a, __half* xs, float* red, float* hs, const __half* nws,
                                              const NormRegs& nr) {  // nr: norm_w_regs (STAGE_REGS with PRO_NORM)
  const int nth = nthreads<NT>();  // the staging threads: the block, or its NT consumers
  unsigned* xs2 = reinterpret_cast<unsigned*>(xs);
  const int npairs = a.K / 2;
  if (PRO == PRO_NORM && MODE == STAGE_SMEM) {
    norm_x_parked<NT>(a, red, hs, nws, [&](int p, unsigned v) { xs2[xs_pair(p)] = v; });
  } else if (PRO == PRO_NORM && norm_one_pass(a.K, nth)) {
    const int nchunks = a.K / 4;
    float4 hv[STAGE_CHUNKS];
    const uint2* wv = nr.w;  // loaded before the wait (norm_w_regs)
    const float ss = row_chunks_sq(reinterpret_cast<const float4*>(a.x), nchunks, nth, hv);
    const float inv = rsqrtf(block_sum<NT>(ss, red) / (float)a.K + a.eps);  // = rms_inv's value, bit for bit
#pragma unroll
    for (int i = 0; i < STAGE_CHUNKS; ++i) {
      const int c = threadIdx.x + i * nth;
      if (c < nchunks) {
        const __half2 w01 = *reinterpret_cast<const __half2*>(&wv[i].x), w23 = *reinterpret_cast<const __half2*>(&wv[i].y);
        const unsigned p01 = norm_pair(hv[i].x, hv[i].y, inv, w01), p23 = norm_pair(hv[i].z, hv[i].w, inv, w23);
        xs2[xs_pair(2 * c)] = p01;
        xs2[xs_pair(2 * c + 1)] = p23;
      }
    }
  } else if (PRO == PRO_NORM) {
    const float* h = reinterpret_cast<const float*>(a.x);
    const float inv = rms_inv<NT>(h, a.eps, a.K, red);
    for (int p = threadIdx.x; p < npairs; p += nth) {
      const float2 hv = __ldcg(reinterpret_cast<const float2*>(h) + p);
      xs2[xs_pair(p)] = norm_pair(hv.x, hv.y, inv, reinterpret_cast<const __half2*>(a.norm_w)[p]);
    }
  } else {  // a copy: 16-byte pieces (4 pairs), STAGE_LOADS in flight per thread (one L2 round up to K = 8192)
    const uint4* src = reinterpret_cast<const uint4*>(a.x);
    const int n16 = a.K / 8;
    for (int c0 = threadIdx.x; c0 < n16; c0 += STAGE_LOADS * nth) {
      uint4 v[STAGE_LOADS];
#pragma unroll
      for (int i = 0; i < STAGE_LOADS; ++i) {
        const int c = c0 + i * nth;
        if (c < n16) v[i] = __ldcg(src + c);
      }
#pragma unroll
      for (int i = 0; i < STAGE_LOADS; ++i) {
        const int c = c0 + i * nth;
        if (c < n16) {
          xs2[xs_pair(4 * c)] = v[i].x;
          xs2[xs_pair(4 * c + 1)] = v[i].y;
          xs2[xs_pair(4 * c + 2)] = v[i].z;
          xs2[xs_pair(4 * c + 3)] = v[i].w;
        }
      }
    }
  }
  sync_n<NT>();
}
