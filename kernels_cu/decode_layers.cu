// decode_layers.cu — the embedding and every transformer layer of one decode step in ONE persistent launch.
//
// Computes   h = emb[*token]; for each layer l (phases, separated by grid-wide barriers):
//              A  qkv = RoPE(W_qkv . RMSNorm(h)), K/V appended to the cache at pos    (EPI_ROPE)
//              B  attn_out = GQA attention over cache[0..pos]                         (attention_item)
//              C  h += W_o . attn_out                                                 (EPI_RESID)
//              D  act = silu(W_gate . RMSNorm(h)) * (W_up . RMSNorm(h))               (EPI_SWIGLU)
//              E  h += W_down . act                                                   (EPI_RESID)
//            then xnorm = RMSNorm(h) * final_norm (block 0). lm_head and argmax stay separate launches.
//            Same math as the standalone kernels: Fp16W/Fp8W dot products, gemv_epilogue, attention_item.
// Scheme     Warp-specialised. One PRODUCER warp per block walks the block's weight rows for the whole step
//            (every layer, every GEMV phase, in consumption order) and streams them into a ring of
//            shared-memory slots with TMA bulk copies (cp.async.bulk, completion on a per-slot "full"
//            mbarrier); it waits only for a slot to be released ("empty" mbarrier), never for the grid
//            barriers, so DRAM keeps streaming the next phases' weights while the consumers synchronise,
//            run attention or stage x. The 8 CONSUMER warps sync among themselves with named barrier 1
//            and across the grid with a release/acquire counter (GridBarrier); tile t goes to consumer warp
//            t % 8 (n_slots is a multiple of 8 and of the producer lanes, so a slot is always filled by the
//            same lane and consumed by the same warp, in order),
//            which computes the dot products from shared memory, runs the epilogue and releases the slot.
//            Why: v5 (each warp loading its own rows after each barrier) measured slower than one kernel
//            per op: ~27 µs per layer of barrier + prologue latency added to the streaming time.
// Status     correct (engine tests vs the NumPy reference) but measured SLOWER than the split step (H100,
//            3B W8A16: 2.40 vs 2.16 ms; results/PERF_NOTES.md v6), so it is opt-in (`run --step fused`).
// Layouts    layers: LayerW[n_layers] (device table of this layer's weight / scale / cache pointers, filled by
//            the host); weights row-major [rows, K] (fp16, or fp8 + fp32 scales [rows, ceil(K/128)]); a
//            GEMV phase gives block b the outputs [b*n/G, (b+1)*n/G); a tile = one output's R weight rows
//            (+ for fp8 each row's scales, copied from a 16-byte aligned window). h fp32 [H]; qkv fp16
//            [qkv_dim] (q, k, v heads, post-RoPE); attn_out fp16 [q_dim]; act fp16 [I]; xnorm fp16 [H].
//            probes (optional, 0 = off; validation only): fp32 [H + n_layers * P], P = qkv_dim + q_dim + 2H
//            + I: embed, then per layer q|k|v, attn_out, h after o_proj, act, h after down_proj.
//            Dynamic shared memory: [union: x staging | attention scratch][ring: n_slots x slot_bytes]
//            [2 x n_slots mbarriers].
// Bytes      all layer weights (+ fp8 scales) once, K/V rows 0..pos once per layer, activations from L2.
// Launch     decode_layers_{f16,f8}_hd{64,128}_g{1,2,3,4}: cooperative, grid = #SMs (one block per SM),
//            block = (PK_CONSUMERS + 1) * 32 (default 8 consumer warps + 1 producer warp); sm_90..sm_10x;
//            attention items run on consumer warps 0..7. sync_counter: uint32, 0
//            before the launch; the kernel leaves it 0.
#ifndef PK_CONSUMERS
#define PK_CONSUMERS 8       // consumer warps (the host reads an override from ATOMFLOW_KERNEL_DEFINES)
#endif
#ifndef PK_PRODUCER_LANES
#define PK_PRODUCER_LANES 1   // producer-warp lanes issuing tiles (tile t: lane t % PK_PRODUCER_LANES); must divide
#endif                        // n_slots so one lane refills a slot, in order. Measured: 8 lanes 2.49 ms, 1 lane 2.40
#define PK_ATT_WARPS 8        // attention items run on consumer warps 0..7 (named barrier 2)
#define PK_THREADS ((PK_CONSUMERS + 1) * 32)
#define AF_CTA_THREADS (PK_CONSUMERS * 32)
#define AF_CTA_SYNC() asm volatile("bar.sync 1, %0;" ::"n"(PK_CONSUMERS * 32) : "memory")
#define AF_ATT_SYNC() asm volatile("bar.sync 2, %0;" ::"n"(PK_ATT_WARPS * 32) : "memory")
#include "gemv_common.cuh"
#include "attention_common.cuh"

struct LayerW {  // 16 pointers, mirrored by atomflow_bench/step.py LAYER_FIELDS
  const unsigned char* wqkv;
  const float* sqkv;
  const __half* attn_norm;
  const unsigned char* wo;
  const float* so;
  const unsigned char* wgu;
  const float* sgu;
  const __half* mlp_norm;
  const unsigned char* wd;
  const float* sd;
  __half* k_cache;
  __half* v_cache;
  unsigned int* att_counters;
  const void* unused[3];
};

// ---- mbarrier + TMA bulk copy (sm_90+) ----
__device__ __forceinline__ unsigned int smem_addr(const void* p) { return (unsigned int)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(unsigned long long* b, unsigned int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* b, unsigned int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* b, unsigned int parity) {
  asm volatile(
      "{\n"
      ".reg .pred P1;\n"
      "LAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra DONE;\n"
      "bra LAB_WAIT;\n"
      "DONE:\n"
      "}\n" ::"r"(smem_addr(b)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, unsigned int bytes, unsigned long long* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(b))
               : "memory");
}

// The ring of weight tiles shared by the producer and the consumers of one block.
struct Ring {
  unsigned char* base;
  unsigned long long* full;
  unsigned long long* empty;
  unsigned int n_slots, slot_bytes;
};

// Scale window of weight row `row`: the 16-byte aligned span holding its ng fp32 scales.
__device__ __forceinline__ void scale_window(int row, int ng, size_t& start, unsigned int& len, unsigned int& skip) {
  const size_t s = (size_t)row * ng * 4, a = s & ~(size_t)15, e = (s + (size_t)ng * 4 + 15) & ~(size_t)15;
  start = a;
  len = (unsigned int)(e - a);
  skip = (unsigned int)(s - a);
}
__device__ __forceinline__ int scale_seg(int ng) { return ((ng * 4 + 15) & ~15) + 16; }  // bytes per row window

// A GEMV phase gives block b the outputs [o0, o0 + n): a balanced contiguous share.
__device__ __forceinline__ int phase_tiles(int n_out, int& o0) {
  o0 = (int)((long long)blockIdx.x * n_out / gridDim.x);
  return (int)((long long)(blockIdx.x + 1) * n_out / gridDim.x) - o0;
}

// PRODUCER: issue one GEMV phase's tiles of this block (lane t % PK_PRODUCER_LANES of the producer warp).
template <int R, int EPI, bool SCALED>
__device__ __forceinline__ void produce_phase(const Ring& ring, unsigned int& t, const unsigned char* W,
                                              const float* scales, int n_out, int K, int bpw, int half_d) {
  int o0;
  const int n = phase_tiles(n_out, o0);
  const size_t row_bytes = (size_t)K * bpw;
  const int ng = (K + 127) >> 7, seg = scale_seg(ng);
  const unsigned int lane = threadIdx.x % AF_WARP;
  for (int i = 0; i < n; ++i, ++t) {
    if (t % PK_PRODUCER_LANES != lane) continue;  // slot t % n_slots always belongs to this lane
    const unsigned int slot = t % ring.n_slots;
    if (t >= ring.n_slots) mbar_wait(ring.empty + slot, ((t / ring.n_slots) - 1) & 1);
    unsigned char* dst = ring.base + (size_t)slot * ring.slot_bytes;
    size_t sstart[R];
    unsigned int slen[R], sskip[R], bytes = (unsigned int)(R * row_bytes);
    if (SCALED) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        scale_window((int)gemv_row<EPI>(o0 + i, r, n_out, half_d), ng, sstart[r], slen[r], sskip[r]);
        bytes += slen[r];
      }
    }
    mbar_expect_tx(ring.full + slot, bytes);
#pragma unroll
    for (int r = 0; r < R; ++r)
      bulk_g2s(dst + r * row_bytes, W + gemv_row<EPI>(o0 + i, r, n_out, half_d) * row_bytes, (unsigned int)row_bytes,
               ring.full + slot);
    if (SCALED) {
#pragma unroll
      for (int r = 0; r < R; ++r)
        bulk_g2s(dst + R * row_bytes + r * seg, reinterpret_cast<const unsigned char*>(scales) + sstart[r], slen[r],
                 ring.full + slot);
    }
  }
}

// CONSUMERS: one GEMV phase. Sync (grid barrier, probes), stage x in shared memory, then each warp takes
// every PK_CONSUMERS-th tile of the block: wait for it, dot products from shared memory, epilogue, release.
template <class WF, int PRO, int EPI, class Sync>
__device__ __forceinline__ void consume_phase(const GemvArgs a, const RopeArgs rope, const Sync sync, const Ring& ring,
                                              unsigned int& t, unsigned char* xs_raw) {
  constexpr int R = (EPI == EPI_SWIGLU || EPI == EPI_ROPE) ? 2 : 1;
  constexpr int BPW = 16 / WF::PER_CHUNK;
  const int K = a.K;
  __half* xs = reinterpret_cast<__half*>(xs_raw);
  float* red = reinterpret_cast<float*>(xs_raw + ((K * sizeof(__half) + 15) & ~15));
  sync.arrive_wait();
  gemv_stage_x<PRO>(a, xs, red);
  int o0;
  const int n = phase_tiles(a.n_out, o0);
  const int warp = threadIdx.x / AF_WARP, lane = threadIdx.x % AF_WARP;
  const int half_d = EPI == EPI_ROPE ? rope.hd / 2 : 1;
  const size_t row_bytes = (size_t)K * BPW;
  const int nchunks = K / WF::PER_CHUNK, ng = (K + 127) >> 7, seg = scale_seg(ng);
  // Tile tt goes to warp tt % PK_CONSUMERS and slot tt % n_slots, n_slots a multiple of PK_CONSUMERS: every
  // slot is always consumed by the same warp, in order, so when a warp waits on a slot the slot's previous
  // tile has landed and been consumed (by that warp), and the parity wait below is never two phases behind.
  for (int i = (int)((warp + PK_CONSUMERS - t % PK_CONSUMERS) % PK_CONSUMERS); i < n; i += PK_CONSUMERS) {
    const unsigned int tt = t + i, slot = tt % ring.n_slots;
    mbar_wait(ring.full + slot, (tt / ring.n_slots) & 1);
    const unsigned char* tile = ring.base + (size_t)slot * ring.slot_bytes;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const unsigned char* wrow = tile + r * row_bytes;
      const float* sc = nullptr;
      if (WF::SCALED) {
        size_t st;
        unsigned int len, skip;
        scale_window((int)gemv_row<EPI>(o0 + i, r, a.n_out, half_d), ng, st, len, skip);
        sc = reinterpret_cast<const float*>(tile + R * row_bytes + r * seg + skip);
      }
      float s = 0.f;
#ifdef PK_TIMING_NO_MATH  // measurement instrument only (wrong results): stream and sync without the dot products
      if (sc == reinterpret_cast<const float*>(xs)) s = 1.f;
#else
#pragma unroll 4
      for (int c = lane; c < nchunks; c += AF_WARP) {
        const float d = WF::dot(*reinterpret_cast<const uint4*>(wrow + (size_t)c * 16), xs, c * WF::PER_CHUNK);
        s += WF::SCALED ? d * sc[(c * WF::PER_CHUNK) >> 7] : d;
      }
#endif
      acc[r] = warp_sum(s);
    }
    __syncwarp();
    if (lane == 0) {
      mbar_arrive(ring.empty + slot);  // the tile's bytes are consumed (all lanes passed the warp_sum)
      gemv_epilogue<EPI>(a, rope, o0 + i, acc[0], acc[R - 1]);
    }
  }
  t += n;
}

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

// dst[0..n) = src[0..n) as fp32, spread over the whole grid's consumers (validation probes only).
template <class T>
__device__ __forceinline__ void probe_copy(float* dst, const T* src, int n) {
  if (dst == nullptr) return;
  for (int i = blockIdx.x * AF_CTA_THREADS + threadIdx.x; i < n; i += gridDim.x * AF_CTA_THREADS)
    dst[i] = to_f32(__ldcg(src + i));
}

// Barrier, then (validation only) copy the previous phase's output to its probe slot.
template <class T>
struct ProbeBarrier {
  GridBarrier bar;
  float* dst;
  const T* src;
  int n;
  __device__ __forceinline__ void arrive_wait() const {
    bar.arrive_wait();
    probe_copy(dst, src, n);
  }
};

// The first phase's sync: wait for the previous step's argmax (token), embed, barrier.
struct EmbedBarrier {
  GridBarrier bar;
  const int* token;
  const __half* emb;
  float* h;
  int H;
  float* probe;
  __device__ __forceinline__ void arrive_wait() const {
    pdl_wait();
    const size_t base = (size_t)(*token) * H;
    for (int i = blockIdx.x * AF_CTA_THREADS + threadIdx.x; i < H; i += gridDim.x * AF_CTA_THREADS)
      h[i] = __half2float(emb[base + i]);
    bar.arrive_wait();
    probe_copy(probe, h, H);
  }
};

template <class WF, int HD, int G>
__device__ __forceinline__ void decode_layers_impl(
    const LayerW* __restrict__ layers, int n_layers, const int* __restrict__ token, const __half* __restrict__ emb,
    const float2* __restrict__ cos_sin, const int* __restrict__ pos, float* h, __half* qkv, __half* attn_out,
    __half* act, __half* xnorm, const __half* __restrict__ final_norm, float* att_ml, float* att_o, int max_splits,
    unsigned int* sync_counter, float* probes, int H, int I, int n_q, int n_kv, float eps, float scale,
    int n_slots, int slot_bytes, int union_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && __CUDA_ARCH__ < 1200
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ float red[32];
  Ring ring{smem_raw + union_bytes, nullptr, nullptr, (unsigned int)n_slots, (unsigned int)slot_bytes};
  ring.full = reinterpret_cast<unsigned long long*>(ring.base + (size_t)n_slots * slot_bytes);
  ring.empty = ring.full + n_slots;
  if (threadIdx.x == 0) {
    for (int i = 0; i < n_slots; ++i) {
      mbar_init(ring.full + i, 1);
      mbar_init(ring.empty + i, 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();  // the only whole-block barrier: mbarriers initialised before anyone uses them
  const int q_dim = n_q * HD, qkv_dim = q_dim + 2 * n_kv * HD;
  constexpr int BPW = 16 / WF::PER_CHUNK;
  unsigned int t = 0;  // tiles of this block so far (producer and consumers count the same sequence)

  if (threadIdx.x / AF_WARP == PK_CONSUMERS) {  // ---- producer warp ----
    if (threadIdx.x % AF_WARP < PK_PRODUCER_LANES) {
      for (int l = 0; l < n_layers; ++l) {
        const LayerW* w = layers + l;
        produce_phase<2, EPI_ROPE, WF::SCALED>(ring, t, w->wqkv, w->sqkv, qkv_dim / 2, H, BPW, HD / 2);
        produce_phase<1, EPI_RESID, WF::SCALED>(ring, t, w->wo, w->so, H, q_dim, BPW, 1);
        produce_phase<2, EPI_SWIGLU, WF::SCALED>(ring, t, w->wgu, w->sgu, I, H, BPW, 1);
        produce_phase<1, EPI_RESID, WF::SCALED>(ring, t, w->wd, w->sd, H, I, BPW, 1);
      }
    }
    return;
  }

  // ---- consumer warps ----
  const size_t P = (size_t)qkv_dim + q_dim + 2 * H + I;  // probe floats per layer
  unsigned int phase = 0;                                  // grid barriers so far
  for (int l = 0; l < n_layers; ++l) {
    // Fields of the layer table are read where used (after each barrier), not held in registers.
    const LayerW* w = layers + l;
    float* pl = probes ? probes + H + (size_t)l * P : nullptr;
    float* prev_mlp = nullptr;  // probe slot of h before this layer: the embedding or the previous mlp
    if (probes) prev_mlp = l == 0 ? probes : probes + H + (size_t)(l - 1) * P + qkv_dim + q_dim + H + I;
    const RopeArgs rope{cos_sin, pos, w->k_cache, w->v_cache, n_q, n_kv, HD};
    // A: QKV + RoPE + KV append (needs h: the embedding or the previous layer's down_proj)
    const GemvArgs qa{w->wqkv, w->sqkv, h, w->attn_norm, eps, qkv, qkv_dim / 2, H};
    if (l == 0)
      consume_phase<WF, PRO_NORM, EPI_ROPE>(qa, rope, EmbedBarrier{{sync_counter, ++phase}, token, emb, h, H, prev_mlp},
                                            ring, t, smem_raw);
    else
      consume_phase<WF, PRO_NORM, EPI_ROPE>(qa, rope, ProbeBarrier<float>{{sync_counter, ++phase}, prev_mlp, h, H},
                                            ring, t, smem_raw);
    // B: attention (the producer keeps streaming o_proj and gate/up rows meanwhile)
    ProbeBarrier<__half>{{sync_counter, ++phase}, pl, qkv, qkv_dim}.arrive_wait();
    {
      const int len = *pos + 1;
      const int n_items = n_kv * ((len + ATT_CHUNK - 1) / ATT_CHUNK);
      for (int it = blockIdx.x; it < n_items && threadIdx.x < PK_ATT_WARPS * AF_WARP; it += gridDim.x) {
        AF_ATT_SYNC();  // the previous item's shared memory is free
        attention_item<HD, G, PK_ATT_WARPS * AF_WARP, true>(qkv, w->k_cache, w->v_cache, len, it % n_kv, it / n_kv, att_ml,
                                                    att_o, w->att_counters, attn_out, n_kv, max_splits, scale,
                                                    reinterpret_cast<float*>(smem_raw));
      }
    }
    // C: o_proj + residual
    consume_phase<WF, PRO_PLAIN, EPI_RESID>(
        GemvArgs{w->wo, w->so, attn_out, nullptr, eps, h, H, q_dim}, RopeArgs{},
        ProbeBarrier<__half>{{sync_counter, ++phase}, pl ? pl + qkv_dim : nullptr, attn_out, q_dim}, ring, t, smem_raw);
    // D: gate/up + SwiGLU
    consume_phase<WF, PRO_NORM, EPI_SWIGLU>(
        GemvArgs{w->wgu, w->sgu, h, w->mlp_norm, eps, act, I, H}, RopeArgs{},
        ProbeBarrier<float>{{sync_counter, ++phase}, pl ? pl + qkv_dim + q_dim : nullptr, h, H}, ring, t, smem_raw);
    // E: down_proj + residual
    consume_phase<WF, PRO_PLAIN, EPI_RESID>(
        GemvArgs{w->wd, w->sd, act, nullptr, eps, h, H, I}, RopeArgs{},
        ProbeBarrier<__half>{{sync_counter, ++phase}, pl ? pl + qkv_dim + q_dim + H : nullptr, act, I}, ring, t,
        smem_raw);
  }
  // final RMSNorm (block 0) once every block's down_proj is done
  float* last_mlp = probes ? probes + H + (size_t)(n_layers - 1) * P + qkv_dim + q_dim + H + I : nullptr;
  ProbeBarrier<float>{{sync_counter, ++phase}, last_mlp, h, H}.arrive_wait();
  if (blockIdx.x == 0) rmsnorm_to_half(h, final_norm, eps, H, xnorm, red);
  // Leave the counter at 0 for the next launch: the last block to arrive here resets it (every other
  // block has passed its last wait, so nobody reads the counter any more).
  if (threadIdx.x == 0) {
    const unsigned int old = atomicAdd(sync_counter, 1u);
    if (old == (phase + 1) * gridDim.x - 1) atomicExch(sync_counter, 0u);
  }
  pdl_launch_dependents();  // only now: lm_head's blocks must not take SM slots before all of ours ran
#else
  __trap();  // TMA + a ~200 KB ring: sm_90..sm_10x only (sm_89: no TMA; sm_12x: ~100 KB shared memory per SM);
            // the host uses the split step there (step.py fused_supported)
#endif
}

#define DECODE_LAYERS_INSTANCE(F, WF, HD, G)                                                              \
  extern "C" __global__ void __launch_bounds__(PK_THREADS, 1) decode_layers_##F##_hd##HD##_g##G(           \
      const LayerW* __restrict__ layers, int n_layers, const int* __restrict__ token,                      \
      const __half* __restrict__ emb, const float2* __restrict__ cos_sin, const int* __restrict__ pos,     \
      float* h, __half* qkv, __half* attn_out, __half* act, __half* xnorm,                                 \
      const __half* __restrict__ final_norm, float* att_ml, float* att_o, int max_splits,                  \
      unsigned int* sync_counter, float* probes, int H, int I, int n_q, int n_kv, float eps, float scale,  \
      int n_slots, int slot_bytes, int union_bytes) {                                                      \
    decode_layers_impl<WF, HD, G>(layers, n_layers, token, emb, cos_sin, pos, h, qkv, attn_out, act, xnorm, \
                                  final_norm, att_ml, att_o, max_splits, sync_counter, probes, H, I, n_q,   \
                                  n_kv, eps, scale, n_slots, slot_bytes, union_bytes);                      \
  }

DECODE_LAYERS_INSTANCE(f16, Fp16W, 64, 1)
DECODE_LAYERS_INSTANCE(f16, Fp16W, 64, 2)
DECODE_LAYERS_INSTANCE(f16, Fp16W, 64, 3)
DECODE_LAYERS_INSTANCE(f16, Fp16W, 64, 4)
DECODE_LAYERS_INSTANCE(f16, Fp16W, 128, 1)
DECODE_LAYERS_INSTANCE(f16, Fp16W, 128, 2)
DECODE_LAYERS_INSTANCE(f16, Fp16W, 128, 3)
DECODE_LAYERS_INSTANCE(f16, Fp16W, 128, 4)
DECODE_LAYERS_INSTANCE(f8, Fp8W, 64, 1)
DECODE_LAYERS_INSTANCE(f8, Fp8W, 64, 2)
DECODE_LAYERS_INSTANCE(f8, Fp8W, 64, 3)
DECODE_LAYERS_INSTANCE(f8, Fp8W, 64, 4)
DECODE_LAYERS_INSTANCE(f8, Fp8W, 128, 1)
DECODE_LAYERS_INSTANCE(f8, Fp8W, 128, 2)
DECODE_LAYERS_INSTANCE(f8, Fp8W, 128, 3)
DECODE_LAYERS_INSTANCE(f8, Fp8W, 128, 4)
