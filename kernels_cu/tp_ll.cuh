// tp_ll.cuh — the low-latency ("LL", as NCCL calls it) slots through which tensor-parallel ranks of one host push
// values into each other's memory (peer memory over NVLink/PCIe): used by the GEMV's cross-rank sum epilogue
// (gemv_epilogue.cuh EPI_TPSUM) and by the standalone sum (tp_comm.cu tp_allreduce_add).
//
// A slot is 8 bytes written by one store: the value's fp32 bits (low word) and the epoch of the exchange (high word).
// The reader polls its local slot until the epoch has arrived; the value came in the same single-copy-atomic 8-byte
// store, so no fence and no separate flag is needed: the writer's stores are posted (no round trip) and the reader
// waits one one-way trip. Why: a flag barrier with remote reads costs ~6 µs per sum (a fence, a flag round trip and
// remote loads).
// Layout     a rank's buffer of one exchange: [n ranks][n values] u64, rank s's values in row s; every rank writes
//            its row into every rank's buffer (its own included) and reads all rows of its own.
// Epochs     count the exchanges of one (buffer, block index): the kernel's block b reads seq[b] + 1 and writes it
//            back when done. Every rank runs the same launches with the same grids (the host checks the GPUs
//            agree), so block b's epochs agree across ranks. Slots start at 0 (epoch 0: nothing yet); comparisons
//            wrap around. Reuse: the host alternates two buffers per kind of exchange, so a rank overwrites a
//            peer's slot only two exchanges later, which it can reach only after that peer finished reading it
//            (it needs the peer's values of the exchange in between, written after the peer's reads).
#pragma once

__device__ __forceinline__ void ll_store(unsigned long long* p, float v, unsigned epoch) {
  const unsigned long long w = (unsigned long long)__float_as_uint(v) | ((unsigned long long)epoch << 32);
  asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(w) : "memory");
}

#define LL_MAX_RANKS 8  // = tp_comm.cu TP_MAX_RANKS: the readers keep one word per rank in registers

__device__ __forceinline__ unsigned long long ll_load(const unsigned long long* p) {
  unsigned long long w;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(w) : "l"(p) : "memory");
  return w;
}
__device__ __forceinline__ bool ll_behind(unsigned long long w, unsigned epoch) {
  return (int)((unsigned)(w >> 32) - epoch) < 0;
}
__device__ __forceinline__ float ll_value(unsigned long long w) { return __uint_as_float((unsigned)w); }

// Readers load every slot they need at once (independent loads, one L2 round trip), then spin on the late ones only:
// one slot after another costs a round trip each (2.9 µs per sum at 4 ranks against 1.7 at 2).
// The N slots rows[0], rows[stride], ... (N <= LL_MAX_RANKS) at `epoch`, summed in rank order.
__device__ __forceinline__ float ll_sum_ranks(const unsigned long long* rows, size_t stride, int n, unsigned epoch) {
  unsigned long long w[LL_MAX_RANKS];
#pragma unroll
  for (int s = 0; s < LL_MAX_RANKS; ++s)
    if (s < n) w[s] = ll_load(rows + s * stride);
  float acc = 0.f;
#pragma unroll
  for (int s = 0; s < LL_MAX_RANKS; ++s) {
    if (s < n) {
      while (ll_behind(w[s], epoch)) w[s] = ll_load(rows + s * stride);
      acc = s == 0 ? ll_value(w[s]) : acc + ll_value(w[s]);
    }
  }
  return acc;
}
