// gemv_ws.cuh — the warp-specialised form of the tiled GEMVs (sm_90+, forms.GemvForm "ws"): a producer warp streams
// the block's weights into a ring of 16 KB shared-memory slots with bulk copies, 8 consumer warps do the mmas.
//
// Computes   the same y = W · x and epilogues as gemv_tiled.cuh (the same mma pieces, the same order of sums).
// Layouts    W and the fp8 scales TILED (gemv_tiled.cuh). Shared memory: xs [K] fp16 | partial sums [2][8][16] f32 |
//            block_sum scratch [32] f32 | full [GEMV_WS_MAX], empty [GEMV_WS_MAX], go [2] u64 | up to 127 bytes of
//            padding | ring [NS][slot], 128-byte aligned (GEMV_WS_SLOT bytes of weights, then the fp8 scales
//            [8 groups][8][2] f32).
// Bytes      as gemv_tiled.cuh: the weights (+ scales) once, x per block.
// Launch     block = GEMV_WS_THREADS (288: 8 consumer warps + 1 producer), 2-3 blocks per SM; dynamic shared memory
//            = the fixed part + NS slots (ops/gemv.py gemv_ws_plan); the kernel reads NS back from its dynamic shared
//            memory size. Declared for every architecture, built only for sm_90+ (below, the body traps).
#pragma once
#include "gemv_tiled.cuh"

// 8 consumer warps + 1 producer warp. The producer's lane 0 streams the block's weights (its tiles in order, each a
// contiguous run of groups) into a ring of NS slots of GEMV_WS_SLOT bytes (fp8: 8 groups + their 512 B of scales;
// fp16: 4 groups) with bulk copies completing on the slot's `full` mbarrier; it starts at the block's start, never
// waits for the previous kernel (but fills at most npre slots before the consumers have: the `go` mbarrier) and
// refills a slot once the 8 consumer warps have arrived on its `empty` mbarrier. The consumers never issue a weight
// load: they wait for the previous kernel, stage x (named barrier of 256 threads), and in every slot take the group
// they own (group g belongs to warp g % 8, as in the ring form), then release the slot. NS is what the host gave:
// (dynamic shared memory - x - scratch - barriers) / slot (ops/gemv.py gemv_ws_plan), at most GEMV_WS_MAX.
// The ring is 128-byte aligned (the header's shared-memory layout): an unaligned ring measured ~5% slower.
#define GEMV_WS_SLOT 16384  // weight bytes per ring slot
#define GEMV_WS_MAX 16      // most slots a ring may have (barriers reserved for all)
#define GEMV_WS_THREADS (GEMV_THREADS + AF_WARP)
// `npre` (a kernel argument, chosen per launch by the host: ops/gemv.py GEMV_WS_PRE, tuned per shape by the forms):
// slots the producer may fill before the consumers have passed their wait (0: the whole ring). Fewer bytes requested
// before the wait let the previous kernel's completion and this kernel's x loads through sooner: for fp16 a part of
// the ring (3 of 6 slots on 3B, 2 on 1B) measured fastest, for fp8 the whole ring. A block takes whole tiles: split-K
// work units shared between blocks measured slower.
// The warp's group G of a ring slot `s` (it sits at the slot's group `off`: weights, then fp8 scales after
// GEMV_WS_SLOT) into d / acc (group_mma).
template <bool FP8, int UPG>
__device__ __forceinline__ void ws_slot_mma(float (&d)[4], float (&acc)[2], const unsigned char* s, int off, int G,
                                            const __half* xs, int nunits, int lane, int t) {
  const unsigned char* src = s + off * UPG * 512 + lane * 16;
  const float2 sc = FP8 ? reinterpret_cast<const float2*>(s + GEMV_WS_SLOT + off * 64)[lane >> 2] : make_float2(0.f, 0.f);
  group_mma<FP8, UPG>(d, acc, [&](int j) { return *reinterpret_cast<const uint4*>(src + j * 512); }, xs, G, nunits, t,
                      sc);
}
#if AF_HAS_BULK
template <bool FP8, int PRO, int EPI>
__device__ __forceinline__ void gemv_tiled_ws(const GemvArgs a, const RopeArgs rope, unsigned char* smem_raw,
                                              const int npre, const TpArgs tp = TpArgs{}) {
  constexpr int R = (EPI == EPI_SWIGLU || EPI == EPI_ROPE) ? 2 : 1;
  constexpr int NWC = GEMV_THREADS / AF_WARP;                   // consumer warps
  constexpr int KU = FP8 ? 32 : 16, UPG = 128 / KU;            // inputs per 512-byte unit, units per group
  constexpr int GPS = GEMV_WS_SLOT / (UPG * 512);              // groups per slot: fp8 8, fp16 4
  constexpr int SLOTB = GEMV_WS_SLOT + (FP8 ? GPS * 64 : 0);   // a slot's bytes (fp8: + the groups' scales)
  static_assert(NWC == 8 && GPS <= NWC && NWC % GPS == 0, "a slot holds at most one group per consumer warp");
  const int K = a.K;
  const int lane = threadIdx.x % AF_WARP, warp = threadIdx.x / AF_WARP, t = lane & 3;
  const int nunits = K / KU, ngroups = (K + 127) >> 7, spt = (ngroups + GPS - 1) / GPS;  // slots per tile
  const int ntiles = a.n_out * R / GEMV_TILE;
  const int my_tiles = blockIdx.x < ntiles ? (ntiles - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  const int tile_bytes = nunits * 512;
  __half* xs = reinterpret_cast<__half*>(smem_raw);
  float* red = reinterpret_cast<float*>(smem_raw + K * sizeof(__half));
  float* rs = red + 2 * NWC * GEMV_TILE;
  unsigned long long* full = reinterpret_cast<unsigned long long*>(rs + 32);
  unsigned long long* empty = full + GEMV_WS_MAX;
  unsigned long long* go = empty + GEMV_WS_MAX;  // one arrival: the consumers passed their wait (npre)
  unsigned char* ring = reinterpret_cast<unsigned char*>(go + 2);
  ring += (128u - ((unsigned)__cvta_generic_to_shared(ring) & 127u)) & 127u;  // slots 128-byte aligned (host: +128)
  unsigned dsmem;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dsmem));
  const int NS = min(GEMV_WS_MAX, (int)((dsmem - (unsigned)(ring - smem_raw)) / SLOTB));
  if (threadIdx.x == 0) {
    for (int s = 0; s < NS; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, NWC);
    }
    mbar_init(go, 1);
    mbar_init_fence();
  }
  __syncthreads();  // the only whole-block barrier: the producer leaves below

  if (warp == NWC) {  // the producer: slot n of the block's stream = tile blockIdx.x + (n / spt) * gridDim.x, part n % spt
    if (lane == 0) {
      const int total = my_tiles * spt;
      auto part = [&](int n, int& T, int& g0, int& g1, int& u0, int& u1) {  // slot n's tile, groups and units
        T = blockIdx.x + (n / spt) * gridDim.x;
        g0 = (n % spt) * GPS;
        g1 = min(ngroups, g0 + GPS);
        u0 = g0 * UPG;
        u1 = min(nunits, g1 * UPG);  // the last group of a tile may be short
      };
      for (int n = 0; n < total; ++n) {
        const int slot = n % NS;
        if (npre > 0 && n == npre) mbar_wait(go, 0u);  // the rest once the consumers passed their wait
        if (n >= NS) mbar_wait(empty + slot, (unsigned)(n / NS - 1) & 1u);
        int T, g0, g1, u0, u1;
        part(n, T, g0, g1, u0, u1);
        const unsigned wbytes = (unsigned)(u1 - u0) * 512u;
        const unsigned sbytes = FP8 && !AF_NO_SCALES ? (unsigned)(g1 - g0) * 64u : 0u;
        mbar_expect_tx(full + slot, wbytes + sbytes);
        gemv_w_copy(ring + slot * SLOTB, a.W + (size_t)T * tile_bytes + (size_t)u0 * 512, wbytes, full + slot);
        if (FP8 && !AF_NO_SCALES)
          gemv_w_copy(ring + slot * SLOTB + GEMV_WS_SLOT, a.scales + ((size_t)T * ngroups + g0) * 16, sbytes,
                      full + slot);
      }
    }
    return;
  }

  const EpiOperand pre = epilogue_operand<EPI, R>(a, rope, blockIdx.x);  // the first tile's, before the wait
  const NormRegs nr = norm_w_regs<PRO, GEMV_THREADS>(a);  // PRO_NORM: norm_w before the wait
  gemv_arrive_wait<EPI>(PdlSync{});  // x / h / pos only once the previous kernel is done (weights are the producer's)
  if (npre > 0 && threadIdx.x == 0) mbar_arrive(go);
  stage_x_tiled<PRO, STAGE_REGS, GEMV_THREADS>(a, xs, rs, nullptr, nullptr, nr);
  AF_TL_MARK(0);  // timeline: x staged (prologue done)

  int n = 0;
  for (int T = blockIdx.x, parity = 0; T < ntiles; T += gridDim.x, parity ^= 1) {
    float acc[2] = {0.f, 0.f}, d[4] = {0.f, 0.f, 0.f, 0.f};
    for (int p = 0; p < spt; ++p, ++n) {
      const int slot = n % NS;
      const int g0 = p * GPS, off = (warp - g0) & (NWC - 1), G = g0 + off;  // this warp's group in the slot
      mbar_wait(full + slot, (unsigned)(n / NS) & 1u);
      if (off < GPS && G < ngroups) ws_slot_mma<FP8, UPG>(d, acc, ring + slot * SLOTB, off, G, xs, nunits, lane, t);
      __syncwarp();  // every lane has read the slot
      if (lane == 0) mbar_arrive(empty + slot);
    }
    gemv_tiled_finish<FP8>(d, acc);
    AF_TL_MARK(1);  // timeline: the (last) tile's dot products done
    tile_epilogue<R, EPI, GEMV_THREADS>(a, rope, red + parity * NWC * GEMV_TILE, T, acc, pre, tp);
  }
  tp_sum_finish<EPI>(a, tp, pre);
  next_weights_l2<EPI>(rope, threadIdx.x == 0);
  AF_TL_MARK(2);  // timeline: epilogue done
}
#endif

// The warp-specialised kernels NAME (FP8: fp8 weights + scales, else fp16), 288 threads. Declared for every
// architecture (the host pass needs them), built for sm_90+ only: below, the body traps — the host launches these
// only on sm_90+, for the ws form (gpu/forms.py).
#if AF_HAS_BULK
#define GEMV_WS_BODY(FP8, PRO, EPI, ROPE, TP)                                                             \
  AF_TIMELINE_BLOCK;                                                                                      \
  extern __shared__ __align__(16) unsigned char smem_raw[];                                               \
  gemv_tiled_ws<FP8, PRO, EPI>(GemvArgs{W, scales, x, norm_w, eps, y, n_out, K}, ROPE, smem_raw, npre, TP);
#elif defined(__CUDA_ARCH__)
#define GEMV_WS_BODY(FP8, PRO, EPI, ROPE, TP) __trap();
#else
#define GEMV_WS_BODY(FP8, PRO, EPI, ROPE, TP)
#endif
#define GEMV_WS_PARAMS GEMV_PARAMS, int npre
#define GEMV_WS_INSTANCE(NAME, FP8, PRO, EPI)                                                             \
  extern "C" __global__ void __launch_bounds__(GEMV_WS_THREADS, 3) NAME(GEMV_WS_PARAMS) {                 \
    GEMV_WS_BODY(FP8, PRO, EPI, RopeArgs{}, TpArgs{})                                                     \
  }
#define GEMV_WS_TP_INSTANCE(NAME, FP8)                                                                    \
  extern "C" __global__ void __launch_bounds__(GEMV_WS_THREADS, 3) NAME(GEMV_WS_PARAMS, GEMV_TP_PARAMS) { \
    GEMV_WS_BODY(FP8, PRO_PLAIN, EPI_TPSUM, RopeArgs{}, GEMV_TP_ARGS_OF)                                  \
  }
#define GEMV_WS_ROPE_INSTANCE(NAME, FP8)                                                                  \
  extern "C" __global__ void __launch_bounds__(GEMV_WS_THREADS, 3) NAME(GEMV_ROPE_PARAMS, int npre) {     \
    GEMV_WS_BODY(FP8, PRO_NORM, EPI_ROPE, GEMV_ROPE_ARGS_OF, TpArgs{})                                    \
  }
