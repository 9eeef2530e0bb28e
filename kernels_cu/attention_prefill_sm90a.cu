// attention_prefill_sm90a.cu — causal GQA attention of a chunk of M query rows (prefill) over the contiguous KV
// cache on Hopper's warpgroup MMA and copy engine (wgmma, TMA; built for sm_90a only: ops/attention_prefill.py runs
// it where the compute capability is 9.0 and attention_prefill.cu everywhere else).
//
// Computes   what attention_prefill.cu computes, with its roundings and results.
// Scheme     attention_prefill.cu's blocks, rows and K/V walk; here the block's 4 warps are one warpgroup, both
//            matrix products are wgmma (one instruction per 64 x N x 16, operands read from shared memory without
//            ldmatrix) and the K/V tiles come by the copy engine: the mma.sync kernel is bound by issue, its mmas,
//            ldmatrix and per-thread staging outnumbering the tensor core's work. Per K/V tile of 64 positions:
//              staging    one thread arms the stage's mbarrier with the tile's bytes and issues 2 (hd 64) or 4 (hd
//                         128) 2D tensor copies of [64 positions][64 dims] boxes for K and V (tile k + 1's while tile
//                         k is computed); the others wait on the barrier's phase. The tensor maps cover the cache
//                         rows 0 .. start + M - 1, so positions past the chunk land as zeros (the cache there may
//                         hold anything, and a masked score's 0 still multiplies V); q is staged once by cp.async;
//              S = Q K^T  4 (hd 64) or 8 (hd 128) wgmma m64n64k16 read q and the K tile from shared memory
//                         (K-major);
//              softmax    per warp on its 16 rows (attention_prefill.cuh: the accumulator's per-warp layout is the
//                         mma.sync fragments'), P rounded to fp16 in registers;
//              O += P V   4 wgmma m64n{hd}k16 take P from registers (a warp's P fragments are wgmma's register-A
//                         layout) and V from shared memory as an N-major operand (positions are the k index).
//            A warp whose rows take nothing from a tile (above its diagonal, or past the chunk) still joins both
//            wgmma: its P is 0 and its O and sums stay as they are.
// Layouts    q, out and the cache as attention_prefill.cu; kv_map: this layer's two CUtensorMaps (K at +0, V at +128;
//            launch.py tensor_maps, box TMA_BOX, 128-byte swizzle) over cache rows 0 .. start + M - 1. In shared
//            memory q, K and V tiles are in the 128-byte swizzle that both the copy engine and wgmma use: slabs of
//            64 dims (64 rows x 128 bytes, 8 KB), 16-byte piece c of row t at (c ^ (t & 7)) * 16 within its row,
//            tiles 1024-byte aligned. Descriptors: stride offset 1024 bytes (8 rows); for V (N-major) the leading
//            offset is the slab distance, 8192 bytes. Dynamic shared memory (ops/attention_prefill.py prefill_smem):
//            the two stage mbarriers, then (1 KB aligned) the q tile [64][hd] and ATP_STAGES x (K [64][hd],
//            V [64][hd]) fp16, within ATP_SMEM_PAD bytes more: 42 KB at hd 64, 82 KB at hd 128. q's cp.async writes
//            are made visible to wgmma (fence.proxy.async) before the first barrier; P.V's wgmma has finished
//            reading V before the barrier that lets its stage be refilled.
// Bytes      as attention_prefill.cu.
// Launch     attention_prefill_wgmma_hd{64,128}_g{1,2,3,4,8,16}: grid = (ceil(M * G / 64), n_kv), block = 128 (one
//            warpgroup), dyn. smem = prefill_smem(hd, wgmma=True), arguments attention_prefill.cu's and kv_map;
//            2 blocks per SM (139 registers at hd 128).
#include "attention_prefill.cuh"
#include "wgmma.cuh"

#define ATP_THREADS 128    // one warpgroup: 4 warps x 16 query rows (ops/attention_prefill.py ATP_THREADS)
#define ATP_ROWS 64        // stacked query rows per block: wgmma's M (ops/attention_prefill.py ATP_ROWS)
#define ATP_KV 64          // positions per K/V tile (ops/attention_prefill.py ATP_KV)
#define ATP_STAGES 2       // K/V tiles in shared memory at once (ops/attention_prefill.py ATP_STAGES)
#define ATP_MIN_BLOCKS 2   // two blocks (8 warps) per SM
#define ATP_SMEM_PAD 2048  // the stage mbarriers (16 bytes) and the tiles' base aligned to 1 KB (ops ATP_SMEM_PAD)

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

// Positions p0 .. p0 + 63 of kv head j -> ks, vs by the copy engine (one thread calls it): the stage's mbarrier
// armed with both tiles' bytes, then one [64][64] box per 64 dims of K and of V (slab h at + 8192 h).
template <int HD>
__device__ __forceinline__ void atp_tma_kv(const char* kv_map, int j, int p0, char* ks, char* vs,
                                           unsigned long long* bar) {
  mbar_expect_tx(bar, 2 * ATP_KV * HD * 2);
#pragma unroll
  for (int h = 0; h < HD / 64; ++h) {
    tma_load_2d(ks + h * 8192, kv_map, j * HD + h * 64, p0, bar);
    tma_load_2d(vs + h * 8192, kv_map + 128, j * HD + h * 64, p0, bar);
  }
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
  unsigned long long* bar = reinterpret_cast<unsigned long long*>(smem);  // stage s's mbarrier: bar[s]
  smem += 16;
  smem += (1024 - ((unsigned)__cvta_generic_to_shared(smem) & 1023)) & 1023;  // ATP_SMEM_PAD covers it
  char* qs = smem;
  char* kvs = smem + ATP_ROWS * HD * 2;  // stage s: K at kvs + 2 s TB, V at kvs + (2 s + 1) TB

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
  if (threadIdx.x == 0) atp_tma_kv<HD>(kv_map, j, 0, kvs, kvs + TB, &bar[0]);

  const float sl2 = scale * 1.4426950408889634f;  // scores in log2 units
  float o[DG][4];                                  // O[gid (+8 in [2..3])][8 n + 2 tig (+1)], relative to m_run
  float m_run[2] = {-AF_INF, -AF_INF};  // rows gid, gid + 8: the running max of the raw scores
  float l_acc[4] = {0.f, 0.f, 0.f, 0.f};  // P's row sums as an mma accumulator: [0], [1] row gid, [2], [3] gid + 8
#pragma unroll
  for (int n = 0; n < DG; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

  for (int kt = 0; kt < n_tiles; ++kt) {
    // tile kt + 1 into the other stage (everyone finished reading it: the barrier ending the previous iteration)
    if (kt + 1 < n_tiles && threadIdx.x == 0) {
      char* nx = kvs + ((kt + 1) % ATP_STAGES) * 2 * TB;
      atp_tma_kv<HD>(kv_map, j, (kt + 1) * ATP_KV, nx, nx + TB, &bar[(kt + 1) % ATP_STAGES]);
    }
    if (kt == 0) {
      cp_async_wait<0>();    // this thread's copies of q have landed ...
      fence_async_shared();  // ... visible to wgmma ...
      __syncthreads();       // ... and every thread's
    }
    mbar_wait(&bar[kt % ATP_STAGES], (kt / ATP_STAGES) & 1);  // tile kt's K and V in shared memory
    if (kt == 0) AF_TL_MARK(0);  // timeline: q and the first K/V tile in shared memory
    const int p0 = kt * ATP_KV;
    const char* ks = kvs + (kt % ATP_STAGES) * 2 * TB;
    const char* vs = ks + TB;
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
    // P's A fragments (16-position k-step kk = n-tiles 2 kk, 2 kk + 1); 0 for a warp whose rows take nothing from
    // this tile, which still joins the warpgroup's P.V
    unsigned pa[NB / 2][4] = {};
    if (active && p0 <= w_hi)  // warp-uniform: a tile above all of the warp's rows adds nothing
      atp_softmax_tile<DG, NB>(s, o, m_run, l_acc, pa, p0, w_lo, lim0, lim1, tig, sl2);
    // ---- O += P V by the warpgroup: 16 positions (V rows 16 kk .., 2048 bytes) a k-step ----
    wgmma_fence_operands(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < NB / 2; ++kk) wgmma_rs(o, pa[kk], sw128_desc(vs + kk * 2048, 8192 >> 4));
    wgmma_commit();
    wgmma_wait0();  // V's stage is read before the barrier below lets it be refilled
    wgmma_fence_operands(o);
    __syncthreads();  // every warp is done with stage kt % 2 before the next iteration refills it
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

ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_wgmma_hd64_g1, 64, 1)
ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_wgmma_hd64_g2, 64, 2)
ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_wgmma_hd64_g3, 64, 3)
ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_wgmma_hd64_g4, 64, 4)
ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_wgmma_hd64_g8, 64, 8)
ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_wgmma_hd64_g16, 64, 16)
ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_wgmma_hd128_g1, 128, 1)
ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_wgmma_hd128_g2, 128, 2)
ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_wgmma_hd128_g3, 128, 3)
ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_wgmma_hd128_g4, 128, 4)
ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_wgmma_hd128_g8, 128, 8)
ATTENTION_PREFILL_TMA_INSTANCE(attention_prefill_wgmma_hd128_g16, 128, 16)
