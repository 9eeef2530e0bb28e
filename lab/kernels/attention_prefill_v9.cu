// attention_prefill_v9.cu — causal GQA attention of a chunk of M query rows (prefill) over the contiguous KV cache:
// FlashAttention-2 on the tensor cores, the scores never leave registers (no M x L matrix in memory). A lab version
// of kernels_cu/attention_prefill.cu (same kernels and results, one argument more: the tensor maps; built for sm_90a
// only; lab/scripts/prefill_att_ab.py builds it in the product's place and passes the maps). v7 (both matrix
// products on wgmma, the product's sm_90a kernel) with each K and V tile brought by the copy engine (TMA) instead of
// every thread's cp.async: one thread arms the stage's mbarrier with the tile's bytes and issues 2 (hd 64) or 4 (hd
// 128) 2D tensor copies of [64 positions][64 dims] boxes, which land in the 128-byte swizzle wgmma reads (the TMA's
// swizzle is sw128's: piece c of row t at c ^ (t & 7) within each 1 KB); the other threads wait on the mbarrier's
// phase. In v7 each thread issued 16 cp.async a tile (hd 128) with their address arithmetic and the zero-fill
// branch. Positions past the chunk read as zeros: the host's tensor maps cover the cache rows 0 .. start + m - 1
// only, the rows this launch may read (rows between a block's last position and start + m are this chunk's, finite,
// and their P is 0). q is staged by cp.async as in v7 (once a block).
// Extra argument: kv_map, this layer's two CUtensorMaps (K at +0, V at +128; launch.py tensor_maps with box (64, 64)
// over k_cache[:start + m], v_cache[:start + m]).
// Shared memory: v7's, with ATP_SMEM_PAD 2048: the two stage mbarriers sit at the base, the tiles at the next 1 KB.
// Computes   for query row r < M (position start + r) and q head hq (kv head j = hq / G, G = n_heads / n_kv):
//              out[r][hq] = sum_{t <= start + r} softmax_t(q[r][hq] . K[t, j] * scale) V[t, j]
//            (causal over the cache before the chunk and the chunk itself). fp16 in, fp32 scores, online softmax in
//            fp32 (a running max and sum per row), P = exp(S - max) rounded to fp16 before P.V (it is the mma's A
//            operand, as in FlashAttention-2) with the sums taken over the rounded values, fp32 O, fp16 out.
// Scheme     block (x, j) = kv head j, row tile T = gridDim.x - 1 - x (the longest causal prefixes start first) of
//            ATP_ROWS = 64 of the kv head's M * G query rows, its G q heads stacked: stacked row R is query row R / G
//            of q head j * G + R % G, so one K/V tile in shared memory serves all G heads. Warp w takes tile rows
//            16 w .. 16 w + 15 (the mma's M). The block walks K/V tiles of ATP_KV = 64 positions from position 0 to
//            its last row's position (tiles wholly above the diagonal are never loaded), staged by TMA in two
//            stages (tile k + 1 lands while tile k is computed); a warp skips a tile above all of its rows and masks
//            only a tile that crosses its rows' diagonal. Per tile: the scores S[64][64] = Q K^T by the warpgroup;
//            per warp, in registers, the causal mask, the online softmax (the row's max over its 4 lanes, the O and
//            sum rescale), P rounded to fp16 in the A fragments' layout and its row sums by an mma.sync with fp16
//            ones; then O[64][hd] += P V by the warpgroup. At the end each warp writes O / sum as fp16 into its own
//            rows of the (dead) q tile (the product's ldmatrix swizzle there, piece c of row t at c ^ (t & 7) in
//            rows of hd * 2 bytes) and stores them in 16-byte pieces. K/V rows past the block's last position are
//            zero-filled, never read (the cache there may hold anything, and a masked score's 0 still multiplies
//            V: 0 * NaN is NaN); q rows past M are zero-filled and never stored.
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
//            launch bounds of 2 blocks per SM (<= 255 registers: O and the scores live in registers; at hd 128 two
//            blocks' 162 KB of shared memory fit an H100's SM).
#include "../../kernels_cu/common.cuh"

#if !AF_HAS_BULK  // the host pass: the copy engine's functions as never-called stubs (the kernels are sm_90a only)
__device__ __forceinline__ void mbar_init(unsigned long long*, unsigned) {}
__device__ __forceinline__ void mbar_init_fence() {}
__device__ __forceinline__ void mbar_expect_tx(unsigned long long*, unsigned) {}
__device__ __forceinline__ void mbar_wait(unsigned long long*, unsigned) {}
__device__ __forceinline__ void tma_load_2d(void*, const void*, int, int, unsigned long long*) {}
#endif

#define ATP_THREADS 128   // 4 warps x 16 query rows (ops/attention_prefill.py ATP_THREADS)
#define ATP_ROWS 64       // stacked query rows per block (ops/attention_prefill.py ATP_ROWS)
#define ATP_KV 64         // positions per K/V tile (ops/attention_prefill.py ATP_KV)
#define ATP_STAGES 2      // K/V tiles in shared memory at once (ops/attention_prefill.py ATP_STAGES)
#define ATP_MIN_BLOCKS 2  // register cap 255: two blocks (8 warps) per SM
#define ATP_BATCH 4       // ldmatrix loads issued before their mmas
#define ATP_SMEM_PAD 2048  // beyond the tiles: the stage mbarriers (16 bytes) and the tiles' base aligned to 1 KB
#define ATP_HEADS_FIRST 0  // 1: the blocks' dispatch order walks the kv heads fastest (variant v9-lpt, below)

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

// Byte offset of 16-byte piece c of row t in a 64-row tile in wgmma's 128-byte-swizzle K-major layout: slabs of 64
// dims (64 rows x 128 bytes = 8 KB each), the pieces of a row XOR-swizzled by the row's low 3 bits.
__device__ __forceinline__ int sw128(int t, int c) { return (c >> 3) * 8192 + t * 128 + (((c & 7) ^ (t & 7)) << 4); }

// The shared-memory matrix descriptor of a 128-byte-swizzle operand starting at `p` (1024-byte aligned but for the
// K-major k-step's 32-byte advance inside a slab): start address >> 4, leading byte offset, stride byte offset 1024
// >> 4 (8 rows of 128 bytes), layout type 1 (128-byte swizzle). K-major (q, K): the leading offset is unused when
// swizzled (1). N-major (V): it is the distance between 64-dim slabs, 8192 bytes (one slab at hd 64: unused).
__device__ __forceinline__ unsigned long long sw128_desc(const char* p, unsigned lead = 1) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  return (unsigned long long)((a & 0x3FFFF) >> 4) | ((unsigned long long)lead << 16) |
         ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Pins an accumulator's registers at this point of the instruction order: the compiler sees a wgmma's outputs as
// ready when its asm ends, so without this it could move their reads above wgmma.wait_group (or their writes, the
// zeroing and the rescale, below wgmma.fence); ptxas orders the rest.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}

// d (+)= A B^T over one 16-dim k-step: A 64 x 16 and B 64 x 16 from their K-major descriptors, d the warpgroup's
// 64 x 64 fp32 accumulator (this thread's 32 values, d[j] the mma.sync C fragment of n-tile j); `acc` 0 overwrites d.
#define ATP_D4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[8][4], unsigned long long da, unsigned long long db,
                                                int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 0, 0;\n}\n"
      : ATP_D4(0), ATP_D4(1), ATP_D4(2), ATP_D4(3), ATP_D4(4), ATP_D4(5), ATP_D4(6), ATP_D4(7)
      : "l"(da), "l"(db), "r"(acc));
}

// d += A B over one 16-position k-step, A (64 x 16) from registers, B (16 x N) from an N-major descriptor: a[0..3]
// this thread's A fragment (the mma.sync m16n8k16 A fragment of its warp's 16 rows), d the warpgroup's 64 x N fp32
// accumulator (d[j] the C fragment of n-tile j), accumulated (scale-d true). The last immediate (1) transposes B:
// N-major.
__device__ __forceinline__ void wgmma_rs_m64n64k16(float (&d)[8][4], const unsigned (&a)[4], unsigned long long db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : ATP_D4(0), ATP_D4(1), ATP_D4(2), ATP_D4(3), ATP_D4(4), ATP_D4(5), ATP_D4(6), ATP_D4(7)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
__device__ __forceinline__ void wgmma_rs_m64n128k16(float (&d)[16][4], const unsigned (&a)[4], unsigned long long db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : ATP_D4(0), ATP_D4(1), ATP_D4(2), ATP_D4(3), ATP_D4(4), ATP_D4(5), ATP_D4(6), ATP_D4(7),
        ATP_D4(8), ATP_D4(9), ATP_D4(10), ATP_D4(11), ATP_D4(12), ATP_D4(13), ATP_D4(14), ATP_D4(15)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
template <int HD>
__device__ __forceinline__ void wgmma_pv(float (&o)[HD / 8][4], const unsigned (&a)[4], unsigned long long db) {
  if constexpr (HD == 128) wgmma_rs_m64n128k16(o, a, db);
  else wgmma_rs_m64n64k16(o, a, db);
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
__device__ __forceinline__ void attention_prefill_block(const __half* q, const __half* k_cache, const __half* v_cache,
                                                        __half* out, int start, int m, int n_kv, int q_stride,
                                                        int out_stride, float scale, int tile, int j, char* smem,
                                                        const char* kv_map) {
  constexpr int DG = HD / 8;           // 16-byte pieces per row = 8-dim n-tiles of O
  constexpr int KS = HD / 16;          // k-steps of the scores
  constexpr int NB = ATP_KV / 8;       // 8-position n-tiles of the scores
  constexpr int TB = ATP_KV * HD * 2;  // bytes of one K (or V) tile
  static_assert(ATP_ROWS == 16 * (ATP_THREADS / AF_WARP) && NB == 2 * ATP_BATCH && (DG / 2) % ATP_BATCH == 0 &&
                KS % 2 == 0, "shape");
  const int lane = threadIdx.x % AF_WARP, warp = threadIdx.x / AF_WARP;
  const int gid = lane >> 2, tig = lane & 3;  // mma fragment coordinates: rows gid, gid + 8; columns 2 tig, 2 tig + 1
  static_assert(ATP_ROWS == 64 && ATP_KV == 64 && ATP_THREADS == 128, "one warpgroup, 64-row tiles (sw128)");
  unsigned long long* bar = reinterpret_cast<unsigned long long*>(smem);  // stage s's mbarrier: bar[s]
  smem += 16;
  smem += (1024 - ((unsigned)__cvta_generic_to_shared(smem) & 1023)) & 1023;  // ATP_SMEM_PAD covers it
  char* qs = smem;
  char* kvs = smem + ATP_ROWS * HD * 2;  // stage s: K at kvs + 2 s TB, V at kvs + (2 s + 1) TB

  // the block's rows and positions: the last query row it holds, the positions up to that row's
  const int row0 = tile * ATP_ROWS;
  const int n_pos = start + min(m - 1, (row0 + ATP_ROWS - 1) / G) + 1;
  const int n_tiles = (n_pos + ATP_KV - 1) / ATP_KV;
  // this warp's rows: whether it holds any query row < m; the last position of its first and last row; this
  // thread's two rows' last positions (rows past the chunk clamped to the last row: computed, never stored)
  const int wr0 = row0 + warp * 16;
  const bool active = wr0 / G < m;
  const int w_lo = start + wr0 / G, w_hi = start + min(m - 1, (wr0 + 15) / G);
  const int lim0 = start + min(m - 1, (wr0 + gid) / G), lim1 = start + min(m - 1, (wr0 + gid + 8) / G);

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
  const unsigned ones = 0x3C003C00u;      // fp16 (1, 1): the B fragment that sums P's rows
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
      wgmma_m64n64k16(s, sw128_desc(qs + off), sw128_desc(ks + off), kk);
    }
    wgmma_commit();
    wgmma_wait0();
    wgmma_fence_operands(s);
    // P's A fragments (16-position k-step kk = n-tiles 2 kk, 2 kk + 1); 0 for a warp whose rows take nothing from
    // this tile, which still joins the warpgroup's P.V
    unsigned pa[NB / 2][4] = {};
    if (active && p0 <= w_hi) {  // warp-uniform: a tile above all of the warp's rows adds nothing
      // ---- the causal mask (only on a tile crossing the diagonal of the warp's rows), the rows' max of the raw
      //      scores (scale > 0: the max of the scaled scores is the scaled max) ----
      if (p0 + ATP_KV - 1 > w_lo) {
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
      // ---- P = 2^(S scale_log2 - max scale_log2) rounded to fp16; its row sums by the mma with the ones ----
#pragma unroll
      for (int kk = 0; kk < NB / 2; ++kk) {
        pa[kk][0] = atp_h2(atp_ex2(fmaf(s[2 * kk][0], sl2, mb[0])), atp_ex2(fmaf(s[2 * kk][1], sl2, mb[0])));
        pa[kk][1] = atp_h2(atp_ex2(fmaf(s[2 * kk][2], sl2, mb[1])), atp_ex2(fmaf(s[2 * kk][3], sl2, mb[1])));
        pa[kk][2] = atp_h2(atp_ex2(fmaf(s[2 * kk + 1][0], sl2, mb[0])), atp_ex2(fmaf(s[2 * kk + 1][1], sl2, mb[0])));
        pa[kk][3] = atp_h2(atp_ex2(fmaf(s[2 * kk + 1][2], sl2, mb[1])), atp_ex2(fmaf(s[2 * kk + 1][3], sl2, mb[1])));
        mma_16816(l_acc, pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], ones, ones);
      }
    }
    // ---- O += P V by the warpgroup: 16 positions (V rows 16 kk .., 2048 bytes) a k-step ----
    wgmma_fence_operands(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < NB / 2; ++kk) wgmma_pv<HD>(o, pa[kk], sw128_desc(vs + kk * 2048, 8192 >> 4));
    wgmma_commit();
    wgmma_wait0();  // V's stage is read before the barrier below lets it be refilled
    wgmma_fence_operands(o);
    __syncthreads();  // every warp is done with stage kt % 2 before the next iteration refills it
  }
  AF_TL_MARK(1);  // timeline: the walk done
  if (!active) return;  // no barrier follows

  // ---- out = O / sum as fp16: through the warp's own rows of the q tile (only this warp read them), then 16-byte
  //      stores of the rows < m ----
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

// Which (row tile, kv head) a block takes. Blocks are dispatched in the order of their linear index (x fastest).
// ATP_HEADS_FIRST 0: tile gridDim.x - 1 - x of head y, so each head's longest causal prefixes start before its
// shorter ones, but head 1's longest only after all of head 0's. 1: the linear index walks the heads fastest, so
// every head's longest prefixes start first, the shortest last (longest-first over the whole grid: the tail of a
// short chunk's launch is its cheapest blocks).
#if ATP_HEADS_FIRST
#define ATP_LINEAR (blockIdx.y * gridDim.x + blockIdx.x)
#define ATP_TILE (gridDim.x - 1 - ATP_LINEAR / gridDim.y)
#define ATP_HEAD (ATP_LINEAR % gridDim.y)
#else
#define ATP_TILE (gridDim.x - 1 - blockIdx.x)
#define ATP_HEAD blockIdx.y
#endif

// One kernel per (head_dim, q heads per kv head): G is a compile-time constant, so a stacked row's query row and
// head are a division by a constant.
#define ATTENTION_PREFILL_INSTANCE(NAME, HD, G)                                                                    \
  extern "C" __global__ void __launch_bounds__(ATP_THREADS, ATP_MIN_BLOCKS)                                       \
      NAME(const __half* __restrict__ q, const __half* __restrict__ k_cache, const __half* __restrict__ v_cache,   \
           __half* __restrict__ out, int start, int m, int n_kv, int q_stride, int out_stride, float scale,        \
           const char* __restrict__ kv_map) {                                                                       \
    AF_TIMELINE_BLOCK;                                                                                             \
    extern __shared__ __align__(16) char atp_smem[];                                                               \
    attention_prefill_block<HD, G>(q, k_cache, v_cache, out, start, m, n_kv, q_stride, out_stride, scale,         \
                                   ATP_TILE, ATP_HEAD, atp_smem, kv_map);                                           \
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
