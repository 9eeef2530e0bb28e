// attention_prefill.cuh — what the prefill attention's two kernels share (attention_prefill.cu, mma.sync on every
// GPU; attention_prefill_sm90a.cu, Hopper's warpgroup MMA): the online softmax of one K/V tile's scores in the mma
// fragments' layout, the output's store and the kernel instances. Both kernels hold a warp's 16 rows in the same
// fragments (rows gid, gid + 8; n-tile j: columns 8 j + 2 tig, + 1), so one softmax serves both; and where a
// block's and a warp's rows lie.
//
// Computes   what attention_prefill.cu's header says.
// Layouts    the fragments above; the q tile's rows (the output's staging) in the ldmatrix swizzle swz16.
// Bytes      none of its own: registers, and the output through shared memory.
// Launch     inside the two kernels, by every thread of the block.
#pragma once
#include "common.cuh"

// 2^x (ex2.approx: 2^-inf = +0, which the first tile's rescale and the masked scores rely on)
__device__ __forceinline__ float atp_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// (a, b) rounded to fp16 in one 32-bit mma operand, a in the low half (the lower column)
__device__ __forceinline__ unsigned atp_h2(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<unsigned*>(&h);
}

// Where a block's rows and this warp's lie: the block's first stacked row (row tile `tile` of ROWS) and the positions
// up to its last query row's (n_pos, in n_tiles tiles of KV); the warp's first stacked row, whether it holds any query
// row < m, the positions of its first and last rows; this thread's two rows' last positions (rows past the chunk
// clamped to the last row: computed, never stored).
struct AtpRows {
  int row0, n_pos, n_tiles, wr0;
  bool active;
  int w_lo, w_hi, lim0, lim1;
};
template <int G, int ROWS, int KV>
__device__ __forceinline__ AtpRows atp_rows(int tile, int start, int m, int warp, int gid) {
  AtpRows r;
  r.row0 = tile * ROWS;
  r.n_pos = start + min(m - 1, (r.row0 + ROWS - 1) / G) + 1;
  r.n_tiles = (r.n_pos + KV - 1) / KV;
  r.wr0 = r.row0 + warp * 16;
  r.active = r.wr0 / G < m;
  r.w_lo = start + r.wr0 / G;
  r.w_hi = start + min(m - 1, (r.wr0 + 15) / G);
  r.lim0 = start + min(m - 1, (r.wr0 + gid) / G);
  r.lim1 = start + min(m - 1, (r.wr0 + gid + 8) / G);
  return r;
}

// The online softmax of one K/V tile (positions p0 .. p0 + 8 NB - 1) for this thread's two rows, in place over the tile's scores
// s (raw, the fragments of the warp's 16 rows): the causal mask where the tile crosses the diagonal of the warp's rows
// (w_lo: its first row's position; lim0, lim1: this thread's rows' last positions), the running max m_run, O's and
// the sums' rescale, then P = 2^(S scale_log2 - max scale_log2) rounded to fp16 as the A fragments pa of P.V
// (16-position k-step kk = n-tiles 2 kk, 2 kk + 1) with their row sums added into l_acc by an mma with fp16 ones.
template <int DG, int NB>
__device__ __forceinline__ void atp_softmax_tile(float (&s)[NB][4], float (&o)[DG][4], float (&m_run)[2],
                                                 float (&l_acc)[4], unsigned (&pa)[NB / 2][4], int p0, int w_lo,
                                                 int lim0, int lim1, int tig, float sl2) {
  const unsigned ones = 0x3C003C00u;  // fp16 (1, 1): the B fragment that sums P's rows
  // ---- the causal mask (only on a tile crossing the diagonal of the warp's rows), the rows' max of the raw
  //      scores (scale > 0: the max of the scaled scores is the scaled max) ----
  if (p0 + 8 * NB - 1 > w_lo) {
#pragma unroll
    for (int n = 0; n < NB; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (p0 + 8 * n + 2 * tig + (e & 1) > (e < 2 ? lim0 : lim1)) s[n][e] = -AF_INF;
    }
  }
  float mx[2] = {-AF_INF, -AF_INF};
#pragma unroll
  for (int n = 0; n < NB; ++n) {
    mx[0] = fmaxf(mx[0], fmaxf(s[n][0], s[n][1]));
    mx[1] = fmaxf(mx[1], fmaxf(s[n][2], s[n][3]));
  }
  float alpha[2], mb[2];  // mb: the new max in log2 units, negated (the exponent's FFMA addend)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    // finite: position 0 is in every row's first tile, and the max only grows
    const float m_new = fmaxf(m_run[h], mx[h]);
    alpha[h] = atp_ex2((m_run[h] - m_new) * sl2);  // 0 on the first tile
    m_run[h] = m_new;
    mb[h] = -m_new * sl2;
  }
#pragma unroll
  for (int n = 0; n < DG; ++n) {
    o[n][0] *= alpha[0]; o[n][1] *= alpha[0];
    o[n][2] *= alpha[1]; o[n][3] *= alpha[1];
  }
  l_acc[0] *= alpha[0]; l_acc[1] *= alpha[0];
  l_acc[2] *= alpha[1]; l_acc[3] *= alpha[1];
  // ---- P = 2^(S scale_log2 - max scale_log2) rounded to fp16, laid out as P's A fragments (16-position k-step
  //      kk = n-tiles 2 kk, 2 kk + 1); their row sums by the mma with the ones ----
#pragma unroll
  for (int kk = 0; kk < NB / 2; ++kk) {
    pa[kk][0] = atp_h2(atp_ex2(fmaf(s[2 * kk][0], sl2, mb[0])), atp_ex2(fmaf(s[2 * kk][1], sl2, mb[0])));
    pa[kk][1] = atp_h2(atp_ex2(fmaf(s[2 * kk][2], sl2, mb[1])), atp_ex2(fmaf(s[2 * kk][3], sl2, mb[1])));
    pa[kk][2] = atp_h2(atp_ex2(fmaf(s[2 * kk + 1][0], sl2, mb[0])), atp_ex2(fmaf(s[2 * kk + 1][1], sl2, mb[0])));
    pa[kk][3] = atp_h2(atp_ex2(fmaf(s[2 * kk + 1][2], sl2, mb[1])), atp_ex2(fmaf(s[2 * kk + 1][3], sl2, mb[1])));
    mma_16816(l_acc, pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], ones, ones);
  }
}

// out = O / sum as fp16 for the warp's 16 rows (stacked rows wr0 ..; query row (wr0 + t) / G, q head
// j G + (wr0 + t) % G): through the warp's own rows of the q tile qs (rows of hd * 2 bytes in swz16; only this warp
// reads them), then 16-byte stores of the rows < m.
template <int HD, int G>
__device__ __forceinline__ void atp_store_out(const float (&o)[HD / 8][4], const float (&l_acc)[4], char* qs, int warp,
                                              int lane, int wr0, int m, int j, __half* out, int out_stride) {
  constexpr int DG = HD / 8;
  const int gid = lane >> 2, tig = lane & 3;
  const float inv[2] = {1.f / l_acc[0], 1.f / l_acc[2]};  // >= 1: the max's own term is 2^0
#pragma unroll
  for (int n = 0; n < DG; ++n) {
    *reinterpret_cast<unsigned*>(qs + swz16<HD>(warp * 16 + gid, n) + 4 * tig) = atp_h2(o[n][0] * inv[0], o[n][1] * inv[0]);
    *reinterpret_cast<unsigned*>(qs + swz16<HD>(warp * 16 + gid + 8, n) + 4 * tig) =
        atp_h2(o[n][2] * inv[1], o[n][3] * inv[1]);
  }
  __syncwarp();
#pragma unroll
  for (int i = lane; i < 16 * DG; i += AF_WARP) {
    const int t = i / DG, c = i % DG, r = (wr0 + t) / G, g = (wr0 + t) % G;
    if (r < m)
      *reinterpret_cast<uint4*>(out + (size_t)r * out_stride + (size_t)(j * G + g) * HD + c * 8) =
          *reinterpret_cast<const uint4*>(qs + swz16<HD>(warp * 16 + t, c));
  }
}

// The (row tile, kv head) of block (x, y). Blocks are dispatched in the order of their linear index, x fastest; the
// index walks the kv heads fastest and the row tiles from the last, so every head's longest causal prefixes start
// first and the shortest last: a short chunk's launch ends on its cheapest blocks, not on one head's longest tiles
// started after another head's whole walk.
__device__ __forceinline__ int atp_linear() { return blockIdx.y * gridDim.x + blockIdx.x; }
__device__ __forceinline__ int atp_tile() { return gridDim.x - 1 - atp_linear() / gridDim.y; }
__device__ __forceinline__ int atp_head() { return atp_linear() % gridDim.y; }

// One kernel per (head_dim, q heads per kv head): G is a compile-time constant, so a stacked row's query row and
// head are a division by a constant.
#define ATTENTION_PREFILL_INSTANCE(NAME, HD, G)                                                                    \
  extern "C" __global__ void __launch_bounds__(ATP_THREADS, ATP_MIN_BLOCKS)                                       \
      NAME(const __half* __restrict__ q, const __half* __restrict__ k_cache, const __half* __restrict__ v_cache,   \
           __half* __restrict__ out, int start, int m, int n_kv, int q_stride, int out_stride, float scale) {      \
    AF_TIMELINE_BLOCK;                                                                                             \
    extern __shared__ __align__(16) char atp_smem[];                                                               \
    attention_prefill_block<HD, G>(q, k_cache, v_cache, out, start, m, n_kv, q_stride, out_stride, scale,         \
                                   atp_tile(), atp_head(), atp_smem);                                               \
  }

