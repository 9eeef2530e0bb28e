// tp_comm.cu — what tensor-parallel ranks of one host exchange through peer memory (P2P over NVLink/PCIe) outside
// the GEMVs: a standalone sum across ranks and the greedy argmax across the vocabulary shards. (The step's sums run in
// the o_proj / down GEMVs' epilogue: gemv_epilogue.cuh EPI_TPSUM, through the same LL slots, tp_ll.cuh.)
//
// Computes   tp_allreduce_add:  h[i] += x_0[i] + x_1[i] + ... + x_{N-1}[i]   (fp32, in rank order)
//              x_s is rank s's vector: each rank pushes its x into every rank's LL buffer (tp_ll.cuh) and adds the
//              N rows of its own in rank order, so h stays bit-identical on every rank. The one-shot sum on its own
//              (the `profile` role "one sum alone", the GPU tests); the step runs the fused form.
//            tp_argmax_combine: the best (value, index) over the ranks' lm_head shards (larger value wins, ties ->
//              smaller global index, NaN never wins: argmax_common.cuh `better`), then the step's bookkeeping as
//              argmax_finish does it (out_tokens[pos] = best; cur_token = prompt[pos + 1] or best; pos += 1) when
//              `advance`. Rank s's value and local index are its lm_head's am_val[0] / am_idx[0]; global index =
//              local + offsets[s]. With peer_flags == 0 there is no barrier: the NCCL path gathered the pairs into
//              local memory first.
// Barrier    (the combine) one-shot: thread s signals rank s (a release store of the epoch into rank s's
//            flags[my rank]), then waits until every rank's flag in its own memory has reached the epoch (acquire
//            loads), so the pairs the peers' lm_heads wrote are complete. Epochs count in `seq` (local); flags only
//            grow, compared with wrap-around arithmetic.
// Layouts    h, x fp32 [n]; slots: [N] device addresses (uint64) of the ranks' LL buffers [N][n] u64 for this sum;
//            seq uint32 [TP_SUM_BLOCKS] (local, per block); flags uint32 [TP_MAX_RANKS] (local, written by peers);
//            peer_flags [N] addresses of every rank's flags; combine_seq uint32 [1].
// Bytes      sum: n*4 read (x), n*8 written to each rank, n*8*N read locally, n*4 read + written (h).
// Launch     tp_allreduce_add grid = ceil(n / TP_AR_THREADS) (<= TP_SUM_BLOCKS), block = TP_AR_THREADS;
//            tp_argmax_combine grid = 1, block = 32. Both start with the PDL wait (their inputs are the previous
//            kernel's outputs); the sum lets its successor launch right after it (before waiting for the ranks).
#include "common.cuh"
#include "argmax_common.cuh"
#include "tp_ll.cuh"

#define TP_MAX_RANKS 8
static_assert(TP_MAX_RANKS == LL_MAX_RANKS, "the LL readers keep one word per rank");
#define TP_AR_THREADS 256
#define TP_SUM_BLOCKS 64

__device__ __forceinline__ void st_release_sys(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned ld_acquire_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Thread s < nranks of the (one) block: on return every rank has reached the next epoch.
__device__ __forceinline__ void tp_barrier(unsigned* flags, const unsigned long long* peer_flags, unsigned* seq,
                                           int rank, int nranks) {
  const unsigned e = *seq + 1u;
  const int s = threadIdx.x;
  if (s < nranks && s != rank) {
    __threadfence_system();
    st_release_sys(reinterpret_cast<unsigned*>(peer_flags[s]) + rank, e);
    while ((int)(ld_acquire_sys(flags + s) - e) < 0) {
    }
  }
  __syncwarp();
  if (threadIdx.x == 0) *seq = e;
}

extern "C" __global__ void __launch_bounds__(TP_AR_THREADS)
tp_allreduce_add(float* __restrict__ h, const float* __restrict__ x, const unsigned long long* __restrict__ slots,
                 unsigned* seq, int n, int rank, int nranks) {
  AF_TIMELINE_BLOCK;
  pdl_wait();  // x is the previous kernel's output (and, transitively, everything before it is complete)
  // The next kernel may launch now and stream the weights it reads before its own wait while we wait for the other
  // ranks: it reads h only after its wait, i.e. after this kernel has completed.
  pdl_launch_dependents();
  const unsigned e = seq[blockIdx.x] + 1u;
  const int i = blockIdx.x * TP_AR_THREADS + threadIdx.x;  // one value per thread: its N slots in one round trip
  if (i < n) {
    const float v = __ldcg(x + i);
    for (int s = 0; s < nranks; ++s)
      ll_store(reinterpret_cast<unsigned long long*>(slots[s]) + (size_t)rank * n + i, v, e);
    h[i] += ll_sum_ranks(reinterpret_cast<const unsigned long long*>(slots[rank]) + i, (size_t)n, nranks, e);
  }
  __syncthreads();  // every thread has read the old epoch
  if (threadIdx.x == 0) seq[blockIdx.x] = e;
}

extern "C" __global__ void __launch_bounds__(32)
tp_argmax_combine(const unsigned long long* __restrict__ vals, const unsigned long long* __restrict__ idxs,
                  const int* __restrict__ offsets, unsigned* flags, const unsigned long long* __restrict__ peer_flags,
                  unsigned* seq, int rank, int nranks, int* pos, int* cur_token, const int* __restrict__ prompt,
                  const int* __restrict__ prompt_len, int* out_tokens, int advance) {
  AF_TIMELINE_BLOCK;
  pdl_wait();  // the lm_head before us is complete
  if (peer_flags) tp_barrier(flags, peer_flags, seq, rank, nranks);
  pdl_launch_dependents();
  const int s = threadIdx.x;
  float bv = -AF_INF;
  int bi = 0x7fffffff;
  if (s < nranks) {
    const float v = __ldcv(reinterpret_cast<const float*>(vals[s]));
    const int i = __ldcv(reinterpret_cast<const int*>(idxs[s]));
    if (i != 0x7fffffff) better(bv, bi, v, i + offsets[s]);
  }
  warp_argmax(bv, bi);
  if (s == 0 && advance) step_advance(bi, pos, cur_token, prompt, prompt_len, out_tokens);
}
