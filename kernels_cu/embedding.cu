// embedding.cu — token embedding lookup into the fp32 residual stream.
//
// Computes   h[i] = float(emb[*token, i]) for i < H; the token id is read from device memory (written by
//            argmax_advance in the previous step, or the prompt), so graph replays need no host input.
// Layouts    emb fp16 [vocab, H] row-major; h fp32 [H].
// Bytes      H * 2 read, H * 4 written.
// Launch     grid = ceil(H / 256), block = 256.
#include "common.cuh"

extern "C" __global__ void embed_lookup(const int* __restrict__ token, const __half* __restrict__ emb,
                                        float* __restrict__ h, int H) {
  AF_TIMELINE_BLOCK;
  pdl_wait();
  pdl_launch_dependents();
  const size_t base = (size_t)(*token) * H;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < H; i += gridDim.x * blockDim.x)
    h[i] = __half2float(emb[base + i]);
}
