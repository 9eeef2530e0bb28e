// decode_persist.cu — the decode step's embedding and layers as one persistent kernel (the lab's persistent step,
// lab/persist.py; measured slower than the product's graph on every shape: PERF_NOTES v48; sm_90+): one block per SM walks the step's ops in order, each op waiting only on the op whose output it reads,
// through counters in global memory instead of a kernel boundary.
//
// Computes   what the step's graph form computes from the embedding to the last layer's residual (gpu/step.py): per
//            layer QKV (RMSNorm prologue, RoPE + KV append), the short attention, o_proj (+ residual), gate/up
//            (RMSNorm, SwiGLU), down (+ residual) — the same device functions as the warp-specialised GEMVs
//            (ws_stream.cuh ws_consume: the same tiles per block, the same mma order) and the short attention
//            (attention_short.cuh), so its results equal the graph's `ws` form bit for bit. The lm_head (final norm,
//            argmax, bookkeeping) stays its own launch after this one.
// Scheme     ops o = 0 (embedding), 1 + 5 i + k (layer i: k = 0 QKV, 1 attention, 2 o_proj, 3 gate/up, 4 down); a
//            launch runs ops [op_begin, op_end) (the graph: all of them; validation's eager steps: one at a time, so
//            every probe can be copied out between launches). The producer warp streams the block's tiles of every
//            GEMV of the launch into its ring, one op after the other, never waiting for activations: while the
//            block still works on (or waits for) op o, op o+1's weights land. The 8 consumer warps run each op after
//            its dependency: the previous op done by every block (the RMSNorm and the GEMVs' K need all of their
//            input), o_proj after the attention blocks; each op ends with a barrier of the consumers and a counter
//            increment (fence, then atomicAdd). The attention runs on the last n_att blocks (those with the fewest
//            tiles in the grid-stride order), which stage the K/V rows of earlier steps before they wait for QKV.
//            The last block to finish resets the launch's counters (a ticket), so every launch starts from zero.
// dyn        0: each block takes the tiles blockIdx.x + i * gridDim.x of every GEMV (static, as the graph's kernels);
//            1: each block's producer takes tiles from the GEMV's counter (ws_stream.cuh ws_produce_dyn), so no block
//            waits for one that got more of them. A tile's sums are one block's either way: the same bits.
// Layouts    layers: per layer PS_PTRS device addresses (lab/persist.py layer_table): the tiled weights and
//            fp8 scales of wqkv, wo, wgu, wd, the two norm weights, the layer's K and V cache. Activations as the
//            step's: h fp32 [H], qkv fp16 [qkv_rows], attn_out fp16 [q_dim], act fp16 [I]. counters: u32
//            [2 n_ops + 1]: the ops' done counts, the ticket, the ops' tile counters (dyn). trace (tests, else
//            null): u32, [0] a sequence, then per (op, block) the
//            sequence numbers at the op's start (after its wait) and end (before its signal), 0 when not run.
//            Dynamic shared memory: region A (xs [Kmax] fp16, or the attention's K/V/P: `a_bytes`) | partial sums
//            [2][8][16] f32 | block_sum scratch [32] f32 | full, empty [GEMV_WS_MAX], go [2] u64 | ring (128-byte
//            aligned, as many GEMV_WS_SLOT slots as the rest holds).
// Bytes      the step's weights once (+ fp8 scales), K/V rows, the activations through L2, n_ops * blocks counter adds.
// Launch     grid = the SM count, block = GEMV_WS_THREADS (288), one block per SM (its shared memory takes the SM);
//            cooperative (every block resident: the waits need it); never with programmatic dependent launch.
#include "../../kernels_cu/attention_short.cuh"
#include "ws_stream.cuh"

#define PS_PTRS 12          // device addresses per layer in the layer table (lab/persist.py PS_PTRS)
#define PS_OPS_PER_LAYER 5  // QKV, attention, o_proj, gate/up, down
enum { PS_QKV = 0, PS_ATT = 1, PS_WO = 2, PS_WGU = 3, PS_WD = 4 };

// Thread 0 waits until *c >= target (acquire, GPU scope), then the consumers meet: what the counted ops wrote is
// visible to every consumer thread after it (the barrier orders their reads after thread 0's acquire).
__device__ __forceinline__ void ps_wait(const unsigned* c, unsigned target) {
  if (threadIdx.x == 0) {
    unsigned v;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(c) : "memory");
    } while (v < target);
  }
  sync_n<GEMV_THREADS>();
}

// The consumers' stores of an op are issued (barrier), then thread 0 makes them visible at GPU scope and counts the
// block in.
__device__ __forceinline__ void ps_signal(unsigned* c) {
  sync_n<GEMV_THREADS>();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(c, 1u);
  }
}

__device__ __forceinline__ void ps_stamp(unsigned* trace, int o, int side) {
  if (trace != nullptr && threadIdx.x == 0)
    trace[1 + ((size_t)o * gridDim.x + blockIdx.x) * 2 + side] = atomicAdd(trace, 1u) + 1u;
}

#define PS_PARAMS                                                                                         \
  const unsigned long long* __restrict__ layers, int op_begin, int op_end, int n_ops, int H, int q_dim,   \
      int qkv_rows, int I, int n_q, int n_kv, float eps, float scale, int att_cap, int a_bytes,           \
      const __half* __restrict__ embed, const int* __restrict__ cur_token, const int* __restrict__ pos,   \
      const float2* __restrict__ cos_sin, float* h, __half* qkv, __half* attn_out, __half* act,            \
      unsigned* counters, unsigned* trace, int dyn

#if AF_HAS_BULK
template <bool FP8, int HD, int G>
__device__ __forceinline__ void decode_persist_body(PS_PARAMS) {
  constexpr int NWC = GEMV_THREADS / AF_WARP;
  constexpr int BG = G > ATS_HEADS ? ATS_HEADS : G, BV = G > ATS_HEADS ? G / ATS_HEADS : 1;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __half* xs = reinterpret_cast<__half*>(smem_raw);
  float* red = reinterpret_cast<float*>(smem_raw + a_bytes);
  float* rs = red + 2 * NWC * GEMV_TILE;
  unsigned dsmem;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dsmem));
  const WsRing ring = ws_ring_setup<FP8>(reinterpret_cast<unsigned char*>(rs + 32), dsmem, smem_raw);
  __syncthreads();  // the only whole-block barrier: the producer leaves below
  pdl_wait();       // a no-op: the step never launches this kernel with programmatic dependent launch
  const int warp = threadIdx.x / AF_WARP;
  auto W = [&](const unsigned long long* L, int k) { return reinterpret_cast<const unsigned char*>(L[k]); };
  auto S = [&](const unsigned long long* L, int k) { return reinterpret_cast<const float*>(L[k]); };

  __shared__ int meta[GEMV_WS_MAX];  // dyn: each ring slot's tile (ws_stream.cuh ws_produce_dyn)
  unsigned* grabs = counters + n_ops + 1;  // dyn: each op's tile counter
  if (warp == NWC) {  // the producer: every GEMV's tiles of this block, op after op
    if (threadIdx.x % AF_WARP == 0) {
      int n = 0;
      for (int o = max(op_begin, 1); o < op_end; ++o) {
        const unsigned long long* L = layers + (size_t)((o - 1) / PS_OPS_PER_LAYER) * PS_PTRS;
        const int k = (o - 1) % PS_OPS_PER_LAYER;
        if (k == PS_ATT) continue;
        const int w = k == PS_QKV ? 0 : k == PS_WO ? 3 : k == PS_WGU ? 5 : 8;  // the weight's place in the table
        const int K = k == PS_WO ? q_dim : k == PS_WD ? I : H;
        const int rows = k == PS_QKV ? qkv_rows : k == PS_WGU ? 2 * I : H;
        n = dyn ? ws_produce_dyn<FP8>(ring, W(L, w), S(L, w + 1), K, rows / GEMV_TILE, n, grabs + o, meta)
                : ws_produce<FP8>(ring, W(L, w), S(L, w + 1), K, rows / GEMV_TILE, n);
      }
    }
    return;
  }

  const int n_att = n_kv * BV;
  const bool att_block = (int)blockIdx.x >= (int)gridDim.x - n_att;
  const unsigned grid = gridDim.x;
  int n = 0;
  for (int o = op_begin; o < op_end; ++o) {
    if (o == 0) {  // the embedding: h = emb[token], a slice per block
      ps_stamp(trace, o, 0);
      const size_t base = (size_t)(*cur_token) * H;
      for (int x = blockIdx.x * GEMV_THREADS + threadIdx.x; x < H; x += gridDim.x * GEMV_THREADS)
        h[x] = __half2float(embed[base + x]);
      ps_stamp(trace, o, 1);
      ps_signal(counters + o);
      continue;
    }
    const int k = (o - 1) % PS_OPS_PER_LAYER;
    const unsigned long long* L = layers + (size_t)((o - 1) / PS_OPS_PER_LAYER) * PS_PTRS;
    __half* k_cache = reinterpret_cast<__half*>(L[10]);
    __half* v_cache = reinterpret_cast<__half*>(L[11]);
    const RopeArgs rope{cos_sin, pos, k_cache, v_cache, n_q, n_kv, HD, nullptr, 0ull, L2Head{}};
    const bool waits = o > op_begin;  // an op of an earlier launch is complete (the kernel boundary)
    if (k == PS_ATT) {
      if (!att_block) continue;  // neither waits nor counts
      auto wait = [&]() {
        if (waits) ps_wait(counters + o - 1, grid);
        ps_stamp(trace, o, 0);
      };
      attention_short_item<HD, BG, GEMV_THREADS, BV, GEMV_THREADS>(qkv, k_cache, v_cache, *pos + 1,
                                                      (int)blockIdx.x - ((int)gridDim.x - n_att), attn_out, n_kv,
                                                      att_cap, scale, reinterpret_cast<char*>(smem_raw), wait);
      ps_stamp(trace, o, 1);
      ps_signal(counters + o);
      continue;
    }
    GemvArgs a;
    if (k == PS_QKV) a = GemvArgs{W(L, 0), S(L, 1), h, reinterpret_cast<const __half*>(L[2]), eps, qkv, qkv_rows / 2, H};
    else if (k == PS_WO) a = GemvArgs{W(L, 3), S(L, 4), attn_out, nullptr, eps, h, H, q_dim};
    else if (k == PS_WGU) a = GemvArgs{W(L, 5), S(L, 6), h, reinterpret_cast<const __half*>(L[7]), eps, act, I, H};
    else a = GemvArgs{W(L, 8), S(L, 9), act, nullptr, eps, h, H, I};
    const bool norm = k == PS_QKV || k == PS_WGU;
    NormRegs nr{};
    if (norm) nr = norm_w_regs<PRO_NORM, GEMV_THREADS>(a);  // a weight: before the wait
    if (waits) ps_wait(counters + o - 1, k == PS_WO ? (unsigned)n_att : grid);
    ps_stamp(trace, o, 0);
    if (k == PS_QKV) {
      const EpiOperand pre = epilogue_operand<EPI_ROPE, 2>(a, rope, blockIdx.x);
      stage_x_tiled<PRO_NORM, STAGE_REGS, GEMV_THREADS>(a, xs, rs, nullptr, nullptr, nr);
      n = dyn ? ws_consume_dyn<FP8, 2, EPI_ROPE>(ring, a, rope, red, xs, n, pre, TpArgs{}, meta)
              : ws_consume<FP8, 2, EPI_ROPE>(ring, a, rope, red, xs, n, pre, TpArgs{});
    } else if (k == PS_WGU) {
      const EpiOperand pre = epilogue_operand<EPI_SWIGLU, 2>(a, rope, blockIdx.x);
      stage_x_tiled<PRO_NORM, STAGE_REGS, GEMV_THREADS>(a, xs, rs, nullptr, nullptr, nr);
      n = dyn ? ws_consume_dyn<FP8, 2, EPI_SWIGLU>(ring, a, rope, red, xs, n, pre, TpArgs{}, meta)
              : ws_consume<FP8, 2, EPI_SWIGLU>(ring, a, rope, red, xs, n, pre, TpArgs{});
    } else {  // o_proj, down: h += W.x
      const EpiOperand pre = epilogue_operand<EPI_RESID, 1>(a, rope, blockIdx.x);  // h, written by earlier ops
      stage_x_tiled<PRO_PLAIN, STAGE_REGS, GEMV_THREADS>(a, xs, rs, nullptr, nullptr, nr);
      n = dyn ? ws_consume_dyn<FP8, 1, EPI_RESID>(ring, a, rope, red, xs, n, pre, TpArgs{}, meta)
              : ws_consume<FP8, 1, EPI_RESID>(ring, a, rope, red, xs, n, pre, TpArgs{});
    }
    ps_stamp(trace, o, 1);
    ps_signal(counters + o);
  }
  // The last block out resets this launch's counters and the ticket for the next launch.
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(counters + n_ops, 1u) == grid - 1) {
      for (int o = op_begin; o < op_end; ++o) counters[o] = grabs[o] = 0u;
      counters[n_ops] = 0u;
      __threadfence();
    }
  }
}
#define PS_BODY(FP8, HD, G)                                                                                \
  decode_persist_body<FP8, HD, G>(layers, op_begin, op_end, n_ops, H, q_dim, qkv_rows, I, n_q, n_kv, eps,    \
                                  scale, att_cap, a_bytes, embed, cur_token, pos, cos_sin, h, qkv, attn_out, \
                                  act, counters, trace, dyn);
#elif defined(__CUDA_ARCH__)
#define PS_BODY(FP8, HD, G) __trap();
#else
#define PS_BODY(FP8, HD, G)
#endif

// One kernel per (format, head_dim, q heads per kv head): lab/persist.py kernel_name. Declared for every
// architecture, built for sm_90+ only (below, the body traps: the host refuses the form there). Nine warps per
// block leave each thread 168 registers (an SM's four register files of 16384 hold three warps each at most); the
// GEMVs and the attention in one kernel need a little more, so ptxas keeps up to 32 bytes on the stack
// (tests/test_lab_persist.py checks that bound).
#define PS_INSTANCE(NAME, FP8, HD, G) \
  extern "C" __global__ void __launch_bounds__(GEMV_WS_THREADS, 1) NAME(PS_PARAMS) { PS_BODY(FP8, HD, G) }

PS_INSTANCE(decode_persist_f16_hd64_g1, false, 64, 1)
PS_INSTANCE(decode_persist_f16_hd64_g2, false, 64, 2)
PS_INSTANCE(decode_persist_f16_hd64_g3, false, 64, 3)
PS_INSTANCE(decode_persist_f16_hd64_g4, false, 64, 4)
PS_INSTANCE(decode_persist_f16_hd64_g8, false, 64, 8)
PS_INSTANCE(decode_persist_f16_hd128_g1, false, 128, 1)
PS_INSTANCE(decode_persist_f16_hd128_g2, false, 128, 2)
PS_INSTANCE(decode_persist_f16_hd128_g3, false, 128, 3)
PS_INSTANCE(decode_persist_f16_hd128_g4, false, 128, 4)
PS_INSTANCE(decode_persist_f16_hd128_g8, false, 128, 8)
PS_INSTANCE(decode_persist_f8_hd64_g1, true, 64, 1)
PS_INSTANCE(decode_persist_f8_hd64_g2, true, 64, 2)
PS_INSTANCE(decode_persist_f8_hd64_g3, true, 64, 3)
PS_INSTANCE(decode_persist_f8_hd64_g4, true, 64, 4)
PS_INSTANCE(decode_persist_f8_hd64_g8, true, 64, 8)
PS_INSTANCE(decode_persist_f8_hd128_g1, true, 128, 1)
PS_INSTANCE(decode_persist_f8_hd128_g2, true, 128, 2)
PS_INSTANCE(decode_persist_f8_hd128_g3, true, 128, 3)
PS_INSTANCE(decode_persist_f8_hd128_g4, true, 128, 4)
PS_INSTANCE(decode_persist_f8_hd128_g8, true, 128, 8)
