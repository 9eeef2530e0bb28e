// gemv_tiled.cuh — the layer GEMVs (QKV, o_proj, gate/up, down) on tensor cores over pre-tiled weights: the tiled
// layout and its mma fragments, and the two per-warp paths of the ring form, fp16 through registers (gemv_tiled) and
// fp8 through a shared-memory ring (gemv_tiled_async). gemv_ws.cuh builds the warp-specialised form on the same
// pieces.
//
// Computes   y = W · x (M = 1) with fp32 accumulation by mma.m16n8k16 f32.f16.f16.f32; fp8: each 128-input group's
//            sum times its per-row scale, in fp32. x is broadcast to all 8 mma columns (column 0 is the result, the
//            others are free work on an otherwise idle unit). Why tensor cores: a scalar fp32 dot product costs ~60
//            instructions per 16-byte fp8 chunk (~25 for fp16), which keeps the fp8 GEMVs below their byte rate;
//            one mma does 16 x 16 weights.
// Layouts    W TILED (ops/gemv.py tile_view, at load time): tiles of 16 weight rows (R = 1: 16 consecutive outputs;
//            R = 2: rows 0-7 = row 0 of 8 outputs, rows 8-15 = their row 1: gate and up, or RoPE rows i and
//            i + hd/2), each stored as units of 512 bytes: unit u holds inputs [u*KU, u*KU + KU) of the 16 rows
//            (KU = 16 fp16, 32 fp8), lane l's 16 bytes being exactly its A fragments (rows l/4 and l/4 + 8, inputs
//            2(l%4), +1, +8, +9 of each 16-input k-tile; fp8: two k-tiles, converted in registers by the hardware
//            fp8x2 -> half2 cvt). fp8 scales [tile][group of 128][8][2] fp32 (rows g and g + 8 adjacent: one 8-byte
//            load per lane and group).
// Requires   rows % 16 == 0 and K % 32 == 0 (the host refuses other shapes); K % 128 may be non-zero (the last group
//            is short: SmolLM2's K = 576).
// Bytes      rows * K * 2 (fp16) or rows * K + rows * ceil(K/128) * 4 (fp8 + scales), streamed once without L1
//            allocation, + K * 2..4 of x per block.
// Launch     block = GEMV_THREADS (8 warps), at most GEMV_MIN_BLOCKS per SM by registers; blocks walk the tiles
//            grid-stride, one tile at a time; warp w takes the 128-input groups w, w + 8, ... and keeps its next
//            groups in flight; the 8 warps' partial sums meet in shared memory and 16/R threads run the epilogue.
//            The first weight requests go out before the PDL wait (no kernel writes weights).
#pragma once
#include "gemv_epilogue.cuh"
#include "gemv_prologue.cuh"

// The ring form's path per weight format, each the faster of the two on the measured shapes (the host mirrors the
// constants in atomflow_bench/gpu/ops/gemv.py):
//   fp8:  weights through a per-warp shared-memory ring (gemv_tiled_async), NS groups of 2 KB in flight; one kernel
//         per ring depth NS (named ..._r<NS>: ops/gemv.py GEMV_RING_DEPTHS), picked per launch by the host plan
//         (ops/gemv.py gemv_plan), which sizes the dynamic shared memory for that depth;
//   fp16: weights through registers (gemv_tiled), GEMV_LOADS_F16 16-byte loads per lane per batch: for fp16 this
//         measured faster than the ring.
// Both: <= 128 registers, so that 2 blocks fit an SM (the fp8 kernels use ~55, so 3 fit where the shared memory does).
#define GEMV_MIN_BLOCKS 2   // resident blocks per SM the register budget is planned for (ops/gemv.py GEMV_MIN_BLOCKS)
// 16-byte weight loads in flight per lane per batch on the register path: the fastest value measured; a multiple of
// 8 (a 128-input group is 8 loads), and its 96 registers fit the 128-register budget.
#define GEMV_LOADS_F16 24

// The tiled GEMVs' bulk weight and scale copies (the fp8 ring on sm_90+, the warp-specialised form) carry an L2
// evict-first policy: the weights stream through L2 once per step, so they are evicted before anything that is read
// again: what next_weights_l2 asked in, the KV cache and the activations. Without it the L2 prefetch of later weights
// measured slower.
#if AF_HAS_BULK
__device__ __forceinline__ void gemv_w_copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  bulk_g2s_hint(dst, src, bytes, bar, l2_evict_first());
}
#endif

// The mma(s) of one 512-byte unit u (16 rows x KU inputs) for lane quad t: fp16 one k-tile, fp8 two.
template <bool FP8>
__device__ __forceinline__ void unit_mma(float (&d)[4], uint4 w, const __half* xs, int u, int t) {
  if (FP8) {
    const uint4 xv = *reinterpret_cast<const uint4*>(xs + u * 32 + t * 8);
    mma_16816(d, e4m3x2_to_h2(w.x & 0xffffu), e4m3x2_to_h2(w.x >> 16), e4m3x2_to_h2(w.y & 0xffffu),
              e4m3x2_to_h2(w.y >> 16), xv.x, xv.y);
    mma_16816(d, e4m3x2_to_h2(w.z & 0xffffu), e4m3x2_to_h2(w.z >> 16), e4m3x2_to_h2(w.w & 0xffffu),
              e4m3x2_to_h2(w.w >> 16), xv.z, xv.w);
  } else {
    const uint2 xv = *reinterpret_cast<const uint2*>(xs + (u >> 1) * 32 + t * 8 + (u & 1) * 4);
    mma_16816(d, w.x, w.y, w.z, w.w, xv.x, xv.y);
  }
}

// One 128-input group G of a tile: the mmas of its units (unit(j) = the lane's 16 bytes of unit G*UPG + j)
// into d; fp8: d times the group's per-row scales (rows g, g + 8) is added to acc and d restarts. fp16 keeps
// accumulating in d (gemv_tiled_finish).
template <bool FP8, int UPG, class Unit>
__device__ __forceinline__ void group_mma(float (&d)[4], float (&acc)[2], Unit unit, const __half* xs, int G,
                                          int nunits, int t, float2 sc) {
#pragma unroll
  for (int j = 0; j < UPG; ++j)
    if (G * UPG + j < nunits) unit_mma<FP8>(d, unit(j), xs, G * UPG + j, t);
  if (FP8) {
    acc[0] = fmaf(d[0], sc.x, acc[0]);
    acc[1] = fmaf(d[2], sc.y, acc[1]);
    d[0] = d[1] = d[2] = d[3] = 0.f;
  }
}

// A tile's sums for rows g and g + 8 once all of the warp's groups are in: fp16 sums live in d.
template <bool FP8>
__device__ __forceinline__ void gemv_tiled_finish(const float (&d)[4], float (&acc)[2]) {
  if (!FP8) {
    acc[0] = d[0];
    acc[1] = d[2];
  }
}

// The 8 warps' partial sums of tile T meet in shared memory (`part`: [nw][16], double-buffered by the caller:
// the next tile writes the other half, so one __syncthreads per tile suffices); 16/R threads run the epilogue.
template <int R, int EPI, int NT = 0>
__device__ __forceinline__ void tile_epilogue(const GemvArgs& a, const RopeArgs& rope, float* part, int T,
                                              const float (&acc)[2], const EpiOperand& pre, const TpArgs& tp) {
  const int lane = threadIdx.x % AF_WARP, warp = threadIdx.x / AF_WARP, nw = nthreads<NT>() / AF_WARP;
  if ((lane & 3) == 0) {  // rows g and g + 8 (all 8 mma columns are equal; quad lane 0 holds column 0)
    part[warp * GEMV_TILE + (lane >> 2)] = acc[0];
    part[warp * GEMV_TILE + (lane >> 2) + 8] = acc[1];
  }
  sync_n<NT>();
  if (threadIdx.x < GEMV_TILE / R) {
    const int r = threadIdx.x;
    float s0 = 0.f, s1 = 0.f;
    for (int w = 0; w < nw; ++w) {
      s0 += part[w * GEMV_TILE + r];
      if (R == 2) s1 += part[w * GEMV_TILE + r + 8];
    }
    gemv_epilogue<EPI>(a, rope, T * (GEMV_TILE / R) + r, s0, R == 2 ? s1 : s0, pre, T == (int)blockIdx.x, tp);
  }
}

// fp16 weights through registers: each lane's loads of a batch (GEMV_LOADS_F16 x 16 bytes) are in flight at once.
template <int PRO, int EPI, class Sync>
__device__ __forceinline__ void gemv_tiled(const GemvArgs a, const RopeArgs rope, const Sync sync,
                                           unsigned char* smem_raw, const TpArgs tp = TpArgs{}) {
  constexpr int R = (EPI == EPI_SWIGLU || EPI == EPI_ROPE) ? 2 : 1;  // weight rows per output
  constexpr int KU = 16;                                              // inputs per unit (lane: 16 bytes)
  constexpr int UPG = 128 / KU;                                       // units per group of 128 inputs
  constexpr int LOADS = GEMV_LOADS_F16;                               // 16-byte loads per lane per batch
  constexpr int GPB = LOADS / UPG;                                    // groups per batch of loads
  const int K = a.K;
  const int lane = threadIdx.x % AF_WARP, warp = threadIdx.x / AF_WARP, nw = blockDim.x / AF_WARP;
  const int t = lane & 3;
  const int nunits = K / KU, ngroups = (K + 127) >> 7;
  const int ntiles = a.n_out * R / GEMV_TILE;
  const int nb = warp < ngroups ? ((ngroups - warp + nw - 1) / nw + GPB - 1) / GPB : 0;  // batches per tile
  const int tile_bytes = nunits * 512;  // < 2^31 for K < 2^21
  __half* xs = reinterpret_cast<__half*>(smem_raw);
  float* red = reinterpret_cast<float*>(smem_raw + K * sizeof(__half));  // [2][nw][16] partial sums
  float* rs = red + 2 * nw * GEMV_TILE;                                   // block_sum scratch (32 floats)
  float* hs = rs + 32;                                                    // PRO_NORM: h (fp32 [K]), then
  __half* nws = reinterpret_cast<__half*>(hs + K);                        // norm_w (fp16 [K]) (ops/gemv.py gemv_plan)

  uint4 wv[LOADS];
  // Batch b of tile T: this warp's groups warp + (b*GPB + q)*nw, q < GPB.
  const unsigned char* wbase = a.W + (size_t)warp * UPG * 512 + lane * 16;  // this lane's bytes of unit warp*UPG
  auto load = [&](int T, int b) {
#pragma unroll
    for (int q = 0; q < GPB; ++q) {
      const int G = warp + (b * GPB + q) * nw;
      const unsigned char* src = wbase + (size_t)T * tile_bytes + (size_t)(b * GPB + q) * nw * UPG * 512;
#pragma unroll
      for (int j = 0; j < UPG; ++j)
        wv[q * UPG + j] = (G < ngroups && G * UPG + j < nunits) ? ld_stream(src + j * 512) : make_uint4(0, 0, 0, 0);
    }
  };

  int T = blockIdx.x;
  if (T < ntiles && nb > 0) load(T, 0);
  const EpiOperand pre = epilogue_operand<EPI, R>(a, rope, T);  // the first tile's, before the wait
  if (PRO == PRO_NORM) stage_norm_w_async(a, nws);
  gemv_arrive_wait<EPI>(sync);  // weights above may be read early; x / h / pos only once the previous kernel is done
  stage_x_tiled<PRO, STAGE_SMEM>(a, xs, rs, hs, nws, NormRegs{});
  AF_TL_MARK(0);  // timeline: x staged (prologue done)

  for (int parity = 0; T < ntiles; T += gridDim.x, parity ^= 1) {
    float acc[2] = {0.f, 0.f}, d[4] = {0.f, 0.f, 0.f, 0.f};
    for (int b = 0; b < nb; ++b) {
      if (b > 0) load(T, b);
#pragma unroll
      for (int q = 0; q < GPB; ++q) {
        const int G = warp + (b * GPB + q) * nw;
        if (G < ngroups)
          group_mma<false, UPG>(d, acc, [&](int j) { return wv[q * UPG + j]; }, xs, G, nunits, t,
                                make_float2(0.f, 0.f));
      }
    }
    gemv_tiled_finish<false>(d, acc);
    AF_TL_MARK(1);  // timeline: the (last) tile's dot products done
    if (nb > 0 && T + (int)gridDim.x < ntiles) load(T + gridDim.x, 0);  // next tile's loads fly during the sum
    tile_epilogue<R, EPI>(a, rope, red + parity * nw * GEMV_TILE, T, acc, pre, tp);
  }
  tp_sum_finish<EPI>(a, tp, pre);
  AF_TL_MARK(2);  // timeline: epilogue done
}

// The same GEMV for fp8 weights, streamed through shared memory: every warp keeps NS of its 128-input groups
// in flight in a private ring, across tile boundaries and through each tile's reduction; the first NS groups are
// requested before the wait for the previous kernel. Registers do not bound the bytes in flight.
// Two ways to fill the ring (the same ring and shared-memory plan):
//   GEMV_BULK (sm_90+, default): lane 0 copies a group's 2 KB of weights and 64 bytes of scales with two bulk
//     copies (`cp.async.bulk`, the copy engine; a group is contiguous in the tiled layout) that complete on the
//     slot's mbarrier; the lanes wait for the slot's phase and __syncwarp before lane 0 refills it. Why: the SM's
//     load path stays free for the activations read after the wait.
//     Ring: [warp][stage][unit][lane] 16 B, scales + mbarrier [warp][stage] 256 B (64 B scales, 8 B barrier).
//   cp.async (GEMV_BULK=0, and below sm_90): each lane copies its own 16-byte fragments of the group (4 x 16 B)
//     and its scale pair; it reads back only what it copied, so no barrier guards the ring.
//     Ring: [warp][stage][unit][lane] 16 B, scales [warp][stage][lane] 8 B.
#ifndef GEMV_BULK
#define GEMV_BULK 1
#endif
#if GEMV_BULK && AF_HAS_BULK
#define GEMV_RING_BULK 1
#else
#define GEMV_RING_BULK 0
#endif
template <int PRO, int EPI, int NS, class Sync>
__device__ __forceinline__ void gemv_tiled_async(const GemvArgs a, const RopeArgs rope, const Sync sync,
                                                 unsigned char* smem_raw, const TpArgs tp = TpArgs{}) {
  constexpr int R = (EPI == EPI_SWIGLU || EPI == EPI_ROPE) ? 2 : 1;
  constexpr int KU = 32, UPG = 128 / KU;  // a ring slot: one group of 128 inputs, 2 KB per warp (+ its scales)
  constexpr int SLOT = UPG * 512, SSLOT = AF_WARP * 8;  // bytes of a warp's slot: weights, scales area
  const int K = a.K;
  const int lane = threadIdx.x % AF_WARP, warp = threadIdx.x / AF_WARP, nw = blockDim.x / AF_WARP;
  const int t = lane & 3, g = lane >> 2;
  const int nunits = K / KU, ngroups = (K + 127) >> 7;
  const int ntiles = a.n_out * R / GEMV_TILE;
  const int my_groups = warp < ngroups ? (ngroups - warp + nw - 1) / nw : 0;  // per tile
  const int my_tiles = blockIdx.x < ntiles ? (ntiles - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  const int total = my_groups * my_tiles;
  const int tile_bytes = nunits * 512;
  __half* xs = reinterpret_cast<__half*>(smem_raw);
  float* red = reinterpret_cast<float*>(smem_raw + K * sizeof(__half));
  float* rs = red + 2 * nw * GEMV_TILE;
  unsigned char* wring = reinterpret_cast<unsigned char*>(rs + 32) + (size_t)warp * NS * SLOT;  // this warp's slots
  unsigned char* sarea = reinterpret_cast<unsigned char*>(rs + 32) + (size_t)nw * NS * SLOT + (size_t)warp * NS * SSLOT;
  // Group n of this warp's sequence: tile blockIdx.x + (n / my_groups) * gridDim.x, group warp + (n % my_groups) * nw.
  auto tile_of = [&](int n) { return (int)blockIdx.x + (n / my_groups) * (int)gridDim.x; };
  auto group_of = [&](int n) { return warp + (n % my_groups) * nw; };
#if GEMV_RING_BULK
  auto bar = [&](int slot) { return reinterpret_cast<unsigned long long*>(sarea + slot * SSLOT + 64); };
  if (lane == 0) {
    for (int s = 0; s < NS; ++s) mbar_init(bar(s), 1);
    mbar_init_fence();
  }
  __syncwarp();
  auto issue = [&](int n) {  // lane 0: the group's weights and scales into slot n % NS
    if (lane == 0 && n < total) {
      const int T = tile_of(n), G = group_of(n), slot = n % NS;
      const unsigned wbytes = (unsigned)min(UPG, nunits - G * UPG) * 512u;  // the last group may be short
      mbar_expect_tx(bar(slot), wbytes + (AF_NO_SCALES ? 0u : 64u));
      gemv_w_copy(wring + slot * SLOT, a.W + (size_t)T * tile_bytes + (size_t)G * SLOT, wbytes, bar(slot));
      if (!AF_NO_SCALES) gemv_w_copy(sarea + slot * SSLOT, a.scales + ((size_t)T * ngroups + G) * 16, 64u, bar(slot));
    }
  };
  auto ready = [&](int n) { mbar_wait(bar(n % NS), (unsigned)(n / NS) & 1u); };
  auto scale = [&](int n) { return reinterpret_cast<const float2*>(sarea + (n % NS) * SSLOT)[g]; };
  auto release = [&]() { __syncwarp(); };  // every lane has read the slot before lane 0 refills it
#else
  auto issue = [&](int n) {  // every lane: its fragments of the group and its scale pair into slot n % NS
    if (n < total) {
      const int T = tile_of(n), G = group_of(n);
      const unsigned char* src = a.W + (size_t)T * tile_bytes + (size_t)G * SLOT + lane * 16;
      unsigned char* dst = wring + (n % NS) * SLOT + lane * 16;
#pragma unroll
      for (int j = 0; j < UPG; ++j)
        if (G * UPG + j < nunits) cp_async16(dst + j * 512, src + j * 512);
      cp_async8(sarea + (n % NS) * SSLOT + lane * 8,
                reinterpret_cast<const float2*>(a.scales) + ((size_t)T * ngroups + G) * 8 + g);
    }
    cp_async_commit();  // always one group per call: wait_group counts stay uniform
  };
  auto ready = [&](int) { cp_async_wait<NS - 1>(); };  // this lane's copies of group n have landed
  auto scale = [&](int n) { return reinterpret_cast<const float2*>(sarea + (n % NS) * SSLOT)[lane]; };
  auto release = [&]() {};  // a lane refills only what it read itself: program order protects it
#endif

#pragma unroll
  for (int n = 0; n < NS; ++n) issue(n);
  const EpiOperand pre = epilogue_operand<EPI, R>(a, rope, blockIdx.x);  // the first tile's, before the wait
  const NormRegs nr = norm_w_regs<PRO>(a);  // PRO_NORM: norm_w before the wait
  gemv_arrive_wait<EPI>(sync);  // weights above may be read early; x / h / pos only once the previous kernel is done
  stage_x_tiled<PRO, STAGE_REGS>(a, xs, rs, nullptr, nullptr, nr);
  AF_TL_MARK(0);  // timeline: x staged (prologue done)

  int n = 0;
  for (int T = blockIdx.x, parity = 0; T < ntiles; T += gridDim.x, parity ^= 1) {
    float acc[2] = {0.f, 0.f}, d[4] = {0.f, 0.f, 0.f, 0.f};
    for (int gi = 0; gi < my_groups; ++gi, ++n) {
      ready(n);
      const unsigned char* src = wring + (n % NS) * SLOT + lane * 16;
      group_mma<true, UPG>(d, acc, [&](int j) { return *reinterpret_cast<const uint4*>(src + j * 512); }, xs,
                           warp + gi * nw, nunits, t, scale(n));
      release();
      issue(n + NS);  // the slot just read is refilled
    }
    gemv_tiled_finish<true>(d, acc);
    AF_TL_MARK(1);  // timeline: the (last) tile's dot products done
    tile_epilogue<R, EPI>(a, rope, red + parity * nw * GEMV_TILE, T, acc, pre, tp);
  }
  tp_sum_finish<EPI>(a, tp, pre);
  next_weights_l2<EPI>(rope, threadIdx.x == 0);
  AF_TL_MARK(2);  // timeline: epilogue done
#if !GEMV_RING_BULK
  cp_async_wait<0>();
#endif
}

// The kernel instances, each named in full by the .cu that spells it (ops/gemv.py KERNELS lists the same names).
// fp16 layer GEMVs: the register path.
#define GEMV_INSTANCE(NAME, PRO, EPI)                                                                     \
  extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_BLOCKS)                            \
  NAME(GEMV_PARAMS) {                                                                                     \
    AF_TIMELINE_BLOCK;                                                                                    \
    extern __shared__ __align__(16) unsigned char smem_raw[];                                             \
    gemv_tiled<PRO, EPI>(GemvArgs{W, scales, x, norm_w, eps, y, n_out, K}, RopeArgs{}, PdlSync{},   \
                                smem_raw);                                                                \
  }

// fp16 EPI_TPSUM, the register path.
#define GEMV_TP_INSTANCE(NAME)                                                                            \
  extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_BLOCKS)                            \
  NAME(GEMV_PARAMS, GEMV_TP_PARAMS) {                                                                     \
    AF_TIMELINE_BLOCK;                                                                                    \
    extern __shared__ __align__(16) unsigned char smem_raw[];                                             \
    gemv_tiled<PRO_PLAIN, EPI_TPSUM>(GemvArgs{W, scales, x, norm_w, eps, y, n_out, K}, RopeArgs{}, PdlSync{}, \
                                     smem_raw, GEMV_TP_ARGS_OF);                                          \
  }

// fp8 layer GEMVs: the ring at depth NS, one kernel per depth the host plan may pick (NAME ends in _r<NS>).
#define GEMV_RING_INSTANCE(NAME, PRO, EPI, NS)                                                            \
  extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_BLOCKS)                            \
  NAME(GEMV_PARAMS) {                                                                                     \
    AF_TIMELINE_BLOCK;                                                                                    \
    extern __shared__ __align__(16) unsigned char smem_raw[];                                             \
    gemv_tiled_async<PRO, EPI, NS>(GemvArgs{W, scales, x, norm_w, eps, y, n_out, K}, RopeArgs{},     \
                                         PdlSync{}, smem_raw);                                            \
  }

// fp8 EPI_TPSUM at ring depth NS.
#define GEMV_TP_RING_INSTANCE(NAME, NS)                                                                   \
  extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_BLOCKS)                            \
  NAME(GEMV_PARAMS, GEMV_TP_PARAMS) {                                                                     \
    AF_TIMELINE_BLOCK;                                                                                    \
    extern __shared__ __align__(16) unsigned char smem_raw[];                                             \
    gemv_tiled_async<PRO_PLAIN, EPI_TPSUM, NS>(GemvArgs{W, scales, x, norm_w, eps, y, n_out, K}, RopeArgs{}, \
                                               PdlSync{}, smem_raw, GEMV_TP_ARGS_OF);                     \
  }

// The QKV projection with RoPE and the KV-cache append in its epilogue: fp16 through registers, or fp8 at ring
// depth NS.
#define GEMV_ROPE_CALL(PATH)                                                                              \
  {                                                                                                       \
    AF_TIMELINE_BLOCK;                                                                                    \
    extern __shared__ __align__(16) unsigned char smem_raw[];                                             \
    PATH(GemvArgs{W, scales, x, norm_w, eps, y, n_out, K},                                                \
         GEMV_ROPE_ARGS_OF, PdlSync{}, smem_raw);                                                         \
  }
#define GEMV_ROPE_INSTANCE(NAME)                                                                          \
  extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_BLOCKS) NAME GEMV_ROPE_ARGS        \
  GEMV_ROPE_CALL((gemv_tiled<PRO_NORM, EPI_ROPE>))
#define GEMV_ROPE_RING_INSTANCE(NAME, NS)                                                                 \
  extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_BLOCKS) NAME GEMV_ROPE_ARGS        \
  GEMV_ROPE_CALL((gemv_tiled_async<PRO_NORM, EPI_ROPE, NS>))
