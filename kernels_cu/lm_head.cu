// lm_head.cu — the step's tail in one launch: the final RMSNorm, logits = lm_head · x, and the greedy argmax with
// the step's bookkeeping (gemv_rows.cuh, argmax_common.cuh).
//
// Computes   x = RMSNorm(h) * final_norm (when norm_w is given; else x is the fp16 input), logits[o] = W[o, :] · x in
//            fp32; the _argmax instance also finds the greedy token (largest logit, ties to the smaller id) and
//            writes out_tokens[pos], cur_token and pos + 1 (argmax_common.cuh argmax_finish).
// Layouts    W fp16 row-major [rows, K] (HF [out, in], shared with the embedding when tied); h fp32 [K] or x fp16
//            [K]; logits fp32 [rows]; x_out fp16 [K] (block 0 stores the normalised x there: the `final_norm`
//            probe).
// Requires   K % 8 == 0 (16-byte rows). The host rejects others.
// Bytes      rows * K * 2 (weights, streamed once, no L1 allocation) + K * 4 + K * 2 per block (h, norm_w) + rows * 4
//            (logits) + V_blocks * 8 (argmax partials).
// Launch     block = 256, grid = min(ceil(rows / 8), 4 * SMs), dyn. smem = K*2 bytes (K*8 + 128 with the final RMSNorm
//            as its prologue: x, h fp32 and norm_w parked in shared memory); ops/lm_head.py rows_launch.
// Instances  (name: prologue / epilogue / used for)
//   gemv_f16_f32          RMSNorm or plain / fp32 store             logits alone (the `gemv` benchmark, tests)
//   gemv_f16_f32_argmax   RMSNorm or plain / fp32 store + argmax    the step's tail (+ V_blocks * 8 bytes of
//                                                                   partials and a ticket)
#include "gemv_rows.cuh"

GEMV_ROWS_INSTANCE(gemv_f16_f32, EPI_F32)
GEMV_ROWS_ARGMAX_INSTANCE(gemv_f16_f32_argmax)
