// common.cuh — helpers shared by every kernel in kernels_cu/ (textually inlined by the loader so the
// kernel cache key covers it). No kernels here.
//
// Conventions for the whole decode path (M = 1, one token per step):
//   * activations between GEMVs are fp16 (`half`), the residual stream `h` is fp32;
//   * weights are row-major [out_features, in_features] exactly as HF stores them;
//   * the decode position `pos` and the current token live in device memory (int32), so a captured
//     CUDA Graph can be replayed without any host round trip.
#pragma once
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#define AF_WARP 32
#define AF_INF __int_as_float(0x7f800000)  // +inf (NVRTC has no math.h INFINITY)

// ---- timeline instrument (`profile --timeline`, atomflow_bench/timeline.py) ------------------------------
// Compiled in only with -DAF_TIMELINE=<record slots per SM>; without it AF_TIMELINE_BLOCK and AF_TL_MARK are
// empty and nothing below exists. Thread 0 of every block of every step kernel records, in %globaltimer
// nanoseconds: its launch's %gridid, the block's start, the return of its PDL wait (0 when it exits before
// waiting), its end, and up to AF_TL_MARKS marks of the kernel's own stages (AF_TL_MARK(k) where thread 0 passes
// stage k; 0 when it does not), into af_tl_rec[SM * AF_TIMELINE + slot]; af_tl_next[SM] hands out the SM's slots
// (the atomic is issued at the start, its result used only at the end, so it delays nothing), then the block's
// index (x | y << 21 | z << 42; scripts/timeline_blocks.py names the stragglers by it). Every module
// (.cu) holds its own copy; the host clears and reads them all around one graph replay.
#ifdef AF_TIMELINE
#define AF_TL_SMS 256  // SM ids covered (H100: 132)
#define AF_TL_MARKS 4
__device__ unsigned long long af_tl_rec[AF_TL_SMS * AF_TIMELINE][5 + AF_TL_MARKS];
__device__ unsigned int af_tl_next[AF_TL_SMS];
__shared__ unsigned long long af_tl_t0, af_tl_wait, af_tl_marks[AF_TL_MARKS];
__shared__ unsigned int af_tl_sm;

__device__ __forceinline__ unsigned long long af_tl_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

struct AfTimelineBlock {  // holds only the slot in a register (the kernels run close to their register budget)
  unsigned int slot = 0;
  __device__ AfTimelineBlock() {
    if (threadIdx.x == 0) {
      af_tl_t0 = af_tl_now();
      af_tl_wait = 0ull;
      for (int k = 0; k < AF_TL_MARKS; ++k) af_tl_marks[k] = 0ull;
      unsigned int sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      af_tl_sm = sm;
      slot = sm < AF_TL_SMS ? atomicAdd(&af_tl_next[sm], 1u) : 0u;
    }
  }
  __device__ ~AfTimelineBlock() {
    if (threadIdx.x == 0 && af_tl_sm < AF_TL_SMS && slot < AF_TIMELINE) {
      unsigned long long g;
      asm volatile("mov.u64 %0, %%gridid;" : "=l"(g));
      unsigned long long* r = af_tl_rec[af_tl_sm * AF_TIMELINE + slot];
      r[0] = g; r[1] = af_tl_t0; r[2] = af_tl_wait; r[3] = af_tl_now();
      for (int k = 0; k < AF_TL_MARKS; ++k) r[4 + k] = af_tl_marks[k];
      r[4 + AF_TL_MARKS] = blockIdx.x | (unsigned long long)blockIdx.y << 21 | (unsigned long long)blockIdx.z << 42;
    }
  }
};
#define AF_TIMELINE_BLOCK AfTimelineBlock af_tl_block_
#define AF_TL_MARK(k) do { if (threadIdx.x == 0) af_tl_marks[k] = af_tl_now(); } while (0)
#else
#define AF_TIMELINE_BLOCK
#define AF_TL_MARK(k) do { } while (0)
#endif

// Programmatic dependent launch (sm_90+). A kernel launched with the PDL attribute may start while its
// predecessor still runs; it must call pdl_wait() before reading anything the predecessor writes (it may
// read weights before). pdl_launch_dependents() lets the next kernel start launching. Both are no-ops
// without PDL and compile to nothing below sm_90.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#ifdef AF_TIMELINE
  if (threadIdx.x == 0) af_tl_wait = af_tl_now();
#endif
}

// AF_NO_WAIT (a timing instrument, never a default): a bit mask of the layer kernels that skip their
// PDL wait — 1 QKV, 2 attention, 4 the residual GEMVs (o_proj, down), 8 gate/up. Such a kernel reads its inputs
// whenever it reaches them, so its results are wrong; a step then times the chain of the same kernels with those
// data dependencies removed: the most any scheduling of these kernels (a persistent layer kernel included) could
// gain at those boundaries. The embedding, lm_head and argmax always wait, so the token and position stay valid.
#ifndef AF_NO_WAIT
#define AF_NO_WAIT 0
#endif
// AF_NO_SCALES (a timing instrument, never a default): the fp8 GEMVs' bulk paths (the ring on sm_90+
// and the warp-specialised forms) copy no scales — each slot then multiplies by whatever its scale area holds, so the
// results are wrong; a step times the fp8 layers without their 3.1% of scale bytes (fp32 per 128 inputs): the most
// any smaller scale format could gain.
#ifndef AF_NO_SCALES
#define AF_NO_SCALES 0
#endif
template <int BIT>
__device__ __forceinline__ void pdl_wait_unless_instrument() {
  if (!(AF_NO_WAIT & BIT)) pdl_wait();
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = AF_WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = AF_WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// A barrier of the block's first NT threads (NT = 0: the whole block, __syncthreads). A warp-specialised kernel
// syncs only its NT consumer threads (named barrier 1); its producer warp never joins. nthreads<NT>(): their count.
template <int NT>
__device__ __forceinline__ void sync_n() {
  if constexpr (NT == 0) {
    __syncthreads();
  } else {
    asm volatile("bar.sync 1, %0;" ::"n"(NT) : "memory");
  }
}
template <int NT>
__device__ __forceinline__ int nthreads() { return NT == 0 ? (int)blockDim.x : NT; }

// Sum over the block's (first NT) threads; `red` must hold nthreads / 32 floats. Every such thread gets the result.
template <int NT = 0>
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x % AF_WARP, warp = threadIdx.x / AF_WARP, nw = nthreads<NT>() / AF_WARP;
  v = warp_sum(v);
  sync_n<NT>();  // `red` may still be read by a previous call
  if (lane == 0) red[warp] = v;
  sync_n<NT>();
  float t = lane < nw ? red[lane] : 0.f;
  return warp_sum(t);
}

// 16-byte streaming load for data read exactly once per step (weights, KV rows): read-only path, no L1
// allocation, so the small reused buffers (activations, x vectors) keep L1.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// 16 (or 8: the fp8 scale pair) bytes global -> shared without passing through registers (sm_80+), and the
// per-thread commit / wait of such copies.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src)
               : "memory");
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Bulk copies by the copy engine (TMA, sm_90+) completing on an mbarrier in shared memory: one thread arms the
// barrier with the bytes to expect (mbar_expect_tx, which is also its arrival: init count 1) and issues the copies
// (bulk_g2s: 16-byte aligned, a multiple of 16 bytes); the consumers wait for the phase (mbar_wait, parity of the
// phase's ordinal); mbar_arrive is a plain arrival (a consumer releasing a slot). Only compiled for sm_90+ (callers guard with AF_HAS_BULK).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define AF_HAS_BULK 1
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"((unsigned)__cvta_generic_to_shared(bar)), "r"(count)
               : "memory");
}
// The barriers' initialisation made visible to the copy engine (the async proxy) before the first bulk copy.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"((unsigned)__cvta_generic_to_shared(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "r"(bytes),
               "r"((unsigned)__cvta_generic_to_shared(bar))
               : "memory");
}
// A 2D tensor copy (TMA): the box of the tensor map `map` (a CUtensorMap in global memory, 64-byte aligned) at
// element coordinates (c0 inner, c1 outer) into shared memory at `dst` (1024-byte aligned for the 128-byte
// swizzle), completing on `bar`; rows past the tensor's bounds land as zeros (and count toward the bytes).
__device__ __forceinline__ void tma_load_2d(void* dst, const void* map, int c0, int c1, unsigned long long* bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
               ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(map), "r"(c0), "r"(c1),
               "r"((unsigned)__cvta_generic_to_shared(bar))
               : "memory");
}
// The same copy with an L2 cache policy (createpolicy: e.g. l2_evict_first), for data read once.
__device__ __forceinline__ void bulk_g2s_hint(void* dst, const void* src, unsigned bytes, unsigned long long* bar,
                                              unsigned long long policy) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
               ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "r"(bytes),
               "r"((unsigned)__cvta_generic_to_shared(bar)), "l"(policy)
               : "memory");
}
// An L2 policy under which the lines a copy brings in are the first to be evicted (streamed weights: read once).
__device__ __forceinline__ unsigned long long l2_evict_first() {
  unsigned long long p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
// Ask L2 for `bytes` (a multiple of 16) at `src` (16-byte aligned) by the copy engine: no destination, no completion.
__device__ __forceinline__ void bulk_prefetch_l2(const void* src, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}
// The generic proxy's earlier accesses to shared memory ordered before later copies of the async proxy into it.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"((unsigned)__cvta_generic_to_shared(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(bar);
  unsigned done = 0;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(a), "r"(parity) : "memory");
  } while (!done);
}
#else
#define AF_HAS_BULK 0
#endif

// D += A · B on the tensor cores: A 16x16 fp16 (row-major fragments a0..a3), B 16x8 fp16 (b0, b1), fp32 D.
__device__ __forceinline__ void mma_16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                          unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ldmatrix: four (x4) or two (x2) 8x8 fp16 matrices from shared memory; lane l gives the address of row l % 8
// of matrix l / 8; with .trans every matrix arrives transposed (the fragments of the mma below).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"((unsigned)__cvta_generic_to_shared(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"((unsigned)__cvta_generic_to_shared(p)));
}
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];"
               : "=r"(r[0]), "=r"(r[1]) : "r"((unsigned)__cvta_generic_to_shared(p)));
}

// Two packed FP8-E4M3 values -> half2 bits (hardware cvt on sm_89+; exact: every E4M3 value is an fp16).
__device__ __forceinline__ unsigned e4m3x2_to_h2(unsigned int u16) {
  const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(u16), __NV_E4M3);
  return (unsigned)r.x | ((unsigned)r.y << 16);
}

// Byte offset of 16-byte piece c of row t in a shared-memory [rows][COLS] fp16 array whose pieces are XOR-swizzled by
// the row (piece c of row t at c ^ (t & 7)): ldmatrix reads 8 rows of one piece without bank conflicts.
template <int COLS>
__device__ __forceinline__ int swz16(int t, int c) {
  return t * COLS * 2 + ((c ^ (t & 7)) << 4);
}

// 16-byte load of data written during the same kernel (activations, the KV row just appended): L2 only
// (.cg), never through L1 or the read-only path, which are not coherent across SMs.
__device__ __forceinline__ uint4 ld_cg16(const void* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }

__device__ __forceinline__ float2 h2_to_f2(unsigned int u) {
  __half2 h = *reinterpret_cast<__half2*>(&u);
  return __half22float2(h);
}

// 1 / RMS of the fp32 residual h[K] (K % 4 == 0), every thread of the block (or its first NT) gets it. h is read through
// L2 (.cg): the previous kernel wrote it.
template <int NT = 0>
__device__ __forceinline__ float rms_inv(const float* h, float eps, int K, float* red) {
  float ss = 0.f;
  for (int k = threadIdx.x * 4; k < K; k += nthreads<NT>() * 4) {
    const float4 v = __ldcg(reinterpret_cast<const float4*>(h + k));
    ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
  }
  return rsqrtf(block_sum<NT>(ss, red) / (float)K + eps);
}

// RMSNorm(h) * w exactly as HF computes it for an fp16 model: normalise in fp32, round to fp16, multiply
// by the fp16 weight (product rounded to fp16). Used by the GEMV prologues (gemv_prologue.cuh).
__device__ __forceinline__ float rmsnorm_elem(float h, float inv, __half w) {
  return __half2float(__hmul(__float2half(h * inv), w));
}

// RMSNorm of two inputs (h0, h1) with their fp16 weights w as one packed half2 (rmsnorm_elem each).
__device__ __forceinline__ unsigned norm_pair(float h0, float h1, float inv, __half2 w) {
  const __half2 v = __halves2half2(__float2half(rmsnorm_elem(h0, inv, __low2half(w))),
                                   __float2half(rmsnorm_elem(h1, inv, __high2half(w))));
  return *reinterpret_cast<const unsigned*>(&v);
}

// A row normalised in one pass: this thread's float4 chunks c = threadIdx.x + i * nth (i < V, c < nchunks) read
// through L2 into hv, kept for the normalisation after the block's sum; returns this thread's sum of their squares,
// in rms_inv's order (so rsqrtf(block_sum / K + eps) is rms_inv's value, bit for bit).
template <int V>
__device__ __forceinline__ float row_chunks_sq(const float4* h4, int nchunks, int nth, float4 (&hv)[V]) {
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int c = threadIdx.x + i * nth;
    if (c < nchunks) {
      hv[i] = __ldcg(h4 + c);
      ss += hv[i].x * hv[i].x + hv[i].y * hv[i].y + hv[i].z * hv[i].z + hv[i].w * hv[i].w;
    }
  }
  return ss;
}

// Synchronisation with the previous kernel, used by the GEMVs (gemv_tiled.cuh, gemv_rows.cuh) between issuing their
// weight loads (independent of the previous kernel) and reading its outputs: wait for the predecessor
// (programmatic dependent launch), then let the next kernel start launching.
struct PdlSync {
  __device__ __forceinline__ void arrive_wait() const {
    pdl_wait();
    pdl_launch_dependents();
  }
};

// GPU-scope acquire-release atomic (the attention kernel's split ticket: the last block of a kv head sees every
// other block's partials). Replaces __threadfence() (fence.sc.gpu), which costs far more.
__device__ __forceinline__ unsigned int atom_add_acq_rel_gpu(unsigned int* p, unsigned int v) {
  unsigned int old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
