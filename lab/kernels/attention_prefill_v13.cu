// attention_prefill_v13.cu — causal GQA attention of a chunk of M query rows (prefill) over the contiguous KV cache:
// a lab version of kernels_cu/attention_prefill.cu (its kernel names and results, with the tensor maps as one more
// argument; built for sm_90a only; lab/scripts/prefill_att_ab.py builds it in the product's place). It is the
// product's sm_90a kernel (lab name v9-lpt) with three blocks an SM instead of two. v62.1: the kernel is bound by
// how often a warp can issue (one warpgroup's serial chain a tile: scores, wait, softmax, P.V, wait, barrier, with
// two blocks an SM to overlap it; the tensor pipe half busy), and v63 ruled shared-memory bandwidth out. Two stages
// of K and V (64 KB) are what hold the block to two an SM (82 KB each at hd 128); here one K buffer and one V buffer
// (32 KB, 50 KB a block) each have their own mbarrier and are refilled as soon as the tile's product has read them:
// K(k + 1) is issued after tile k's scores (a barrier), so it lands during tile k's softmax and P.V; V(k + 1) after
// tile k's P.V (the barrier the product has), landing during tile k + 1's scores and softmax. Two barriers a tile
// instead of one; whatever latency stays exposed is the other two blocks' time on the SM.
// Computes, Layouts, Bytes: as attention_prefill_sm90a.cu; dynamic shared memory q [64][hd], K [64][hd], V [64][hd]
// fp16 (50 KB at hd 128, 26 KB at hd 64) within ATP_SMEM_PAD.
// Launch     attention_prefill_hd{64,128}_g{1,2,3,4,8,16}: grid = (ceil(M * G / 64), n_kv), block = 128, the tensor
//            maps as v9's (prefill_att_ab.py variant_launch); 3 blocks an SM (<= 170 registers).
#include "../../kernels_cu/common.cuh"
#include "../../kernels_cu/attention_prefill.cuh"
#include "../../kernels_cu/wgmma.cuh"

#define ATP_THREADS 128    // one warpgroup: 4 warps x 16 query rows (ops/attention_prefill.py ATP_THREADS)
#define ATP_ROWS 64        // stacked query rows per block: wgmma's M (ops/attention_prefill.py ATP_ROWS)
#define ATP_KV 64          // positions per K/V tile (ops/attention_prefill.py ATP_KV)
#define ATP_STAGES 1       // one K and one V buffer, each refilled as soon as the tile's product has read it
#define ATP_MIN_BLOCKS 3   // three blocks (12 warps) per SM: 50 KB of shared memory and <= 170 registers each
#define ATP_SMEM_PAD 2048  // the K and V mbarriers (16 bytes) and the tiles' base aligned to 1 KB

// The block's 64 stacked q rows (row0 ..) -> qs; rows past the chunk (query row >= m) zero-filled.
template <int HD, int G>
__device__ __forceinline__ void atp_stage_q(const __half* q, size_t q_stride, int row0, int m, int j, char* qs) {
  constexpr int DG = HD / 8;
#pragma unroll
  for (int i = threadIdx.x; i < ATP_ROWS * DG; i += ATP_THREADS) {
    const int t = i / DG, c = i % DG, r = (row0 + t) / G, g = (row0 + t) % G;
    if (r < m)
      cp_async16(qs + sw128(t, c), q + (size_t)r * q_stride + (size_t)(j * G + g) * HD + c * 8);
    else
      *reinterpret_cast<uint4*>(qs + sw128(t, c)) = make_uint4(0, 0, 0, 0);
  }
}

// Positions p0 .. p0 + 63 of kv head j of one tensor map (K's or V's) -> dst by the copy engine (one thread calls
// it): `bar` armed with the tile's bytes, then one [64][64] box per 64 dims (slab h at + 8192 h).
template <int HD>
__device__ __forceinline__ void atp_tma_tile(const char* map, int j, int p0, char* dst, unsigned long long* bar) {
  mbar_expect_tx(bar, ATP_KV * HD * 2);
#pragma unroll
  for (int h = 0; h < HD / 64; ++h) tma_load_2d(dst + h * 8192, map, j * HD + h * 64, p0, bar);
}

// Row tile `tile` (64 stacked rows) of kv head j.
template <int HD, int G>
__device__ __forceinline__ void attention_prefill_block(const __half* q, __half* out, int start, int m, int n_kv,
                                                        int q_stride, int out_stride, float scale, int tile, int j,
                                                        char* smem, const char* kv_map) {
  constexpr int DG = HD / 8;           // 16-byte pieces per row = 8-dim n-tiles of O
  constexpr int KS = HD / 16;          // k-steps of the scores
  constexpr int NB = ATP_KV / 8;       // 8-position n-tiles of the scores
  constexpr int TB = ATP_KV * HD * 2;  // bytes of one K (or V) tile
  const int lane = threadIdx.x % AF_WARP, warp = threadIdx.x / AF_WARP;
  const int gid = lane >> 2, tig = lane & 3;  // mma fragment coordinates: rows gid, gid + 8; columns 2 tig, 2 tig + 1
  static_assert(ATP_ROWS == 64 && ATP_KV == 64 && ATP_THREADS == 128, "one warpgroup, 64-row tiles (sw128)");
  unsigned long long* bar = reinterpret_cast<unsigned long long*>(smem);  // bar[0]: the K tile's, bar[1]: V's
  smem += 16;
  smem += (1024 - ((unsigned)__cvta_generic_to_shared(smem) & 1023)) & 1023;  // ATP_SMEM_PAD covers it
  char* qs = smem;
  char* ks = smem + ATP_ROWS * HD * 2;  // the K tile
  char* vs = ks + TB;                   // the V tile
  static_assert(ATP_STAGES == 1, "one K and one V buffer");

  const auto [row0, n_pos, n_tiles, wr0, active, w_lo, w_hi, lim0, lim1] =
      atp_rows<G, ATP_ROWS, ATP_KV>(tile, start, m, warp, gid);

  if (threadIdx.x == 0) {
    mbar_init(&bar[0], 1);
    mbar_init(&bar[1], 1);
    mbar_init_fence();
  }
  __syncthreads();  // the barriers initialised before anyone waits on them
  pdl_wait();  // q and the chunk's K/V rows are the previous kernels' outputs
  pdl_launch_dependents();
  atp_stage_q<HD, G>(q, (size_t)q_stride, row0, m, j, qs);
  cp_async_commit();
  if (threadIdx.x == 0) {
    atp_tma_tile<HD>(kv_map, j, 0, ks, &bar[0]);
    atp_tma_tile<HD>(kv_map + 128, j, 0, vs, &bar[1]);
  }

  const float sl2 = scale * 1.4426950408889634f;  // scores in log2 units
  float o[DG][4];                                  // O[gid (+8 in [2..3])][8 n + 2 tig (+1)], relative to m_run
  float m_run[2] = {-AF_INF, -AF_INF};  // rows gid, gid + 8: the running max of the raw scores
  float l_acc[4] = {0.f, 0.f, 0.f, 0.f};  // P's row sums as an mma accumulator: [0], [1] row gid, [2], [3] gid + 8
#pragma unroll
  for (int n = 0; n < DG; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

  for (int kt = 0; kt < n_tiles; ++kt) {
    if (kt == 0) {
      cp_async_wait<0>();    // this thread's copies of q have landed ...
      fence_async_shared();  // ... visible to wgmma ...
      __syncthreads();       // ... and every thread's
    }
    mbar_wait(&bar[0], kt & 1);  // tile kt's K in shared memory
    if (kt == 0) AF_TL_MARK(0);  // timeline: q and the first K/V tile in shared memory
    const int p0 = kt * ATP_KV;
    // ---- S = Q K^T for the block's 64 rows by the warpgroup (every warp takes part); this warp's s[n] is positions
    //      p0 + 8 n + 2 tig (+1), rows 16 warp + gid ([0..1]) and + 8 ([2..3]) ----
    float s[NB][4] = {};  // overwritten by the first k-step (its accumulate flag is 0)
    static_assert(NB == 8, "m64n64: 8 n-tiles");
    wgmma_fence_operands(s);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      const int off = (kk >> 2) * 8192 + (kk & 3) * 32;  // 16 dims = 32 bytes into the slab kk / 4
      wgmma_ss(s, sw128_desc(qs + off), sw128_desc(ks + off), kk);
    }
    wgmma_commit();
    wgmma_wait0();
    wgmma_fence_operands(s);
    __syncthreads();  // every warp's scores have read the K tile: tile kt + 1's K lands during this softmax and P.V
    if (kt + 1 < n_tiles && threadIdx.x == 0) atp_tma_tile<HD>(kv_map, j, (kt + 1) * ATP_KV, ks, &bar[0]);
    // P's A fragments (16-position k-step kk = n-tiles 2 kk, 2 kk + 1); 0 for a warp whose rows take nothing from
    // this tile, which still joins the warpgroup's P.V
    unsigned pa[NB / 2][4] = {};
    if (active && p0 <= w_hi)  // warp-uniform: a tile above all of the warp's rows adds nothing
      atp_softmax_tile<DG, NB>(s, o, m_run, l_acc, pa, p0, w_lo, lim0, lim1, tig, sl2);
    mbar_wait(&bar[1], kt & 1);  // tile kt's V in shared memory
    // ---- O += P V by the warpgroup: 16 positions (V rows 16 kk .., 2048 bytes) a k-step ----
    wgmma_fence_operands(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < NB / 2; ++kk) wgmma_rs(o, pa[kk], sw128_desc(vs + kk * 2048, 8192 >> 4));
    wgmma_commit();
    wgmma_wait0();  // V is read before the barrier below lets it be refilled
    wgmma_fence_operands(o);
    __syncthreads();  // every warp's P.V has read the V tile: tile kt + 1's V lands during the next scores and softmax
    if (kt + 1 < n_tiles && threadIdx.x == 0) atp_tma_tile<HD>(kv_map + 128, j, (kt + 1) * ATP_KV, vs, &bar[1]);
  }
  AF_TL_MARK(1);  // timeline: the walk done
  if (!active) return;  // no barrier follows

  atp_store_out<HD, G>(o, l_acc, qs, warp, lane, wr0, m, j, out, out_stride);
}

// One kernel per (head_dim, q heads per kv head), as attention_prefill.cuh's instances with the tensor maps beside
// (k_cache and v_cache, which the copy engine reads through kv_map, stay in the argument list both kernels share).
#define ATTENTION_PREFILL_TMA_INSTANCE(NAME, HD, G)                                                                \
  extern "C" __global__ void __launch_bounds__(ATP_THREADS, ATP_MIN_BLOCKS)                                       \
      NAME(const __half* __restrict__ q, const __half* __restrict__ k_cache, const __half* __restrict__ v_cache,   \
           __half* __restrict__ out, int start, int m, int n_kv, int q_stride, int out_stride, float scale,        \
           const char* __restrict__ kv_map) {                                                                       \
    AF_TIMELINE_BLOCK;                                                                                             \
    extern __shared__ __align__(16) char atp_smem[];                                                               \
    attention_prefill_block<HD, G>(q, out, start, m, n_kv, q_stride, out_stride, scale, atp_tile(), atp_head(),  \
                                   atp_smem, kv_map);                                                               \
  }

ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_hd64_g1, 64, 1)
ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_hd64_g2, 64, 2)
ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_hd64_g3, 64, 3)
ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_hd64_g4, 64, 4)
ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_hd64_g8, 64, 8)
ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_hd64_g16, 64, 16)
ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_hd128_g1, 128, 1)
ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_hd128_g2, 128, 2)
ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_hd128_g3, 128, 3)
ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_hd128_g4, 128, 4)
ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_hd128_g8, 128, 8)
ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_hd128_g16, 128, 16)
