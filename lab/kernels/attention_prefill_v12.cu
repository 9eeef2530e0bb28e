// attention_prefill_v12.cu — causal GQA attention of a chunk of M query rows (prefill) over the contiguous KV cache:
// a lab version of kernels_cu/attention_prefill.cu (its kernel names and results, with the tensor maps as one more
// argument; built for sm_90a only; lab/scripts/prefill_att_ab.py builds it in the product's place). It is the
// product's sm_90a kernel (kernels_cu/attention_prefill_sm90a.cu, lab name v9-lpt) with one change, ATP_QREG: the
// scores S = Q K^T take q from registers (wgmma's register-A form, each warp's 16 rows loaded once by ldmatrix from
// the staged q tile) instead of reading the q tile from shared memory on every wgmma. Per 64-position tile an
// m64n64k16 k-step in the shared-memory form reads A (2 KB of q) and B (2 KB of K): at hd 128 the scores read 32 KB
// and P.V 16 KB (V) a tile, plus the 32 KB the copy engine writes; with q in registers the reads drop to 32 KB. Two
// blocks an SM at ~470 TFLOPS move ~270 GB/s through shared memory, about its bandwidth (128 bytes a clock), so the
// q reads are a cost the tensor core waits on. q costs 32 registers a thread at hd 128 (16 at hd 64); two blocks of
// 128 threads allow 255. Measured within 1.5% of v9-lpt on 3B and 8B (PERF_NOTES v63): shared memory is not the limit.
// Computes, Layouts, Bytes: as attention_prefill_sm90a.cu; the q tile stays in shared memory (the output's staging).
// Launch     attention_prefill_hd{64,128}_g{1,2,3,4,8,16}: grid = (ceil(M * G / 64), n_kv), block = 128, dyn. smem as
//            the product's sm_90a kernel, the tensor maps as v9's (prefill_att_ab.py variant_launch); 2 blocks an SM.
#include "../../kernels_cu/common.cuh"
#include "../../kernels_cu/attention_prefill.cuh"
#include "../../kernels_cu/wgmma.cuh"

#define ATP_THREADS 128    // one warpgroup: 4 warps x 16 query rows (ops/attention_prefill.py ATP_THREADS)
#define ATP_ROWS 64        // stacked query rows per block: wgmma's M (ops/attention_prefill.py ATP_ROWS)
#define ATP_KV 64          // positions per K/V tile (ops/attention_prefill.py ATP_KV)
#define ATP_STAGES 2       // K/V tiles in shared memory at once (ops/attention_prefill.py ATP_STAGES)
#define ATP_MIN_BLOCKS 2   // two blocks (8 warps) per SM
#define ATP_SMEM_PAD 2048  // the stage mbarriers (16 bytes) and the tiles' base aligned to 1 KB (ops ATP_SMEM_PAD)
#define ATP_QREG 1         // 1: S = Q K^T takes q from registers (loaded once by ldmatrix); 0: from shared memory

// D[64][64] (=|+=) A B^T with A from registers (this warp's 16 rows of a 64 x 16 k-step) and B [64][16] K-major from
// shared memory: wgmma_ss's scores with q held in registers. `acc` 0 overwrites D.
__device__ __forceinline__ void wgmma_rs_s(float (&d)[8][4], const unsigned (&a)[4], unsigned long long db, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : WG_D4(0), WG_D4(1), WG_D4(2), WG_D4(3), WG_D4(4), WG_D4(5), WG_D4(6), WG_D4(7)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));
}

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
#if ATP_QREG
  unsigned qa[KS][4];  // q's A fragments (this warp's 16 rows), loaded once q is in shared memory
#endif
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
#if ATP_QREG
      // this warp's 16 rows of q as wgmma's register-A fragments, one per 16-dim k-step (mma.sync's A layout):
      // lane l gives row (l & 7) + 8 ((l >> 3) & 1) of piece 2 kk + (l >> 4)
#pragma unroll
      for (int kk = 0; kk < KS; ++kk)
        ldmatrix_x4(qa[kk], qs + sw128(16 * warp + (lane & 7) + (((lane >> 3) & 1) << 3), 2 * kk + (lane >> 4)));
#endif
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
#if ATP_QREG
      wgmma_rs_s(s, qa[kk], sw128_desc(ks + off), kk);
#else
      wgmma_ss(s, sw128_desc(qs + off), sw128_desc(ks + off), kk);
#endif
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
