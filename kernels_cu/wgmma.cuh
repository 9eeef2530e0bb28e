// wgmma.cuh — Hopper's warpgroup MMA (wgmma) and the shared-memory layout it reads, as the sm_90a kernels use them:
// the 128-byte swizzle and its descriptors, the m64nNk16 fp16 -> fp32 instructions with A from shared memory or from
// registers, the fences that keep the compiler's register order right around asynchronous MMAs; and, for the host
// pass of an sm_90a-only file, the copy engine's functions as never-called stubs.
//
// Computes   nothing of its own: d (+)= A B^T (A 64 x 16, B 64 x 16, both K-major in shared memory) and d += A B
//            (A 64 x 16 from registers in the mma.sync m16n8k16 A fragment of each warp's 16 rows, B 16 x N N-major in
//            shared memory, N = 64 or 128); d the warpgroup's 64 x N fp32 accumulator, d[j] the mma.sync C fragment
//            of n-tile j (rows gid, gid + 8 of the warp's 16; columns 8 j + 2 tig, + 1).
// Layouts    the 128-byte swizzle that both the copy engine (TMA) and wgmma use: 64-dim slabs of rows of 128 bytes,
//            16-byte piece c of row t at ((c & 7) ^ (t & 7)) * 16 within its row, slabs 1024-byte aligned.
// Bytes      none of its own.
// Launch     inside sm_90a kernels, by every thread of a warpgroup (the wgmma and fence instructions are
//            warpgroup-wide: .sync.aligned).
#pragma once
#include "common.cuh"

#if !AF_HAS_BULK  // the host pass: the copy engine's functions as never-called stubs (the kernels are sm_90a only)
__device__ __forceinline__ void mbar_init(unsigned long long*, unsigned) {}
__device__ __forceinline__ void mbar_init_fence() {}
__device__ __forceinline__ void mbar_expect_tx(unsigned long long*, unsigned) {}
__device__ __forceinline__ void mbar_wait(unsigned long long*, unsigned) {}
__device__ __forceinline__ void tma_load_2d(void*, const void*, int, int, unsigned long long*) {}
#endif

// Byte offset of 16-byte piece c of row t in a 64-row tile in the 128-byte swizzle: slabs of 64 dims (64 rows x 128
// bytes = 8 KB each), the pieces of a row XOR-swizzled by the row's low 3 bits.
__device__ __forceinline__ int sw128(int t, int c) { return (c >> 3) * 8192 + t * 128 + (((c & 7) ^ (t & 7)) << 4); }

// The shared-memory matrix descriptor of a 128-byte-swizzle operand starting at `p` (1024-byte aligned but for the
// K-major k-step's 32-byte advance inside a slab): start address >> 4, leading byte offset, stride byte offset 1024
// >> 4 (8 rows of 128 bytes), layout type 1 (128-byte swizzle). K-major: the leading offset is unused when swizzled
// (1). N-major: it is the distance between 64-dim slabs, >> 4 (one slab: unused).
__device__ __forceinline__ unsigned long long sw128_desc(const char* p, unsigned lead = 1) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  return (unsigned long long)((a & 0x3FFFF) >> 4) | ((unsigned long long)lead << 16) |
         ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Pins an accumulator's registers at this point of the instruction order: the compiler sees a wgmma's outputs as
// ready when its asm ends, so without this it could move their reads above wgmma.wait_group (or their writes, the
// zeroing and the rescale, below wgmma.fence); ptxas orders the rest.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}
// d (+)= A B^T over one 16-dim k-step, A and B from their K-major descriptors; `acc` 0 overwrites d.
#define WG_D4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
__device__ __forceinline__ void wgmma_ss(float (&d)[8][4], unsigned long long da, unsigned long long db, int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 0, 0;\n}\n"
      : WG_D4(0), WG_D4(1), WG_D4(2), WG_D4(3), WG_D4(4), WG_D4(5), WG_D4(6), WG_D4(7)
      : "l"(da), "l"(db), "r"(acc));
}

// d += A B over one 16-position k-step, A from registers (a[0..3]), B from an N-major descriptor, accumulated
// (scale-d true). The last immediate (1) transposes B: N-major.
__device__ __forceinline__ void wgmma_rs(float (&d)[8][4], const unsigned (&a)[4], unsigned long long db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : WG_D4(0), WG_D4(1), WG_D4(2), WG_D4(3), WG_D4(4), WG_D4(5), WG_D4(6), WG_D4(7)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
__device__ __forceinline__ void wgmma_rs(float (&d)[16][4], const unsigned (&a)[4], unsigned long long db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : WG_D4(0), WG_D4(1), WG_D4(2), WG_D4(3), WG_D4(4), WG_D4(5), WG_D4(6), WG_D4(7),
        WG_D4(8), WG_D4(9), WG_D4(10), WG_D4(11), WG_D4(12), WG_D4(13), WG_D4(14), WG_D4(15)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
