// gemv_fp16.cu — the layer GEMVs y = W · x for fp16 weights (M = 1 decode): gemv_tiled.cuh, gemv_ws.cuh.
//
// Computes   out[o] = sum_k W[o, k] * x[k]   with W fp16, x fp16 (or the fp32 residual, RMS-normalised in
//            the prologue), fp32 accumulation (tensor cores, mma.m16n8k16 f32.f16.f16.f32).
// Layouts    W fp16 TILED (gemv_tiled.cuh; atomflow_bench/gpu/ops/gemv.py tile_view): tiles of 16 rows, each
//            [K/16 units][32 lanes][8 halves] = the lanes' mma A fragments; x fp16 [K] or fp32 residual [K]; y per
//            epilogue.
// Requires   rows % 16 == 0, K % 32 == 0. The host rejects others.
// Bytes      rows * K * 2 (weights, streamed once, no L1 allocation) + K * 2..4 per block (x, from L2)
//            + n_out * 2..4 (output).
// Launch     tiled, sm_90+ (the _ws instances): block = 288 (8 consumer warps + 1 producer warp filling a ring of
//            16 KB slots with bulk copies), 2-3 blocks per SM, grid = min(tiles, blocks per SM * SMs), dyn. smem
//            = K*2 + 1408 + slots * 16384 (ops/gemv.py gemv_ws_plan); the ring form (and sm_89): block = 256 through
//            registers, 2 blocks per SM, dyn. smem = K*2 + 1152 (+ K*6 with the RMSNorm prologue).
// Instances  (name: prologue / epilogue / used for)
//   gemv_f16_qkv_rope     RMSNorm / RoPE + KV append  fused QKV projection (q|k|v rows, RoPE pairs tiled)
//   gemv_f16_norm_swiglu  RMSNorm / silu(gate)*up     fused gate+up projection (gate|up rows tiled in pairs)
//   gemv_f16_resid        plain / h += W·x            o_proj and down_proj with the residual add
//   gemv_f16_store        plain / fp16 store          generic (tests, microbenchmarks)
//   gemv_f16_partial      plain / fp32 store          a tensor-parallel rank's share of o_proj / down (the NCCL path)
//   gemv_f16_resid_tp     plain / h += sum over ranks  o_proj and down under tensor parallel with peer memory: the
//                         of W_s.x_s (EPI_TPSUM)      cross-rank sum in the epilogue (tp_ll.cuh; 11 more arguments:
//                                                     slots, seq, rank, ranks and the next GEMV's L2Head)
//   gemv_f16_<variant>_ws the same tiled variants, warp-specialised (sm_90+; a last argument `npre`: ring
//                         slots filled before the PDL wait)
#include "gemv_ws.cuh"

// The ring form (the register path on fp16).
GEMV_ROPE_INSTANCE(gemv_f16_qkv_rope)
GEMV_INSTANCE(gemv_f16_norm_swiglu, PRO_NORM, EPI_SWIGLU)
GEMV_INSTANCE(gemv_f16_resid, PRO_PLAIN, EPI_RESID)
GEMV_INSTANCE(gemv_f16_store, PRO_PLAIN, EPI_STORE)
GEMV_INSTANCE(gemv_f16_partial, PRO_PLAIN, EPI_F32)
GEMV_TP_INSTANCE(gemv_f16_resid_tp)
// The warp-specialised form (sm_90+ only: producer warp + bulk copies).
GEMV_WS_ROPE_INSTANCE(gemv_f16_qkv_rope_ws, false)
GEMV_WS_INSTANCE(gemv_f16_norm_swiglu_ws, false, PRO_NORM, EPI_SWIGLU)
GEMV_WS_INSTANCE(gemv_f16_resid_ws, false, PRO_PLAIN, EPI_RESID)
GEMV_WS_INSTANCE(gemv_f16_store_ws, false, PRO_PLAIN, EPI_STORE)
GEMV_WS_INSTANCE(gemv_f16_partial_ws, false, PRO_PLAIN, EPI_F32)
GEMV_WS_TP_INSTANCE(gemv_f16_resid_tp_ws, false)
