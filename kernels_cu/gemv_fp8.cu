// gemv_fp8.cu — fused W8A16 GEMV (M = 1 decode): FP8-E4M3 weights, fp16 activations, fp32 accumulation.
//
// Computes   out[o] = sum_g scale[o, g] * sum_{k in group g} e4m3(W[o, k]) * x[k]
//            one fp32 scale per row and group of 128 consecutive inputs. Dequantisation happens in registers
//            only (hardware fp8x2 -> half2 conversion, sm_89+, exact), never in memory; each group's sum is
//            an mma chain (mma.m16n8k16 f32.f16.f16.f32) scaled in fp32.
// Layouts    W uint8 FP8-E4M3 bits TILED (gemv_tiled.cuh; atomflow_bench/gpu/ops/gemv.py tile_view) — tiles of 16
//            rows, each [K/32 units][32 lanes][16 bytes] = the lanes' A fragments of two k-tiles;
//            scales fp32 [tiles][ceil(K/128)][16]; x fp16 [K] or fp32 residual [K]; y per epilogue.
// Requires   rows % 16 == 0, K % 32 == 0. K need not be a multiple of 128: the last group is short
//            (e.g. SmolLM2's K = 576 = 4.5 groups) and its scale covers only the elements present.
// Bytes      rows * K (weights) + rows * ceil(K/128) * 4 (scales) + K * 2..4 per block (x) + outputs.
// Launch     sm_90+ (the _ws instances): block = 288 (8 consumer warps + 1 producer warp filling a ring of 16 KB +
//            512 B slots with bulk copies), 2-3 blocks per SM, dyn. smem = K*2 + 1408 + slots * 16896 (ops/gemv.py
//            gemv_ws_plan). The ring form (and sm_89): block = 256, one kernel per shared-memory ring depth
//            (suffix _r2.._r5: groups of 128 inputs per warp in flight; filled by bulk copies on sm_90+, per-lane
//            cp.async below or with -DGEMV_BULK=0);
//            the host plan (ops/gemv.py gemv_plan) picks depth and blocks per SM (2, or 3 for 2-3 tiles
//            per SM), grid = min(tiles, blocks per SM * SMs), dyn. smem = K*2 + 1152 + depth * 8 * 2304 bytes.
// Instances  same roles as gemv_fp16.cu, each at ring depths 2-5:
//   gemv_f8_qkv_rope_r* (QKV + RoPE + KV append), gemv_f8_norm_swiglu_r* (gate+up), gemv_f8_resid_r* (o_proj,
//   down_proj), gemv_f8_store_r* (generic), gemv_f8_partial_r* (fp32 y = W.x: a tensor-parallel rank's share of
//   o_proj / down, summed across ranks by NCCL), gemv_f8_resid_tp_r* (o_proj / down under tensor parallel with
//   peer memory: h += the sum over ranks in the epilogue, EPI_TPSUM), and gemv_f8_<variant>_ws. The lm_head stays
//   fp16 (lm_head.cu), as in AtomFlow.
#include "gemv_ws.cuh"

// The ring form: one kernel per ring depth of ops/gemv.py GEMV_RING_DEPTHS.
GEMV_ROPE_RING_INSTANCE(gemv_f8_qkv_rope_r2, 2)
GEMV_ROPE_RING_INSTANCE(gemv_f8_qkv_rope_r3, 3)
GEMV_ROPE_RING_INSTANCE(gemv_f8_qkv_rope_r4, 4)
GEMV_ROPE_RING_INSTANCE(gemv_f8_qkv_rope_r5, 5)
GEMV_RING_INSTANCE(gemv_f8_norm_swiglu_r2, PRO_NORM, EPI_SWIGLU, 2)
GEMV_RING_INSTANCE(gemv_f8_norm_swiglu_r3, PRO_NORM, EPI_SWIGLU, 3)
GEMV_RING_INSTANCE(gemv_f8_norm_swiglu_r4, PRO_NORM, EPI_SWIGLU, 4)
GEMV_RING_INSTANCE(gemv_f8_norm_swiglu_r5, PRO_NORM, EPI_SWIGLU, 5)
GEMV_RING_INSTANCE(gemv_f8_resid_r2, PRO_PLAIN, EPI_RESID, 2)
GEMV_RING_INSTANCE(gemv_f8_resid_r3, PRO_PLAIN, EPI_RESID, 3)
GEMV_RING_INSTANCE(gemv_f8_resid_r4, PRO_PLAIN, EPI_RESID, 4)
GEMV_RING_INSTANCE(gemv_f8_resid_r5, PRO_PLAIN, EPI_RESID, 5)
GEMV_RING_INSTANCE(gemv_f8_store_r2, PRO_PLAIN, EPI_STORE, 2)
GEMV_RING_INSTANCE(gemv_f8_store_r3, PRO_PLAIN, EPI_STORE, 3)
GEMV_RING_INSTANCE(gemv_f8_store_r4, PRO_PLAIN, EPI_STORE, 4)
GEMV_RING_INSTANCE(gemv_f8_store_r5, PRO_PLAIN, EPI_STORE, 5)
GEMV_RING_INSTANCE(gemv_f8_partial_r2, PRO_PLAIN, EPI_F32, 2)
GEMV_RING_INSTANCE(gemv_f8_partial_r3, PRO_PLAIN, EPI_F32, 3)
GEMV_RING_INSTANCE(gemv_f8_partial_r4, PRO_PLAIN, EPI_F32, 4)
GEMV_RING_INSTANCE(gemv_f8_partial_r5, PRO_PLAIN, EPI_F32, 5)
GEMV_TP_RING_INSTANCE(gemv_f8_resid_tp_r2, 2)
GEMV_TP_RING_INSTANCE(gemv_f8_resid_tp_r3, 3)
GEMV_TP_RING_INSTANCE(gemv_f8_resid_tp_r4, 4)
GEMV_TP_RING_INSTANCE(gemv_f8_resid_tp_r5, 5)
// The warp-specialised form (sm_90+ only: producer warp + bulk copies).
GEMV_WS_ROPE_INSTANCE(gemv_f8_qkv_rope_ws, true)
GEMV_WS_INSTANCE(gemv_f8_norm_swiglu_ws, true, PRO_NORM, EPI_SWIGLU)
GEMV_WS_INSTANCE(gemv_f8_resid_ws, true, PRO_PLAIN, EPI_RESID)
GEMV_WS_INSTANCE(gemv_f8_store_ws, true, PRO_PLAIN, EPI_STORE)
GEMV_WS_INSTANCE(gemv_f8_partial_ws, true, PRO_PLAIN, EPI_F32)
GEMV_WS_TP_INSTANCE(gemv_f8_resid_tp_ws, true)
