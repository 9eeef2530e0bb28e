// rope_kv.cu — rotary position embedding (HF `rotate_half` convention, `llama3` scaling folded into
// inv_freq by the host) fused with the KV-cache append. Fused because both touch the same freshly
// projected k row: rotating k in place and then copying it would read it twice.
//
// Computes   for every q head and k head, pair i < hd/2 at position p = *pos:
//              a = p * inv_freq[i] (fp32, as HF);  x0' = x0 cos a - x1 sin a;  x1' = x1 cos a + x0 sin a
//            (x0 = x[i], x1 = x[i + hd/2]); q and k are rotated in place in `qkv`, then
//            k_cache[p, :] = rotated k and v_cache[p, :] = v.
// Layouts    qkv fp16 [n_heads*hd | n_kv*hd | n_kv*hd] (output of the fused QKV GEMV);
//            k_cache/v_cache: this layer's slab, fp16 [max_seq][n_kv*hd] (contiguous, arithmetic
//            addressing: row p at p * kv_dim).
// Bytes      reads (n_heads + 2 n_kv) * hd * 2, writes the same + 2 * n_kv * hd * 2 to the cache.
// Launch     grid = ceil(((n_heads + n_kv) * hd/2 + n_kv*hd) / 256), block = 256.
#include "common.cuh"

extern "C" __global__ void rope_kv_append(__half* __restrict__ qkv, const float* __restrict__ inv_freq,
                                          const int* __restrict__ pos_ptr, __half* __restrict__ k_cache,
                                          __half* __restrict__ v_cache, int n_heads, int n_kv, int hd) {
  const int pos = *pos_ptr;
  const int half_d = hd / 2, kv_dim = n_kv * hd;
  const int n_pairs = (n_heads + n_kv) * half_d;
  const size_t row = (size_t)pos * kv_dim;
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < n_pairs + kv_dim; t += gridDim.x * blockDim.x) {
    if (t < n_pairs) {
      const int head = t / half_d, i = t % half_d;
      __half* x = qkv + (size_t)head * hd;
      float s, c;
      sincosf((float)pos * inv_freq[i], &s, &c);
      const float x0 = __half2float(x[i]), x1 = __half2float(x[i + half_d]);
      const __half r0 = __float2half(x0 * c - x1 * s), r1 = __float2half(x1 * c + x0 * s);
      x[i] = r0;
      x[i + half_d] = r1;
      if (head >= n_heads) {
        const int off = (head - n_heads) * hd + i;
        k_cache[row + off] = r0;
        k_cache[row + off + half_d] = r1;
      }
    } else {
      const int j = t - n_pairs;
      v_cache[row + j] = qkv[(size_t)n_heads * hd + kv_dim + j];
    }
  }
}
