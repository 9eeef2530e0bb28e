// untile.cu — a layer weight from the decode GEMV's tiled layout back to row-major fp16 (gpu/prefill.py, the staged
// form: the prefill's cuBLAS GEMMs read row-major fp16, the arena holds tiled fp16 or fp8 codes and group scales).
//
// Computes   untile_f16  out[row][k] = w[row][k]
//            untile_f8   out[row][k] = fp16(e4m3(code[row][k]) * scale[row][k / 128]) (fp32 product rounded to
//                        nearest; the two NaN codes as 0: gpu/prefill.py e4m3_table, the CuPy reference row_major)
// Layouts    tiled: 16-row tiles (gemv_tiled.cuh, ops/gemv.py tile_view); a tile is 512-byte units of 16 rows x 16
//            inputs (fp16) or 32 inputs (fp8), whose 16-byte piece (g, t) holds rows g and g + 8 of the tile at inputs
//            2t, 2t + 1 (+ 8 for kh; fp8 also + 16 for j), ordered (kh, rh, e) for fp16 and (j, kh, rh, e) for fp8.
//            Which rows make up a tile follows the pairing (ops/gemv.py _tile_rows): 0 none (tile T: rows 16T ..),
//            1 halves (rh 0: row 8T + g, rh 1: row rows/2 + 8T + g), 2 rope (tile = head * half/8 + i8, row = head *
//            2 half + rh * half + 8 i8 + g). Scales [tile][group][g][rh] fp32 (tile_scale_view). out fp16 [rows][K].
// Bytes      reads the tiled weight once (fp16: 2 bytes a weight; fp8: 1 + its group's scale), writes 2 bytes a
//            weight.
// Launch     one thread per 16-byte piece of the tiled weight, blocks of UNTILE_THREADS; a warp's 32 pieces are one
//            512-byte unit, so each warp writes 32 (fp16) or 64 (fp8) contiguous bytes of each of 16 rows. No
//            programmatic dependent launch (the prefill's chunks are stream-ordered).
#include "common.cuh"

#define UNTILE_THREADS 256

// The row of a tile's (rh, g) element under `pairing` (see Layouts).
__device__ __forceinline__ int untile_row(int tile, int rh, int g, int rows, int pairing, int half) {
  if (pairing == 0) return tile * 16 + rh * 8 + g;
  if (pairing == 1) return rh * (rows / 2) + tile * 8 + g;
  const int per_head = half / 8, head = tile / per_head, i8 = tile % per_head;
  return head * 2 * half + rh * half + i8 * 8 + g;
}

extern "C" __global__ void __launch_bounds__(UNTILE_THREADS) untile_f16(const uint4* __restrict__ w,
                                                                         __half* __restrict__ out, int rows, int K,
                                                                         int pairing, int half) {
  const size_t c = (size_t)blockIdx.x * UNTILE_THREADS + threadIdx.x, per_tile = (size_t)K * 2;
  if (c >= (size_t)rows * K / 8) return;
  const int tile = (int)(c / per_tile), r = (int)(c % per_tile);
  const int unit = r / 32, g = (r % 32) / 4, t = r % 4;
  const uint4 v = w[c];
  const unsigned words[4] = {v.x, v.y, v.z, v.w};  // (kh, rh) = (0, 0), (0, 1), (1, 0), (1, 1)
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int kh = q >> 1, rh = q & 1;
    const size_t row = untile_row(tile, rh, g, rows, pairing, half);
    *reinterpret_cast<unsigned*>(out + row * K + unit * 16 + kh * 8 + t * 2) = words[q];
  }
}

// Two codes (low byte first) times the scale, as two fp16 (low half first); a NaN code gives 0.
__device__ __forceinline__ unsigned untile_pair(unsigned codes, float scale) {
  const float2 f = h2_to_f2(e4m3x2_to_h2(codes));
  const float lo = (codes & 0x7fu) == 0x7fu ? 0.f : f.x * scale;
  const float hi = ((codes >> 8) & 0x7fu) == 0x7fu ? 0.f : f.y * scale;
  const __half2 h = __halves2half2(__float2half_rn(lo), __float2half_rn(hi));
  return *reinterpret_cast<const unsigned*>(&h);
}

extern "C" __global__ void __launch_bounds__(UNTILE_THREADS) untile_f8(const uint4* __restrict__ w,
                                                                        const float* __restrict__ scales,
                                                                        __half* __restrict__ out, int rows, int K,
                                                                        int pairing, int half) {
  const size_t c = (size_t)blockIdx.x * UNTILE_THREADS + threadIdx.x;
  if (c >= (size_t)rows * K / 16) return;
  const int groups = (K + 127) / 128;
  const int tile = (int)(c / K), r = (int)(c % K);
  const int unit = r / 32, g = (r % 32) / 4, t = r % 4;
  const float* s = scales + ((size_t)tile * groups + unit / 4) * 16 + g * 2;  // this unit's group: rows g, g + 8
  const size_t row0 = untile_row(tile, 0, g, rows, pairing, half), row1 = untile_row(tile, 1, g, rows, pairing, half);
  const uint4 v = w[c];
  const unsigned words[4] = {v.x, v.y, v.z, v.w};  // (j, kh) = (0, 0), (0, 1), (1, 0), (1, 1); low 16 bits rh 0
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int k = unit * 32 + (q >> 1) * 16 + (q & 1) * 8 + t * 2;
    *reinterpret_cast<unsigned*>(out + row0 * K + k) = untile_pair(words[q] & 0xffffu, s[0]);
    *reinterpret_cast<unsigned*>(out + row1 * K + k) = untile_pair(words[q] >> 16, s[1]);
  }
}
