// tp_comm.cu — what tensor-parallel ranks of one host exchange through peer memory (P2P over NVLink/PCIe):
// the sum of the residual GEMVs' partials and the greedy argmax across the vocabulary shards.
//
// Computes   tp_allreduce_add:  h[i] += part_0[i] + part_1[i] + ... + part_{N-1}[i]   (fp32, in rank order)
//              part_s is rank s's partial y = W_s . x_s (the "partial" GEMV of o_proj or down), read from its own
//              memory through a peer pointer. Every rank sums the same values in the same order, so h stays
//              bit-identical on every rank.
//            tp_argmax_combine: the best (value, index) over the ranks' lm_head shards (larger value wins, ties ->
//              smaller global index, NaN never wins: argmax_common.cuh `better`), then the step's bookkeeping as
//              argmax_finish does it (out_tokens[pos] = best; cur_token = prompt[pos + 1] or best; pos += 1) when
//              `advance`. Rank s's value and local index are its lm_head's am_val[0] / am_idx[0]; global index =
//              local + offsets[s]. With peer_flags == 0 there is no barrier: the NCCL path gathered the pairs into
//              local memory first.
// Barrier    one-shot, per block ("slot"): each block's thread s signals rank s (a release store of the slot's
//            epoch into rank s's flags[slot][my rank]), then waits until every rank's flag in its own memory has
//            reached the epoch (acquire loads), so the partials the peers' previous kernels wrote are complete.
//            Epochs count per slot in `seq` (local); flags only grow, compared with wrap-around arithmetic.
//            Reuse: a rank overwrites a partial buffer only two sums later (the host alternates two buffers: o_proj
//            one, down the other), and it can only get there after every peer has signalled the sum in between,
//            i.e. after the peers finished reading the first.
// Layouts    h fp32 [n]; parts: [N] device addresses (uint64) of the ranks' partial buffers fp32 [n] for this sum;
//            flags uint32 [TP_SLOTS][TP_MAX_RANKS] (local, written by peers); peer_flags [N] addresses of every
//            rank's flags; seq uint32 [TP_SLOTS] (local). Slots 0..TP_AR_SLOTS-1: the sum's blocks; TP_ARGMAX_SLOT.
// Bytes      sum: n*4 read from each rank (N-1 of them remote), n*4 read + written locally.
// Launch     tp_allreduce_add grid = ceil(n / (TP_AR_THREADS * 4)) (<= TP_AR_SLOTS), block = TP_AR_THREADS;
//            tp_argmax_combine grid = 1, block = 32. Both start with the PDL wait (their inputs are the previous
//            kernel's outputs) and signal only after it; the sum lets its successor launch before its barrier.
#include "common.cuh"
#include "argmax_common.cuh"

#define TP_MAX_RANKS 8
#define TP_AR_THREADS 256
#define TP_AR_SLOTS 16
#define TP_ARGMAX_SLOT 16
#define TP_SLOTS 17

__device__ __forceinline__ void st_release_sys(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned ld_acquire_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// All threads of the block call it; on return every rank has reached this slot's next epoch.
__device__ __forceinline__ void tp_barrier(unsigned* flags, const unsigned long long* peer_flags, unsigned* seq,
                                           int slot, int rank, int nranks) {
  __shared__ unsigned epoch;
  if (threadIdx.x == 0) epoch = seq[slot] + 1u;
  __syncthreads();
  const unsigned e = epoch;
  const int s = threadIdx.x;
  if (s < nranks && s != rank) {
    __threadfence_system();
    st_release_sys(reinterpret_cast<unsigned*>(peer_flags[s]) + slot * TP_MAX_RANKS + rank, e);
    const unsigned* f = flags + slot * TP_MAX_RANKS + s;
    while ((int)(ld_acquire_sys(f) - e) < 0) {
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) seq[slot] = e;
}

extern "C" __global__ void __launch_bounds__(TP_AR_THREADS)
tp_allreduce_add(float* __restrict__ h, const unsigned long long* __restrict__ parts, unsigned* flags,
                 const unsigned long long* __restrict__ peer_flags, unsigned* seq, int n, int rank, int nranks) {
  AF_TIMELINE_BLOCK;
  pdl_wait();  // the partial GEMV before us is complete (and, transitively, everything before it)
  // The next GEMV may launch now and stream the weights it reads before its own wait while we wait for the other
  // ranks: it reads h only after its wait, i.e. after this kernel has completed.
  pdl_launch_dependents();
  tp_barrier(flags, peer_flags, seq, blockIdx.x, rank, nranks);
  const int i = (blockIdx.x * TP_AR_THREADS + threadIdx.x) * 4;
  if (i >= n) return;
  float4 acc = __ldcv(reinterpret_cast<const float4*>(reinterpret_cast<const float*>(parts[0]) + i));
  for (int s = 1; s < nranks; ++s) {
    const float4 p = __ldcv(reinterpret_cast<const float4*>(reinterpret_cast<const float*>(parts[s]) + i));
    acc.x += p.x; acc.y += p.y; acc.z += p.z; acc.w += p.w;
  }
  float4* hp = reinterpret_cast<float4*>(h + i);
  float4 v = *hp;
  v.x += acc.x; v.y += acc.y; v.z += acc.z; v.w += acc.w;
  *hp = v;
}

extern "C" __global__ void __launch_bounds__(32)
tp_argmax_combine(const unsigned long long* __restrict__ vals, const unsigned long long* __restrict__ idxs,
                  const int* __restrict__ offsets, unsigned* flags, const unsigned long long* __restrict__ peer_flags,
                  unsigned* seq, int rank, int nranks, int* pos, int* cur_token, const int* __restrict__ prompt,
                  const int* __restrict__ prompt_len, int* out_tokens, int advance) {
  AF_TIMELINE_BLOCK;
  pdl_wait();  // the lm_head before us is complete
  if (peer_flags) tp_barrier(flags, peer_flags, seq, TP_ARGMAX_SLOT, rank, nranks);
  pdl_launch_dependents();
  const int s = threadIdx.x;
  float bv = -AF_INF;
  int bi = 0x7fffffff;
  if (s < nranks) {
    const float v = __ldcv(reinterpret_cast<const float*>(vals[s]));
    const int i = __ldcv(reinterpret_cast<const int*>(idxs[s]));
    if (i != 0x7fffffff) better(bv, bi, v, i + offsets[s]);
  }
#pragma unroll
  for (int o = AF_WARP / 2; o > 0; o >>= 1)
    better(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
  if (s == 0 && advance) {
    const int p = *pos;
    const int best = bi == 0x7fffffff ? 0 : bi;
    out_tokens[p] = best;
    *cur_token = (p + 1 < *prompt_len) ? prompt[p + 1] : best;
    *pos = p + 1;
  }
}
