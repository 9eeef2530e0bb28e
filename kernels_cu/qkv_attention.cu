// qkv_attention.cu — the QKV projection (RMSNorm, RoPE, KV append) with the short attention beside it, in one grid.
//
// Computes   what gemv_f{8,16}_qkv_rope_ws computes (q|k|v = W . RMSNorm(h), RoPE on q and k, k and v appended to
//            the cache at pos) and, in the same launch, what attention_short.cu computes from it (GQA attention of
//            the new q over cache[0 .. pos] -> out).
// Scheme     grid = the QKV GEMV's blocks (gemv_tiled_ws with EPI_ROPE_LL), then n_kv * V attention blocks at its
//            end. Each GEMV output pair is also pushed as one LL word (tp_ll.cuh: the fp16 pair and an epoch in one
//            posted 8-byte store, no fence, no flag). An attention block stages its kv head's history (rows
//            0 .. L-2, written by earlier steps) into shared memory at once — while QKV streams — then polls the
//            words of its q heads and of K/V row L-1 (AtsFromLL) and runs attention_short_item: no wait for the
//            grid's completion, no launch, no K/V staging after QKV.
//            Why: the QKV -> attention -> o_proj chain is the largest piece of the layers' latency (PERF_NOTES v28:
//            -2.4 µs per layer on 3B W8A16 without the attention's wait); the earlier hand-overs by counters (v19,
//            v29) lost to their release fences, which LL words do not need (v41: one one-way trip per word).
//            The attention blocks trigger o_proj's launch once they hold q (as attention_short.cu does after its
//            wait), so o_proj's blocks do not compete with QKV's stream earlier than before.
// Epochs     seq[b]: the launches block b has run; every block of a launch runs once, so all agree. One LL buffer
//            serves every layer and bucket: each launch's words carry a new epoch.
// Layouts    W, scales, cache as gemv_fp8.cu / gemv_fp16.cu (QKV, "rope" tile pairing) and attention_short.cu;
//            ll u64 [n_out]: word o = output pair o (head o / (hd/2), dims o % (hd/2) and + hd/2) as 2 x fp16
//            (low word) + epoch (high word); out fp16 [n_q * hd].
// Bytes      the QKV GEMV's + the short attention's + 2 x 8 x n_out (the LL words, written and read through L2).
// Launch     qkv_attention_f{8,16}_hd{64,128}_g{1,2,3,4,8,16}, sm_90+: grid = GEMV blocks + n_kv * V, block = 288
//            (the GEMV's 8 consumer warps + its producer; an attention block runs on the first 256 threads), dyn.
//            smem = the QKV ws plan's (the attention's capacity is what fits in it: ops/qkv_attention.py), at most
//            2 blocks per SM (<= 112 registers: the attention's path needs more than the GEMV's).
#include "gemv_common.cuh"
#include "attention_short.cuh"

#define ATS_SPLITS_MAX 4  // windows per head group (ops/qkv_attention.py SPLITS_MAX): the owner's combine keeps them in registers

// An attention block beside QKV: q (its G heads) and K/V row L-1 from the GEMV's LL words; its result stored, or, when
// the positions are split into windows of `cap` (ns > 1 of them hold positions), combined: the block of window s > 0
// pushes its normalised output and each head's (max, sum) as LL words into `part`; the block of window 0 (the owner)
// polls them and writes out = sum_s o_s l_s e^(m_s - M) / sum_s l_s e^(m_s - M), M = max_s m_s (flash-decoding's
// combine, one one-way trip after the windows are done).
struct AtsFromLL {
  const unsigned long long* ll;  // the GEMV's words (this launch's epoch and older ones)
  unsigned long long* part;      // the windows' partial results: [head group][S][G * hd + 2 G] words
  unsigned epoch;
  int n_q, n_kv;                 // heads of the QKV output: q, then k, then v
  unsigned* last;                // shared [2][hd/2]: row L-1's K and V pairs, for the chunks after the first
  int s, ns, S;                  // this block's window, the windows holding positions, the windows per head group
  static constexpr bool kLastInCache = false;  // row L-1 comes from `last`, never from the cache (not fenced)
  static constexpr bool kSplit = true;

  template <int HD>
  __device__ __forceinline__ static void put(char* rows, int r, int d, unsigned pair) {  // dims d and d + HD/2
    *reinterpret_cast<unsigned short*>(rows + ats_swz<HD>(r, d / 8) + (d % 8) * 2) = (unsigned short)pair;
    *reinterpret_cast<unsigned short*>(rows + ats_swz<HD>(r, (d + HD / 2) / 8) + (d % 8) * 2) =
        (unsigned short)(pair >> 16);
  }

  template <int HD, int G, int T>
  __device__ __forceinline__ void bring(char* q_h, char* ks, char* vs, int j, int kvh, int len, int cap, int w0,
                                        int w1) const {
    constexpr int HP = HD / 2, DG = HD / 8;
    constexpr int NQ = G * HP;                      // words of the block's q heads; then K's and V's row L-1
    constexpr int PER = (NQ + 2 * HP + T - 1) / T;
    const int nw = NQ + (len - 1 < w1 ? 2 * HP : 0);  // row L-1 only in the window holding it
    const int tid = threadIdx.x;
    for (int i = tid; i < (ATS_HEADS - G) * DG; i += T)  // q rows G .. 7: zero (the mma's padding)
      *reinterpret_cast<uint4*>(q_h + ats_swz<HD>(G + i / DG, i % DG)) = make_uint4(0, 0, 0, 0);
    unsigned long long w[PER];
    const unsigned long long* src[PER];
#pragma unroll
    for (int k = 0; k < PER; ++k) {  // every word at once (one L2 round), then spin on the late ones only
      const int i = tid + k * T;
      if (i < nw) {
        const int head = i < NQ ? j * G + i / HP : n_q + ((i - NQ) / HP) * n_kv + kvh;
        src[k] = ll + (size_t)head * HP + i % HP;
        w[k] = ll_load(src[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int i = tid + k * T;
      if (i < nw) {
        while (ll_behind(w[k], epoch)) w[k] = ll_load(src[k]);
        const unsigned pair = (unsigned)w[k];
        if (i < NQ) {
          put<HD>(q_h, i / HP, i % HP, pair);
        } else {
          if (len - 1 - w0 < cap) put<HD>((i - NQ) / HP ? vs : ks, len - 1 - w0, i % HP, pair);
          last[i - NQ] = pair;
        }
      }
    }
    pdl_launch_dependents();  // o_proj may launch: this block holds what QKV wrote (attention_short.cu: after its wait)
  }

  // A later chunk (L > cap) holding row L-1 at row r: put it there from `last` (its staging stopped before it).
  template <int HD, int T>
  __device__ __forceinline__ void last_row(char* ks, char* vs, int r, int n) const {
    if (r < 0 || r >= n) return;
    for (int i = threadIdx.x; i < HD; i += T) put<HD>(i < HD / 2 ? ks : vs, r, i % (HD / 2), last[i]);
  }

  // The owner (window 0) of ns > 1 windows: every other window's words -> `got` (fp32 [ns - 1][G * hd + 2 G]), all
  // loads issued at once, then the late ones spun on (one round trip, not one per output).
  template <int HD, int G, int T>
  __device__ __forceinline__ void gather(char* got, int j) const {
    if (s != 0 || ns == 1) return;
    constexpr int W = G * HD + 2 * G;
    constexpr int PER = ((ATS_SPLITS_MAX - 1) * W + T - 1) / T;
    const unsigned long long* src = part + ((size_t)j * S + 1) * W;  // windows 1 .. ns - 1, consecutive
    const int n = (ns - 1) * W;
    unsigned long long w[PER];
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int i = threadIdx.x + k * T;
      if (i < n) w[k] = ll_load(src + i);
    }
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int i = threadIdx.x + k * T;
      if (i < n) {
        while (ll_behind(w[k], epoch)) w[k] = ll_load(src + i);
        reinterpret_cast<float*>(got)[i] = ll_value(w[k]);
      }
    }
  }

  template <int HD, int G>
  __device__ __forceinline__ void finish(__half* out, int j, int i, float acc, float l, const float* m,
                                         const float* got) const {
    const int g = i / HD;
    constexpr int W = G * HD + 2 * G;  // one window's words: outputs, then (max, sum) per head
    if (ns == 1) {
      out[(size_t)j * G * HD + i] = __float2half(acc / l);
    } else if (s > 0) {
      unsigned long long* mine = part + ((size_t)j * S + s) * W;
      ll_store(mine + i, acc / l, epoch);
      if (i % HD == 0) {
        ll_store(mine + G * HD + 2 * g, m[g], epoch);
        ll_store(mine + G * HD + 2 * g + 1, l, epoch);
      }
    } else {  // the owner: its own result and the gathered ones, weighted by l_s e^(m_s - M)
      float mx = m[g];
      for (int t = 1; t < ns; ++t) mx = fmaxf(mx, got[(t - 1) * W + G * HD + 2 * g]);
      float wsum = l * __expf(m[g] - mx);
      float num = acc / l * wsum;
      for (int t = 1; t < ns; ++t) {
        const float* o = got + (t - 1) * W;
        const float wt = o[G * HD + 2 * g + 1] * __expf(o[G * HD + 2 * g] - mx);
        num += o[i] * wt;
        wsum += wt;
      }
      out[(size_t)j * G * HD + i] = __float2half(num / wsum);
    }
  }
};

// The extra operands of the attention blocks.
struct AttBeside {
  unsigned* seq;               // [gridDim.x] epochs per block
  __half* out;                 // the attention's output, fp16 [n_q * hd]
  unsigned long long* part;    // the windows' partial results (AtsFromLL)
  int cap;                     // positions per window: what the dynamic shared memory holds
  int splits;                  // windows per head group (<= ATS_SPLITS_MAX)
  float scale;                 // 1 / sqrt(hd)
};

#if AF_HAS_BULK
template <bool FP8, int HD, int G>
__device__ __forceinline__ void qkv_attention(const GemvArgs a, RopeArgs rope, const AttBeside att,
                                              unsigned char* smem_raw, int npre) {
  const unsigned e = att.seq[blockIdx.x] + 1u;
  if ((int)blockIdx.x >= rope.gemv_blocks) {  // an attention block: head group jg, window s
    const int ab = (int)blockIdx.x - rope.gemv_blocks, jg = ab / att.splits, s = ab % att.splits;
    // pos was written by the previous step's argmax, complete before this step's first kernel
    // the windows holding positions: as few as hold L (at most `splits`), their sizes even (multiples of 16)
    const int len = *rope.pos + 1, ns = min(att.splits, (len + att.cap - 1) / att.cap);
    const int wsz = ((len + ns - 1) / ns + 15) & ~15, w0 = s * wsz;
    if (threadIdx.x < ATS_THREADS && s < ns) {  // the 9th warp, and a window past L, have no part in it
      __shared__ unsigned last[HD];
      attention_short_item<HD, ATS_BG(G), ATS_THREADS, ATS_BV(G), ATS_THREADS>(
          rope.k_cache, rope.v_cache, len, jg, att.out, rope.n_kv, att.cap, att.scale,
          reinterpret_cast<char*>(smem_raw), AtsFromLL{rope.ll, att.part, e, rope.n_q, rope.n_kv, last, s, ns, att.splits},
          w0, s == ns - 1 ? len : w0 + wsz);  // the last window also walks in chunks what lies beyond them all
    }
    if (threadIdx.x == 0) att.seq[blockIdx.x] = e;
    return;
  }
  rope.epoch = e;
  gemv_tiled_ws<FP8, PRO_NORM, EPI_ROPE_LL>(a, rope, smem_raw, npre);
  if (threadIdx.x == 0) att.seq[blockIdx.x] = e;  // a consumer thread (the producer warp left inside)
}
#define QKV_ATTENTION_BODY(FP8, HD, G)                                                                    \
  AF_TIMELINE_BLOCK;                                                                                      \
  extern __shared__ __align__(16) unsigned char smem_raw[];                                               \
  RopeArgs rope = GEMV_ROPE_ARGS_OF;                                                                      \
  rope.ll = ll;                                                                                           \
  rope.gemv_blocks = gemv_blocks;                                                                         \
  qkv_attention<FP8, HD, G>(GemvArgs{W, scales, x, norm_w, eps, y, n_out, K}, rope,                       \
                            AttBeside{seq, att_out, part, cap, splits, scale}, smem_raw, npre);
#elif defined(__CUDA_ARCH__)
#define QKV_ATTENTION_BODY(FP8, HD, G) __trap();
#else
#define QKV_ATTENTION_BODY(FP8, HD, G)
#endif

// F: 8 (fp8 weights + scales) or 16; the kernel qkv_attention_f<F>_hd<HD>_g<G>. Arguments: the QKV ws kernel's,
// then (ll, seq, att_out, part, gemv_blocks, cap, splits, scale).
#define QKV_ATTENTION_INSTANCE(F, FP8, HD, G)                                                             \
  extern "C" __global__ void __launch_bounds__(GEMV_WS_THREADS, 2) qkv_attention_f##F##_hd##HD##_g##G(    \
      GEMV_ROPE_PARAMS, int npre, unsigned long long* __restrict__ ll, unsigned* __restrict__ seq,         \
      __half* __restrict__ att_out, unsigned long long* __restrict__ part, int gemv_blocks, int cap,      \
      int splits, float scale) {                                                                          \
    QKV_ATTENTION_BODY(FP8, HD, G)                                                                        \
  }
#define QKV_ATTENTION_GROUPS(F, FP8, HD)                                                                  \
  QKV_ATTENTION_INSTANCE(F, FP8, HD, 1) QKV_ATTENTION_INSTANCE(F, FP8, HD, 2)                            \
  QKV_ATTENTION_INSTANCE(F, FP8, HD, 3) QKV_ATTENTION_INSTANCE(F, FP8, HD, 4)                            \
  QKV_ATTENTION_INSTANCE(F, FP8, HD, 8) QKV_ATTENTION_INSTANCE(F, FP8, HD, 16)

QKV_ATTENTION_GROUPS(8, true, 64)
QKV_ATTENTION_GROUPS(8, true, 128)
QKV_ATTENTION_GROUPS(16, false, 64)
QKV_ATTENTION_GROUPS(16, false, 128)
