// prefill_gemm.cu — the layer projections of a prefill chunk (M tokens at once) on the tensor cores, straight from the
// TILED weights the decode GEMVs read (no second copy of the weights): Y = X · W^T.
//
// Computes   Y[r][o] = sum_k X[r][k] W[o][k] for tokens r < M and weight rows (outputs) o < N, by
//            mma.m16n8k16 f32.f16.f16.f32 with the weights as the A operand (16 weight rows = one tile) and the
//            tokens as B (8 tokens per n-tile). fp16 weights: one fp32 sum over K. fp8 (W8A16): E4M3 codes become
//            fp16 in registers (the hardware cvt, exact), each 128-input group's mma sum is multiplied by the row's
//            scale of that group and added to an fp32 sum (fmaf), exactly the decode GEMV's group_mma arithmetic
//            (gemv_tiled.cuh); only the order of the products inside a group differs.
//            Epilogues: PG_EPI_STORE16 (Y as fp16, rounded to nearest), PG_EPI_STORE32 (Y as fp32), PG_EPI_RESID
//            (h[r][o] += Y[r][o], h fp32: o_proj and down into the residual stream).
// Scheme     block (bx, by) = tokens 128 bx .. (PG_BN), weight tiles 8 by .. (PG_BM = 128 rows); 8 warps as 4 x 2:
//            warp w takes the block's tiles 2 (w % 4), +1 and its tokens 64 (w / 4) .. +63, i.e. 2 x 8 mma tiles
//            (64 fp32 accumulators per lane; fp8 another 64 for the running group). The K loop walks steps of
//            PG_BK = 128 inputs (one fp8 scale group) through a ring of STAGES stages in shared memory filled by
//            cp.async (16-byte copies; stage kb + STAGES - 1 is requested while stage kb is multiplied, one barrier
//            per step). A stage holds the X step [128 tokens][128 inputs] fp16, each token row's 16-byte pieces
//            XOR-swizzled by the row (piece c of row t at c ^ (t & 7)) so that ldmatrix (non-transposed, 8 token rows
//            of one piece) reads without bank conflicts and hands each lane the mma's col-major B fragments; then
//            the weight step, every tile's units copied verbatim (fp16: 8 units = 4 KB per tile, fp8: 4 units = 2 KB):
//            lane l's 16 bytes of a unit are its A fragments, one conflict-free 16-byte shared load per unit; fp8
//            then the step's scales, 64 bytes per tile. Tokens past M read the last token's row (their columns are
//            computed, never stored); tiles past N read the last tile (never stored). The weight copies of the
//            first STAGES - 1 steps go out before the PDL wait (no kernel writes weights).
//            Epilogue from registers: lane (g = l / 4, t = l % 4) holds rows g, g + 8 of each of its tiles for
//            tokens 2t, 2t + 1 of each n-tile; a tile row becomes the original weight row through the tile pairing
//            (pg_row: none, halves, rope), so Y is in the row-major weight's order whatever the pairing.
// Layouts    W TILED as ops/gemv.py tile_view writes it (tiles of 16 rows in 512-byte units; lane l's 16 bytes are
//            its A fragments: rows l/4, l/4 + 8, inputs 2(l%4), +1, +8, +9 of a 16-input k-tile; fp8 two k-tiles
//            per unit), tile row order by `pairing` (0 none, 1 halves, 2 rope with `half` = head_dim / 2); fp8
//            scales [tile][group of 128][8][2] fp32 (ops/gemv.py tile_scale_view). X fp16 [M][x_stride]; Y fp16 or
//            fp32 [M][y_stride] (resid: h, fp32). x_stride % 8 == 0 and pointers 16-byte aligned (the copies);
//            N % 16 == 0, K % 128 == 0 (ops/prefill_gemm.py refuses other shapes).
// Bytes      W once from DRAM (N * K * 2, fp8 N * K + N * K / 32 with scales): the blocks of one weight block run
//            side by side (blockIdx.x = tokens), so the other token blocks find it in L2; X (M * K * 2) from L2
//            once per weight block; Y M * N * 2 or 4 (resid: read and written).
// Launch     prefill_gemm_{f16,f8}_{store16,store32,resid}: grid (ceil(M / 128), ceil(N / 128)), block PG_THREADS,
//            dynamic shared memory STAGES x stage (ops/prefill_gemm.py pg_smem: 192 KB fp16 at 3 stages, 194 KB
//            fp8 at 4), one block per SM (launch bounds: up to 255 registers for the 128 fp32 sums of fp8).
#include "common.cuh"

#define PG_THREADS 256    // 8 warps: 4 (weight rows) x 2 (tokens) (ops/prefill_gemm.py PG_THREADS)
#define PG_BM 128         // weight rows per block = 8 tiles (ops/prefill_gemm.py PG_BM)
#define PG_BN 128         // tokens per block (ops/prefill_gemm.py PG_BN)
#define PG_BK 128         // inputs per K step = one fp8 scale group (ops/prefill_gemm.py PG_BK)
#define PG_STAGES_F16 3   // ring stages, fp16 weights: 3 x 64 KB (ops/prefill_gemm.py PG_STAGES_F16)
#define PG_STAGES_F8 4    // ring stages, fp8 weights: 4 x 48.5 KB (ops/prefill_gemm.py PG_STAGES_F8)
#define PG_EPI_STORE16 0  // Y as fp16
#define PG_EPI_STORE32 1  // Y as fp32
#define PG_EPI_RESID 2    // h += Y, fp32

// Bytes of one ring stage: X step, weight step, fp8 scales (all multiples of 16).
template <bool FP8>
struct PgStage {
  static constexpr int XB = PG_BN * PG_BK * 2;                // [128 tokens][128 inputs] fp16
  static constexpr int TB = PG_BK * 16 * (FP8 ? 1 : 2);       // one tile's step: 8 fp16 / 4 fp8 units
  static constexpr int WB = (PG_BM / 16) * TB;                // the block's 8 tiles
  static constexpr int SB = FP8 ? (PG_BM / 16) * 64 : 0;      // [8 tiles][8][2] fp32 scales
  static constexpr int BYTES = XB + WB + SB;
  static constexpr int STAGES = FP8 ? PG_STAGES_F8 : PG_STAGES_F16;
};

// The original (row-major) weight row of row r (0..15) of tile T under the tile pairing (ops/gemv.py _tile_rows):
// 0 none: 16 T + r; 1 halves: gate rows 8T + g (r < 8) and up rows N/2 + 8T + g (r >= 8); 2 rope: tile T = (head,
// i8) holds rows i8*8 + g (r < 8) and half + i8*8 + g (r >= 8) of the head's 2 half rows.
__device__ __forceinline__ int pg_row(int T, int r, int pairing, int n, int half) {
  const int g = r & 7, rh = r >> 3;
  if (pairing == 1) return rh * (n >> 1) + 8 * T + g;
  if (pairing == 2) {
    const int per = half >> 3, head = T / per, i8 = T - head * per;
    return head * 2 * half + rh * half + 8 * i8 + g;
  }
  return 16 * T + r;
}

// K step kb of the block's weight tiles T0 .. T0 + 7 (tiles past the last read the last) -> ws; fp8 also the step's
// scales -> ws + WB.
template <bool FP8>
__device__ __forceinline__ void pg_load_w(char* ws, const unsigned char* W, const float* S, int kb, int T0,
                                          int ntiles, int K) {
  using C = PgStage<FP8>;
  constexpr int PER = C::TB / 16;  // 16-byte pieces of one tile's step
  const size_t tile_bytes = (size_t)K * 16 * (FP8 ? 1 : 2);
#pragma unroll
  for (int i = 0; i < C::WB / 16 / PG_THREADS; ++i) {
    const int c = threadIdx.x + i * PG_THREADS, t = c / PER, o = c % PER;
    const int T = min(T0 + t, ntiles - 1);
    cp_async16(ws + t * C::TB + o * 16, W + (size_t)T * tile_bytes + (size_t)kb * C::TB + o * 16);
  }
  if (FP8 && threadIdx.x < C::SB / 16) {
    const int t = threadIdx.x >> 2, p = threadIdx.x & 3;
    const int T = min(T0 + t, ntiles - 1);
    cp_async16(ws + C::WB + t * 64 + p * 16,
               reinterpret_cast<const char*>(S) + ((size_t)T * (K / PG_BK) + kb) * 64 + p * 16);
  }
}

// K step kb of tokens m0 .. m0 + 127 (tokens past M read token M - 1) -> xs, swizzled.
__device__ __forceinline__ void pg_load_x(char* xs, const __half* x, int kb, int m0, int m, int x_stride) {
#pragma unroll
  for (int i = 0; i < PG_BN * (PG_BK / 8) / PG_THREADS; ++i) {
    const int c = threadIdx.x + i * PG_THREADS, t = c / (PG_BK / 8), p = c % (PG_BK / 8);
    const int r = min(m0 + t, m - 1);
    cp_async16(xs + swz16<PG_BK>(t, p), x + (size_t)r * x_stride + kb * PG_BK + p * 8);
  }
}

// One stage's 128 inputs into c: the warp's tiles 2 wr, 2 wr + 1 (i) x its n-tiles 64 wc + 8 j (j < 8).
template <bool FP8>
__device__ __forceinline__ void pg_kstep(float (&c)[2][8][4], const char* xs, const char* ws, int wr, int wc,
                                         int lane) {
  using C = PgStage<FP8>;
  uint4 raw[2];  // fp8: the lane's 16 bytes of the current unit (two k-tiles), per tile
#pragma unroll
  for (int ks = 0; ks < PG_BK / 16; ++ks) {
    unsigned a[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const char* tile = ws + (2 * wr + i) * C::TB + lane * 16;
      if (FP8) {
        if ((ks & 1) == 0) raw[i] = *reinterpret_cast<const uint4*>(tile + (ks >> 1) * 512);
        const unsigned lo = (ks & 1) ? raw[i].z : raw[i].x, hi = (ks & 1) ? raw[i].w : raw[i].y;
        a[i][0] = e4m3x2_to_h2(lo & 0xffffu);
        a[i][1] = e4m3x2_to_h2(lo >> 16);
        a[i][2] = e4m3x2_to_h2(hi & 0xffffu);
        a[i][3] = e4m3x2_to_h2(hi >> 16);
      } else {
        const uint4 v = *reinterpret_cast<const uint4*>(tile + ks * 512);
        a[i][0] = v.x;
        a[i][1] = v.y;
        a[i][2] = v.z;
        a[i][3] = v.w;
      }
    }
#pragma unroll
    for (int p = 0; p < 4; ++p) {  // tokens 64 wc + 16 p ..: n-tiles 2p (b[0], b[1]) and 2p + 1 (b[2], b[3])
      unsigned b[4];
      ldmatrix_x4(b, xs + swz16<PG_BK>(64 * wc + 16 * p + ((lane >> 4) << 3) + (lane & 7), 2 * ks + ((lane >> 3) & 1)));
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        mma_16816(c[i][2 * p], a[i][0], a[i][1], a[i][2], a[i][3], b[0], b[1]);
        mma_16816(c[i][2 * p + 1], a[i][0], a[i][1], a[i][2], a[i][3], b[2], b[3]);
      }
    }
  }
}

template <bool FP8, int EPI>
__device__ __forceinline__ void prefill_gemm_block(const unsigned char* W, const float* S, const __half* x, void* y,
                                                   int m, int n, int K, int x_stride, int y_stride, int pairing,
                                                   int half, char* smem) {
  using C = PgStage<FP8>;
  constexpr int ST = C::STAGES;
  const int lane = threadIdx.x % AF_WARP, warp = threadIdx.x / AF_WARP;
  const int wr = warp & 3, wc = warp >> 2;  // the warp's tiles 2 wr, +1 of the block; its tokens 64 wc ..
  const int g = lane >> 2, t = lane & 3;
  const int m0 = blockIdx.x * PG_BN, T0 = blockIdx.y * (PG_BM / 16);
  const int ntiles = n / 16, nk = K / PG_BK;

#pragma unroll
  for (int s = 0; s < ST - 1; ++s)
    if (s < nk) pg_load_w<FP8>(smem + s * C::BYTES + C::XB, W, S, s, T0, ntiles, K);
  pdl_wait();  // X and h are the previous kernels' outputs
  pdl_launch_dependents();
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) {  // group s: X step s (group 0 also every weight copy above)
    if (s < nk) pg_load_x(smem + s * C::BYTES, x, s, m0, m, x_stride);
    cp_async_commit();
  }

  float acc[2][8][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;

  for (int kb = 0; kb < nk; ++kb) {
    cp_async_wait<ST - 2>();  // this thread's copies of step kb have landed ...
    __syncthreads();          // ... and everyone's; everyone is done with step kb - 1's stage, refilled next
    if (kb + ST - 1 < nk) {
      char* nx = smem + ((kb + ST - 1) % ST) * C::BYTES;
      pg_load_w<FP8>(nx + C::XB, W, S, kb + ST - 1, T0, ntiles, K);
      pg_load_x(nx, x, kb + ST - 1, m0, m, x_stride);
    }
    cp_async_commit();  // (empty near the end: the wait above counts groups)
    const char* st = smem + (kb % ST) * C::BYTES;
    if constexpr (FP8) {
      float d[2][8][4];
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) d[i][j][0] = d[i][j][1] = d[i][j][2] = d[i][j][3] = 0.f;
      pg_kstep<true>(d, st, st + C::XB, wr, wc, lane);
#pragma unroll
      for (int i = 0; i < 2; ++i) {  // rows g and g + 8 of tile 2 wr + i: this group's scales
        const float2 sc = *reinterpret_cast<const float2*>(st + C::XB + C::WB + (2 * wr + i) * 64 + g * 8);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          acc[i][j][0] = fmaf(d[i][j][0], sc.x, acc[i][j][0]);
          acc[i][j][1] = fmaf(d[i][j][1], sc.x, acc[i][j][1]);
          acc[i][j][2] = fmaf(d[i][j][2], sc.y, acc[i][j][2]);
          acc[i][j][3] = fmaf(d[i][j][3], sc.y, acc[i][j][3]);
        }
      }
    } else {
      pg_kstep<false>(acc, st, st + C::XB, wr, wc, lane);
    }
  }
  AF_TL_MARK(1);  // timeline: the K loop done

  // acc[i][j][2 rh + e] = Y[token 64 wc + 8 j + 2 t + e][row g + 8 rh of tile 2 wr + i]
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int T = T0 + 2 * wr + i;
    if (T >= ntiles) continue;
    const int row[2] = {pg_row(T, g, pairing, n, half), pg_row(T, g + 8, pairing, n, half)};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = m0 + 64 * wc + 8 * j + 2 * t + e;
        if (r >= m) continue;
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
          const size_t at = (size_t)r * y_stride + row[rh];
          const float v = acc[i][j][2 * rh + e];
          if (EPI == PG_EPI_STORE16)
            reinterpret_cast<__half*>(y)[at] = __float2half_rn(v);
          else if (EPI == PG_EPI_STORE32)
            reinterpret_cast<float*>(y)[at] = v;
          else
            reinterpret_cast<float*>(y)[at] += v;
        }
      }
    }
  }
}

#define PREFILL_GEMM_INSTANCE(NAME, FP8, EPI)                                                                      \
  extern "C" __global__ void __launch_bounds__(PG_THREADS, 1)                                                     \
      NAME(const unsigned char* __restrict__ w, const float* __restrict__ scales, const __half* __restrict__ x,   \
           void* __restrict__ y, int m, int n, int k, int x_stride, int y_stride, int pairing, int half) {         \
    AF_TIMELINE_BLOCK;                                                                                             \
    extern __shared__ __align__(16) char pg_smem[];                                                                \
    prefill_gemm_block<FP8, EPI>(w, scales, x, y, m, n, k, x_stride, y_stride, pairing, half, pg_smem);           \
  }

PREFILL_GEMM_INSTANCE(prefill_gemm_f16_store16, false, PG_EPI_STORE16)
PREFILL_GEMM_INSTANCE(prefill_gemm_f16_store32, false, PG_EPI_STORE32)
PREFILL_GEMM_INSTANCE(prefill_gemm_f16_resid, false, PG_EPI_RESID)
PREFILL_GEMM_INSTANCE(prefill_gemm_f8_store16, true, PG_EPI_STORE16)
PREFILL_GEMM_INSTANCE(prefill_gemm_f8_store32, true, PG_EPI_STORE32)
PREFILL_GEMM_INSTANCE(prefill_gemm_f8_resid, true, PG_EPI_RESID)
