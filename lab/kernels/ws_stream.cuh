// ws_stream.cuh — the warp-specialised GEMV's ring as functions a kernel can call op after op (the lab's persistent
// step, decode_persist.cu): the producer's copies of one GEMV's tiles and the consumers' dot products and epilogues,
// each continuing a running slot count. The same slots, barriers and sums as kernels_cu/gemv_ws.cuh.
//
// Computes   y = W . x per GEMV, as gemv_ws.cuh.
// Layouts    as gemv_ws.cuh (tiled weights, 16 KB slots, full/empty mbarriers).
// Bytes      as gemv_ws.cuh.
// Launch     inside a kernel of GEMV_THREADS consumers + one producer warp (sm_90+).
#pragma once
#include "../../kernels_cu/gemv_ws.cuh"

#if AF_HAS_BULK
// The ring as the producer and the consumers of a block share it: NS slots of SLOTB bytes (weights, then fp8 scales),
// each with a `full` mbarrier (the producer's bulk copies landed) and an `empty` one (the 8 consumer warps read it).
// Both sides walk one running slot count `n` (slot n % NS, phase n / NS), so a kernel may stream several GEMVs through
// one ring back to back: the persistent step (decode_persist.cu), each side continuing from the count the last one
// returned. The product's gemv_tiled_ws (kernels_cu/gemv_ws.cuh) runs the same loops for one GEMV in its own body:
// built on these functions its kernels measured 0.7% slower (3B fp16, H200, two interleaved rounds: PERF_NOTES v48).
struct WsRing {
  unsigned char* slots;
  unsigned long long* full;
  unsigned long long* empty;
  int NS;
};

// The ws form's shape constants for a format.
template <bool FP8>
struct WsShape {
  static constexpr int KU = FP8 ? 32 : 16, UPG = 128 / KU;             // inputs per 512-byte unit, units per group
  static constexpr int GPS = GEMV_WS_SLOT / (UPG * 512);               // groups per slot: fp8 8, fp16 4
  static constexpr int SLOTB = GEMV_WS_SLOT + (FP8 ? GPS * 64 : 0);    // a slot's bytes (fp8: + the groups' scales)
  // slots per 16-row tile of K inputs (the split mode's units per tile): its 128-input groups, GPS a slot
  static __device__ __forceinline__ int parts(int K) { return (((K + 127) >> 7) + GPS - 1) / GPS; }
};

// Lane 0 of the producer: part `part` of tile T of a GEMV (its groups [g0, g1)) into ring slot n % NS, once the
// consumers have released that slot's previous use.
template <bool FP8>
__device__ __forceinline__ void ws_fill(const WsRing& r, const unsigned char* W, const float* scales, int K, int T,
                                        int part, int n) {
  using S = WsShape<FP8>;
  const int nunits = K / S::KU, ngroups = (K + 127) >> 7;
  const int slot = n % r.NS;
  if (n >= r.NS) mbar_wait(r.empty + slot, (unsigned)(n / r.NS - 1) & 1u);
  const int g0 = part * S::GPS, g1 = min(ngroups, g0 + S::GPS);
  const int u0 = g0 * S::UPG, u1 = min(nunits, g1 * S::UPG);  // the last group of a tile may be short
  const unsigned wbytes = (unsigned)(u1 - u0) * 512u;
  const unsigned sbytes = FP8 && !AF_NO_SCALES ? (unsigned)(g1 - g0) * 64u : 0u;
  unsigned char* dst = r.slots + (size_t)slot * S::SLOTB;
  mbar_expect_tx(r.full + slot, wbytes + sbytes);
  gemv_w_copy(dst, W + (size_t)T * nunits * 512 + (size_t)u0 * 512, wbytes, r.full + slot);
  if (FP8 && !AF_NO_SCALES)
    gemv_w_copy(dst + GEMV_WS_SLOT, scales + ((size_t)T * ngroups + g0) * 16, sbytes, r.full + slot);
}

// Lane 0 of the producer warp: the block's tiles of one GEMV (tile blockIdx.x + i * gridDim.x, in order, each a
// contiguous run of groups) into the ring from slot count n; returns the count after them. It never waits for the
// data the GEMV reads, only for free slots.
template <bool FP8>
__device__ __forceinline__ int ws_produce(const WsRing& r, const unsigned char* W, const float* scales, int K,
                                          int ntiles, int n) {
  using S = WsShape<FP8>;
  const int spt = S::parts(K);
  for (int T = blockIdx.x; T < ntiles; T += gridDim.x)
    for (int p = 0; p < spt; ++p) ws_fill<FP8>(r, W, scales, K, T, p, n++);
  return n;
}

// The producer's marker at slot count n: a slot with meta -1 and no bytes, which ends a GEMV for the consumers.
__device__ __forceinline__ int ws_mark_end(const WsRing& r, int n, int* meta) {
  const int slot = n % r.NS;
  if (n >= r.NS) mbar_wait(r.empty + slot, (unsigned)(n / r.NS - 1) & 1u);
  meta[slot] = -1;
  mbar_arrive(r.full + slot);
  return n + 1;
}

// The same with the tiles taken dynamically: each from the GEMV's counter `grab` (shared by the grid, zero before
// the GEMV), so a block that is ahead takes more of them (the v32 probe: static shares end every op with its slowest
// block). A slot's tile goes to the consumers in `meta` [slot]; after the last tile a marker slot (meta -1, no bytes)
// ends the GEMV for them. The next tile is asked for while the current one's last part is issued.
template <bool FP8>
__device__ __forceinline__ int ws_produce_dyn(const WsRing& r, const unsigned char* W, const float* scales, int K,
                                              int ntiles, int n, unsigned* grab, int* meta) {
  using S = WsShape<FP8>;
  const int spt = S::parts(K);
  int T = (int)atomicAdd(grab, 1u);
  while (T < ntiles) {
    int next = ntiles;
    for (int p = 0; p < spt; ++p) {
      if (p == spt - 1) next = (int)atomicAdd(grab, 1u);
      const int slot = n % r.NS;
      if (n >= r.NS) mbar_wait(r.empty + slot, (unsigned)(n / r.NS - 1) & 1u);
      meta[slot] = T;
      ws_fill<FP8>(r, W, scales, K, T, p, n++);
    }
    T = next;
  }
  return ws_mark_end(r, n, meta);
}

// The same with split-K units of one slot each (16 KB of weights): unit u = part u % spt of tile u / spt, taken from
// the GEMV's counter `grab` in that order, so the parts of a tile go out close together. The next unit is asked for
// before this one's slot is waited for and its copies issued: the atomic's round trip runs under the slot's wait
// (a grab asked only when needed put one round trip in front of every copy: PERF_NOTES v48.1). Units as grain: an op
// ends within one 16 KB unit on every block (v32.7: 48 KB grabs cost ~2 us more per op). A unit goes to the
// consumers in `meta` [slot]; a marker slot (meta -1, no bytes) ends the GEMV.
template <bool FP8>
__device__ __forceinline__ int ws_produce_split(const WsRing& r, const unsigned char* W, const float* scales, int K,
                                                int ntiles, int n, unsigned* grab, int* meta) {
  using S = WsShape<FP8>;
  const int spt = S::parts(K);
  const int nu = ntiles * spt;
  int u = (int)atomicAdd(grab, 1u);
  while (u < nu) {
    const int next = (int)atomicAdd(grab, 1u);  // used at the next turn: its round trip runs under this one's
    const int slot = n % r.NS;
    if (n >= r.NS) mbar_wait(r.empty + slot, (unsigned)(n / r.NS - 1) & 1u);
    meta[slot] = u;
    ws_fill<FP8>(r, W, scales, K, u / spt, u % spt, n++);
    u = next;
  }
  return ws_mark_end(r, n, meta);
}

// The 8 consumer warps: tile T's slots from slot count n, its sums into acc (fp8: scaled per group). In every slot a
// warp takes the group it owns (group g belongs to warp g % 8, as in the ring form), then releases the slot.
template <bool FP8>
__device__ __forceinline__ int ws_tile(const WsRing& r, const __half* xs, int K, int n, float (&acc)[2]) {
  using S = WsShape<FP8>;
  constexpr int NWC = GEMV_THREADS / AF_WARP;
  static_assert(NWC == 8 && S::GPS <= NWC && NWC % S::GPS == 0, "a slot holds at most one group per consumer warp");
  const int lane = threadIdx.x % AF_WARP, warp = threadIdx.x / AF_WARP, t = lane & 3;
  const int nunits = K / S::KU, ngroups = (K + 127) >> 7, spt = S::parts(K);
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  acc[0] = acc[1] = 0.f;
  for (int p = 0; p < spt; ++p, ++n) {
    const int slot = n % r.NS;
    const int g0 = p * S::GPS, off = (warp - g0) & (NWC - 1), G = g0 + off;  // this warp's group in the slot
    mbar_wait(r.full + slot, (unsigned)(n / r.NS) & 1u);
    if (off < S::GPS && G < ngroups)
      ws_slot_mma<FP8, S::UPG>(d, acc, r.slots + (size_t)slot * S::SLOTB, off, G, xs, nunits, lane, t);
    __syncwarp();  // every lane has read the slot
    if (lane == 0) mbar_arrive(r.empty + slot);
  }
  gemv_tiled_finish<FP8>(d, acc);
  return n;
}

// The consumers' side of ws_produce: the block's tiles of one GEMV from slot count n (x staged in xs, `pre` tile
// blockIdx.x's epilogue operand), each tile's epilogue run (red: [2][8][16] partial sums); returns the count after.
template <bool FP8, int R, int EPI>
__device__ __forceinline__ int ws_consume(const WsRing& r, const GemvArgs& a, const RopeArgs& rope, float* red,
                                          const __half* xs, int n, const EpiOperand& pre, const TpArgs& tp) {
  constexpr int NWC = GEMV_THREADS / AF_WARP;
  const int ntiles = a.n_out * R / GEMV_TILE;
  for (int T = blockIdx.x, parity = 0; T < ntiles; T += gridDim.x, parity ^= 1) {
    float acc[2];
    n = ws_tile<FP8>(r, xs, a.K, n, acc);
    tile_epilogue<R, EPI, GEMV_THREADS>(a, rope, red + parity * NWC * GEMV_TILE, T, acc, pre, tp);
  }
  return n;
}

// The consumers' side of ws_produce_dyn: tiles as `meta` names them until the marker (`pre` is still tile
// blockIdx.x's operand: tile_epilogue uses it for that tile only, whenever it comes).
template <bool FP8, int R, int EPI>
__device__ __forceinline__ int ws_consume_dyn(const WsRing& r, const GemvArgs& a, const RopeArgs& rope, float* red,
                                              const __half* xs, int n, const EpiOperand& pre, const TpArgs& tp,
                                              const int* meta) {
  constexpr int NWC = GEMV_THREADS / AF_WARP;
  const int lane = threadIdx.x % AF_WARP;
  for (int parity = 0;; parity ^= 1) {
    const int slot = n % r.NS;
    mbar_wait(r.full + slot, (unsigned)(n / r.NS) & 1u);
    const int T = meta[slot];
    if (T < 0) {  // the marker: released like any slot
      __syncwarp();
      if (lane == 0) mbar_arrive(r.empty + slot);
      return n + 1;
    }
    float acc[2];
    n = ws_tile<FP8>(r, xs, a.K, n, acc);
    tile_epilogue<R, EPI, GEMV_THREADS>(a, rope, red + parity * NWC * GEMV_TILE, T, acc, pre, tp);
  }
}

// The fixed part of the ws form's shared memory: xs [K] fp16 | partial sums [2][8][16] f32 | block_sum scratch [32] f32
// | full [GEMV_WS_MAX], empty [GEMV_WS_MAX], go [2] u64; then the ring, 128-byte aligned. From the barriers at
// `bars` on: sets them up (thread 0; the caller's block-wide barrier publishes them) and returns the ring of as many
// slots as fit before `smem_end` (the dynamic shared memory's size; at most GEMV_WS_MAX).
template <bool FP8>
__device__ __forceinline__ WsRing ws_ring_setup(unsigned char* bars, unsigned smem_end, unsigned char* smem_raw) {
  unsigned long long* full = reinterpret_cast<unsigned long long*>(bars);
  unsigned long long* empty = full + GEMV_WS_MAX;
  unsigned char* ring = reinterpret_cast<unsigned char*>(empty + GEMV_WS_MAX + 2);
  ring += (128u - ((unsigned)__cvta_generic_to_shared(ring) & 127u)) & 127u;  // slots 128-byte aligned (host: +128)
  const int NS = min(GEMV_WS_MAX, (int)((smem_end - (unsigned)(ring - smem_raw)) / WsShape<FP8>::SLOTB));
  if (threadIdx.x == 0) {
    for (int s = 0; s < NS; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, GEMV_THREADS / AF_WARP);
    }
    mbar_init(empty + GEMV_WS_MAX, 1);  // `go` (gemv_tiled_ws)
    mbar_init_fence();
  }
  return WsRing{ring, full, empty, NS};
}

#endif

