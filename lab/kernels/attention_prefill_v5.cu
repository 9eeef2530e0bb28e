// attention_prefill_v5.cu — causal GQA attention of a chunk of M query rows (prefill) over the contiguous KV cache:
// FlashAttention-2 on the tensor cores, the scores never leave registers (no M x L matrix in memory). A lab version
// of kernels_cu/attention_prefill.cu (same kernels, arguments and results; lab/scripts/prefill_att_ab.py builds it
// in the product's place). The product's softmax (v4), with each warp taking two m-tiles: 32 stacked query rows a
// warp, 128 a block (FlashAttention-2's 128 x 64 tile with 4 warps). Every K fragment and every V fragment loaded by
// ldmatrix feeds two mmas instead of one, and each staged K/V tile serves twice the rows, so the instructions a warp
// issues per mma (the product is issue-bound: ncu, lab v52) drop by about a third. q's A fragments are read from
// shared memory at every k-step (in registers they would take 64 more: O is 128 at hd 128, the scores 64).
// Fewer blocks: 3B at M 2048 is 384 blocks (1.45 waves of 264), against the product's 768.
// Computes   for query row r < M (position start + r) and q head hq (kv head j = hq / G, G = n_heads / n_kv):
//              out[r][hq] = sum_{t <= start + r} softmax_t(q[r][hq] . K[t, j] * scale) V[t, j]
//            (causal over the cache before the chunk and the chunk itself). fp16 in, fp32 scores, online softmax in
//            fp32 (a running max and sum per row), P = exp(S - max) rounded to fp16 before P.V (it is the mma's A
//            operand, as in FlashAttention-2) with the sums taken over the rounded values, fp32 O, fp16 out.
// Scheme     block (x, j) = kv head j, row tile T = gridDim.x - 1 - x (the longest causal prefixes start first) of
//            ATP_ROWS = 128 of the kv head's M * G query rows, its G q heads stacked: stacked row R is query row R / G
//            of q head j * G + R % G, so one K/V tile in shared memory serves all G heads. Warp w takes tile rows
//            32 w .. 32 w + 31 (two m-tiles of the mma's M). The block walks K/V tiles of ATP_KV = 64 positions from position 0 to
//            its last row's position (tiles wholly above the diagonal are never loaded), staged by cp.async in two
//            stages (tile k + 1 lands while tile k is computed); a warp skips a tile above all of its rows and masks
//            only a tile that crosses its rows' diagonal. Per warp and tile, in registers (mma m16n8k16, fp16 x
//            fp16 -> fp32):
//              scores   S[16][64] = Q K^T: q's A fragments read from shared memory each k-step, K rows by ldmatrix as the
//                       B operand, times scale in log2 units, the causal mask;
//              softmax  online per row (the row's max over its 4 lanes), the O and sum rescale, P rounded to fp16;
//              P.V      O[16][hd] += P V: the score fragments are P's A fragments as they stand (no shared memory),
//                       V rows by ldmatrix.trans as the B operand.
//            At the end each warp writes O / sum as fp16 into its own rows of the (dead) q tile and stores them in
//            16-byte pieces. Rows in shared memory (q, K, V) have their 16-byte pieces XOR-swizzled by the row
//            (piece c of row t at c ^ (t & 7)): ldmatrix reads 8 rows of one piece without bank conflicts. K/V rows
//            past the block's last position are zero-filled, never read (the cache there may hold anything, and a
//            masked score's 0 still multiplies V: 0 * NaN is NaN); q rows past M are zero-filled and never stored.
// Layouts    q fp16 [M][q_stride] (q head hq at columns hq*hd ..; the stride lets q be the start of the fused qkv
//            buffer [M][q_dim + 2*kv_dim]); k_cache/v_cache: this layer's slab fp16 [max_seq][n_kv*hd], rows
//            start .. start+M-1 already holding the chunk's K/V; out fp16 [M][out_stride]. Strides multiples of 8
//            elements, pointers 16-byte aligned (the 16-byte copies). Dynamic shared memory
//            (ops/attention_prefill.py prefill_smem): the q tile [128][hd] fp16, then ATP_STAGES x (K [64][hd],
//            V [64][hd]) fp16: 48 KB at hd 64, 96 KB at hd 128.
// Bytes      q and out (M * n_heads * hd * 2 each) + K and V rows 0 .. start+M-1 (2 * (start+M) * n_kv * hd * 2)
//            from DRAM at least; every row tile reads its kv head's causal prefix again, through L2.
// Launch     attention_prefill_hd{64,128}_g{1,2,3,4,8,16}: grid = (ceil(M * G / 128), n_kv), block = 128
//            (ATP_THREADS), dyn. smem = prefill_smem(hd) (ops/attention_prefill.py attention_prefill_launch);
//            launch bounds of 2 blocks per SM (<= 255 registers: O, q's fragments and the scores live in registers;
//            at hd 128 two blocks' 160 KB of shared memory fit an H100's SM, an sm_89 SM holds one).
#include "../../kernels_cu/common.cuh"

#define ATP_THREADS 128   // 4 warps x 32 query rows
#define ATP_ROWS 128      // stacked query rows per block: 4 warps x ATP_MT x 16
#define ATP_MT 2          // m-tiles (16 rows each) per warp
#define ATP_KV 64         // positions per K/V tile (ops/attention_prefill.py ATP_KV)
#define ATP_STAGES 2      // K/V tiles in shared memory at once (ops/attention_prefill.py ATP_STAGES)
#define ATP_MIN_BLOCKS 2  // register cap 255: two blocks (8 warps) per SM
#define ATP_BATCH 4       // ldmatrix loads issued before their mmas

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

// The block's 64 stacked q rows (row0 ..) -> qs; rows past the chunk (query row >= m) zero-filled.
template <int HD, int G>
__device__ __forceinline__ void atp_stage_q(const __half* q, size_t q_stride, int row0, int m, int j, char* qs) {
  constexpr int DG = HD / 8;
#pragma unroll
  for (int i = threadIdx.x; i < ATP_ROWS * DG; i += ATP_THREADS) {
    const int t = i / DG, c = i % DG, r = (row0 + t) / G, g = (row0 + t) % G;
    if (r < m)
      cp_async16(qs + swz16<HD>(t, c), q + (size_t)r * q_stride + (size_t)(j * G + g) * HD + c * 8);
    else
      *reinterpret_cast<uint4*>(qs + swz16<HD>(t, c)) = make_uint4(0, 0, 0, 0);
  }
}

// Positions p0 .. p0 + 63 of kv head j -> ks / vs; positions at or past n_pos zero-filled (not read).
template <int HD>
__device__ __forceinline__ void atp_stage_kv(const __half* k_cache, const __half* v_cache, size_t kv_dim, int j,
                                             int p0, int n_pos, char* ks, char* vs) {
  constexpr int DG = HD / 8;
#pragma unroll
  for (int i = threadIdx.x; i < ATP_KV * DG; i += ATP_THREADS) {
    const int t = i / DG, c = i % DG, off = swz16<HD>(t, c);
    if (p0 + t < n_pos) {
      const size_t src = (size_t)(p0 + t) * kv_dim + (size_t)j * HD + c * 8;
      cp_async16(ks + off, k_cache + src);
      cp_async16(vs + off, v_cache + src);
    } else {
      *reinterpret_cast<uint4*>(ks + off) = make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(vs + off) = make_uint4(0, 0, 0, 0);
    }
  }
}

// Row tile `tile` (ATP_ROWS stacked rows) of kv head j.
template <int HD, int G>
__device__ __forceinline__ void attention_prefill_block(const __half* q, const __half* k_cache, const __half* v_cache,
                                                        __half* out, int start, int m, int n_kv, int q_stride,
                                                        int out_stride, float scale, int tile, int j, char* smem) {
  constexpr int DG = HD / 8;           // 16-byte pieces per row = 8-dim n-tiles of O
  constexpr int KS = HD / 16;          // k-steps of the scores
  constexpr int NB = ATP_KV / 8;       // 8-position n-tiles of the scores
  constexpr int TB = ATP_KV * HD * 2;  // bytes of one K (or V) tile
  constexpr int WR = 16 * ATP_MT;      // rows a warp
  static_assert(ATP_ROWS == WR * (ATP_THREADS / AF_WARP) && NB == 2 * ATP_BATCH && (DG / 2) % ATP_BATCH == 0 &&
                KS % 2 == 0, "shape");
  const size_t kv_dim = (size_t)n_kv * HD;
  const int lane = threadIdx.x % AF_WARP, warp = threadIdx.x / AF_WARP;
  const int gid = lane >> 2, tig = lane & 3;  // mma fragment coordinates: rows gid, gid + 8; columns 2 tig, 2 tig + 1
  char* qs = smem;
  char* kvs = smem + ATP_ROWS * HD * 2;  // stage s: K at kvs + 2 s TB, V at kvs + (2 s + 1) TB

  const int row0 = tile * ATP_ROWS;
  const int n_pos = start + min(m - 1, (row0 + ATP_ROWS - 1) / G) + 1;
  const int n_tiles = (n_pos + ATP_KV - 1) / ATP_KV;
  // this warp's rows (m-tile t: rows wr0 + 16 t ..): whether it holds any query row < m; the last position of its
  // first and last row; this thread's rows' last positions (rows past the chunk clamped: computed, never stored)
  const int wr0 = row0 + warp * WR;
  const bool active = wr0 / G < m;
  const int w_lo = start + wr0 / G, w_hi = start + min(m - 1, (wr0 + WR - 1) / G);
  int lim[ATP_MT][2];
#pragma unroll
  for (int t = 0; t < ATP_MT; ++t) {
    lim[t][0] = start + min(m - 1, (wr0 + 16 * t + gid) / G);
    lim[t][1] = start + min(m - 1, (wr0 + 16 * t + gid + 8) / G);
  }

  pdl_wait();  // q and the chunk's K/V rows are the previous kernels' outputs
  pdl_launch_dependents();
  atp_stage_q<HD, G>(q, (size_t)q_stride, row0, m, j, qs);
  atp_stage_kv<HD>(k_cache, v_cache, kv_dim, j, 0, n_pos, kvs, kvs + TB);
  cp_async_commit();

  const float sl2 = scale * 1.4426950408889634f;  // scores in log2 units
  const unsigned ones = 0x3C003C00u;              // fp16 (1, 1): the B fragment that sums P's rows
  float o[ATP_MT][DG][4];                         // O per m-tile, as the product's
  float m_run[ATP_MT][2], l_acc[ATP_MT][4];       // the raw scores' running max; P's row sums (mma accumulator)
#pragma unroll
  for (int t = 0; t < ATP_MT; ++t) {
    m_run[t][0] = m_run[t][1] = -AF_INF;
    l_acc[t][0] = l_acc[t][1] = l_acc[t][2] = l_acc[t][3] = 0.f;
#pragma unroll
    for (int n = 0; n < DG; ++n) o[t][n][0] = o[t][n][1] = o[t][n][2] = o[t][n][3] = 0.f;
  }

  for (int kt = 0; kt < n_tiles; ++kt) {
    // tile kt + 1 into the other stage (everyone finished reading it: the barrier ending the previous iteration)
    if (kt + 1 < n_tiles) {
      char* nx = kvs + ((kt + 1) % ATP_STAGES) * 2 * TB;
      atp_stage_kv<HD>(k_cache, v_cache, kv_dim, j, (kt + 1) * ATP_KV, n_pos, nx, nx + TB);
      cp_async_commit();
      cp_async_wait<1>();  // this thread's copies of tile kt (and of q) have landed ...
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // ... and every thread's, with the zero rows
    if (kt == 0) AF_TL_MARK(0);  // timeline: q and the first K/V tile in shared memory
    const int p0 = kt * ATP_KV;
    if (active && p0 <= w_hi) {  // warp-uniform: a tile above all of the warp's rows adds nothing
      const char* ks = kvs + (kt % ATP_STAGES) * 2 * TB;
      const char* vs = ks + TB;
      // ---- S = Q K^T per m-tile; q's A fragments from shared memory at each k-step, each K fragment feeds both ----
      float s[ATP_MT][NB][4];
#pragma unroll
      for (int t = 0; t < ATP_MT; ++t)
#pragma unroll
        for (int n = 0; n < NB; ++n) s[t][n][0] = s[t][n][1] = s[t][n][2] = s[t][n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
        unsigned qa[ATP_MT][4];
#pragma unroll
        for (int t = 0; t < ATP_MT; ++t)
          ldmatrix_x4(qa[t], qs + swz16<HD>(warp * WR + 16 * t + (lane & 15), 2 * kk + (lane >> 4)));
#pragma unroll
        for (int u = 0; u < ATP_BATCH; ++u) {  // one K fragment at a time (registers), four mmas each
          unsigned b[4];
          ldmatrix_x4(b, ks + swz16<HD>(16 * u + ((lane >> 4) << 3) + (lane & 7), 2 * kk + ((lane >> 3) & 1)));
#pragma unroll
          for (int t = 0; t < ATP_MT; ++t) {
            mma_16816(s[t][2 * u], qa[t][0], qa[t][1], qa[t][2], qa[t][3], b[0], b[1]);
            mma_16816(s[t][2 * u + 1], qa[t][0], qa[t][1], qa[t][2], qa[t][3], b[2], b[3]);
          }
        }
      }
      // ---- the causal mask on a tile crossing the warp's diagonal; the online softmax per m-tile (the product's) ----
      if (p0 + ATP_KV - 1 > w_lo) {
#pragma unroll
        for (int t = 0; t < ATP_MT; ++t)
#pragma unroll
          for (int n = 0; n < NB; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              if (p0 + 8 * n + 2 * tig + (e & 1) > lim[t][e >> 1]) s[t][n][e] = -AF_INF;
      }
      unsigned pa[ATP_MT][NB / 2][4];
#pragma unroll
      for (int t = 0; t < ATP_MT; ++t) {
        float mx[2] = {-AF_INF, -AF_INF};
#pragma unroll
        for (int n = 0; n < NB; ++n) {
          mx[0] = fmaxf(mx[0], fmaxf(s[t][n][0], s[t][n][1]));
          mx[1] = fmaxf(mx[1], fmaxf(s[t][n][2], s[t][n][3]));
        }
        float alpha[2], mb[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
          mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
          // finite: position 0 is in every row's first tile, and the max only grows
          const float m_new = fmaxf(m_run[t][h], mx[h]);
          alpha[h] = atp_ex2((m_run[t][h] - m_new) * sl2);  // 0 on the first tile
          m_run[t][h] = m_new;
          mb[h] = -m_new * sl2;
        }
#pragma unroll
        for (int n = 0; n < DG; ++n) {
          o[t][n][0] *= alpha[0]; o[t][n][1] *= alpha[0];
          o[t][n][2] *= alpha[1]; o[t][n][3] *= alpha[1];
        }
        l_acc[t][0] *= alpha[0]; l_acc[t][1] *= alpha[0];
        l_acc[t][2] *= alpha[1]; l_acc[t][3] *= alpha[1];
#pragma unroll
        for (int kk = 0; kk < NB / 2; ++kk) {
          pa[t][kk][0] = atp_h2(atp_ex2(fmaf(s[t][2 * kk][0], sl2, mb[0])), atp_ex2(fmaf(s[t][2 * kk][1], sl2, mb[0])));
          pa[t][kk][1] = atp_h2(atp_ex2(fmaf(s[t][2 * kk][2], sl2, mb[1])), atp_ex2(fmaf(s[t][2 * kk][3], sl2, mb[1])));
          pa[t][kk][2] = atp_h2(atp_ex2(fmaf(s[t][2 * kk + 1][0], sl2, mb[0])),
                                atp_ex2(fmaf(s[t][2 * kk + 1][1], sl2, mb[0])));
          pa[t][kk][3] = atp_h2(atp_ex2(fmaf(s[t][2 * kk + 1][2], sl2, mb[1])),
                                atp_ex2(fmaf(s[t][2 * kk + 1][3], sl2, mb[1])));
          mma_16816(l_acc[t], pa[t][kk][0], pa[t][kk][1], pa[t][kk][2], pa[t][kk][3], ones, ones);
        }
      }
      // ---- O += P V: each V fragment (ldmatrix.trans, two 8-dim n-tiles a load) feeds both m-tiles ----
#pragma unroll
      for (int kk = 0; kk < NB / 2; ++kk) {
#pragma unroll
        for (int c0 = 0; c0 < DG; c0 += 2 * ATP_BATCH) {
#pragma unroll
          for (int u = 0; u < ATP_BATCH; ++u) {  // one V fragment at a time (registers), four mmas each
            unsigned b[4];
            ldmatrix_x4_trans(b, vs + swz16<HD>(16 * kk + ((lane >> 3) & 1) * 8 + (lane & 7), c0 + 2 * u + (lane >> 4)));
#pragma unroll
            for (int t = 0; t < ATP_MT; ++t) {
              mma_16816(o[t][c0 + 2 * u], pa[t][kk][0], pa[t][kk][1], pa[t][kk][2], pa[t][kk][3], b[0], b[1]);
              mma_16816(o[t][c0 + 2 * u + 1], pa[t][kk][0], pa[t][kk][1], pa[t][kk][2], pa[t][kk][3], b[2], b[3]);
            }
          }
        }
      }
    }
    __syncthreads();  // every warp is done with stage kt % 2 before the next iteration refills it
  }
  AF_TL_MARK(1);  // timeline: the walk done
  if (!active) return;  // no barrier follows

  // ---- out = O / sum as fp16: through the warp's own rows of the q tile (only this warp read them), then 16-byte
  //      stores of the rows < m ----
#pragma unroll
  for (int t = 0; t < ATP_MT; ++t) {
    const float inv0 = 1.f / l_acc[t][0], inv1 = 1.f / l_acc[t][2];  // >= 1: the max's own term is 2^0
#pragma unroll
    for (int n = 0; n < DG; ++n) {
      *reinterpret_cast<unsigned*>(qs + swz16<HD>(warp * WR + 16 * t + gid, n) + 4 * tig) =
          atp_h2(o[t][n][0] * inv0, o[t][n][1] * inv0);
      *reinterpret_cast<unsigned*>(qs + swz16<HD>(warp * WR + 16 * t + gid + 8, n) + 4 * tig) =
          atp_h2(o[t][n][2] * inv1, o[t][n][3] * inv1);
    }
  }
  __syncwarp();
#pragma unroll
  for (int i = lane; i < WR * DG; i += AF_WARP) {
    const int t = i / DG, c = i % DG, r = (wr0 + t) / G, g = (wr0 + t) % G;
    if (r < m)
      *reinterpret_cast<uint4*>(out + (size_t)r * out_stride + (size_t)(j * G + g) * HD + c * 8) =
          *reinterpret_cast<const uint4*>(qs + swz16<HD>(warp * WR + t, c));
  }
}

// One kernel per (head_dim, q heads per kv head): G is a compile-time constant, so a stacked row's query row and
// head are a division by a constant.
#define ATTENTION_PREFILL_INSTANCE(NAME, HD, G)                                                                    \
  extern "C" __global__ void __launch_bounds__(ATP_THREADS, ATP_MIN_BLOCKS)                                       \
      NAME(const __half* __restrict__ q, const __half* __restrict__ k_cache, const __half* __restrict__ v_cache,   \
           __half* __restrict__ out, int start, int m, int n_kv, int q_stride, int out_stride, float scale) {      \
    AF_TIMELINE_BLOCK;                                                                                             \
    extern __shared__ __align__(16) char atp_smem[];                                                               \
    attention_prefill_block<HD, G>(q, k_cache, v_cache, out, start, m, n_kv, q_stride, out_stride, scale,         \
                                   gridDim.x - 1 - blockIdx.x, blockIdx.y, atp_smem);                               \
  }

ATTENTION_PREFILL_INSTANCE(attention_prefill_hd64_g1, 64, 1)
ATTENTION_PREFILL_INSTANCE(attention_prefill_hd64_g2, 64, 2)
ATTENTION_PREFILL_INSTANCE(attention_prefill_hd64_g3, 64, 3)
ATTENTION_PREFILL_INSTANCE(attention_prefill_hd64_g4, 64, 4)
ATTENTION_PREFILL_INSTANCE(attention_prefill_hd64_g8, 64, 8)
ATTENTION_PREFILL_INSTANCE(attention_prefill_hd64_g16, 64, 16)
ATTENTION_PREFILL_INSTANCE(attention_prefill_hd128_g1, 128, 1)
ATTENTION_PREFILL_INSTANCE(attention_prefill_hd128_g2, 128, 2)
ATTENTION_PREFILL_INSTANCE(attention_prefill_hd128_g3, 128, 3)
ATTENTION_PREFILL_INSTANCE(attention_prefill_hd128_g4, 128, 4)
ATTENTION_PREFILL_INSTANCE(attention_prefill_hd128_g8, 128, 8)
ATTENTION_PREFILL_INSTANCE(attention_prefill_hd128_g16, 128, 16)
