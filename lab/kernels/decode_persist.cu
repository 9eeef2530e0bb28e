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
// mode       0: each block takes the tiles blockIdx.x + i * gridDim.x of every GEMV (static, as the graph's kernels);
//            1: each block's producer takes tiles from the GEMV's counter (ws_stream.cuh ws_produce_dyn), so no block
//            waits for one that got more of them. A tile's sums are one block's either way: the same bits.
//            2 (split): the producers take split-K units of 16 KB (a ring slot: part p of tile T) from the GEMV's
//            counter (ws_produce_split). The consumers sum a unit's 8 warps and store the 16 row sums as LL slots
//            (tp_ll.cuh: value and epoch in one 8-byte store, no fence) — except a tile's last part, whose sums go to
//            the block's reducer warp through a shared-memory queue. The reducer waits for the tile's other parts,
//            adds them in part order (so the bits do not depend on which block ran which part), runs the epilogue and
//            counts the tile done; an op's successor waits for all its tiles. The reducer's waits keep the consumers
//            off every L2 round trip. No cycle of waits: within an op a block's units come in grab order and a
//            tile's last part is grabbed after its other parts, so the part a reducer waits for was grabbed before
//            anything that blocks the block holding it.
// Layouts    layers: per layer PS_PTRS device addresses (lab/persist.py layer_table): the tiled weights and
//            fp8 scales of wqkv, wo, wgu, wd, the two norm weights, the layer's K and V cache. Activations as the
//            step's: h fp32 [H], qkv fp16 [qkv_rows], attn_out fp16 [q_dim], act fp16 [I]. counters: u32
//            [2 n_ops + 1]: the ops' done counts (blocks; split: tiles), the ticket, the ops' tile or unit counters.
//            ll (split): u64 [1 + max over GEMVs of tiles x parts x 16]: [0] the launch's epoch (the last block out
//            counts it), then a unit's 16 row sums at (T * spt + p) * 16, epoch-tagged per op, so one buffer
//            serves every op (an op's successor starts only after every slot of it was read).
//            trace (tests, else null): u32, [0] a sequence, then per (op, block) the
//            sequence numbers at the op's start (after its wait) and end (before its signal; split: the block's last
//            tile finished by its reducer, atomicMax), 0 when not run.
//            Dynamic shared memory: region A (xs [Kmax] fp16, or the attention's K/V/P: `a_bytes`) | partial sums
//            [2][8][16] f32 | block_sum scratch [32] f32 | full, empty [GEMV_WS_MAX], go [2] u64 | ring (128-byte
//            aligned, as many GEMV_WS_SLOT slots as the rest holds).
// Bytes      the step's weights once (+ fp8 scales), K/V rows, the activations through L2, n_ops * blocks counter adds.
// Launch     grid = the SM count, block = PS_THREADS (320: 8 consumer warps, the producer, the reducer), one block per SM
//            (its shared memory takes the SM);
//            cooperative (every block resident: the waits need it); never with programmatic dependent launch.
#include "../../kernels_cu/attention_short.cuh"
#include "ws_stream.cuh"

#define PS_PTRS 12          // device addresses per layer in the layer table (lab/persist.py PS_PTRS)
#define PS_OPS_PER_LAYER 5  // QKV, attention, o_proj, gate/up, down
#define PS_RQ 8             // the reducer's queue entries (split)
#define PS_LL_BATCH 8       // parts a reducer asks for at once (one L2 round trip for up to this many)
#define PS_THREADS (GEMV_WS_THREADS + AF_WARP)
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
      unsigned* counters, unsigned* trace, int mode, unsigned long long* ll

#if AF_HAS_BULK
// The reducer's queue (split): a tile's last part, summed over the block's 8 warps, with its unit and op.
struct PsEntry {
  float v[GEMV_TILE];
  int u, o;
};

// One op's GEMV as the kernel sees it: its arguments (weights, scales, K among them) and its weight rows.
struct PsGemv {
  GemvArgs a;
  RopeArgs rope;
  int rows;
};

template <int HD>
__device__ __forceinline__ PsGemv ps_gemv(const unsigned long long* layers, int o, int H, int q_dim, int qkv_rows,
                                          int I, int n_q, int n_kv, float eps, const int* pos,
                                          const float2* cos_sin, float* h, __half* qkv, __half* attn_out,
                                          __half* act) {
  const int k = (o - 1) % PS_OPS_PER_LAYER;
  const unsigned long long* L = layers + (size_t)((o - 1) / PS_OPS_PER_LAYER) * PS_PTRS;
  auto W = [&](int j) { return reinterpret_cast<const unsigned char*>(L[j]); };
  auto S = [&](int j) { return reinterpret_cast<const float*>(L[j]); };
  PsGemv g;
  g.rope = RopeArgs{cos_sin, pos, reinterpret_cast<__half*>(L[10]), reinterpret_cast<__half*>(L[11]), n_q, n_kv, HD,
                    nullptr, 0ull, L2Head{}};
  if (k == PS_QKV) {
    g.a = GemvArgs{W(0), S(1), h, reinterpret_cast<const __half*>(L[2]), eps, qkv, qkv_rows / 2, H};
    g.rows = qkv_rows;
  } else if (k == PS_WO) {
    g.a = GemvArgs{W(3), S(4), attn_out, nullptr, eps, h, H, q_dim};
    g.rows = H;
  } else if (k == PS_WGU) {
    g.a = GemvArgs{W(5), S(6), h, reinterpret_cast<const __half*>(L[7]), eps, act, I, H};
    g.rows = 2 * I;
  } else {
    g.a = GemvArgs{W(8), S(9), act, nullptr, eps, h, H, I};
    g.rows = H;
  }
  return g;
}

// The consumers' side of ws_produce_split for one GEMV (x staged in xs): every unit as `meta` names it until the
// marker. A unit's 8 warp sums meet in `red` (double-buffered: one barrier per unit); threads 0-15 add them in warp
// order and store the row sums as LL slots, or, for a tile's last part, hand them to the reducer. Returns the count
// after the marker; `rq_n` counts the queue's entries.
template <bool FP8>
__device__ __forceinline__ int ps_consume_split(const WsRing& r, int K, const __half* xs, float* red, int n,
                                                const int* meta, int o, unsigned long long* ll, unsigned e,
                                                PsEntry* rq, unsigned long long* rfull, unsigned long long* rempty,
                                                int& rq_n) {
  using S = WsShape<FP8>;
  constexpr int NWC = GEMV_THREADS / AF_WARP;
  const int lane = threadIdx.x % AF_WARP, warp = threadIdx.x / AF_WARP, t = lane & 3;
  const int nunits = K / S::KU, ngroups = (K + 127) >> 7, spt = S::parts(K);
  for (int parity = 0;; parity ^= 1) {
    const int slot = n % r.NS;
    mbar_wait(r.full + slot, (unsigned)(n / r.NS) & 1u);
    const int u = meta[slot];
    float d[4] = {0.f, 0.f, 0.f, 0.f}, acc[2] = {0.f, 0.f};
    const int p = u % spt, g0 = p * S::GPS, off = (warp - g0) & (NWC - 1), G = g0 + off;
    if (u >= 0 && off < S::GPS && G < ngroups)
      ws_slot_mma<FP8, S::UPG>(d, acc, r.slots + (size_t)slot * S::SLOTB, off, G, xs, nunits, lane, t);
    __syncwarp();  // every lane has read the slot
    if (lane == 0) mbar_arrive(r.empty + slot);
    ++n;
    if (u < 0) return n;
    gemv_tiled_finish<FP8>(d, acc);
    float* part = red + parity * NWC * GEMV_TILE;
    if ((lane & 3) == 0) {
      part[warp * GEMV_TILE + (lane >> 2)] = acc[0];
      part[warp * GEMV_TILE + (lane >> 2) + 8] = acc[1];
    }
    sync_n<GEMV_THREADS>();
    if (threadIdx.x < GEMV_TILE) {
      float s = 0.f;
      for (int w = 0; w < NWC; ++w) s += part[w * GEMV_TILE + threadIdx.x];
      if (p < spt - 1) {
        ll_store(ll + 1 + (size_t)u * GEMV_TILE + threadIdx.x, s, e);
      } else {  // the tile's last part: to the reducer
        const int q = rq_n % PS_RQ;
        if (rq_n >= PS_RQ) mbar_wait(rempty + q, (unsigned)(rq_n / PS_RQ - 1) & 1u);
        rq[q].v[threadIdx.x] = s;
        if (threadIdx.x == 0) rq[q].u = u, rq[q].o = o;
        __syncwarp(0xffffu);
        if (threadIdx.x == 0) mbar_arrive(rfull + q);
        ++rq_n;
      }
    }
  }
}

// Thread 0 of the consumers: the end of the launch to the reducer (an entry with op -1).
__device__ __forceinline__ void ps_queue_end(PsEntry* rq, unsigned long long* rfull, unsigned long long* rempty,
                                             int rq_n) {
  if (threadIdx.x != 0) return;
  const int q = rq_n % PS_RQ;
  if (rq_n >= PS_RQ) mbar_wait(rempty + q, (unsigned)(rq_n / PS_RQ - 1) & 1u);
  rq[q].o = -1;
  mbar_arrive(rfull + q);
}

// Lanes 0-15 of the reducer: parts [0, np) of a tile's row (LL slots at `base`, stride 16) at epoch e, added in part
// order; PS_LL_BATCH slots asked at once (one L2 round trip), then the late ones waited for.
__device__ __forceinline__ float ps_sum_parts(const unsigned long long* base, int np, unsigned e) {
  float s = 0.f;
  for (int p0 = 0; p0 < np; p0 += PS_LL_BATCH) {
    unsigned long long w[PS_LL_BATCH];
#pragma unroll
    for (int j = 0; j < PS_LL_BATCH; ++j)
      if (p0 + j < np) w[j] = ll_load(base + (size_t)(p0 + j) * GEMV_TILE);
#pragma unroll
    for (int j = 0; j < PS_LL_BATCH; ++j) {
      if (p0 + j < np) {
        while ((unsigned)(w[j] >> 32) != e) w[j] = ll_load(base + (size_t)(p0 + j) * GEMV_TILE);
        s = p0 + j == 0 ? ll_value(w[j]) : s + ll_value(w[j]);
      }
    }
  }
  return s;
}

template <int EPI, int R>
__device__ __forceinline__ void ps_finish_rows(const PsGemv& g, int T, float s) {
  const float s1 = __shfl_sync(0xffffffffu, s, (threadIdx.x + 8) % AF_WARP);  // row r + 8 (R = 2)
  if (threadIdx.x % AF_WARP < GEMV_TILE / R)
    gemv_epilogue<EPI>(g.a, g.rope, T * (GEMV_TILE / R) + (int)(threadIdx.x % AF_WARP), s, R == 2 ? s1 : s);
}

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
  __shared__ int meta[GEMV_WS_MAX];  // dyn, split: each ring slot's tile or unit (ws_stream.cuh)
  __shared__ PsEntry rq[PS_RQ];      // split: the reducer's queue
  __shared__ __align__(8) unsigned long long rfull[PS_RQ], rempty[PS_RQ];
  if (threadIdx.x == 0) {
    for (int q = 0; q < PS_RQ; ++q) {
      mbar_init(rfull + q, 1);
      mbar_init(rempty + q, 1);
    }
    mbar_init_fence();
  }
  __syncthreads();  // the only whole-block barrier: the producer and the reducer leave below
  pdl_wait();       // a no-op: the step never launches this kernel with programmatic dependent launch
  const int warp = threadIdx.x / AF_WARP;
  const unsigned grid = gridDim.x;
  unsigned* grabs = counters + n_ops + 1;  // dyn, split: each op's tile or unit counter
  const int n_att = n_kv * BV;
  const bool split = mode == 2;
  // split: this launch's epoch; op o's slots carry e0 + o (never 0, the buffer's initial tag, in the first launch).
  // Every block reads it before its ticket, and only the last ticket counts it on.
  const unsigned e0 = split ? (unsigned)*(volatile unsigned long long*)ll * (unsigned)(n_ops + 1) + 1u : 0u;
  auto ntiles_of = [&](const PsGemv& g) { return g.rows / GEMV_TILE; };
  auto gemv_of = [&](int o) {
    return ps_gemv<HD>(layers, o, H, q_dim, qkv_rows, I, n_q, n_kv, eps, pos, cos_sin, h, qkv, attn_out, act);
  };
  // The last block out resets this launch's counters and the ticket (and counts the epoch on) for the next launch.
  auto ticket = [&]() {
    __threadfence();
    if (atomicAdd(counters + n_ops, 1u) == grid - 1) {
      for (int o = op_begin; o < op_end; ++o) counters[o] = grabs[o] = 0u;
      counters[n_ops] = 0u;
      if (split) ll[0] += 1ull;
      __threadfence();
    }
  };

  if (warp == NWC) {  // the producer: every GEMV's tiles (or units) of this block, op after op
    if (threadIdx.x % AF_WARP == 0) {
      int n = 0;
      for (int o = max(op_begin, 1); o < op_end; ++o) {
        if ((o - 1) % PS_OPS_PER_LAYER == PS_ATT) continue;
        const PsGemv g = gemv_of(o);
        const int nt = ntiles_of(g);
        const GemvArgs& a = g.a;
        n = mode == 2   ? ws_produce_split<FP8>(ring, a.W, a.scales, a.K, nt, n, grabs + o, meta)
            : mode == 1 ? ws_produce_dyn<FP8>(ring, a.W, a.scales, a.K, nt, n, grabs + o, meta)
                        : ws_produce<FP8>(ring, a.W, a.scales, a.K, nt, n);
      }
    }
    return;
  }

  if (warp == NWC + 1) {  // the reducer (split): each tile's parts added, its epilogue, the tile counted done
    if (!split) return;
    const int lane = threadIdx.x % AF_WARP;
    for (int rq_n = 0;; ++rq_n) {
      const int q = rq_n % PS_RQ;
      mbar_wait(rfull + q, (unsigned)(rq_n / PS_RQ) & 1u);
      const int o = rq[q].o, u = rq[q].u;
      const float own = rq[q].v[lane % GEMV_TILE];
      __syncwarp();
      if (lane == 0) mbar_arrive(rempty + q);
      if (o < 0) break;
      const PsGemv g = gemv_of(o);
      const int spt = WsShape<FP8>::parts(g.a.K), T = u / spt;
      const unsigned e = e0 + (unsigned)o;
      float s = own;
      if (spt > 1 && lane < GEMV_TILE)
        s = ps_sum_parts(ll + 1 + (size_t)T * spt * GEMV_TILE + lane, spt - 1, e) + own;
      const int k = (o - 1) % PS_OPS_PER_LAYER;
      if (k == PS_QKV) ps_finish_rows<EPI_ROPE, 2>(g, T, s);
      else if (k == PS_WGU) ps_finish_rows<EPI_SWIGLU, 2>(g, T, s);
      else ps_finish_rows<EPI_RESID, 1>(g, T, s);
      __syncwarp();  // the epilogue's stores, then one fence and the count
      if (lane == 0) {
        if (trace != nullptr)  // stamped before the count: a successor that saw the count starts after it
          atomicMax(trace + 1 + ((size_t)o * gridDim.x + blockIdx.x) * 2 + 1, atomicAdd(trace, 1u) + 1u);
        __threadfence();
        atomicAdd(counters + o, 1u);
      }
    }
    if (lane == 0) ticket();
    return;
  }

  const bool att_block = (int)blockIdx.x >= (int)gridDim.x - n_att;
  int n = 0, rq_n = 0;
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
    const bool waits = o > op_begin;  // an op of an earlier launch is complete (the kernel boundary)
    // what op o - 1 counts when it is complete: blocks (the embedding, the attention, the graph's tiling) or tiles
    unsigned target = grid;
    if (o - 1 > 0 && (o - 2) % PS_OPS_PER_LAYER == PS_ATT) target = (unsigned)n_att;
    else if (split && o - 1 > 0) target = (unsigned)ntiles_of(gemv_of(o - 1));
    if (k == PS_ATT) {
      if (!att_block) continue;  // neither waits nor counts
      const unsigned long long* L = layers + (size_t)((o - 1) / PS_OPS_PER_LAYER) * PS_PTRS;
      __half* k_cache = reinterpret_cast<__half*>(L[10]);
      __half* v_cache = reinterpret_cast<__half*>(L[11]);
      auto wait = [&]() {
        if (waits) ps_wait(counters + o - 1, target);
        ps_stamp(trace, o, 0);
      };
      attention_short_item<HD, BG, GEMV_THREADS, BV, GEMV_THREADS>(qkv, k_cache, v_cache, *pos + 1,
                                                      (int)blockIdx.x - ((int)gridDim.x - n_att), attn_out, n_kv,
                                                      att_cap, scale, reinterpret_cast<char*>(smem_raw), wait);
      ps_stamp(trace, o, 1);
      ps_signal(counters + o);
      continue;
    }
    const PsGemv g = gemv_of(o);
    const GemvArgs& a = g.a;
    const RopeArgs& rope = g.rope;
    const bool norm = k == PS_QKV || k == PS_WGU;
    NormRegs nr{};
    if (norm) nr = norm_w_regs<PRO_NORM, GEMV_THREADS>(a);  // a weight: before the wait
    if (waits) ps_wait(counters + o - 1, target);
    ps_stamp(trace, o, 0);
    if (split) {
      if (norm) stage_x_tiled<PRO_NORM, STAGE_REGS, GEMV_THREADS>(a, xs, rs, nullptr, nullptr, nr);
      else stage_x_tiled<PRO_PLAIN, STAGE_REGS, GEMV_THREADS>(a, xs, rs, nullptr, nullptr, nr);
      n = ps_consume_split<FP8>(ring, a.K, xs, red, n, meta, o, ll, e0 + (unsigned)o, rq, rfull, rempty, rq_n);
      continue;  // the reducer counts the op's tiles and stamps its end
    }
    const int dyn = mode == 1;
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
  if (split) {
    ps_queue_end(rq, rfull, rempty, rq_n);  // the reducer takes the ticket once it has finished every tile
  } else if (threadIdx.x == 0) {
    ticket();
  }
}
#define PS_BODY(FP8, HD, G)                                                                                \
  decode_persist_body<FP8, HD, G>(layers, op_begin, op_end, n_ops, H, q_dim, qkv_rows, I, n_q, n_kv, eps,    \
                                  scale, att_cap, a_bytes, embed, cur_token, pos, cos_sin, h, qkv, attn_out, \
                                  act, counters, trace, mode, ll);
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
  extern "C" __global__ void __launch_bounds__(PS_THREADS, 1) NAME(PS_PARAMS) { PS_BODY(FP8, HD, G) }

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
