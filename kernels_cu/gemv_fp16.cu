// gemv_fp16.cu — y = W · x for fp16 weights (M = 1 decode), the skeleton in gemv_common.cuh.
//
// Computes   out[o] = sum_k W[o, k] * x[k]   with W fp16 row-major [rows, K], x fp16 (or the fp32
//            residual, RMS-normalised in the prologue), fp32 accumulation.
// Layouts    W fp16 row-major [rows, K] (HF [out, in]); x fp16 [K] or fp32 residual [K]; y per epilogue.
// Requires   K % 8 == 0 (16-byte rows); the host rejects other K.
// Bytes      rows * K * 2 (weights, streamed once, evict-first) + K * 2..4 per block (x, from L2)
//            + n_out * 2..4 (output).
// Launch     grid = min(ceil(n_out / 8), 4 blocks per SM), block = 256, dyn. smem = K*2 + 128 bytes (x in fp16).
// Instances  (name: prologue / epilogue / used for)
//   gemv_f16_qkv_rope     RMSNorm / RoPE + KV append  fused QKV projection (q|k|v rows stacked)
//   gemv_f16_norm_swiglu  RMSNorm / silu(gate)*up     fused gate+up projection ([gate; up] stacked)
//   gemv_f16_resid        plain / h += W·x            o_proj and down_proj with the residual add
//   gemv_f16_f32          plain / fp32 store          lm_head logits
//   gemv_f16_store        plain / fp16 store          generic (microbenchmarks)
#include "gemv_common.cuh"

GEMV_ROPE_INSTANCE(gemv_f16_qkv_rope, Fp16W)
GEMV_INSTANCE(gemv_f16_norm_swiglu, Fp16W, PRO_NORM, EPI_SWIGLU)
GEMV_INSTANCE(gemv_f16_resid, Fp16W, PRO_PLAIN, EPI_RESID)
GEMV_INSTANCE(gemv_f16_f32, Fp16W, PRO_PLAIN, EPI_F32)
GEMV_INSTANCE(gemv_f16_store, Fp16W, PRO_PLAIN, EPI_STORE)
