// probe_stream.cu — a benchmarking probe, not part of the decode step: what one persistent kernel could reach when
// it streams a whole step's weights with the step's dependencies between ops (lab/PERF_NOTES.md v32-v32.7).
//
// Computes   a checksum: every byte of w[op_off[0], op_off[n_ops]) is read once from shared memory as 32-bit words
//            and summed (mod 2^64) into *sink; nothing else (an M = 1 GEMV's arithmetic is not what bounds it).
// Why        the decode step loses ~11 µs of HBM time per layer at its kernel boundaries (v30: the QKV -> attention
//            -> o_proj -> gate/up latency chain), because a kernel's blocks can only request weights once they are
//            resident. Here one grid of persistent blocks walks all ops: a producer lane keeps a ring of bulk copies
//            full across op boundaries (weights never depend on the previous op), while the consumers of op o wait
//            for a group of blocks — the whole grid, the dependency a GEMV's full input vector makes — to have
//            finished op o-1, plus delay_ns[o] (a model of a latency between them, e.g. the attention's). Smaller
//            groups model dependencies on a slice (split-K by head or by intermediate slice). The step time of this
//            probe is the ceiling of that design on this GPU; with `slots` small it models copies that cannot run
//            ahead.
// Layouts    w: the step's weight bytes, op after op (op_off[o] .. op_off[o+1], 16-byte multiples); block b streams
//            its 1/gridDim share of each op in chunks of `chunk` bytes (a 16-byte multiple) through a ring of
//            `slots` chunks in dynamic shared memory. group[o]: 0, op o waits for nothing; G, block b's op o waits
//            for blocks [G*(b/G), G*(b/G) + G) (clipped to the grid) to have finished op o-1. counters[o][gridDim]:
//            per group of op o+1's grouping, the blocks done with op o, cumulative over launches (launch = 1, 2, ...
//            waits for launch x the group's size; never reset). poll_ns: 0, the waiting thread spins on its counter;
//            > 0, it sleeps that long between polls. signal: how a block announces an op done — 1: red.release.gpu
//            (the default), 0: __threadfence() then atomicAdd. dyn = 1: no static shares — each producer takes the
//            op's chunks grab_n at a time from grab[o] (zeroed before the launch), so faster SMs take more, and ends
//            its op with a marker slot (meta = 0); an op's waiters then wait for counters[o-1][0] to reach the
//            op's chunk count (each block adds the chunks it consumed; group[] only says which ops wait).
//            stats (or null): per block 5 cycle counts (clock64) of its last launch — the producer waiting for a
//            free slot; thread 0 waiting for chunks to land, for the dependency, at each op's closing bar.sync;
//            thread 0's whole run.
// Bytes      op_off[n_ops] - op_off[0] read once (+ counter traffic: 4 bytes per block and op, and the polls).
// Launch     grid = the SM count (every block resident: the waits need it), block = 288 (8 consumer
//            warps + 1 producer warp), dynamic shared memory = 2048 + slots x chunk (slots <= 64).
#include "../../kernels_cu/common.cuh"

extern "C" __global__ void __launch_bounds__(288, 1)
probe_stream(const unsigned char* __restrict__ w, const unsigned long long* __restrict__ op_off, int n_ops,
             const unsigned* __restrict__ delay_ns, const unsigned* __restrict__ group, unsigned* counters,
             unsigned launch, int poll_ns, int slots, unsigned chunk, int signal, int dyn, unsigned grab_n,
             unsigned* grab,
             unsigned long long* sink, unsigned long long* stats) {
#if AF_HAS_BULK
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned long long* full = reinterpret_cast<unsigned long long*>(smem);  // slots barriers: chunk landed
  unsigned long long* empty = full + 64;                                    // slots barriers: 8 warps done with it
  unsigned* meta = reinterpret_cast<unsigned*>(smem + 1024);               // dyn: the slot's bytes (0: op's end)
  unsigned char* ring = smem + 2048;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int s = 0; s < slots; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, 8);
    }
    mbar_init_fence();
  }
  __syncthreads();
  // block b's part of op o: [lo, hi), share = the op's bytes / gridDim rounded up to 16
  auto part = [&](int o, unsigned long long& lo, unsigned long long& hi) {
    const unsigned long long a = op_off[o], n = op_off[o + 1] - a;
    const unsigned long long share = ((n + gridDim.x - 1) / gridDim.x + 15) & ~15ull;
    lo = min(a + share * blockIdx.x, a + n);
    hi = min(lo + share, a + n);
  };
  if (warp == 8) {  // producer: runs ahead across ops, bounded only by the ring
    if (lane == 0) {
      unsigned k = 0;
      unsigned long long blocked = 0;  // cycles waiting for a free slot (the ring full of unconsumed chunks)
      auto free_slot = [&](unsigned k) {
        const int slot = (int)(k % (unsigned)slots);
        if (k >= (unsigned)slots) {
          const unsigned long long t0 = clock64();
          mbar_wait(empty + slot, (k / slots - 1) & 1u);
          blocked += clock64() - t0;
        }
        return slot;
      };
      for (int o = 0; o < n_ops; ++o) {
        if (dyn) {  // the op's chunks taken grab_n at a time from a shared counter; the next grab asked before
                    // this one's copies are issued
          const unsigned long long a = op_off[o], n = op_off[o + 1] - a;
          const unsigned nc = (unsigned)((n + chunk - 1) / chunk), ng = (nc + grab_n - 1) / grab_n;
          unsigned gi = atomicAdd(grab + o, 1u);
          for (;;) {
            const bool end = gi >= ng;
            const unsigned nxt = end ? 0u : atomicAdd(grab + o, 1u);
            if (end) {  // the consumers' marker: this block has no more of op o
              const int slot = free_slot(k);
              meta[slot] = 0u;
              mbar_arrive(full + slot);
              ++k;
              break;
            }
            for (unsigned c = gi * grab_n; c < min(nc, gi * grab_n + grab_n); ++c, ++k) {
              const int slot = free_slot(k);
              const unsigned bytes = (unsigned)min((unsigned long long)chunk, n - (unsigned long long)c * chunk);
              meta[slot] = bytes;
              mbar_expect_tx(full + slot, bytes);
              bulk_g2s(ring + (size_t)slot * chunk, w + a + (unsigned long long)c * chunk, bytes, full + slot);
            }
            gi = nxt;
          }
          continue;
        }
        unsigned long long lo, hi;
        part(o, lo, hi);
        for (unsigned long long p = lo; p < hi; p += chunk, ++k) {
          const int slot = free_slot(k);
          const unsigned bytes = (unsigned)min((unsigned long long)chunk, hi - p);
          mbar_expect_tx(full + slot, bytes);
          bulk_g2s(ring + (size_t)slot * chunk, w + p, bytes, full + slot);
        }
      }
      if (stats) stats[blockIdx.x * 5 + 0] = blocked;
    }
    return;
  }
  unsigned long long acc = 0;
  unsigned k = 0;
  // thread 0's cycles: waiting for chunks to land, for the dependency (+ delay), at the op's closing bar.sync; all
  const unsigned long long t_start = clock64();
  unsigned long long data_wait = 0, dep_wait = 0, end_sync = 0, t0 = 0;
  for (int o = 0; o < n_ops; ++o) {
    const unsigned G = o > 0 ? group[o] : 0u;
    if (G) {  // the dependency: this block's group done with op o-1, then the modelled latency
      t0 = clock64();
      if (threadIdx.x == 0) {
        // dyn: op o-1's chunks all consumed (one counter); else: the blocks of this block's group done with it
        const unsigned g = dyn ? 0u : blockIdx.x / G;
        const unsigned want = launch * (dyn ? (unsigned)((op_off[o] - op_off[o - 1] + chunk - 1) / chunk)
                                            : min(G, gridDim.x - g * G));
        const unsigned* c = counters + (size_t)(o - 1) * gridDim.x + g;
        unsigned done;
        for (;;) {
          asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(done) : "l"(c) : "memory");
          if (done >= want) break;
          if (poll_ns) __nanosleep((unsigned)poll_ns);
        }
        if (delay_ns[o]) {
          unsigned long long t0, t;
          asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
          do {
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
          } while (t - t0 < delay_ns[o]);
        }
      }
      asm volatile("bar.sync 1, 256;" ::: "memory");
      dep_wait += clock64() - t0;
    }
    unsigned long long lo = 0, hi = 0;
    unsigned mine = 0;  // chunks of op o this block consumed
    if (!dyn) part(o, lo, hi);
    for (unsigned long long p = lo;; p += chunk, ++k) {
      if (!dyn && p >= hi) break;
      const int slot = (int)(k % (unsigned)slots);
      t0 = clock64();
      mbar_wait(full + slot, (k / slots) & 1u);
      data_wait += clock64() - t0;
      const unsigned bytes = dyn ? meta[slot] : (unsigned)min((unsigned long long)chunk, hi - p);
      if (bytes == 0) {  // dyn: the producer's end-of-op marker
        __syncwarp();
        if (lane == 0) mbar_arrive(empty + slot);
        ++k;
        break;
      }
      const uint4* v = reinterpret_cast<const uint4*>(ring + (size_t)slot * chunk);
      for (unsigned i = threadIdx.x; i < bytes / 16; i += 256) {
        const uint4 x = v[i];
        acc += (unsigned long long)x.x + x.y + x.z + x.w;
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + slot);
      ++mine;
    }
    t0 = clock64();
    asm volatile("bar.sync 1, 256;" ::: "memory");  // every consumer done with op o
    end_sync += clock64() - t0;
    if (threadIdx.x == 0 && o + 1 < n_ops && group[o + 1]) {  // announced to the group op o+1 waits on
      unsigned* c = counters + (size_t)o * gridDim.x + (dyn ? 0u : blockIdx.x / group[o + 1]);
      const unsigned add = dyn ? mine : 1u;  // dyn: the chunks it consumed; else: one block
      if (signal) {  // a release reduction: orders this block's earlier writes without a full fence
        asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(c), "r"(add) : "memory");
      } else {       // a full fence, then the add (v32: ~0.3 µs per op more where nothing else is waited for)
        __threadfence();
        atomicAdd(c, add);
      }
    }
  }
  for (int d = 16; d; d >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, d);
  if (lane == 0) atomicAdd(sink, acc);
  if (stats && threadIdx.x == 0) {
    unsigned long long* s = stats + blockIdx.x * 5;
    s[1] = data_wait;
    s[2] = dep_wait;
    s[3] = end_sync;
    s[4] = clock64() - t_start;
  }
#endif
}
