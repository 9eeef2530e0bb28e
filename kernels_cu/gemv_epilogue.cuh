// gemv_epilogue.cuh — what a GEMV does with its dot products, and when it lets the next kernel start. Each fused
// epilogue removes a launch and a round trip of an activation vector.
//
// Computes   per output o, from the sums of its rows (acc0: row 0; acc1: row R-1, R = 2 for SwiGLU and RoPE):
//   EPI_STORE  y[o] = fp16(acc0)            EPI_F32  y[o] = acc0 (lm_head logits; a tensor-parallel rank's share)
//   EPI_RESID  h[o] += acc0                 (the residual add after o_proj and down)
//   EPI_SWIGLU y[o] = silu(gate) * up       gate and up are rows o and o + n_out of the stacked [gate; up] weight and
//                                           meet in one tile: the 2·I intermediate never exists
//   EPI_ROPE   rows i and i + hd/2 of a q or k head rotated (HF rotate_half; cos/sin of pos * inv_freq[i] from a
//              host table, so no sincosf slow path), written to y, and k and v appended to the KV cache at pos
//   EPI_TPSUM  h[o] += the sum over ranks s, in rank order, of rank s's W_s.x_s: each tile's outputs are pushed into
//              every rank's LL buffer (tp_ll.cuh), and after its last tile the block waits for the same rows of every
//              other rank (tp_sum_finish): the cross-rank sum costs no kernel of its own
// Layouts    y fp16 or h fp32 [n_out]; k_cache, v_cache one layer's [max_seq][n_kv * hd] fp16; cos_sin
//            [max_seq][hd/2] float2; EPI_TPSUM: LL buffers [ranks][n_out] of 8-byte (value, epoch) slots.
// Bytes      n_out * 2..4 (y or h), + 2 * n_kv * hd * 2 (EPI_ROPE: the K and V rows), + n_out * 8 * ranks written
//            and as many read (EPI_TPSUM).
// Launch     inside the GEMV kernels: 16/R threads per tile (gemv_tiled.cuh tile_epilogue), lane 0 of a warp per
//            output (gemv_rows.cuh).
#pragma once
#include "gemv_args.cuh"
#include "tp_ll.cuh"

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
// meet, and the next GEMV's blocks can start only once this kernel's have left their SMs, so the head they read first
// is in L2 when they do.
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

// The GEMVs' synchronisation with the previous kernel, called after their pre-wait weight requests.
// Early trigger: the residual GEMVs (o_proj, down) let the next kernel launch before their own wait, so gate/up's
// (and the next QKV's) blocks take free shared memory and request weights while o_proj still waits for attention;
// with the short attention a step of 1B to 3B runs 14 to 21 µs faster. Safe: neither successor reads anything
// before its wait but weights, pos and the cos/sin table, and the residual GEMVs' pre-wait read of h keeps its
// guarantee (their predecessors, attention and gate/up, still trigger after their wait: gpu/step.py
// check_residual_order). The
// trigger sits here, after this kernel's own weight requests, and not at the kernel's start: there the successor's
// requests go out first and delay this kernel's. The other GEMVs trigger after their wait (sync.arrive_wait): an
// early QKV trigger measured no faster.
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

// Next weights into L2 (sm_90+): after its last epilogue (its own weights are all in) each block of the QKV kernel
// asks L2 for o_proj's head (rope.head) and its 1/gridDim share of a range of later weights (rope.next_w, next_bytes:
// the host's choice, ops/gemv.py next_l2: the last MB of gate/up; 0 bytes: none) by bulk prefetches. Why: the hardware
// counters show HBM idle for ~4.5 µs per layer between QKV's last weights and o_proj's blocks (QKV's tail, then the
// attention), because o_proj's blocks are launched only at the attention's wait. Issued earlier (right after
// the block's own pre-wait requests) it measured slower.
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
