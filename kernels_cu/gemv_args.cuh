// gemv_args.cuh — what every GEMV kernel takes (gemv_fp16.cu, gemv_fp8.cu, lm_head.cu): the operands, the prologue
// and epilogue selectors, and the kernel parameter lists that the instance macros spell. No kernels here.
//
// Computes   nothing: the declarations gemv_prologue.cuh, gemv_epilogue.cuh, gemv_tiled.cuh, gemv_ws.cuh and
//            gemv_rows.cuh share.
// Layouts    W tiled (gemv_tiled.cuh) or row-major (gemv_rows.cuh); x: const float* (the fp32 residual) with
//            PRO_NORM, else const half*; y: half* or float* per epilogue (gemv_epilogue.cuh).
// Bytes      each kernel's own: see its .cu.
// Launch     GEMV_THREADS threads per block do the arithmetic (the warp-specialised form adds a producer warp).
//
// Kernel signatures (unused arguments are 0):
//   (W, scales, x, norm_w, eps, y, n_out, K)                   GEMV_PARAMS, every GEMV
//   + (cos_sin, pos, k_cache, v_cache, n_q_heads, n_kv_heads, hd,
//      next_w, next_bytes, L2Head)                             GEMV_ROPE_PARAMS, EPI_ROPE
//   + (slots, seq, rank, n, L2Head)                            GEMV_TP_PARAMS, EPI_TPSUM
//   warp-specialised: `npre` after GEMV_PARAMS (before the TP arguments), last after GEMV_ROPE_PARAMS;
//   lm_head: + x_out (+ the argmax arguments): gemv_rows.cuh.
#pragma once
#include "common.cuh"

#define GEMV_THREADS 256    // 8 warps; warp w takes the 128-input groups w, w + 8, ... of a tile
#define GEMV_TILE 16        // weight rows per tile (the mma's M)

// The prologue (gemv_prologue.cuh) and the epilogue (gemv_epilogue.cuh) of an instance.
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
  const unsigned char* next_w;    // later weights asked into L2 (next_weights_l2; ops/gemv.py next_l2; 0 bytes: none)
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

// The kernel parameter lists (the arguments' order is the host's: ops/gemv.py gemv_launch, ops/lm_head.py).
// An L2Head as seven kernel arguments P_w, P_s, P_w_stride, P_w_chunk, P_s_stride, P_s_chunk, P_count.
#define L2HEAD_PARAMS(P)                                                                                  \
  const unsigned char* __restrict__ P##_w, const unsigned char* __restrict__ P##_s, unsigned P##_w_stride, \
      unsigned P##_w_chunk, unsigned P##_s_stride, unsigned P##_s_chunk, int P##_count
#define L2HEAD_OF(P) L2Head{P##_w, P##_s, P##_w_stride, P##_w_chunk, P##_s_stride, P##_s_chunk, P##_count}
// Every GEMV's first eight arguments (GemvArgs).
#define GEMV_PARAMS                                                                                       \
  const unsigned char* __restrict__ W, const float* __restrict__ scales, const void* __restrict__ x,      \
      const __half* __restrict__ norm_w, float eps, void* __restrict__ y, int n_out, int K
// EPI_ROPE (the QKV projection): RopeArgs after the eight.
#define GEMV_ROPE_PARAMS                                                                                  \
  GEMV_PARAMS, const float2* __restrict__ cos_sin, const int* __restrict__ pos, __half* __restrict__ k_cache, \
      __half* __restrict__ v_cache, int n_q, int n_kv, int hd, const unsigned char* __restrict__ next_w,  \
      unsigned long long next_bytes, L2HEAD_PARAMS(l2)
#define GEMV_ROPE_ARGS (GEMV_ROPE_PARAMS)
#define GEMV_ROPE_ARGS_OF                                                                                 \
  (RopeArgs{cos_sin, pos, k_cache, v_cache, n_q, n_kv, hd, next_w, next_bytes, L2HEAD_OF(l2)})
// EPI_TPSUM (the cross-rank sum): TpArgs as the last eleven arguments.
#define GEMV_TP_PARAMS                                                                                    \
  const unsigned long long* __restrict__ tp_slots, unsigned* __restrict__ tp_seq, int tp_rank, int tp_n,  \
      L2HEAD_PARAMS(l2)
#define GEMV_TP_ARGS_OF (TpArgs{tp_slots, tp_seq, tp_rank, tp_n, L2HEAD_OF(l2)})
