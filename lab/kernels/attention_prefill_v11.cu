// attention_prefill_v11.cu — causal GQA attention of a chunk of M query rows (prefill) over the contiguous KV cache,
// in FlashAttention-3's shape: a lab version of kernels_cu/attention_prefill.cu (its kernel names and results, v9's
// arguments: the tensor maps too; built for sm_90a only; lab/scripts/prefill_att_ab.py builds it in the product's
// place). What it changes against v9 (the product's sm_90a kernel), each a #define so one call measures each step:
//   - warp specialisation: warpgroup 0 is the producer (one thread issues the K/V copies by TMA, gated per stage by
//     an "empty" mbarrier the consumers arrive on); warpgroups 1 and 2 are consumers, 64 stacked rows each, sharing
//     every K/V tile (blocks of 128 rows, one block an SM). No block-wide barrier inside the walk: each consumer
//     waits on the stage's "full" mbarrier and releases it when its P.V has read V.
//   - ATP_KV positions a K/V tile (128: each tile's fixed work, its waits, O's rescale and the mask test, paid half
//     as often a FLOP as at 64).
//   - per consumer, tile k's P.V and tile k + 1's S = Q K^T issued together as one wgmma group, then tile k + 1's
//     softmax: the tensor core's work of a consumer is one burst a tile.
//   - ATP_PINGPONG 1: the consumers take turns issuing their bursts (two named barriers), so one's softmax runs
//     beside the other's matrix products.
//   - ATP_INTRA 1 (FlashAttention-3's intra-warpgroup overlap): the burst is two wgmma groups, tile k + 1's scores
//     then tile k's P.V; the consumer waits for the scores only, runs tile k + 1's softmax while its P.V still runs
//     (P double-buffered: pa read by the P.V, pb made by the softmax), then waits for the P.V and rescales O.
//   - setmaxnreg: the producer gives its registers up (24) and the consumers take 240: O, the scores of a
//     128-position tile and P (64 + 64 + 32 at hd 128) do not fit the 168 a thread that 384 threads get otherwise.
// Computes   as attention_prefill.cu (the softmax, the mask, the roundings: attention_prefill.cuh's atp_softmax_tile
//            and atp_store_out, shared with the product).
// Scheme     block (x, y) = (row tile, kv head) in the product's longest-first order (atp_tile, atp_head); its 128
//            stacked rows R (query row R / G of q head j G + R % G); consumer c takes rows 64 c .. 64 c + 63, warp w
//            of it 16 w ..; the block walks the K/V tiles from position 0 to its last row's, a consumer skips the
//            matrix products of a tile above all of its rows (it still waits and releases the stage, and keeps its
//            turn in the ping-pong: both consumers take as many turns).
// Layouts    q, out and the cache as attention_prefill.cu; kv_map as v9's (box [64 positions][64 dims], 128-byte
//            swizzle: a 128-position tile is two boxes a slab). Dynamic shared memory: the 2 ATP_STAGES mbarriers
//            (full, then empty), then (1 KB aligned) the consumers' q tiles [2][64][hd], then ATP_STAGES x (K, V),
//            each [hd / 64 slabs][ATP_KV positions][64 dims] fp16 in the 128-byte swizzle (slab ATP_KV * 128 bytes);
//            the formula of prefill_att_ab.py variant_smem (ATP_SMEM_PAD covers the barriers and the alignment):
//            162 KB at hd 128, 82 KB at hd 64 (ATP_KV 128).
// Bytes      as attention_prefill.cu; each K/V tile crosses L2 once for 128 rows (v9: 64).
// Launch     attention_prefill_hd{64,128}_g{1,2,3,4,8,16}: grid = (ceil(M * G / 128), n_kv), block = 384
//            (ATP_THREADS), dyn. smem as above, the tensor maps as v9's (prefill_att_ab.py variant_launch); one block
//            an SM.
#include "../../kernels_cu/common.cuh"
#include "../../kernels_cu/attention_prefill.cuh"
#include "../../kernels_cu/wgmma.cuh"

// What v11 needs beside wgmma.cuh (the product's sm_90a kernel needs none of it): the consumers' release arrival in
// the host pass, the second wgmma group's wait, the 128-position tile's scores, named barriers, setmaxnreg.
#if !AF_HAS_BULK
__device__ __forceinline__ void mbar_arrive(unsigned long long*) {}
#endif
__device__ __forceinline__ void wgmma_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }

// Holds a register-A operand's registers to this point: wgmma reads them until its wait_group, which the compiler
// does not see.
template <int N>
__device__ __forceinline__ void operand_fence(unsigned (&a)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[j][e])::"memory");
}

// d (+)= A B^T over one 16-dim k-step, B 128 x 16 (wgmma.cuh's wgmma_ss at N = 128).
__device__ __forceinline__ void wgmma_ss(float (&d)[16][4], unsigned long long da, unsigned long long db, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      : WG_D4(0), WG_D4(1), WG_D4(2), WG_D4(3), WG_D4(4), WG_D4(5), WG_D4(6), WG_D4(7),
        WG_D4(8), WG_D4(9), WG_D4(10), WG_D4(11), WG_D4(12), WG_D4(13), WG_D4(14), WG_D4(15)
      : "l"(da), "l"(db), "r"(acc));
}

// Named barrier `id` over `n` threads: bar.sync arrives and waits for the barrier's completion, bar.arrive only
// arrives (n counts both).
__device__ __forceinline__ void named_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void named_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}

// A warpgroup's register budget, moved between the warpgroups of a block (every thread of the warpgroup executes
// it; an increase waits until the registers are free).
template <int R>
__device__ __forceinline__ void regs_down() {
#if defined(__CUDA_ARCH__)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
#endif
}
template <int R>
__device__ __forceinline__ void regs_up() {
#if defined(__CUDA_ARCH__)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
#endif
}

#define ATP_THREADS 384    // the producer warpgroup and two consumer warpgroups
#define ATP_ROWS 128       // stacked query rows per block: 64 a consumer
#define ATP_KV 128         // positions per K/V tile (64 or 128)
#define ATP_STAGES 2       // K/V tiles in shared memory at once
#define ATP_MIN_BLOCKS 1   // one block an SM
#define ATP_SMEM_PAD 2048  // the stage mbarriers and the tiles' base aligned to 1 KB
#define ATP_PINGPONG 1     // 1: the consumers take turns issuing their matrix products
#define ATP_INTRA 0        // 1: a consumer's softmax of tile k + 1 beside its own P.V of tile k (two wgmma groups)

// Positions p0 .. p0 + ATP_KV - 1 of kv head j -> ks, vs by the copy engine (the producer thread): the stage's full
// barrier armed with both tiles' bytes, then per 64-dim slab h (at + h ATP_KV * 128) one [64][64] box per 64
// positions. Positions past the maps' rows land as zeros (a box wholly past them too).
template <int HD>
__device__ __forceinline__ void atp_tma_kv(const char* kv_map, int j, int p0, char* ks, char* vs,
                                           unsigned long long* bar) {
  constexpr int SLAB = ATP_KV * 128;
  mbar_expect_tx(bar, 2 * ATP_KV * HD * 2);
#pragma unroll
  for (int h = 0; h < HD / 64; ++h)
#pragma unroll
    for (int b = 0; b < ATP_KV / 64; ++b) {
      tma_load_2d(ks + h * SLAB + b * 8192, kv_map, j * HD + h * 64, p0 + 64 * b, bar);
      tma_load_2d(vs + h * SLAB + b * 8192, kv_map + 128, j * HD + h * 64, p0 + 64 * b, bar);
    }
}

// The ping-pong's turns: consumer c waits for its turn on barrier 3 + c (its 128 threads and the other consumer's
// arrival) and hands the turn over by arriving on the other's.
__device__ __forceinline__ void pp_wait(int c) {
  if (ATP_PINGPONG) named_sync(3 + c, 256);
}
__device__ __forceinline__ void pp_pass(int c) {
  if (ATP_PINGPONG) named_arrive(4 - c, 256);
}

template <int HD, int G>
__device__ __forceinline__ void attention_prefill_block(const __half* q, __half* out, int start, int m, int n_kv,
                                                        int q_stride, int out_stride, float scale, int tile, int j,
                                                        char* smem, const char* kv_map) {
  constexpr int DG = HD / 8;           // 8-dim n-tiles of O
  constexpr int KS = HD / 16;          // k-steps of the scores
  constexpr int NB = ATP_KV / 8;       // 8-position n-tiles of the scores
  constexpr int TB = ATP_KV * HD * 2;  // bytes of one K (or V) tile
  constexpr int SLAB = ATP_KV * 128;   // bytes of one 64-dim slab of a K/V tile
  static_assert(ATP_ROWS == 128 && ATP_THREADS == 384 && (ATP_KV == 64 || ATP_KV == 128), "v11's shape");
  unsigned long long* full = reinterpret_cast<unsigned long long*>(smem);  // stage s: K and V landed
  unsigned long long* empty = full + ATP_STAGES;                           // stage s: both consumers done with it
  smem += 16 * ATP_STAGES;
  smem += (1024 - ((unsigned)__cvta_generic_to_shared(smem) & 1023)) & 1023;  // ATP_SMEM_PAD covers it
  char* qs = smem;
  char* kvs = smem + ATP_ROWS * HD * 2;  // stage s: K at kvs + 2 s TB, V at + TB
  const int row0 = tile * ATP_ROWS;
  const int n_tiles = atp_rows<G, ATP_ROWS, ATP_KV>(tile, start, m, 0, 0).n_tiles;  // the block's, both roles'

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < ATP_STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 8);  // one arrival a consumer warp
    }
    mbar_init_fence();
  }
  __syncthreads();  // the barriers initialised before anyone waits on them; the last block-wide barrier
  pdl_wait();       // q and the chunk's K/V rows are the previous kernels' outputs
  pdl_launch_dependents();

  if (threadIdx.x < 128) {  // ---- the producer warpgroup: one thread streams the tiles ----
    regs_down<24>();
    if (threadIdx.x == 0)
      for (int kt = 0; kt < n_tiles; ++kt) {
        const int s = kt % ATP_STAGES;
        if (kt >= ATP_STAGES) mbar_wait(&empty[s], (kt / ATP_STAGES - 1) & 1);
        atp_tma_kv<HD>(kv_map, j, kt * ATP_KV, kvs + s * 2 * TB, kvs + s * 2 * TB + TB, &full[s]);
      }
    return;
  }
  regs_up<240>();
  // ---- consumer c: stacked rows row0 + 64 c .., warp w (0..7 over both consumers) rows 16 w .. of the block ----
  const int c = threadIdx.x / 128 - 1, ct = threadIdx.x - 128;
  const int lane = ct % AF_WARP, warp = ct / AF_WARP, wq = warp & 3;
  const int gid = lane >> 2, tig = lane & 3;
  const AtpRows r = atp_rows<G, ATP_ROWS, ATP_KV>(tile, start, m, warp, gid);
  const int c_row0 = row0 + 64 * c;
  char* qw = qs + c * (64 * HD * 2);
  const bool c_active = c_row0 / G < m;
  const int c_hi = start + min(m - 1, (c_row0 + 63) / G);  // the consumer's last row's position

  for (int i = ct % 128; i < 64 * DG; i += 128) {  // this consumer's q tile
    const int t = i / DG, c8 = i % DG, R = c_row0 + t, qr = R / G, g = R % G;
    if (qr < m)
      cp_async16(qw + sw128(t, c8), q + (size_t)qr * q_stride + (size_t)(j * G + g) * HD + c8 * 8);
    else
      *reinterpret_cast<uint4*>(qw + sw128(t, c8)) = make_uint4(0, 0, 0, 0);
  }
  cp_async_commit();
  cp_async_wait<0>();
  fence_async_shared();   // this thread's q writes visible to wgmma ...
  named_sync(1 + c, 128);  // ... and every thread's of the consumer

  const float sl2 = scale * 1.4426950408889634f;
  float o[DG][4];
  float m_run[2] = {-AF_INF, -AF_INF};
  float l_acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int n = 0; n < DG; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float s[NB][4] = {};
  unsigned pa[NB / 2][4];
  // consumer-uniform: whether tile kt reaches any of its rows; warp-uniform: any of the warp's
  auto c_takes = [&](int kt) { return c_active && kt * ATP_KV <= c_hi; };
  auto w_takes = [&](int kt) { return r.active && kt * ATP_KV <= r.w_hi; };
  auto issue_s = [&](int kt) {  // S = Q K^T of tile kt into s
    const char* ks = kvs + (kt % ATP_STAGES) * 2 * TB;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk)
      wgmma_ss(s, sw128_desc(qw + (kk >> 2) * 8192 + (kk & 3) * 32), sw128_desc(ks + (kk >> 2) * SLAB + (kk & 3) * 32),
               kk);
  };
  auto softmax = [&](int kt) {  // tile kt's P (0 for a warp it does not reach) and the rescale of O
#pragma unroll
    for (int kk = 0; kk < NB / 2; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
    if (w_takes(kt)) atp_softmax_tile<DG, NB>(s, o, m_run, l_acc, pa, kt * ATP_KV, r.w_lo, r.lim0, r.lim1, tig, sl2);
  };

  if (c == 1) pp_pass(c);  // consumer 0 takes the first turn
  pp_wait(c);              // tile 0's scores
  mbar_wait(&full[0], 0);
  wgmma_fence_operands(s);
  wgmma_fence();
  issue_s(0);  // every consumer: position 0 is in every row's prefix (a consumer past the chunk has zero q rows)
  wgmma_commit();
  pp_pass(c);
  wgmma_wait0();
  wgmma_fence_operands(s);
  softmax(0);
#if !ATP_INTRA
  for (int kt = 0; kt < n_tiles; ++kt) {
    const bool next = kt + 1 < n_tiles;
    pp_wait(c);  // tile kt's P.V and tile kt + 1's scores, one burst
    wgmma_fence_operands(o);
    wgmma_fence_operands(s);
    wgmma_fence();
    if (c_takes(kt)) {
      const char* vs = kvs + (kt % ATP_STAGES) * 2 * TB + TB;
#pragma unroll
      for (int kk = 0; kk < NB / 2; ++kk) wgmma_rs(o, pa[kk], sw128_desc(vs + kk * 2048, SLAB >> 4));
    }
    if (next) {
      mbar_wait(&full[(kt + 1) % ATP_STAGES], ((kt + 1) / ATP_STAGES) & 1);
      if (c_takes(kt + 1)) issue_s(kt + 1);
    }
    wgmma_commit();
    if (next || c == 0) pp_pass(c);  // consumer 1's last turn hands nothing on: consumer 0 takes no more
    wgmma_wait0();
    wgmma_fence_operands(o);
    wgmma_fence_operands(s);
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[kt % ATP_STAGES]);  // this warp's reads of stage kt are done
    if (next) softmax(kt + 1);
  }
#else
  unsigned pb[NB / 2][4];  // tile kt + 1's P, made while tile kt's P.V still reads pa
  for (int kt = 0; kt < n_tiles; ++kt) {
    const bool next = kt + 1 < n_tiles;
    pp_wait(c);  // tile kt + 1's scores (the older group), then tile kt's P.V, one burst
    wgmma_fence_operands(o);
    wgmma_fence_operands(s);
    wgmma_fence();
    if (next) {
      mbar_wait(&full[(kt + 1) % ATP_STAGES], ((kt + 1) / ATP_STAGES) & 1);
      if (c_takes(kt + 1)) issue_s(kt + 1);
    }
    wgmma_commit();
    if (c_takes(kt)) {
      const char* vs = kvs + (kt % ATP_STAGES) * 2 * TB + TB;
#pragma unroll
      for (int kk = 0; kk < NB / 2; ++kk) wgmma_rs(o, pa[kk], sw128_desc(vs + kk * 2048, SLAB >> 4));
    }
    wgmma_commit();
    if (next || c == 0) pp_pass(c);
    wgmma_wait1();  // the scores are in; P.V may still run
    wgmma_fence_operands(s);
    const bool w_next = next && w_takes(kt + 1);
    const float m_old[2] = {m_run[0], m_run[1]};
#pragma unroll
    for (int kk = 0; kk < NB / 2; ++kk) pb[kk][0] = pb[kk][1] = pb[kk][2] = pb[kk][3] = 0u;
    if (w_next) {  // O's rescale waits for P.V: the softmax rescales a stand-in, O is rescaled below by the same alpha
      float stand_in[1][4] = {};
      atp_softmax_tile<1, NB>(s, stand_in, m_run, l_acc, pb, (kt + 1) * ATP_KV, r.w_lo, r.lim0, r.lim1, tig, sl2);
    }
    wgmma_wait0();
    wgmma_fence_operands(o);
    operand_fence(pa);  // pa's registers stay P's until P.V has read them (pb is made elsewhere)
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[kt % ATP_STAGES]);  // this warp's reads of stage kt are done
    if (w_next) {
      const float alpha[2] = {atp_ex2((m_old[0] - m_run[0]) * sl2), atp_ex2((m_old[1] - m_run[1]) * sl2)};
#pragma unroll
      for (int n = 0; n < DG; ++n) {
        o[n][0] *= alpha[0]; o[n][1] *= alpha[0];
        o[n][2] *= alpha[1]; o[n][3] *= alpha[1];
      }
    }
#pragma unroll
    for (int kk = 0; kk < NB / 2; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) pa[kk][e] = pb[kk][e];
  }
#endif
  named_sync(1 + c, 128);  // the consumer's matrix products have read its q tile before it holds the output
  if (!r.active) return;
  atp_store_out<HD, G>(o, l_acc, qw, wq, lane, r.wr0, m, j, out, out_stride);
}

#define ATTENTION_PREFILL_V11_INSTANCE(NAME, HD, G)                                                                \
  extern "C" __global__ void __launch_bounds__(ATP_THREADS, ATP_MIN_BLOCKS)                                       \
      NAME(const __half* __restrict__ q, const __half* __restrict__ k_cache, const __half* __restrict__ v_cache,   \
           __half* __restrict__ out, int start, int m, int n_kv, int q_stride, int out_stride, float scale,        \
           const char* __restrict__ kv_map) {                                                                       \
    AF_TIMELINE_BLOCK;                                                                                             \
    extern __shared__ __align__(16) char atp_smem[];                                                               \
    attention_prefill_block<HD, G>(q, out, start, m, n_kv, q_stride, out_stride, scale, atp_tile(), atp_head(),  \
                                   atp_smem, kv_map);                                                               \
  }

ATTENTION_PREFILL_V11_INSTANCE(attention_prefill_hd64_g1, 64, 1)
ATTENTION_PREFILL_V11_INSTANCE(attention_prefill_hd64_g2, 64, 2)
ATTENTION_PREFILL_V11_INSTANCE(attention_prefill_hd64_g3, 64, 3)
ATTENTION_PREFILL_V11_INSTANCE(attention_prefill_hd64_g4, 64, 4)
ATTENTION_PREFILL_V11_INSTANCE(attention_prefill_hd64_g8, 64, 8)
ATTENTION_PREFILL_V11_INSTANCE(attention_prefill_hd64_g16, 64, 16)
ATTENTION_PREFILL_V11_INSTANCE(attention_prefill_hd128_g1, 128, 1)
ATTENTION_PREFILL_V11_INSTANCE(attention_prefill_hd128_g2, 128, 2)
ATTENTION_PREFILL_V11_INSTANCE(attention_prefill_hd128_g3, 128, 3)
ATTENTION_PREFILL_V11_INSTANCE(attention_prefill_hd128_g4, 128, 4)
ATTENTION_PREFILL_V11_INSTANCE(attention_prefill_hd128_g8, 128, 8)
ATTENTION_PREFILL_V11_INSTANCE(attention_prefill_hd128_g16, 128, 16)
