// attention.cu — GQA attention of one query token over the contiguous KV cache, split over the sequence
// (flash-decoding) with the split combine fused into the same launch: the long-context form (the engine runs
// attention_short.cu up to the positions one block's shared memory holds, this kernel beyond).
//
// Computes   for q head hq (kv head j = hq / G, G = n_heads / n_kv), L = *pos + 1 cached positions:
//              out[hq] = sum_t softmax_t(q[hq] . K[t, j] * scale) V[t, j]   (fp16 in, fp32 scores and sums, fp16 out)
// Scheme     block (j, s) = kv head j, split s of the L positions (an even share of the ceil(L / ATT_CHUNK)
//            32-position sub-chunks, the last split half a share: att_split_start; up to max_splits = grid.y),
//            all G q heads. The split is cut in 16-position groups; warp w owns groups w, w + 4, ... and
//            streams them through its own ring in shared memory
//            (ATT_RING_BYTES: 3 groups of K and V at hd 128, 6 at hd 64) by cp.async — the whole ring requested
//            before the PDL wait (the K/V rows of earlier steps; row L-1, which the QKV kernel appends, is
//            patched in after the wait or, in a later group, copied then). Per group, in registers
//            (FlashAttention-2 form, tensor cores, mma m16n8k16 fp16 x fp16 -> fp32):
//              scores   S^T[head][pos] = Q K^T: the G q heads are the mma's M rows (padded to 16), K rows by
//                       ldmatrix as the B operand; q's A fragments loaded once after the wait;
//              softmax  online per head row (log2 domain, one max over the 4 lanes of the row), P rounded to
//                       fp16, the sums taken over the rounded values;
//              P.V      O[head][dim] += P V: the score fragments are P's A fragments as they stand (no shared
//                       memory), V rows by ldmatrix.trans as the B operand.
//            No block barrier inside the walk; the 4 warps' (max, sum, O) merge once through shared memory.
//            With one split the block writes `out`. Otherwise it writes (max, sum, o[hd]) partials; the last block
//            of head j to finish (acq_rel atomic ticket) rescales and sums them into `out` (every partial o of
//            the head copied into shared memory by cp.async in one L2 round, together with the one round of all
//            (max, sum) pairs; in batches when they do not fit) and resets its ticket. Blocks whose split is empty at this L exit at
//            once, so one launch shape (captured in the graph) serves every position < max_seq. The combine runs
//            in the last block because a combine through thread block clusters, or sliced over the head's last
//            blocks, measured slower.
//            ATT_TMA = 1 (the default on sm_90+, set by the host: nvrtc.arch_defines; the source default 0 is the
//            cp.async form of older GPUs): a group's K and V by 2D tensor copies (boxes
//            [16][64] fp16 with the 128-byte swizzle; the layer slabs' tensor maps built by ops/attention.py
//            attention_launch, passed as kv_map), completing on one mbarrier per ring slot (sm_90+).
//            Rows past the split in a warp's last group: V zero-filled (P is 0 there, but 0 * NaN is NaN), K's
//            scores masked to -inf. K/V rows sit in shared memory with their 16-byte pieces XOR-swizzled by
//            the row (piece c of row t at c ^ (t & 7)): ldmatrix reads 8 rows of one piece without bank conflicts.
//            Why tensor cores and per-warp rings: walks on the FP32 pipes (block-wide, or per warp with 4-position
//            passes in registers) ran well below the K/V byte rate.
// Layouts    q fp16 [n_heads*hd] (post-RoPE, start of the qkv buffer); k_cache/v_cache: this layer's slab
//            fp16 [max_seq][n_kv*hd]; part_ml fp32 [n_heads][max_splits][2] (max in log2 units, sum); part_o
//            fp32 [n_heads][max_splits][hd]; counters uint32 [n_kv * V]; out fp16 [n_heads*hd].
//            Dynamic shared memory (ops/attention.py attention_smem): 4 warp rings of ATT_RING_BYTES ([slot][K group |
//            V group], each [16][hd] fp16), reused at the end for the warps' O [4][G][hd] fp32 and the combine
//            (m, l [2][G][max_splits], sums [G*hd/4] float4, then as many splits' partial o [G*hd] as fit).
// Bytes      2 * L * n_kv * hd * 2 (K and V, each read once) + partials n_heads * splits * (hd + 2) * 4 * 2.
// Launch     attention_decode_hd{64,128}_g{1,2,3,4,8,16}: grid = (n_kv * V, max_splits) (V = 2 for G = 16, else 1:
//            ATTENTION_INSTANCE), block = 128 (ATT_THREADS),
//            2 blocks per SM, dyn. smem = 4 * ATT_RING_BYTES (+ 1 KB with ATT_TMA) (ops/attention.py attention_launch;
//            arena.attention_splits caps max_splits at ~2 blocks per SM).
#include "common.cuh"

#define ATT_CHUNK 32    // positions per sub-chunk: the unit splits are cut in (ops/attention.py ATT_CHUNK)
#define ATT_THREADS 128 // ops/attention.py ATT_THREADS; 4 warps, 2 blocks per SM (256 threads, 1 block: slower)
#define ATT_WARPS (ATT_THREADS / AF_WARP)
#define ATT_GROUP 16    // positions per group: a warp's unit of the walk (the P.V mma's K)
#define ATT_BATCH 4     // ldmatrix loads issued before their mmas
#ifndef ATT_TMA
#define ATT_TMA 0  // K/V groups by 2D tensor copies (TMA boxes [16][64], 128-byte swizzle), sm_90+ (host: 1 there)
#endif
#if ATT_TMA && defined(__CUDA_ARCH__) && !AF_HAS_BULK
#error "ATT_TMA needs sm_90+ (cp.async.bulk.tensor)"
#endif
#if ATT_TMA
#define ATT_TMA_PARAM , const char* __restrict__ kv_map  // this layer's tensor maps: K at +0, V at +128 (ops/attention.py)
#define ATT_TMA_ARG , kv_map
#else
#define ATT_TMA_PARAM
#define ATT_TMA_ARG
#endif
// the TMA form's code is device code of sm_90+ (the host pass compiles the default staging in its place)
#define ATT_TMA_CODE (ATT_TMA && AF_HAS_BULK)
#define ATT_RING_BYTES 24576  // K/V ring per warp, 24 KB (ops/attention.py ATT_RING_BYTES)

__device__ __forceinline__ float ex2(float x) {  // 2^x (ex2.approx: 2^-inf = +0)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ unsigned h2_bits(__half2 h) { return *reinterpret_cast<unsigned*>(&h); }

// Splits of kv head j at context length len: one per ATT_CHUNK-position sub-chunk up to max_splits (the
// launch's grid.y), beyond that each split takes a contiguous, even share of the sub-chunks.
__device__ __forceinline__ int attention_splits(int len, int max_splits) {
  return min((len + ATT_CHUNK - 1) / ATT_CHUNK, max_splits);
}

// First sub-chunk of split s of n: an even share each, except the last split, which takes ATT_LAST_SHARE / 4 of
// a share (4 would be even): the last split's blocks are dispatched last, some only when the previous launch's
// combining blocks leave their SM, so they get less to read.
#define ATT_LAST_SHARE 2  // half a share: the fastest of the shares measured
__device__ __forceinline__ int att_split_start(int s, int n_sub, int n) {
  return s >= n ? n_sub : (int)((long long)4 * s * n_sub / (4 * (n - 1) + ATT_LAST_SHARE));
}

// byte offset of 16-byte piece c of row t in a staged [16][HD] fp16 group (pieces XOR-swizzled by the row).
// With ATT_TMA the group is HD/64 boxes of [16][64] (2 KB, 128-byte rows) as the tensor copy's 128-byte swizzle
// lays them: piece c of row t in box c / 8 at (c % 8) ^ (t & 7), the same XOR as without.
template <int HD>
__device__ __forceinline__ int att_swz(int t, int c) {
  return ATT_TMA ? (c >> 3) * (ATT_GROUP * 128) + t * 128 + (((c & 7) ^ (t & 7)) << 4)
                 : swz16<HD>(t, c);
}

// The last block of kv head j: out = sum_s coef[g][s] * part_o[g][s] with coef = exp2(m_s - M) / sum_s l_s
// exp2(m_s - M). Every partial o of the head is copied into shared memory by cp.async in one round of 16-byte L2
// copies (in batches of the splits that fit, when G x splits x hd floats exceed the rings), together with the
// (m, l) round; the sums are then taken from shared memory. `smem`: the block's rings (dead by now).
template <int HD, int G>
__device__ __forceinline__ void attention_combine(const float* part_ml, const float* part_o, __half* out, int j,
                                                  int n_splits, int max_splits, float* smem) {
  constexpr int T = ATT_THREADS, COLS = G * HD / 4;  // float4 columns of the head group's output
  const int lane = threadIdx.x % AF_WARP, warp = threadIdx.x / AF_WARP;
  float* coef = smem;                                  // [G][max_splits]: m_s, then the weights
  float* l_s = coef + G * max_splits;                  // [G][max_splits]: l_s
  float4* sums = reinterpret_cast<float4*>(coef + ((2 * G * max_splits + 3) & ~3));  // [COLS]
  float4* po = sums + COLS;                            // [batch][COLS] partial o of one batch of splits
  const int batch = (int)((ATT_WARPS * ATT_RING_BYTES / 16 - (po - reinterpret_cast<float4*>(smem))) / COLS);
  auto stage = [&](int s0, int s1) {  // partial o of splits [s0, s1) -> po, one cp.async group
    for (int e = threadIdx.x; e < (s1 - s0) * COLS; e += T) {
      const int sp = e / COLS, c = e % COLS, g = c * 4 / HD;
      cp_async16(po + e, part_o + ((size_t)(j * G + g) * max_splits + s0 + sp) * HD + c * 4 % HD);
    }
    cp_async_commit();
  };
  stage(0, min(batch, n_splits));
  for (int i = threadIdx.x; i < G * n_splits; i += T) {  // every (m, l) pair, in the same round
    const int g = i / n_splits, sp = i % n_splits;
    const float2 ml = __ldcg(reinterpret_cast<const float2*>(part_ml) + (size_t)(j * G + g) * max_splits + sp);
    coef[g * max_splits + sp] = ml.x;
    l_s[g * max_splits + sp] = ml.y;
  }
  __syncthreads();
  for (int g = warp; g < G; g += ATT_WARPS) {
    float M = -AF_INF;
    for (int sp = lane; sp < n_splits; sp += AF_WARP) M = fmaxf(M, coef[g * max_splits + sp]);
    M = warp_max(M);
    float L = 0.f;
    for (int sp = lane; sp < n_splits; sp += AF_WARP) {
      const float w = ex2(coef[g * max_splits + sp] - M);
      coef[g * max_splits + sp] = w;
      L += w * l_s[g * max_splits + sp];
    }
    L = warp_sum(L);
    __syncwarp();
    for (int sp = lane; sp < n_splits; sp += AF_WARP) coef[g * max_splits + sp] /= L;
  }
  for (int s0 = 0; s0 < n_splits; s0 += batch) {
    const int s1 = min(s0 + batch, n_splits);
    cp_async_wait<0>();
    __syncthreads();  // the batch's copies (and, the first time, the weights) are visible to every thread
    for (int c = threadIdx.x; c < COLS; c += T) {
      const float* cf = coef + c * 4 / HD * max_splits;
      float4 a = s0 == 0 ? make_float4(0.f, 0.f, 0.f, 0.f) : sums[c];
#pragma unroll 4
      for (int sp = s0; sp < s1; ++sp) {
        const float w = cf[sp];
        const float4 v = po[(sp - s0) * COLS + c];
        a.x = fmaf(w, v.x, a.x); a.y = fmaf(w, v.y, a.y); a.z = fmaf(w, v.z, a.z); a.w = fmaf(w, v.w, a.w);
      }
      if (s1 < n_splits) sums[c] = a;
      else {
        __half2* dst = reinterpret_cast<__half2*>(out + (size_t)j * G * HD + c * 4);
        dst[0] = __floats2half2_rn(a.x, a.y);
        dst[1] = __floats2half2_rn(a.z, a.w);
      }
    }
    if (s1 < n_splits) {
      __syncthreads();  // po is free again
      stage(s1, min(s1 + batch, n_splits));
    }
  }
}

// One work item: head group j (kv head j / V: V blocks share a kv head when it has more q heads than one block
// takes, ATT_BLOCK_HEADS; each takes G of them), split `split` of the len cached positions (see the header).
template <int HD, int G, int V = 1>
__device__ __forceinline__ void attention_item(const __half* q, const __half* k_cache, const __half* v_cache, int len,
                                               int j, int split, float* part_ml, float* part_o,
                                               unsigned int* counters, __half* out, int n_kv, int max_splits,
                                               float scale, char* smem ATT_TMA_PARAM) {
  constexpr int NW = ATT_WARPS;
  constexpr int DG = HD / 8;                    // 16-byte pieces per row = 8-dim tiles of O
  constexpr int KS = HD / 16;                   // k-steps of the scores
  constexpr int GB = ATT_GROUP * HD * 2;        // bytes of one group's K (or V)
  constexpr int D = ATT_RING_BYTES / (2 * GB);  // ring slots per warp
  static_assert(D >= 1 && G <= 8 && KS % ATT_BATCH == 0 && DG % (2 * ATT_BATCH) == 0, "shape");
  const int n_sub = (len + ATT_CHUNK - 1) / ATT_CHUNK;
  const int n_splits = attention_splits(len, max_splits);
  if (split >= n_splits) return;  // nothing at this context length (before any barrier)
  const int p0 = att_split_start(split, n_sub, n_splits) * ATT_CHUNK;
  const int p1 = min(att_split_start(split + 1, n_sub, n_splits) * ATT_CHUNK, len);
  const size_t kv_dim = (size_t)n_kv * HD;
  const int kvh = j / V;  // the kv head whose K/V this block reads
  const int lane = threadIdx.x % AF_WARP, warp = threadIdx.x / AF_WARP;
  const int gid = lane >> 2, tig = lane & 3;  // mma fragment coordinates: gid = the q head row
#if ATT_TMA_CODE
  smem += (1024u - ((unsigned)__cvta_generic_to_shared(smem) & 1023u)) & 1023u;  // the swizzle's 1 KB (ops/attention.py: +1 KB)
#endif
  char* ring = smem + warp * D * 2 * GB;
  const int n_grp = (p1 - p0 + ATT_GROUP - 1) / ATT_GROUP;
  const int mine = warp < n_grp ? (n_grp - 1 - warp) / NW + 1 : 0;  // this warp's groups

#if ATT_TMA_CODE
  __shared__ unsigned long long att_bar[NW][D];  // a barrier per ring slot: the group's copies complete on it
  if (lane == 0) {
#pragma unroll
    for (int d = 0; d < D; ++d) mbar_init(&att_bar[warp][d], 1);
    mbar_init_fence();
  }
  __syncwarp();
#endif
#if ATT_TMA_CODE
  // ATT_TMA: the default walk (the last form below) with the group's K and V as HD/64 tensor boxes each, issued by
  // lane 0 onto the slot's barrier (a group staged before the wait brings row len-1 as it stood: patched below
  // once the boxes have landed)
  auto stage = [&](int i, bool) {
    if (i >= mine) return;
    const int t0 = p0 + (warp + NW * i) * ATT_GROUP;
    fence_proxy_async();  // the slot's earlier reads and zero rows (every lane's) before the copies
    __syncwarp();
    if (lane == 0) {
      unsigned long long* bar = &att_bar[warp][i % D];
      char* ks = ring + (i % D) * 2 * GB;
      mbar_expect_tx(bar, 2 * GB);
#pragma unroll
      for (int h = 0; h < HD / 64; ++h) {
        tma_load_2d(ks + h * ATT_GROUP * 128, kv_map, kvh * HD + h * 64, t0, bar);
        tma_load_2d(ks + GB + h * ATT_GROUP * 128, kv_map + 128, kvh * HD + h * 64, t0, bar);
      }
    }
  };
#else
  // this warp's i-th group -> ring slot i % D (one cp.async group, committed even when empty so that the
  // wait counts stay uniform); before the wait row len-1 is skipped (the QKV kernel is still writing it)
  auto stage = [&](int i, bool before_wait) {
    if (i < mine) {
      const int t0 = p0 + (warp + NW * i) * ATT_GROUP;
      char* ks = ring + (i % D) * 2 * GB;
      char* vs = ks + GB;
#pragma unroll
      for (int e = lane; e < ATT_GROUP * DG; e += AF_WARP) {
        const int r = e / DG, c = e % DG, t = t0 + r;
        if (t < p1) {
          if (!(before_wait && t == len - 1)) {
            const size_t src = (size_t)t * kv_dim + (size_t)kvh * HD + c * 8;
            cp_async16(ks + att_swz<HD>(r, c), k_cache + src);
            cp_async16(vs + att_swz<HD>(r, c), v_cache + src);
          }
        } else {
          *reinterpret_cast<uint4*>(vs + att_swz<HD>(r, c)) = make_uint4(0, 0, 0, 0);
        }
      }
    }
    cp_async_commit();
  };
#endif
#pragma unroll
  for (int i = 0; i < D; ++i) stage(i, true);
  pdl_wait_unless_instrument<2>();  // AF_NO_WAIT (common.cuh)
  pdl_launch_dependents();

  // row len-1 (appended by the QKV kernel) into its slot, when its group was staged above (with ATT_TMA once
  // that group's boxes have landed: the patch must come after the copy's stale row)
  const int gl = (len - 1 - p0) / ATT_GROUP;
  if (len - 1 >= p0 && len - 1 < p1 && gl % NW == warp && gl / NW < D) {
#if ATT_TMA_CODE
    mbar_wait(&att_bar[warp][gl / NW], 0u);  // the slot's first use: phase 0
#endif
    const int r = (len - 1 - p0) % ATT_GROUP;
    char* ks = ring + (gl / NW) * 2 * GB;
    for (int e = lane; e < 2 * DG; e += AF_WARP) {
      const int c = e % DG;
      const size_t src = (size_t)(len - 1) * kv_dim + (size_t)kvh * HD + c * 8;
      *reinterpret_cast<uint4*>(ks + (e < DG ? 0 : GB) + att_swz<HD>(r, c)) = ld_cg16((e < DG ? k_cache : v_cache) + src);
    }
  }
  unsigned qa[KS][2];  // q head gid as the scores' A operand (rows gid + 8: padding, 0), every k-step
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    const unsigned* qp = reinterpret_cast<const unsigned*>(q + ((size_t)j * G + gid) * HD + kk * 16 + 2 * tig);
    qa[kk][0] = gid < G ? __ldcg(qp) : 0u;
    qa[kk][1] = gid < G ? __ldcg(qp + 4) : 0u;
  }
  AF_TL_MARK(0);  // timeline: q requested (the first L2 round after the wait)
  const float sl2 = scale * 1.4426950408889634f;  // scores in log2 units

  float m_run = -AF_INF, l_run = 0.f;  // head gid: running max, this lane's share of the running sum
  float o[DG][4];                      // O[gid][tile * 8 + 2 tig + (0, 1)] in [.][0..1]; [.][2..3]: padding rows
#pragma unroll
  for (int c = 0; c < DG; ++c) o[c][0] = o[c][1] = o[c][2] = o[c][3] = 0.f;

  for (int i = 0; i < mine; ++i) {
#if ATT_TMA_CODE
    mbar_wait(&att_bar[warp][i % D], (unsigned)(i / D) & 1u);  // group i's copies have landed ...
#else
    cp_async_wait<D - 1>();  // this lane's copies of group i have landed ...
#endif
#if ATT_TMA_CODE
    {
      const int t0 = p0 + (warp + NW * i) * ATT_GROUP;
      char* vz = ring + (i % D) * 2 * GB + GB;
      if (t0 + ATT_GROUP > p1)  // ... V rows past the split zeroed (they may hold anything, and 0 * NaN is NaN)
        for (int e = lane; e < ATT_GROUP * DG; e += AF_WARP)
          if (t0 + e / DG >= p1) *reinterpret_cast<uint4*>(vz + att_swz<HD>(e / DG, e % DG)) = make_uint4(0, 0, 0, 0);
    }
#endif
    __syncwarp();            // ... and every lane's (and the zero rows, and row len-1)
    const char* ks = ring + (i % D) * 2 * GB;
    const char* vs = ks + GB;
    const int t0 = p0 + (warp + NW * i) * ATT_GROUP;
    // ---- S^T[head][pos] = Q K^T: n-tile 0 = positions 0-7, 1 = 8-15 ----
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int k0 = 0; k0 < KS; k0 += ATT_BATCH) {
      unsigned b[ATT_BATCH][4];
#pragma unroll
      for (int u = 0; u < ATT_BATCH; ++u)
        ldmatrix_x4(b[u], ks + att_swz<HD>(((lane >> 4) << 3) + (lane & 7), 2 * (k0 + u) + ((lane >> 3) & 1)));
#pragma unroll
      for (int u = 0; u < ATT_BATCH; ++u) {
        mma_16816(s[0], qa[k0 + u][0], 0u, qa[k0 + u][1], 0u, b[u][0], b[u][1]);
        mma_16816(s[1], qa[k0 + u][0], 0u, qa[k0 + u][1], 0u, b[u][2], b[u][3]);
      }
    }
    // ---- online softmax of row gid: s[n][e] is position t0 + 8 n + 2 tig + e ----
    float mx = -AF_INF;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        s[n][e] = t0 + 8 * n + 2 * tig + e < p1 ? s[n][e] * sl2 : -AF_INF;
        mx = fmaxf(mx, s[n][e]);
      }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run, mx);  // finite: position t0 < p1 is in every row's quad
    const float alpha = ex2(m_run - m_new);  // 0 on the first group
    m_run = m_new;
    const __half2 p0h = __floats2half2_rn(ex2(s[0][0] - m_new), ex2(s[0][1] - m_new));
    const __half2 p1h = __floats2half2_rn(ex2(s[1][0] - m_new), ex2(s[1][1] - m_new));
    const float2 f0 = __half22float2(p0h), f1 = __half22float2(p1h);
    l_run = l_run * alpha + (f0.x + f0.y) + (f1.x + f1.y);
#pragma unroll
    for (int c = 0; c < DG; ++c) { o[c][0] *= alpha; o[c][1] *= alpha; }
    const unsigned pa0 = h2_bits(p0h), pa2 = h2_bits(p1h);  // P's A fragment (rows gid + 8: 0)
    // ---- O += P V: ldmatrix.trans gives V's B fragments, two 8-dim tiles per load ----
#pragma unroll
    for (int c0 = 0; c0 < DG; c0 += 2 * ATT_BATCH) {
      unsigned b[ATT_BATCH][4];
#pragma unroll
      for (int u = 0; u < ATT_BATCH; ++u)
        ldmatrix_x4_trans(b[u], vs + att_swz<HD>(((lane >> 3) & 1) * 8 + (lane & 7), c0 + 2 * u + (lane >> 4)));
#pragma unroll
      for (int u = 0; u < ATT_BATCH; ++u) {
        mma_16816(o[c0 + 2 * u], pa0, 0u, pa2, 0u, b[u][0], b[u][1]);
        mma_16816(o[c0 + 2 * u + 1], pa0, 0u, pa2, 0u, b[u][2], b[u][3]);
      }
    }
    __syncwarp();          // every lane is done with slot i % D ...
    stage(i + D, false);   // ... which takes group i + D
  }
  cp_async_wait<0>();
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
  AF_TL_MARK(1);  // timeline: this thread's (warp 0's) walk done

  // ---- merge the warps (weights exp2(m_w - M)), then out (one split) or the partials ----
  __shared__ float w_m[NW][G], w_l[NW][G], s_w[NW][G], s_l[G];
  __shared__ bool last;
  float* wo = reinterpret_cast<float*>(smem);  // [NW][G][HD] each warp's O (relative to its own max)
  __syncthreads();                             // every warp's ring is dead
  if (gid < G) {
#pragma unroll
    for (int c = 0; c < DG; ++c)
      *reinterpret_cast<float2*>(wo + ((size_t)warp * G + gid) * HD + c * 8 + 2 * tig) = make_float2(o[c][0], o[c][1]);
    if (tig == 0) { w_m[warp][gid] = m_run; w_l[warp][gid] = l_run; }
  }
  __syncthreads();
  if (threadIdx.x < G) {
    const int g = threadIdx.x;
    float M = -AF_INF;
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, w_m[w][g]);
    float L = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float a = ex2(w_m[w][g] - M);  // 0 for a warp that had no group (m = -inf)
      s_w[w][g] = a;
      L += a * w_l[w][g];
    }
    s_l[g] = L;
    if (n_splits > 1) {
      float* ml = part_ml + ((size_t)(j * G + g) * max_splits + split) * 2;
      ml[0] = M;
      ml[1] = L;
    }
  }
  __syncthreads();
  constexpr int GH = G * HD;
  for (int i = threadIdx.x; i < GH; i += ATT_THREADS) {
    const int g = i / HD;
    float acc = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) acc = fmaf(s_w[w][g], wo[(size_t)w * GH + i], acc);
    if (n_splits == 1) out[(size_t)j * GH + i] = __float2half(acc / s_l[g]);  // one split: finish here
    else part_o[((size_t)(j * G + g) * max_splits + split) * HD + i % HD] = acc;
  }
  if (n_splits == 1) return;
  __syncthreads();  // all partials of this block written; thread 0's acq_rel ticket publishes them
  AF_TL_MARK(2);  // timeline: merged, partials stored
  if (threadIdx.x == 0) last = atom_add_acq_rel_gpu(counters + j, 1u) == (unsigned int)n_splits - 1;
  __syncthreads();
  AF_TL_MARK(3);  // timeline: ticket back
  if (!last) return;  // the last block acquired every other block's partials through its ticket
  attention_combine<HD, G>(part_ml, part_o, out, j, n_splits, max_splits, reinterpret_cast<float*>(smem));
  if (threadIdx.x == 0) counters[j] = 0u;
}

// One kernel per (head_dim, q heads per kv head): G is a compile-time constant so the per-head arrays are
// exactly sized. Block (j, s) = item (head group j, split s): with G <= ATT_BLOCK_HEADS a head group is a kv head;
// with more (G = 16: Llama-3.1-405B over 8 GPUs) G / ATT_BLOCK_HEADS blocks share a kv head, each taking
// ATT_BLOCK_HEADS of its q heads (its K/V read by each of them: through L2 for all but the first). 2 blocks per SM
// (ops/attention.py attention_smem).
#define ATT_BLOCK_HEADS 8  // the most q heads one block takes (the scores' mma rows gid, 0-7)
#define ATT_BG(G) ((G) > ATT_BLOCK_HEADS ? ATT_BLOCK_HEADS : (G))
#define ATT_BV(G) ((G) > ATT_BLOCK_HEADS ? (G) / ATT_BLOCK_HEADS : 1)
#define ATTENTION_INSTANCE(NAME, HD, G)                                                                   \
  extern "C" __global__ void __launch_bounds__(ATT_THREADS, 256 / ATT_THREADS)                          \
      NAME(                                                                                               \
      const __half* __restrict__ q, const __half* __restrict__ k_cache, const __half* __restrict__ v_cache, \
      const int* __restrict__ pos_ptr, float* part_ml, float* part_o, unsigned int* counters,             \
      __half* __restrict__ out, int n_kv, int max_splits, float scale ATT_TMA_PARAM) {                    \
    AF_TIMELINE_BLOCK;                                                                                    \
    extern __shared__ __align__(16) char att_smem[];                                                      \
    /* pos was written by the previous step's argmax, complete before this step's first kernel: readable */ \
    /* before the PDL wait, and so are the K/V rows before pos (attention_item waits before row pos and q) */ \
    attention_item<HD, ATT_BG(G), ATT_BV(G)>(q, k_cache, v_cache, *pos_ptr + 1, blockIdx.x, blockIdx.y, part_ml, \
                                             part_o, counters, out, n_kv, max_splits, scale, att_smem ATT_TMA_ARG); \
  }

ATTENTION_INSTANCE(attention_decode_hd64_g1, 64, 1)
ATTENTION_INSTANCE(attention_decode_hd64_g2, 64, 2)
ATTENTION_INSTANCE(attention_decode_hd64_g3, 64, 3)
ATTENTION_INSTANCE(attention_decode_hd64_g4, 64, 4)
ATTENTION_INSTANCE(attention_decode_hd64_g8, 64, 8)
ATTENTION_INSTANCE(attention_decode_hd64_g16, 64, 16)
ATTENTION_INSTANCE(attention_decode_hd128_g1, 128, 1)
ATTENTION_INSTANCE(attention_decode_hd128_g2, 128, 2)
ATTENTION_INSTANCE(attention_decode_hd128_g3, 128, 3)
ATTENTION_INSTANCE(attention_decode_hd128_g4, 128, 4)
ATTENTION_INSTANCE(attention_decode_hd128_g8, 128, 8)
ATTENTION_INSTANCE(attention_decode_hd128_g16, 128, 16)
