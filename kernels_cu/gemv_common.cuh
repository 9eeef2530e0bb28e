// gemv_common.cuh — the GEMV skeletons shared by gemv_fp16.cu and gemv_fp8.cu (M = 1: y = W · x).
//
// Two weight layouts, two skeletons:
//
// TILED (every layer projection: QKV, o_proj, gate/up, down) — tensor cores, weights pre-tiled at load time
//   (atomflow_bench/gpu/ops/gemv.py tile_view). The output rows are grouped into tiles of 16 weight rows (R = 1:
//   16 consecutive outputs; R = 2: rows 0-7 = row 0 of 8 outputs, rows 8-15 = their row 1 — gate and up, or
//   RoPE rows i and i + hd/2). A tile is stored as units of 512 bytes: unit u holds inputs [u*KU, u*KU + KU)
//   of the 16 rows (KU = 16 fp16 or 32 fp8), lane l's 16 bytes being exactly its mma.m16n8k16 A fragments
//   (row l/4 and l/4 + 8, inputs 2(l%4), +1, +8, +9 of each 16-input k-tile; fp8: two k-tiles, dequantised
//   in registers by the hardware fp8x2 -> half2 conversion). fp8 scales: [tile][group of 128][8][2] fp32
//   (rows g, g + 8 adjacent: one 8-byte load per lane and group).
//   A block (8 warps) takes one tile at a time (grid-stride); warp w takes the 128-input groups w, w + 8, ...
//   and keeps its next groups in flight: fp8 through a per-lane cp.async ring in shared memory that runs ahead
//   across tiles (gemv_tiled_async), fp16 through registers in batches (gemv_tiled); x is staged in shared memory in fragment order (one
//   8- or 16-byte load per lane per mma, conflict-free) and is broadcast to all 8 mma columns (column 0 is
//   the result; the others are free work on an otherwise idle unit). fp8: each group's mma sum is scaled in
//   fp32. The 8 warps' partial sums meet in shared memory; 16/R threads run the epilogue.
//   Why: the scalar fp32 dot product cost ~60 instructions per 16-byte fp8 chunk (~25 for fp16) and the
//   fp8 GEMVs ran behind their byte rate (docs/PERF_NOTES.md v1, v7); an mma does 16x16 weights in one.
//   Requires rows % 16 == 0 and K % 32 == 0 (the host refuses other shapes); K % 128 may be non-zero (the
//   last group is short: SmolLM2 K = 576).
//
// ROWS (lm_head, fp16 weights shared with the embedding table, row-major as HF stores them) — a warp owns one
//   output row and walks it with 16-byte streaming loads, ROWS_LOADS chunks per lane in flight; grid-stride.
//   Measured at ~100% of copy bandwidth on 128256 x 3072 (results/gemv-*.json), so it keeps the plain layout.
//   (v35: its last rows loaded evict-last into an L2 set-aside, knob LMHEAD_L2_KEEP, gained less than the adoption
//   bar asks, removed; last in commit 9969095.)
//
// Both: 256 threads per block (TILED: 2 resident blocks per SM, ROWS: 4); the first weight loads (or
// cp.async groups) are issued BEFORE the prologue and, under programmatic dependent launch, before waiting for the previous
// kernel (weights never depend on it).
//
// Fusions (each removes a launch and a round trip of an activation vector):
//   PRO_NORM   prologue: x = RMSNorm(h_fp32) * w_norm computed per block straight into shared memory
//              (replaces a separate RMSNorm kernel before QKV and gate/up).
//   EPI_RESID  epilogue: h_fp32[o] += W·x (residual add after o_proj and down_proj).
//   EPI_SWIGLU epilogue: rows o (gate) and o + n_out (up) of the stacked [gate; up] weight meet in one tile;
//              y[o] = silu(gate) * up; the 2·I intermediate never exists.
//   EPI_ROPE   epilogue of the stacked q|k|v projection: rows i and i + hd/2 of one head meet in one tile;
//              rotates q and k heads (RoPE, HF rotate_half convention; cos/sin of pos * inv_freq[i] from a
//              host-computed table, so no sincosf slow path in the kernel),
//              writes them to y and appends k and v to the KV cache at pos (replaces rope + KV-append).
//   EPI_F32    plain fp32 store (lm_head logits); EPI_STORE plain fp16 store.
//   EPI_TPSUM  tensor parallel, o_proj and down: h[o] += sum over ranks s (in rank order) of rank s's W_s.x_s. Each
//              tile's outputs are pushed into every rank's LL buffer (tp_ll.cuh; TpArgs); after its last tile the
//              block waits for the same rows of every other rank (pushed by their block of the same index) and
//              adds them to h: the cross-rank sum costs no kernel of its own (tp_sum_finish).
//
// Kernel signature for every instantiation (unused arguments are 0):
//   (W, scales, x, norm_w, eps, y, n_out, K)            + for EPI_ROPE: (cos_sin, pos, k_cache, v_cache,
//                                                                       n_q_heads, n_kv_heads, hd, next_w, next_bytes,
//                                                                       L2Head)
//                                                       + for EPI_TPSUM: (slots, seq, rank, n, L2Head)
//   x: const float* (fp32 residual) with PRO_NORM, else const half*;  y: half* / float* per epilogue.
#pragma once
#include "common.cuh"
#include "argmax_common.cuh"
#include "tp_ll.cuh"

#define GEMV_THREADS 256
// TILED configuration per weight format (measured, docs/PERF_NOTES.md v7.1-v9; fixed: the other values measured
// slower; the host mirrors them in atomflow_bench/gpu/ops/gemv.py):
//   fp8:  weights through a cp.async shared-memory ring (gemv_tiled_async), NS groups of 2 KB per warp in flight;
//         one kernel per ring depth NS (GEMV_RING_INSTANCE: name suffix _r<NS>), picked per launch by the
//         host plan (ops/gemv.py gemv_plan), which sizes the dynamic shared memory for that depth;
//   fp16: weights through registers (gemv_tiled), 24 16-byte loads per lane per batch (measured faster than the
//         ring for fp16, v7.2).
// Both: <= 128 registers (2 resident blocks per SM; the fp8 kernels use ~55, so 3 fit where the shared memory does).
#define GEMV_MIN_BLOCKS 2   // resident blocks per SM the register budget is planned for (ops/gemv.py GEMV_MIN_BLOCKS)
#define GEMV_LOADS_F16 24   // register path: 16-byte weight loads in flight per lane per batch (a multiple of 8)
// ROWS (lm_head): 8 loads per lane, 4 blocks per SM (<= 64 registers): ~100% of copy bandwidth as is.
#define ROWS_MIN_BLOCKS 4
#define ROWS_LOADS 8
#define GEMV_TILE 16        // weight rows per tile (the mma's M)

enum { PRO_PLAIN = 0, PRO_NORM = 1 };
enum { EPI_STORE = 0, EPI_F32 = 1, EPI_RESID = 2, EPI_SWIGLU = 3, EPI_ROPE = 4, EPI_TPSUM = 5 };

// A later GEMV's head, asked into L2 (l2_head; ops/gemv.py head_l2): `count` tiles (that GEMV's first round, one
// per block), of each the first w_chunk bytes (tile j at w + j * w_stride) and the first s_chunk bytes of its scales
// (s + j * s_stride; fp8); count 0: none.
struct L2Head {
  const unsigned char* w;
  const unsigned char* s;
  unsigned w_stride, w_chunk, s_stride, s_chunk;
  int count;
};

struct RopeArgs {
  const float2* cos_sin;  // [max_seq][hd/2] (cos, sin) of pos * inv_freq[i], precomputed by the host
  const int* pos;
  __half* k_cache;  // this layer's [max_seq][n_kv * hd]
  __half* v_cache;
  int n_q, n_kv, hd;
  const unsigned char* next_w;    // later weights asked into L2 (next_weights_l2; step.next_l2; 0 bytes: none)
  unsigned long long next_bytes;
  L2Head head;                    // and, before them, o_proj's head (tensor parallel: step.build_step)
};

// One GEMV's operands (unused ones 0). x: const float* (fp32 residual) with PRO_NORM, else const half*.
struct GemvArgs {
  const unsigned char* W;
  const float* scales;
  const void* x;
  const __half* norm_w;
  float eps;
  void* y;
  int n_out, K;
};

// EPI_TPSUM's exchange (tp_ll.cuh): slots[s] = the address of rank s's LL buffer [n ranks][n_out] for this GEMV's
// role; seq [gridDim.x] this rank's epochs per block (local); this rank's index and the number of ranks; the next
// GEMV's head, asked into L2 while the block waits for the other ranks (tp_sum_finish).
struct TpArgs {
  const unsigned long long* slots;
  unsigned* seq;
  int rank, n;
  L2Head head;
};

// This block's share of `h` (one tile in gridDim.x), by bulk prefetches (sm_90+).
__device__ __forceinline__ void l2_head(const L2Head& h) {
#if AF_HAS_BULK
  for (int j = blockIdx.x; j < h.count; j += gridDim.x) {
    bulk_prefetch_l2(h.w + (size_t)j * h.w_stride, h.w_chunk);
    if (h.s_chunk) bulk_prefetch_l2(h.s + (size_t)j * h.s_stride, h.s_chunk);
  }
#endif
}

// What the epilogue of an output reads besides its dot product, fetched BEFORE the PDL wait by the epilogue
// threads of a block's first tile, so that the epilogue runs without an L2 round: EPI_RESID h[o] (the residual;
// the step never launches a residual GEMV right after a writer of h — gpu/step.py build_step checks — and a kernel
// starts only after its predecessor passed its own wait, so the last writer of h is complete), EPI_ROPE the
// (cos, sin) of pos (pos is written by the previous step's argmax; the table is constant).
struct EpiOperand {
  float h;
  float2 cs;
};

// The operand of output o (< n_out).
template <int EPI>
__device__ __forceinline__ EpiOperand epilogue_operand_of(const GemvArgs& a, const RopeArgs& rope, int o) {
  EpiOperand p{0.f, make_float2(1.f, 0.f)};
  if (EPI == EPI_RESID || EPI == EPI_TPSUM) p.h = __ldcg(reinterpret_cast<const float*>(a.y) + o);
  if (EPI == EPI_ROPE) {
    const int half_d = rope.hd / 2;
    if (o / half_d < rope.n_q + rope.n_kv) p.cs = rope.cos_sin[(size_t)*rope.pos * half_d + o % half_d];
  }
  return p;
}
template <int EPI, int R>
__device__ __forceinline__ EpiOperand epilogue_operand(const GemvArgs& a, const RopeArgs& rope, int T) {
  if (threadIdx.x < GEMV_TILE / R && T < a.n_out * R / GEMV_TILE)
    return epilogue_operand_of<EPI>(a, rope, T * (GEMV_TILE / R) + threadIdx.x);
  return EpiOperand{0.f, make_float2(1.f, 0.f)};
}

// The epilogue of output o: acc0 = its row 0, acc1 = its row R-1 (R = 2: gate and up, or RoPE pair rows
// i and i + hd/2). With `have_pre` its operand is `pre` (fetched before the wait: epilogue_operand), else read here.
template <int EPI>
__device__ __forceinline__ void gemv_epilogue(const GemvArgs& a, const RopeArgs& rope, int o, float acc0, float acc1,
                                              const EpiOperand pre = EpiOperand{}, bool have_pre = false,
                                              const TpArgs& tp = TpArgs{}) {
  const int half_d = EPI == EPI_ROPE ? rope.hd / 2 : 1;
  if (EPI == EPI_TPSUM) {  // this rank's row of every rank's buffer (h is summed by tp_sum_finish)
    const unsigned e = tp.seq[blockIdx.x] + 1u;
    for (int s = 0; s < tp.n; ++s)
      ll_store(reinterpret_cast<unsigned long long*>(tp.slots[s]) + (size_t)tp.rank * a.n_out + o, acc0, e);
  } else if (EPI == EPI_STORE) {
    reinterpret_cast<__half*>(a.y)[o] = __float2half(acc0);
  } else if (EPI == EPI_F32) {
    reinterpret_cast<float*>(a.y)[o] = acc0;
  } else if (EPI == EPI_RESID) {
    float* hp = reinterpret_cast<float*>(a.y) + o;
    *hp = (have_pre ? pre.h : __ldcg(hp)) + acc0;
  } else if (EPI == EPI_SWIGLU) {  // HF rounds gate and up to fp16, then silu(gate) * up in fp16
    const float g = __half2float(__float2half(acc0));
    const float u = __half2float(__float2half(acc1));
    const float s = __half2float(__float2half(g / (1.f + __expf(-g))));
    reinterpret_cast<__half*>(a.y)[o] = __float2half(s * u);
  } else {  // EPI_ROPE: rows i and i + hd/2 of head `head`; the projection is rounded to fp16 first (HF)
    const int head = o / half_d, i = o % half_d;
    float x0 = __half2float(__float2half(acc0)), x1 = __half2float(__float2half(acc1));
    const int pos = *rope.pos;
    if (head < rope.n_q + rope.n_kv) {
      const float2 cs = have_pre ? pre.cs : rope.cos_sin[(size_t)pos * half_d + i];
      const float r0 = x0 * cs.x - x1 * cs.y, r1 = x1 * cs.x + x0 * cs.y;
      x0 = r0;
      x1 = r1;
    }
    const __half h0 = __float2half(x0), h1 = __float2half(x1);
    __half* out = reinterpret_cast<__half*>(a.y) + (size_t)head * rope.hd + i;
    out[0] = h0;
    out[half_d] = h1;
    if (head >= rope.n_q) {
      const int kvh = head - rope.n_q;  // k heads first, then v heads
      __half* cache = kvh < rope.n_kv ? rope.k_cache : rope.v_cache;
      __half* dst = cache + (size_t)pos * rope.n_kv * rope.hd + (size_t)(kvh % rope.n_kv) * rope.hd + i;
      dst[0] = h0;
      dst[half_d] = h1;
    }
  }
}

// EPI_TPSUM, after the block's last tile: the threads that ran the epilogue wait, output by output, for every rank's
// value of it (the other ranks' blocks of the same index pushed them: tp_ll.cuh), add them in rank order, and add
// the sum to h (pre: the first tile's h, read before the PDL wait); the block's epoch is then stored. Every rank adds
// the same values in the same order, so h stays bit-identical on every rank.
// Before it waits, thread 0 asks L2 for its share of the next GEMV's head (TpArgs head): HBM idles while the ranks
// meet, and the next GEMV's blocks can start only once this kernel's have left their SMs (PERF_NOTES v42).
template <int EPI>
__device__ __forceinline__ void tp_sum_finish(const GemvArgs& a, const TpArgs& tp, const EpiOperand& pre) {
  if (EPI != EPI_TPSUM || threadIdx.x >= GEMV_TILE) return;
  if (threadIdx.x == 0) l2_head(tp.head);
  const unsigned e = tp.seq[blockIdx.x] + 1u;
  const unsigned long long* mine = reinterpret_cast<const unsigned long long*>(tp.slots[tp.rank]);
  for (int T = blockIdx.x; T < a.n_out / GEMV_TILE; T += gridDim.x) {
    const int o = T * GEMV_TILE + threadIdx.x;
    const float acc = ll_sum_ranks(mine + o, (size_t)a.n_out, tp.n, e);
    float* hp = reinterpret_cast<float*>(a.y) + o;
    *hp = (T == (int)blockIdx.x ? pre.h : __ldcg(hp)) + acc;
  }
  __syncwarp(0xffffu);  // all 16 have read the old epoch
  if (threadIdx.x == 0) tp.seq[blockIdx.x] = e;
}

// Early trigger: the residual GEMVs (o_proj, down) let the next kernel launch before their own
// wait, so gate/up's (and the next QKV's) blocks take free shared memory and request weights while o_proj still
// waits for attention. Safe: neither successor reads anything before its wait but weights, pos and the cos/sin
// table, and the residual GEMVs' pre-wait read of h keeps its guarantee (their predecessors, attention and gate/up,
// still trigger after their wait: gpu/step.py check_residual_order). Measured: PERF_NOTES v10.3 (with the split
// attention, +7 µs) and v20 (short attention: 3B W8A16 -21 µs, 1B fp16 -14, 3B fp16 -18).
// Where: after this kernel's own pre-wait weight requests (ring path) or its mbarrier setup (warp-specialised), just
// before the wait — at the kernel's very start (v17.1) the successor's requests went first: +38 µs on 3B W8A16,
// +21 µs on 1B fp16 against this placement in one call (v20.2). (QKV triggering early too: neutral, v20.1.)
// (Was the knob GEMV_EARLY_RESID; off measured slower (v20), removed; last in commit 9969095.)
// The GEMVs' synchronisation with the previous kernel (after the pre-wait weight requests): the early trigger of the
// residual GEMVs above, then the wait (and the usual trigger after it).
template <int EPI, class Sync>
__device__ __forceinline__ void gemv_arrive_wait(const Sync& sync) {
  if (EPI == EPI_RESID || EPI == EPI_TPSUM) pdl_launch_dependents();
  // the AF_NO_WAIT bit (common.cuh) of this epilogue
  constexpr int bit = EPI == EPI_ROPE ? 1 : (EPI == EPI_RESID || EPI == EPI_TPSUM) ? 4 : EPI == EPI_SWIGLU ? 8 : 0;
  if (AF_NO_WAIT & bit) {
    pdl_launch_dependents();
  } else {
    sync.arrive_wait();
  }
}

// Next weights into L2 (docs/PERF_NOTES.md v30-v31; sm_90+): the QKV kernel asks L2 for a range of later weights
// (rope.next_w, next_bytes: the host's choice, ops/gemv.py next_l2: the last MB of gate/up.s; 0 bytes: none),
// each block its 1/gridDim share by bulk prefetches, after the block's last epilogue (its own weights are all in). The
// hardware counters show HBM idle for ~4.5 µs per layer between QKV's last weights and o_proj's blocks (QKV's tail,
// then the attention), because o_proj's blocks are launched only at the attention's wait. (Was the knob GEMV_NEXT_L2;
// its form 2, right after the block's own pre-wait weight requests, measured slower (v30.1), removed; off is the
// host's next_bytes = 0; last in commit 9969095.)
// Evict-first (PERF_NOTES v30.3, v31): the tiled GEMVs' weight and scale copies (the bulk paths: fp8 ring on sm_90+,
// warp-specialised) carry an L2 evict-first policy, so the weights streamed through L2 once per step are evicted
// before anything else: what next_weights_l2 asked in, the KV cache and the activations. (Was the knob
// GEMV_EVICT_FIRST; off measured slower with the prefetch (v30.3, v31.1), removed; last in commit 9969095.)
#if AF_HAS_BULK
__device__ __forceinline__ void gemv_w_copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  bulk_g2s_hint(dst, src, bytes, bar, l2_evict_first());
}
#endif
template <int EPI>
__device__ __forceinline__ void next_weights_l2(const RopeArgs& rope, bool issuer) {
  if (EPI == EPI_ROPE && issuer) l2_head(rope.head);  // o_proj's head first: it is read first
#if AF_HAS_BULK
  if (EPI == EPI_ROPE && issuer && rope.next_bytes) {
    const unsigned long long share = ((rope.next_bytes + gridDim.x - 1) / gridDim.x + 15) & ~15ull;
    const unsigned long long end = min(share * (blockIdx.x + 1), rope.next_bytes);
    for (unsigned long long b = share * blockIdx.x; b < end; b += 32768)
      bulk_prefetch_l2(rope.next_w + b, (unsigned)min(32768ull, end - b));
  }
#endif
}

// ---- TILED: every layer projection ---------------------------------------------------------------------

// Two packed FP8-E4M3 values -> half2 bits (hardware cvt on sm_89+; exact: every E4M3 value is an fp16).
__device__ __forceinline__ unsigned e4m3x2_to_h2(unsigned int u16) {
  const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(u16), __NV_E4M3);
  return (unsigned)r.x | ((unsigned)r.y << 16);
}

// Where input pair p (inputs 2p, 2p + 1) lives in the fragment-ordered x (in pairs): within each block of
// 32 inputs, lane quad t = p % 4 reads its 8 inputs {2t, 2t+1, 2t+8, 2t+9, 2t+16, 2t+17, 2t+24, 2t+25}
// contiguously (one 16-byte load: the B fragments of two k-tiles).
__device__ __forceinline__ int xs_pair(int p) {
  const int r = p & 15;
  return (p & ~15) | ((r & 3) << 2) | ((r >> 3) << 1) | ((r >> 2) & 1);
}

// x staged in shared memory in fragment order as fp16 by the whole block: RMSNorm(h_fp32) * norm_w
// (PRO_NORM) or a copy of the fp16 input; read through L2 (.cg: written by the previous kernel).
// The norm prologue reads h through L2 once (docs/PERF_NOTES.md v10.4-v10.5), in one of two ways:
// STAGE_REGS (the fp8 ring path and the warp-specialised consumers, whose registers are free here; K <= 4096): each
// thread keeps its float4 chunks of h in registers from the one round that also feeds the sum of squares, and its
// norm_w chunks, loaded before the PDL wait (norm_w_regs); STAGE_SMEM (the fp16
// register path, whose registers hold its weight batch): h is parked in shared memory `hs` (fp32 [K]) by that
// round and norm_w was copied to `nws` (fp16 [K]) by cp.async before the PDL wait (stage_norm_w_async). Either
// way the sums run in rms_inv's order: x is bit-identical to the two-round form, which remains for K > 4096 in
// STAGE_REGS.
#define STAGE_CHUNKS 4  // float4 chunks of h per thread in the one-pass prologue (K <= 4 * 4 * 256)
#define STAGE_LOADS 4   // 16-byte x loads in flight per thread when copying x (K <= 4 * 8 * 256 in one round)
enum { STAGE_REGS = 0, STAGE_SMEM = 1 };

// Before the wait (STAGE_SMEM): this thread's 16-byte pieces of norm_w -> nws, one cp.async group, committed.
__device__ __forceinline__ void stage_norm_w_async(const GemvArgs& a, __half* nws) {
  for (int c = threadIdx.x; c < a.K / 8; c += blockDim.x) cp_async16(nws + c * 8, a.norm_w + c * 8);
  cp_async_commit();
}

// RMSNorm of two inputs (h0, h1) with their fp16 weights w as one packed half2 (rmsnorm_elem each).
__device__ __forceinline__ unsigned norm_pair(float h0, float h1, float inv, __half2 w) {
  const __half2 v = __halves2half2(__float2half(rmsnorm_elem(h0, inv, __low2half(w))),
                                   __float2half(rmsnorm_elem(h1, inv, __high2half(w))));
  return *reinterpret_cast<const unsigned*>(&v);
}

// x = RMSNorm(h_fp32) * norm_w with h parked: the (first NT) threads read h through L2 once into `hs` (fp32 [K]) while
// summing its squares in rms_inv's order, norm_w is in `nws` (stage_norm_w_async, before the wait); input pair p of
// x goes out as store(p, its two fp16 values packed). Used by stage_x_tiled (STAGE_SMEM) and the lm_head's prologue.
template <int NT, class Store>
__device__ __forceinline__ void norm_x_parked(const GemvArgs& a, float* red, float* hs, const __half* nws, Store store) {
  const int nth = nthreads<NT>();
  const float4* h4 = reinterpret_cast<const float4*>(a.x);
  float ss = 0.f;
  for (int c = threadIdx.x; c < a.K / 4; c += nth) {
    const float4 v = __ldcg(h4 + c);
    reinterpret_cast<float4*>(hs)[c] = v;
    ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
  }
  cp_async_wait<0>();  // this thread's norm_w pieces; block_sum's barriers publish everyone's hs and nws
  const float inv = rsqrtf(block_sum<NT>(ss, red) / (float)a.K + a.eps);  // = rms_inv's value, bit for bit
  for (int p = threadIdx.x; p < a.K / 2; p += nth) {
    const float2 hv = reinterpret_cast<const float2*>(hs)[p];
    store(p, norm_pair(hv.x, hv.y, inv, reinterpret_cast<const __half2*>(nws)[p]));
  }
}

// Whether the register prologue's norm runs in one pass (each of the nth staging threads holds <= STAGE_CHUNKS
// float4 chunks of h): the one test both norm_w_regs and stage_x_tiled branch on.
__device__ __forceinline__ bool norm_one_pass(int K, int nth) { return K <= STAGE_CHUNKS * 4 * nth; }

// The one-pass register prologue's norm_w chunks (STAGE_REGS, norm_one_pass), loaded into
// registers BEFORE the PDL wait (a weight: no kernel writes it), so the round after the wait reads only h: norm_w was
// last read a step (~3 GB of weights through the 50 MB L2) earlier. Measured -3 µs on 3B W8A16, -8 on 8B W8A16, -10
// on 3B fp16 against loading it with h after the wait (docs/PERF_NOTES.md v25).
struct NormRegs {
  uint2 w[STAGE_CHUNKS];  // this thread's fp16 norm_w chunks c = threadIdx.x + i * threads (4 inputs each)
};
template <int PRO, int NT = 0>
__device__ __forceinline__ NormRegs norm_w_regs(const GemvArgs& a) {
  NormRegs r;
  const int nth = nthreads<NT>();
#pragma unroll
  for (int i = 0; i < STAGE_CHUNKS; ++i) {
    const int c = threadIdx.x + i * nth;
    r.w[i] = PRO == PRO_NORM && norm_one_pass(a.K, nth) && c < a.K / 4
                 ? reinterpret_cast<const uint2*>(a.norm_w)[c] : make_uint2(0u, 0u);
  }
  return r;
}

template <int PRO, int MODE, int NT = 0>
__device__ __forceinline__ void stage_x_tiled(const GemvArgs& a, __half* xs, float* red, float* hs, const __half* nws,
                                              const NormRegs& nr) {  // nr: norm_w_regs (STAGE_REGS with PRO_NORM)
  const int nth = nthreads<NT>();  // the staging threads: the block, or its NT consumers
  unsigned* xs2 = reinterpret_cast<unsigned*>(xs);
  const int npairs = a.K / 2;
  if (PRO == PRO_NORM && MODE == STAGE_SMEM) {
    norm_x_parked<NT>(a, red, hs, nws, [&](int p, unsigned v) { xs2[xs_pair(p)] = v; });
  } else if (PRO == PRO_NORM && norm_one_pass(a.K, nth)) {
    const float4* h4 = reinterpret_cast<const float4*>(a.x);
    const int nchunks = a.K / 4;
    float4 hv[STAGE_CHUNKS];
    const uint2* wv = nr.w;  // loaded before the wait (norm_w_regs)
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < STAGE_CHUNKS; ++i) {
      const int c = threadIdx.x + i * nth;
      if (c < nchunks) {
        hv[i] = __ldcg(h4 + c);
        ss += hv[i].x * hv[i].x + hv[i].y * hv[i].y + hv[i].z * hv[i].z + hv[i].w * hv[i].w;
      }
    }
    const float inv = rsqrtf(block_sum<NT>(ss, red) / (float)a.K + a.eps);  // = rms_inv's value, bit for bit
#pragma unroll
    for (int i = 0; i < STAGE_CHUNKS; ++i) {
      const int c = threadIdx.x + i * nth;
      if (c < nchunks) {
        const __half2 w01 = *reinterpret_cast<const __half2*>(&wv[i].x), w23 = *reinterpret_cast<const __half2*>(&wv[i].y);
        const unsigned v01 = norm_pair(hv[i].x, hv[i].y, inv, w01), v23 = norm_pair(hv[i].z, hv[i].w, inv, w23);
        xs2[xs_pair(2 * c)] = v01;
        xs2[xs_pair(2 * c + 1)] = v23;
      }
    }
  } else if (PRO == PRO_NORM) {
    const float* h = reinterpret_cast<const float*>(a.x);
    const float inv = rms_inv<NT>(h, a.eps, a.K, red);
    for (int p = threadIdx.x; p < npairs; p += nth) {
      const float2 hv = __ldcg(reinterpret_cast<const float2*>(h) + p);
      xs2[xs_pair(p)] = norm_pair(hv.x, hv.y, inv, reinterpret_cast<const __half2*>(a.norm_w)[p]);
    }
  } else {  // a copy: 16-byte pieces (4 pairs), STAGE_LOADS in flight per thread (one L2 round up to K = 8192)
    const uint4* src = reinterpret_cast<const uint4*>(a.x);
    const int n16 = a.K / 8;
    for (int c0 = threadIdx.x; c0 < n16; c0 += STAGE_LOADS * nth) {
      uint4 v[STAGE_LOADS];
#pragma unroll
      for (int i = 0; i < STAGE_LOADS; ++i) {
        const int c = c0 + i * nth;
        if (c < n16) v[i] = __ldcg(src + c);
      }
#pragma unroll
      for (int i = 0; i < STAGE_LOADS; ++i) {
        const int c = c0 + i * nth;
        if (c < n16) {
          xs2[xs_pair(4 * c)] = v[i].x;
          xs2[xs_pair(4 * c + 1)] = v[i].y;
          xs2[xs_pair(4 * c + 2)] = v[i].z;
          xs2[xs_pair(4 * c + 3)] = v[i].w;
        }
      }
    }
  }
  sync_n<NT>();
}

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
// requested before the wait for the previous kernel. Registers no longer bound the bytes in flight.
// Two ways to fill the ring (the same ring and shared-memory plan):
//   GEMV_BULK (sm_90+, default): lane 0 copies a group's 2 KB of weights and 64 bytes of scales with two bulk
//     copies (`cp.async.bulk`, the copy engine; a group is contiguous in the tiled layout) that complete on the
//     slot's mbarrier; the lanes wait for the slot's phase and __syncwarp before lane 0 refills it. The SM's load
//     path stays free for the activations read after the wait (docs/PERF_NOTES.md v12).
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

// Warp-specialised form (sm_90+, the ws form of gpu/forms.py; the ring form launches the two above): 8 consumer warps + 1 producer warp.
// The producer's lane 0 streams the block's weights (its tiles in order, each a contiguous run of groups) into a
// ring of NS slots of GEMV_WS_SLOT bytes (fp8: 8 groups + their 512 B of scales; fp16: 4 groups) with bulk copies
// completing on the slot's `full` mbarrier; it starts at the block's start, never waits for the previous kernel
// (but fills at most npre slots before the consumers have: the `go` mbarrier) and refills a slot once the 8 consumer
// warps have arrived on its `empty` mbarrier. The consumers never issue a
// weight load: they wait for the previous kernel, stage x (named barrier of 256 threads), and in every slot take
// the group they own (group g belongs to warp g % 8, as in the forms above), then release the slot. NS is what the
// host gave: (dynamic shared memory - x - scratch - barriers) / slot (ops/gemv.py gemv_ws_plan), at most GEMV_WS_MAX.
// Shared memory: xs [K] fp16 | partial sums [2][8][16] f32 | block_sum scratch [32] f32 | full [GEMV_WS_MAX],
// empty [GEMV_WS_MAX], go [2] u64 | up to 127 bytes of padding | ring [NS][slot], 128-byte aligned (weights
// GEMV_WS_SLOT, then fp8 scales [8 groups][8][2] f32). An unaligned ring measured ~5% slower (PERF_NOTES v13).
#define GEMV_WS_SLOT 16384  // weight bytes per ring slot
#define GEMV_WS_MAX 16      // most slots a ring may have (barriers reserved for all)
#define GEMV_WS_THREADS (GEMV_THREADS + AF_WARP)
// `npre` (a kernel argument, chosen per launch by the host: ops/gemv.py GEMV_WS_PRE, and measured per shape by the
// engine): slots the producer may fill before the consumers have passed their wait (0: the whole ring). Fewer
// bytes requested before the wait let the previous kernel's completion and this kernel's x loads through sooner
// (measured, PERF_NOTES v13.2: fp16 3 of 6 slots -78 µs on 3B; v16: 1B fp16 is faster at 2; fp8 2 was slower on 8B).
// (v33: dynamic split-K work units, the `_dyn` kernels, measured slower than whole tiles per block, removed; last in
// commit 9969095.)
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
// An L2Head as seven kernel arguments P_w, P_s, P_w_stride, P_w_chunk, P_s_stride, P_s_chunk, P_count.
#define L2HEAD_PARAMS(P)                                                                                  \
  const unsigned char* __restrict__ P##_w, const unsigned char* __restrict__ P##_s, unsigned P##_w_stride, \
      unsigned P##_w_chunk, unsigned P##_s_stride, unsigned P##_s_chunk, int P##_count
#define L2HEAD_OF(P) L2Head{P##_w, P##_s, P##_w_stride, P##_w_chunk, P##_s_stride, P##_s_chunk, P##_count}
// Every tiled GEMV's first eight arguments (GemvArgs).
#define GEMV_PARAMS                                                                                       \
  const unsigned char* __restrict__ W, const float* __restrict__ scales, const void* __restrict__ x,      \
      const __half* __restrict__ norm_w, float eps, void* __restrict__ y, int n_out, int K
#define GEMV_WS_PARAMS GEMV_PARAMS, int npre
#define GEMV_ROPE_ARGS_OF                                                                                 \
  (RopeArgs{cos_sin, pos, k_cache, v_cache, n_q, n_kv, hd, next_w, next_bytes, L2HEAD_OF(l2)})
#define GEMV_WS_INSTANCE(NAME, FP8, PRO, EPI)                                                             \
  extern "C" __global__ void __launch_bounds__(GEMV_WS_THREADS, 3) NAME(GEMV_WS_PARAMS) {                 \
    GEMV_WS_BODY(FP8, PRO, EPI, RopeArgs{}, TpArgs{})                                                     \
  }
// The cross-rank sum variant (EPI_TPSUM): TpArgs as the last eleven arguments.
#define GEMV_TP_PARAMS                                                                                    \
  const unsigned long long* __restrict__ tp_slots, unsigned* __restrict__ tp_seq, int tp_rank, int tp_n,  \
      L2HEAD_PARAMS(l2)
#define GEMV_TP_ARGS_OF (TpArgs{tp_slots, tp_seq, tp_rank, tp_n, L2HEAD_OF(l2)})
#define GEMV_WS_TP_INSTANCE(NAME, FP8)                                                                    \
  extern "C" __global__ void __launch_bounds__(GEMV_WS_THREADS, 3) NAME(GEMV_WS_PARAMS, GEMV_TP_PARAMS) { \
    GEMV_WS_BODY(FP8, PRO_PLAIN, EPI_TPSUM, RopeArgs{}, GEMV_TP_ARGS_OF)                                  \
  }
#define GEMV_WS_ROPE_INSTANCE(NAME, FP8)                                                                  \
  extern "C" __global__ void __launch_bounds__(GEMV_WS_THREADS, 3) NAME(GEMV_ROPE_PARAMS, int npre) {     \
    GEMV_WS_BODY(FP8, PRO_NORM, EPI_ROPE, GEMV_ROPE_ARGS_OF, TpArgs{})                                    \
  }

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

// fp8 layer GEMVs: the cp.async ring at depth NS; the kernel is NAME_r<NS> (the host picks the depth per launch).
#define GEMV_RING_INSTANCE(NAME, PRO, EPI, NS)                                                            \
  extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_BLOCKS)                            \
  NAME##_r##NS(GEMV_PARAMS) {                                                                             \
    AF_TIMELINE_BLOCK;                                                                                    \
    extern __shared__ __align__(16) unsigned char smem_raw[];                                             \
    gemv_tiled_async<PRO, EPI, NS>(GemvArgs{W, scales, x, norm_w, eps, y, n_out, K}, RopeArgs{},     \
                                         PdlSync{}, smem_raw);                                            \
  }

// fp8 EPI_TPSUM at ring depth NS.
#define GEMV_TP_RING_INSTANCE(NAME, NS)                                                                   \
  extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_BLOCKS)                            \
  NAME##_r##NS(GEMV_PARAMS, GEMV_TP_PARAMS) {                                                             \
    AF_TIMELINE_BLOCK;                                                                                    \
    extern __shared__ __align__(16) unsigned char smem_raw[];                                             \
    gemv_tiled_async<PRO_PLAIN, EPI_TPSUM, NS>(GemvArgs{W, scales, x, norm_w, eps, y, n_out, K}, RopeArgs{}, \
                                               PdlSync{}, smem_raw, GEMV_TP_ARGS_OF);                     \
  }
#define GEMV_TP_RING_INSTANCES(NAME)                                                                      \
  GEMV_TP_RING_INSTANCE(NAME, 2) GEMV_TP_RING_INSTANCE(NAME, 3) GEMV_TP_RING_INSTANCE(NAME, 4)            \
  GEMV_TP_RING_INSTANCE(NAME, 5)

// One kernel per ring depth the host plan may pick (atomflow_bench/gpu/ops/gemv.py GEMV_RING_DEPTHS lists the same).
#define GEMV_RING_INSTANCES(NAME, PRO, EPI)                                                               \
  GEMV_RING_INSTANCE(NAME, PRO, EPI, 2) GEMV_RING_INSTANCE(NAME, PRO, EPI, 3)                            \
  GEMV_RING_INSTANCE(NAME, PRO, EPI, 4) GEMV_RING_INSTANCE(NAME, PRO, EPI, 5)

// The QKV projection with RoPE and the KV-cache append in its epilogue: fp16 through registers (NAME) or fp8 at
// ring depth NS (NAME_r<NS>).
#define GEMV_ROPE_PARAMS                                                                                  \
  GEMV_PARAMS, const float2* __restrict__ cos_sin, const int* __restrict__ pos, __half* __restrict__ k_cache, \
      __half* __restrict__ v_cache, int n_q, int n_kv, int hd, const unsigned char* __restrict__ next_w,  \
      unsigned long long next_bytes, L2HEAD_PARAMS(l2)
#define GEMV_ROPE_ARGS (GEMV_ROPE_PARAMS)
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
  extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_BLOCKS) NAME##_r##NS GEMV_ROPE_ARGS \
  GEMV_ROPE_CALL((gemv_tiled_async<PRO_NORM, EPI_ROPE, NS>))
#define GEMV_ROPE_RING_INSTANCES(NAME)                                                                    \
  GEMV_ROPE_RING_INSTANCE(NAME, 2) GEMV_ROPE_RING_INSTANCE(NAME, 3) GEMV_ROPE_RING_INSTANCE(NAME, 4)      \
  GEMV_ROPE_RING_INSTANCE(NAME, 5)

// ---- ROWS: lm_head (fp16, row-major) -------------------------------------------------------------------

// 8 fp16 weights · 8 fp16 activations, accumulated in fp32.
__device__ __forceinline__ float dot8_f16(uint4 w, const __half* xs, int k) {
  const uint4 xv = *reinterpret_cast<const uint4*>(xs + k);
  float2 a = h2_to_f2(w.x), b = h2_to_f2(w.y), c = h2_to_f2(w.z), d = h2_to_f2(w.w);
  float2 p = h2_to_f2(xv.x), q = h2_to_f2(xv.y), r = h2_to_f2(xv.z), s = h2_to_f2(xv.w);
  float acc = a.x * p.x;
  acc = fmaf(a.y, p.y, acc); acc = fmaf(b.x, q.x, acc); acc = fmaf(b.y, q.y, acc);
  acc = fmaf(c.x, r.x, acc); acc = fmaf(c.y, r.y, acc); acc = fmaf(d.x, s.x, acc);
  acc = fmaf(d.y, s.y, acc);
  return acc;
}

// y[o] (EPI) = W[o, :] · x for fp16 row-major W, x fp16: every warp owns outputs gw, gw + n_warps, ... .
// With a.norm_w (the final RMSNorm as the lm_head's prologue): x = RMSNorm(a.x) * norm_w by norm_x_parked, bit-identical
// to rmsnorm_f32_f16 at 256 threads (h parked in `hs`, norm_w copied to `nws` before the PDL wait; shared memory
// K * 8 + 128 bytes, else K * 2); block 0 also stores x to `x_out` (the `final_norm` probe) when given.
// ARGMAX: each warp also keeps the best (y[o], o) of its outputs, and the block ends with argmax_finish
// (argmax_common.cuh): the greedy token and the step's bookkeeping without a kernel of their own.
template <int EPI, class Sync, bool ARGMAX = false>
__device__ __forceinline__ void gemv_rows(const GemvArgs a, const Sync sync, unsigned char* smem_raw,
                                          __half* x_out, const ArgmaxArgs am = {}) {
  const int K = a.K, n_out = a.n_out;
  __half* xs = reinterpret_cast<__half*>(smem_raw);
  float* hs = reinterpret_cast<float*>(smem_raw + (size_t)K * 2);
  __half* nws = reinterpret_cast<__half*>(smem_raw + (size_t)K * 6);
  float* red = reinterpret_cast<float*>(smem_raw + (size_t)K * 8);
  const bool norm = a.norm_w != nullptr;
  const int lane = threadIdx.x % AF_WARP;
  const int nwarps = blockDim.x / AF_WARP;
  const int stride = gridDim.x * nwarps;
  const int nchunks = K / 8;
  const size_t row_bytes = (size_t)K * 2;

  int o = blockIdx.x * nwarps + threadIdx.x / AF_WARP;
  uint4 wv[ROWS_LOADS];
  if (o < n_out) {  // the first iteration's weights of this warp's first output, before the sync
    const unsigned char* wrow = a.W + (size_t)o * row_bytes;
#pragma unroll
    for (int u = 0; u < ROWS_LOADS; ++u) {
      const int c = lane + u * AF_WARP;
      wv[u] = c < nchunks ? ld_stream(wrow + (size_t)c * 16) : make_uint4(0, 0, 0, 0);
    }
  }
  if (norm) stage_norm_w_async(a, nws);  // constant: before the wait
  sync.arrive_wait();
  if (norm) {
    norm_x_parked<0>(a, red, hs, nws, [&](int p, unsigned v) { reinterpret_cast<unsigned*>(xs)[p] = v; });
  } else {
    const __half* src = reinterpret_cast<const __half*>(a.x);
    for (int i = threadIdx.x; i < K / 8; i += blockDim.x) reinterpret_cast<uint4*>(xs)[i] = ld_cg16(src + 8 * i);
  }
  __syncthreads();
  if (x_out != nullptr && blockIdx.x == 0)
    for (int i = threadIdx.x; i < K / 8; i += blockDim.x)
      reinterpret_cast<uint4*>(x_out)[i] = reinterpret_cast<const uint4*>(xs)[i];

  bool prefetched = true;
  float bv = -AF_INF;  // ARGMAX: this warp's best (value, index) so far (the same in every lane)
  int bi = 0x7fffffff;
  for (; o < n_out; o += stride) {
    const unsigned char* wrow = a.W + (size_t)o * row_bytes;
    float acc = 0.f;
    for (int c0 = lane; c0 < nchunks; c0 += AF_WARP * ROWS_LOADS) {
      if (!prefetched) {
#pragma unroll
        for (int u = 0; u < ROWS_LOADS; ++u) {
          const int c = c0 + u * AF_WARP;
          wv[u] = c < nchunks ? ld_stream(wrow + (size_t)c * 16) : make_uint4(0, 0, 0, 0);
        }
      }
      prefetched = false;
#pragma unroll
      for (int u = 0; u < ROWS_LOADS; ++u) {
        const int c = c0 + u * AF_WARP;
        if (c < nchunks) acc += dot8_f16(wv[u], xs, c * 8);
      }
    }
    acc = warp_sum(acc);
    if (lane == 0) gemv_epilogue<EPI>(a, RopeArgs{}, o, acc, acc);
    if (ARGMAX) better(bv, bi, acc, o);  // acc is what EPI_F32 stored
  }
  if (ARGMAX) argmax_finish(bv, bi, am);
}

// x_out: where block 0 stores x (0: nowhere); with norm_w the final norm's output (the `final_norm` probe).
#define GEMV_ROWS_INSTANCE(NAME, EPI)                                                                     \
  extern "C" __global__ void __launch_bounds__(GEMV_THREADS, ROWS_MIN_BLOCKS)                            \
  NAME(const unsigned char* __restrict__ W, const float* __restrict__ scales, const void* __restrict__ x, \
       const __half* __restrict__ norm_w, float eps, void* __restrict__ y, int n_out, int K,              \
       __half* __restrict__ x_out) {                                                                      \
    AF_TIMELINE_BLOCK;                                                                                    \
    extern __shared__ __align__(16) unsigned char smem_raw[];                                             \
    gemv_rows<EPI>(GemvArgs{W, scales, x, norm_w, eps, y, n_out, K}, PdlSync{}, smem_raw, x_out);        \
  }
// The lm_head with the greedy argmax and the step's bookkeeping in its epilogue (fp32 logits, EPI_F32).
#define GEMV_ROWS_ARGMAX_INSTANCE(NAME)                                                                   \
  extern "C" __global__ void __launch_bounds__(GEMV_THREADS, ROWS_MIN_BLOCKS)                            \
  NAME(const unsigned char* __restrict__ W, const float* __restrict__ scales, const void* __restrict__ x, \
       const __half* __restrict__ norm_w, float eps, void* __restrict__ y, int n_out, int K,              \
       __half* __restrict__ x_out, float* part_val, int* part_idx, unsigned int* counter, int* pos,       \
       int* cur_token, const int* __restrict__ prompt, const int* __restrict__ prompt_len, int* out_tokens, \
       int advance) {                                                                                     \
    AF_TIMELINE_BLOCK;                                                                                    \
    extern __shared__ __align__(16) unsigned char smem_raw[];                                             \
    gemv_rows<EPI_F32, PdlSync, true>(GemvArgs{W, scales, x, norm_w, eps, y, n_out, K}, PdlSync{}, smem_raw, \
                                      x_out, ArgmaxArgs{part_val, part_idx, counter, pos, cur_token, prompt,     \
                                                 prompt_len, out_tokens, advance});                       \
  }
