// rmsnorm.cu — RMSNorm of the fp32 residual stream into an fp16 vector, as HF LlamaRMSNorm computes it:
// out = fp16(h * rsqrt(mean(h^2) + eps)) * w.
//
// Used standalone only with the knob LMHEAD_NORM=0 (the final norm before lm_head) and as the tests' reference:
// the same math (common.cuh: rms_inv, rmsnorm_elem) runs in the prologue of the QKV and gate/up GEMVs
// (gemv_common.cuh stage_x_tiled) and of the lm_head GEMV (norm_x_parked: bit-identical at 256 threads).
// Layouts    h fp32 [K], w fp16 [K], out fp16 [K]; K % 4 == 0.
// Bytes      K * 4 + K * 2 read, K * 2 written.
// Launch     grid = 1, block = 256 (step.py rmsnorm_launch; the sums' order is the lm_head prologue's).
#include "common.cuh"

extern "C" __global__ void rmsnorm_f32_f16(const float* __restrict__ h, const __half* __restrict__ w, float eps,
                                           __half* __restrict__ out, int K) {
  AF_TIMELINE_BLOCK;
  __shared__ float red[32];
  pdl_wait();
  pdl_launch_dependents();
  rmsnorm_to_half(h, w, eps, K, out, red);
}
