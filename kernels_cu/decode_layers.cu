// decode_layers.cu — the embedding and every transformer layer of one decode step in ONE persistent launch.
//
// Computes   h = emb[*token]; for each layer l (phases, separated by grid-wide barriers):
//              A  qkv = RoPE(W_qkv . RMSNorm(h)), K/V appended to the cache at pos    (gemv_phase, EPI_ROPE)
//              B  attn_out = GQA attention over cache[0..pos]                         (attention_item)
//              C  h += W_o . attn_out                                                 (gemv_phase, EPI_RESID)
//              D  act = silu(W_gate . RMSNorm(h)) * (W_up . RMSNorm(h))               (gemv_phase, EPI_SWIGLU)
//              E  h += W_down . act                                                   (gemv_phase, EPI_RESID)
//            then xnorm = RMSNorm(h) * final_norm (block 0). lm_head and argmax stay separate launches.
//            The math of every phase is the same device code as the standalone kernels (gemv_common.cuh,
//            attention_common.cuh); only the synchronisation differs.
// Why        Measured (results/PERF_NOTES.md v4): each standalone GEMV streams at ~3.5 TB/s once running but
//            pays 4-8 µs of launch, ramp-up and drain, x 112 GEMVs per step. Here a phase boundary is a
//            barrier (one atomic + a poll, ~1-2 µs) and, before arriving at it, every warp has already
//            issued its first weight loads of the next phase into registers and prefetched the rest of
//            that output's rows into L2 (weights never depend on the previous phase), so DRAM keeps
//            streaming through the boundary. While attention runs (little DRAM traffic at short
//            context) every warp prefetches its first o_proj rows into L2.
// Layouts    layers: LayerW[n_layers] (device table of this layer's weight / scale / cache pointers, filled
//            by the host); weights as in gemv_common.cuh; h fp32 [H]; qkv fp16 [qkv_dim] (q heads, k heads,
//            v heads, post-RoPE); attn_out fp16 [q_dim]; act fp16 [I]; xnorm fp16 [H]; caches per layer
//            [max_seq][n_kv*hd]; att_ml/att_o split partials as attention.cu.
//            probes (optional, 0 = off; validation only): fp32 [H + n_layers * P], P = qkv_dim + q_dim + 2H
//            + I: embed, then per layer q|k|v, attn_out, h after o_proj, act, h after down_proj.
// Bytes      all layer weights (+ fp8 scales) once, K/V rows 0..pos once per layer, activations from L2.
// Launch     decode_layers_{f16,f8}_hd{64,128}_g{1,2,3,4,8}: cooperative (all blocks co-resident; grid =
//            #SMs x resident blocks per SM, at most 2), block = 256, dyn. smem = max(GEMV x staging
//            max(H, q_dim, I) * 2 + 128, attention 4 * attention_smem_floats<hd, G, 256>) bytes.
//            sync_counter: uint32, 0 before the launch; the kernel leaves it 0.
#include "gemv_common.cuh"
#include "attention_common.cuh"

#define PK_THREADS 256
#ifndef PK_MIN_BLOCKS
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
#define PK_MIN_BLOCKS 1   // sm_120 code needs more than 128 registers without spills: one block per SM
#else
#define PK_MIN_BLOCKS 2   // 2 x 256 threads per SM: <= 128 registers per thread, no spills (sm_89, sm_90)
#endif
#endif
#ifndef PK_LOADS
#define PK_LOADS 4        // 16-byte weight loads per lane per iteration (the L2 prefetch supplies the depth)
#endif
#ifndef PK_PF_BYTES
#define PK_PF_BYTES 0     // L2 prefetch look-ahead per warp (bytes of its next output's rows); measured
#endif                    // slower on (v5: 2.50 ms with 8192, 2.39 ms off, 3B fp8), so off by default

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

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

// dst[0..n) = src[0..n) as fp32, spread over the whole grid (validation probes only).
template <class T>
__device__ __forceinline__ void probe_copy(float* dst, const T* src, int n) {
  if (dst == nullptr) return;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) dst[i] = to_f32(__ldcg(src + i));
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
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < H; i += gridDim.x * blockDim.x)
      h[i] = __half2float(emb[base + i]);
    bar.arrive_wait();
    probe_copy(probe, h, H);
  }
};

// Each phase is its own (non-inlined) function so that the register allocator sizes it alone: the
// kernel needs the maximum over phases, not the sum of everything live across one huge inlined body.
template <class WF, int PRO, int EPI, class Sync>
__device__ __forceinline__ void pk_gemv(GemvArgs a, const RopeArgs rope, const Sync sync) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
#ifdef PK_TIMING_NO_GEMV  // measurement instrument only (wrong results): phases without weight rows, so the
  a.n_out = 0;            // step time is barriers + prologues + attention alone
#endif
  gemv_phase<WF, PRO, EPI, PK_LOADS, PK_PF_BYTES>(a, rope, sync, smem_raw);
}

// Attention phase: L2-prefetch this warp's first o_proj rows (DRAM is nearly idle during attention at
// short context), sync, then the (kv head, split) items spread over the blocks.
template <class WF, int HD, int G>
__device__ __forceinline__ void pk_attention(const GemvArgs o_proj, const ProbeBarrier<__half> sync, const __half* qkv,
                                          const __half* k_cache, const __half* v_cache, const int* pos,
                                          float* att_ml, float* att_o, unsigned int* counters, __half* out,
                                          int n_kv, int max_splits, float scale) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int gw = blockIdx.x * (blockDim.x / AF_WARP) + threadIdx.x / AF_WARP;
  if (PK_PF_BYTES > 0)
    gemv_l2_prefetch<1, EPI_RESID>(o_proj, gw, 1, (size_t)o_proj.K * (16 / WF::PER_CHUNK), 0, 1u << 30);
  sync.arrive_wait();
  const int len = *pos + 1;
  const int n_items = n_kv * ((len + ATT_CHUNK - 1) / ATT_CHUNK);
  for (int it = blockIdx.x; it < n_items; it += gridDim.x) {
    __syncthreads();  // the previous item's shared memory is free
    attention_item<HD, G, PK_THREADS, true>(qkv, k_cache, v_cache, len, it % n_kv, it / n_kv, att_ml, att_o, counters,
                                      out, n_kv, max_splits, scale, reinterpret_cast<float*>(smem_raw));
  }
}

template <class WF, int HD, int G>
__device__ __forceinline__ void decode_layers_impl(
    const LayerW* __restrict__ layers, int n_layers, const int* __restrict__ token, const __half* __restrict__ emb,
    const float2* __restrict__ cos_sin, const int* __restrict__ pos, float* h, __half* qkv, __half* attn_out,
    __half* act, __half* xnorm, const __half* __restrict__ final_norm, float* att_ml, float* att_o, int max_splits,
    unsigned int* sync_counter, float* probes, int H, int I, int n_q, int n_kv, float eps, float scale) {
  __shared__ float red[32];
  const int q_dim = n_q * HD, qkv_dim = q_dim + 2 * n_kv * HD;
  const size_t P = (size_t)qkv_dim + q_dim + 2 * H + I;  // probe floats per layer
  unsigned int phase = 0;                                  // barriers so far

  for (int l = 0; l < n_layers; ++l) {
    // Fields of the layer table are read where used (after each barrier), not held in registers across
    // the whole layer: that keeps the kernel within 128 registers without spills.
    const LayerW* w = layers + l;
    float* pl = probes ? probes + H + (size_t)l * P : nullptr;
    float* prev_mlp = nullptr;  // probe slot of h before this layer: the embedding or the previous mlp
    if (probes) prev_mlp = l == 0 ? probes : probes + H + (size_t)(l - 1) * P + qkv_dim + q_dim + H + I;
    const RopeArgs rope{cos_sin, pos, w->k_cache, w->v_cache, n_q, n_kv, HD};
    // A: QKV + RoPE + KV append (needs h: the embedding or the previous layer's down_proj)
    const GemvArgs qa{w->wqkv, w->sqkv, h, w->attn_norm, eps, qkv, qkv_dim / 2, H};
    if (l == 0)
      pk_gemv<WF, PRO_NORM, EPI_ROPE>(qa, rope, EmbedBarrier{{sync_counter, ++phase}, token, emb, h, H, prev_mlp});
    else
      pk_gemv<WF, PRO_NORM, EPI_ROPE>(qa, rope, ProbeBarrier<float>{{sync_counter, ++phase}, prev_mlp, h, H});
    // B: attention
    const GemvArgs oa{w->wo, w->so, attn_out, nullptr, eps, h, H, q_dim};
    pk_attention<WF, HD, G>(oa, ProbeBarrier<__half>{{sync_counter, ++phase}, pl, qkv, qkv_dim}, qkv, w->k_cache,
                            w->v_cache, pos, att_ml, att_o, w->att_counters, attn_out, n_kv, max_splits, scale);
    // C: o_proj + residual
    pk_gemv<WF, PRO_PLAIN, EPI_RESID>(
        oa, RopeArgs{}, ProbeBarrier<__half>{{sync_counter, ++phase}, pl ? pl + qkv_dim : nullptr, attn_out, q_dim});
    // D: gate/up + SwiGLU
    pk_gemv<WF, PRO_NORM, EPI_SWIGLU>(
        GemvArgs{w->wgu, w->sgu, h, w->mlp_norm, eps, act, I, H}, RopeArgs{},
        ProbeBarrier<float>{{sync_counter, ++phase}, pl ? pl + qkv_dim + q_dim : nullptr, h, H});
    // E: down_proj + residual
    pk_gemv<WF, PRO_PLAIN, EPI_RESID>(
        GemvArgs{w->wd, w->sd, act, nullptr, eps, h, H, I}, RopeArgs{},
        ProbeBarrier<__half>{{sync_counter, ++phase}, pl ? pl + qkv_dim + q_dim + H : nullptr, act, I});
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
}

#define DECODE_LAYERS_INSTANCE(F, WF, HD, G)                                                              \
  extern "C" __global__ void __launch_bounds__(PK_THREADS, PK_MIN_BLOCKS) decode_layers_##F##_hd##HD##_g##G( \
      const LayerW* __restrict__ layers, int n_layers, const int* __restrict__ token,                      \
      const __half* __restrict__ emb, const float2* __restrict__ cos_sin, const int* __restrict__ pos,     \
      float* h, __half* qkv, __half* attn_out, __half* act, __half* xnorm,                                 \
      const __half* __restrict__ final_norm, float* att_ml, float* att_o, int max_splits,                  \
      unsigned int* sync_counter, float* probes, int H, int I, int n_q, int n_kv, float eps, float scale) { \
    decode_layers_impl<WF, HD, G>(layers, n_layers, token, emb, cos_sin, pos, h, qkv, attn_out, act, xnorm, \
                                  final_norm, att_ml, att_o, max_splits, sync_counter, probes, H, I, n_q,   \
                                  n_kv, eps, scale);                                                        \
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
