// spin.cu — a benchmarking utility, not part of the decode step: one thread waits `ns` nanoseconds on the GPU's
// global timer.
//
// Computes   nothing; returns once %globaltimer has advanced `ns` past the kernel's start (at once for ns = 0: the
//            empty launch whose event-pair time is the floor under every isolated figure).
// Why        launches timed one by one with events (profile.gemv_bench's isolated figure) must not include the
//            host's time to submit them: queued behind this kernel, the events and launches are all in the
//            stream before the GPU reaches the first one (the host checks that it finished queueing in time).
// Layouts    no operands (ns: a kernel argument).
// Bytes      none.
// Launch     grid = 1, block = 1.
#include "common.cuh"

extern "C" __global__ void spin_ns(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  t = t0;
  while (t - t0 < ns) {  // ns = 0: returns at once (profile.gemv_bench's empty launch)
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  }
}
