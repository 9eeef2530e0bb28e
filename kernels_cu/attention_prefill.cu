// attention_prefill.cu — causal GQA attention of a chunk of M query rows (prefill) over the contiguous KV cache:
// FlashAttention-2 on the tensor cores, the scores never leave registers (no M x L matrix in memory).
//
// Computes   for query row r < M (position start + r) and q head hq (kv head j = hq / G, G = n_heads / n_kv):
//              out[r][hq] = sum_{t <= start + r} softmax_t(q[r][hq] . K[t, j] * scale) V[t, j]
//            (causal over the cache before the chunk and the chunk itself). fp16 in, fp32 scores, online softmax in
//            fp32 (a running max and sum per row), P = exp(S - max) rounded to fp16 before P.V (it is the mma's A
//            operand, as in FlashAttention-2) with the sums taken over the rounded values, fp32 O, fp16 out.
// Scheme     a block takes kv head j and row tile T (atp_tile, atp_head: every head's longest causal prefixes
//            start first, the shortest last) of ATP_ROWS = 64 of the kv head's M * G query rows, its G q heads
//            stacked: stacked row R is query row R / G of q head j * G + R % G, so one K/V tile in shared memory
//            serves all G heads. Warp w takes tile rows 16 w .. 16 w + 15 (the mma's M). The block walks K/V tiles
//            of ATP_KV = 64 positions from position 0 to its last row's position (tiles wholly above the diagonal
//            are never loaded), staged by cp.async in two stages (tile k + 1 lands while tile k is computed); a
//            warp skips a tile above all of its rows and masks only a tile that crosses its rows' diagonal. Per
//            warp and tile, in registers (mma m16n8k16, fp16 x fp16 -> fp32):
//              scores   S[16][64] = Q K^T: q's A fragments read from shared memory once, K rows by ldmatrix as the
//                       B operand; the causal mask only on a tile crossing the warp's diagonal (warp-uniform);
//              softmax  online per row: the max of the raw scores (the row's max over its 4 lanes; scale > 0, so
//                       the scaled max is the max scaled), the O and sum rescale, P = 2^(S scale_log2 - max
//                       scale_log2) as one FFMA and one ex2 a score, rounded to fp16; P's row sums are one more mma a
//                       16-position k-step, P times a B fragment of fp16 ones into an fp32 accumulator (every column
//                       holds the row's sum) instead of unpacking and adding each pair;
//              P.V      O[16][hd] += P V: the score fragments are P's A fragments as they stand (no shared memory),
//                       V rows by ldmatrix.trans as the B operand.
//            With 2 warps a scheduler the kernel is bound by issue (its FP32 work and the staging outnumber its mmas
//            several times over), so the FP32 work between the two mma phases is kept to the least.
//            At the end each warp writes O / sum as fp16 into its own rows of the (dead) q tile and stores them in
//            16-byte pieces. Rows in shared memory (q, K, V) have their 16-byte pieces XOR-swizzled by the row
//            (piece c of row t at c ^ (t & 7)): ldmatrix reads 8 rows of one piece without bank conflicts. K/V rows
//            past the block's last position are zero-filled, never read (the cache there may hold anything, and a
//            masked score's 0 still multiplies V: 0 * NaN is NaN); q rows past M are zero-filled and never stored.
// Layouts    q fp16 [M][q_stride] (q head hq at columns hq*hd ..; the stride lets q be the start of the fused qkv
//            buffer [M][q_dim + 2*kv_dim]); k_cache/v_cache: this layer's slab fp16 [max_seq][n_kv*hd], rows
//            start .. start+M-1 already holding the chunk's K/V; out fp16 [M][out_stride]. Strides multiples of 8
//            elements, pointers 16-byte aligned (the 16-byte copies). Dynamic shared memory
//            (ops/attention_prefill.py prefill_smem): the q tile [64][hd] fp16, then ATP_STAGES x (K [64][hd],
//            V [64][hd]) fp16: 40 KB at hd 64, 80 KB at hd 128.
// Bytes      q and out (M * n_heads * hd * 2 each) + K and V rows 0 .. start+M-1 (2 * (start+M) * n_kv * hd * 2)
//            from DRAM at least; every row tile reads its kv head's causal prefix again, through L2.
// Launch     attention_prefill_hd{64,128}_g{1,2,3,4,8,16}: grid = (ceil(M * G / 64), n_kv), block = 128
//            (ATP_THREADS), dyn. smem = prefill_smem(hd) (ops/attention_prefill.py attention_prefill_launch);
//            launch bounds of 2 blocks per SM (<= 255 registers: O, q's fragments and the scores live in registers;
//            at hd 128 two blocks' 160 KB of shared memory fit an H100's SM, an sm_89 SM holds one).
#include "attention_prefill.cuh"

#define ATP_THREADS 128   // 4 warps x 16 query rows (ops/attention_prefill.py ATP_THREADS)
#define ATP_ROWS 64       // stacked query rows per block (ops/attention_prefill.py ATP_ROWS)
#define ATP_KV 64         // positions per K/V tile (ops/attention_prefill.py ATP_KV)
#define ATP_STAGES 2      // K/V tiles in shared memory at once (ops/attention_prefill.py ATP_STAGES)
#define ATP_MIN_BLOCKS 2  // register cap 255: two blocks (8 warps) per SM
#define ATP_BATCH 4       // ldmatrix loads issued before their mmas

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

// Row tile `tile` (64 stacked rows) of kv head j.
template <int HD, int G>
__device__ __forceinline__ void attention_prefill_block(const __half* q, const __half* k_cache, const __half* v_cache,
                                                        __half* out, int start, int m, int n_kv, int q_stride,
                                                        int out_stride, float scale, int tile, int j, char* smem) {
  constexpr int DG = HD / 8;           // 16-byte pieces per row = 8-dim n-tiles of O
  constexpr int KS = HD / 16;          // k-steps of the scores
  constexpr int NB = ATP_KV / 8;       // 8-position n-tiles of the scores
  constexpr int TB = ATP_KV * HD * 2;  // bytes of one K (or V) tile
  static_assert(ATP_ROWS == 16 * (ATP_THREADS / AF_WARP) && NB == 2 * ATP_BATCH && (DG / 2) % ATP_BATCH == 0 &&
                KS % 2 == 0, "shape");
  const size_t kv_dim = (size_t)n_kv * HD;
  const int lane = threadIdx.x % AF_WARP, warp = threadIdx.x / AF_WARP;
  const int gid = lane >> 2, tig = lane & 3;  // mma fragment coordinates: rows gid, gid + 8; columns 2 tig, 2 tig + 1
  char* qs = smem;
  char* kvs = smem + ATP_ROWS * HD * 2;  // stage s: K at kvs + 2 s TB, V at kvs + (2 s + 1) TB

  const auto [row0, n_pos, n_tiles, wr0, active, w_lo, w_hi, lim0, lim1] =
      atp_rows<G, ATP_ROWS, ATP_KV>(tile, start, m, warp, gid);

  pdl_wait();  // q and the chunk's K/V rows are the previous kernels' outputs
  pdl_launch_dependents();
  atp_stage_q<HD, G>(q, (size_t)q_stride, row0, m, j, qs);
  atp_stage_kv<HD>(k_cache, v_cache, kv_dim, j, 0, n_pos, kvs, kvs + TB);
  cp_async_commit();

  const float sl2 = scale * 1.4426950408889634f;  // scores in log2 units
  unsigned qa[KS][4];                              // the warp's 16 q rows as the scores' A operand, every k-step
  float o[DG][4];                                  // O[gid (+8 in [2..3])][8 n + 2 tig (+1)], relative to m_run
  float m_run[2] = {-AF_INF, -AF_INF};  // rows gid, gid + 8: the running max of the raw scores
  float l_acc[4] = {0.f, 0.f, 0.f, 0.f};  // P's row sums as an mma accumulator: [0], [1] row gid, [2], [3] gid + 8
#pragma unroll
  for (int n = 0; n < DG; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

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
    if (kt == 0) {
      AF_TL_MARK(0);  // timeline: q and the first K/V tile in shared memory
#pragma unroll
      for (int kk = 0; kk < KS; ++kk)
        ldmatrix_x4(qa[kk], qs + swz16<HD>(warp * 16 + (lane & 15), 2 * kk + (lane >> 4)));
    }
    const int p0 = kt * ATP_KV;
    if (active && p0 <= w_hi) {  // warp-uniform: a tile above all of the warp's rows adds nothing
      const char* ks = kvs + (kt % ATP_STAGES) * 2 * TB;
      const char* vs = ks + TB;
      // ---- S = Q K^T: s[n] is positions p0 + 8 n + 2 tig (+1), rows gid ([0..1]) and gid + 8 ([2..3]) ----
      float s[NB][4];
#pragma unroll
      for (int n = 0; n < NB; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
        unsigned b[ATP_BATCH][4];  // 16 positions each: n-tile 2u (b[u][0..1]) and 2u + 1 (b[u][2..3])
#pragma unroll
        for (int u = 0; u < ATP_BATCH; ++u)
          ldmatrix_x4(b[u], ks + swz16<HD>(16 * u + ((lane >> 4) << 3) + (lane & 7), 2 * kk + ((lane >> 3) & 1)));
#pragma unroll
        for (int u = 0; u < ATP_BATCH; ++u) {
          mma_16816(s[2 * u], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[u][0], b[u][1]);
          mma_16816(s[2 * u + 1], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[u][2], b[u][3]);
        }
      }
      unsigned pa[NB / 2][4];  // P's A fragments
      atp_softmax_tile<DG, NB>(s, o, m_run, l_acc, pa, p0, w_lo, lim0, lim1, tig, sl2);
      // ---- O += P V: ldmatrix.trans gives V's B fragments, two 8-dim n-tiles per load ----
#pragma unroll
      for (int kk = 0; kk < NB / 2; ++kk) {
#pragma unroll
        for (int c0 = 0; c0 < DG; c0 += 2 * ATP_BATCH) {
          unsigned b[ATP_BATCH][4];
#pragma unroll
          for (int u = 0; u < ATP_BATCH; ++u)
            ldmatrix_x4_trans(b[u], vs + swz16<HD>(16 * kk + ((lane >> 3) & 1) * 8 + (lane & 7), c0 + 2 * u + (lane >> 4)));
#pragma unroll
          for (int u = 0; u < ATP_BATCH; ++u) {
            mma_16816(o[c0 + 2 * u], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b[u][0], b[u][1]);
            mma_16816(o[c0 + 2 * u + 1], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b[u][2], b[u][3]);
          }
        }
      }
    }
    __syncthreads();  // every warp is done with stage kt % 2 before the next iteration refills it
  }
  AF_TL_MARK(1);  // timeline: the walk done
  if (!active) return;  // no barrier follows

  atp_store_out<HD, G>(o, l_acc, qs, warp, lane, wr0, m, j, out, out_stride);
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
