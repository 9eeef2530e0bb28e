// argmax_common.cuh — greedy argmax pieces of the lm_head GEMV with the
// argmax in its epilogue (gemv_rows.cuh gemv_rows, lm_head.cu gemv_f16_f32_argmax). No kernels here.
//
// Order      (value, index): larger value wins, ties -> smaller index (like numpy.argmax); NaN never wins.
// argmax_finish: every block's (value, index) -> part_*[blockIdx.x]; the last block to finish (atomic ticket
//            on `counter`, after a __threadfence) reduces the partials and, when `advance`, writes the step
//            state: with p = *pos: out_tokens[p] = best; *cur_token = (p + 1 < *prompt_len) ? prompt[p + 1]
//            : best; *pos = p + 1. It always resets the counter to 0 for the next launch, and leaves the best
//            (value, index) in part_val[0] / part_idx[0] (tensor parallel: tp_comm.cu combines the ranks' bests).
#pragma once
#include "common.cuh"

struct ArgmaxArgs {
  float* part_val;        // [>= gridDim.x] fp32
  int* part_idx;          // [>= gridDim.x] int32
  unsigned int* counter;  // [1], 0 between launches
  int* pos;
  int* cur_token;
  const int* prompt;
  const int* prompt_len;
  int* out_tokens;
  int advance;  // 0: the state is left as it is (timing runs that replay one position)
};

__device__ __forceinline__ void better(float& bv, int& bi, float v, int i) {
  if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
}

// Warp-wide (value, index) reduction; result valid in every lane.
__device__ __forceinline__ void warp_argmax(float& bv, int& bi) {
#pragma unroll
  for (int o = AF_WARP / 2; o > 0; o >>= 1)
    better(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
}

// Block-wide (value, index) reduction; result valid in thread 0.
__device__ __forceinline__ void block_argmax(float& bv, int& bi) {
  __shared__ float sv[32];
  __shared__ int si[32];
  const int lane = threadIdx.x % AF_WARP, warp = threadIdx.x / AF_WARP;
  warp_argmax(bv, bi);
  if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
  __syncthreads();
  if (warp == 0) {
    bv = lane < (int)(blockDim.x / AF_WARP) ? sv[lane] : -AF_INF;
    bi = lane < (int)(blockDim.x / AF_WARP) ? si[lane] : 0x7fffffff;
    warp_argmax(bv, bi);
  }
}

// The step's bookkeeping once the greedy token `bi` is known (see the header; 0x7fffffff: none, token 0).
__device__ __forceinline__ void step_advance(int bi, int* pos, int* cur_token, const int* prompt, const int* prompt_len,
                                             int* out_tokens) {
  const int p = *pos;
  const int best = bi == 0x7fffffff ? 0 : bi;
  out_tokens[p] = best;
  *cur_token = (p + 1 < *prompt_len) ? prompt[p + 1] : best;
  *pos = p + 1;
}

// Every thread of the block calls this with its own (value, index); see the header.
__device__ __forceinline__ void argmax_finish(float bv, int bi, const ArgmaxArgs& m) {
  __shared__ bool last;
  block_argmax(bv, bi);
  if (threadIdx.x == 0) {
    m.part_val[blockIdx.x] = bv;
    m.part_idx[blockIdx.x] = bi;
    __threadfence();
    last = atomicAdd(m.counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  bv = -AF_INF;
  bi = 0x7fffffff;
  for (int b = threadIdx.x; b < (int)gridDim.x; b += blockDim.x)
    better(bv, bi, __ldcg(m.part_val + b), __ldcg(m.part_idx + b));
  block_argmax(bv, bi);
  if (threadIdx.x == 0) {
    m.part_val[0] = bv;
    m.part_idx[0] = bi;
    if (m.advance) step_advance(bi, m.pos, m.cur_token, m.prompt, m.prompt_len, m.out_tokens);
    *m.counter = 0u;
  }
}
