"""The sums across ranks inside the step: everything the host knows about kernels_cu/tp_comm.cu, the LL slots of
tp_ll.cuh (also the GEMV's EPI_TPSUM epilogue, ops/gemv.py variant resid_tp), and the NCCL reference path beside
them (group.py's collectives).

Two places per layer need a sum across ranks (o_proj's and down's partial products), and the step's tail needs the
greedy token over the vocabulary shards. Two paths, chosen per run (the record says which ran):

  peer  (one host with peer access and the same GPU model on every rank; the default there) o_proj and down run the
        resid_tp GEMV: each tile's partial outputs are pushed (8-byte value + epoch stores, tp_ll.cuh) into one of two
        LL buffers of every rank (o_proj: 0, down: 1, so a buffer is reused only two sums later), and each block
        then waits for the other ranks' values of its own rows and adds them to h in rank order: no kernel of its
        own, h bit-identical on every rank. The lm_head leaves its best (value, index) in am_val[0] / am_idx[0] of
        the exported buffer; tp_argmax_combine reads every rank's pair and does the step's bookkeeping.
  nccl  (always available: the reference) rank 0's o_proj / down keep the residual epilogue (h += W.x), the other
        ranks' GEMVs store their partial product into h, and an in-place NCCL all-reduce of h sums them: two
        launches per sum. The argmax pairs are all-gathered (two NCCL all-gathers of 4 bytes per rank) into local
        memory, where tp_argmax_combine (no barrier) reads them.

A third, `local`, only for timing: the partial GEMVs into a scratch vector and no exchange at all (values wrong),
the step the exchanges' cost is measured against (figures.py). The standalone sum tp_allreduce_add uses
the same slots (its own two buffers): the "one sum alone" figure and the GPU tests. Both real paths are built at
setup where they can be (peer needs every rank on this host and peer access), so a run times both.

The batched prefill (gpu/prefill.py) sums a chunk's rows (up to its chunk length) after its o_proj and down GEMMs:
`RowSums`, on NCCL whatever the step's path (the LL buffers hold one row).
"""
from __future__ import annotations

import numpy as np

from ...errors import AtomflowError
from ..launch import NULL, Launch, i32

TP_MAX_RANKS = 8        # tp_comm.cu TP_MAX_RANKS
TP_AR_THREADS = 256     # tp_comm.cu TP_AR_THREADS: one value per thread
TP_SUM_BLOCKS = 64      # tp_comm.cu TP_SUM_BLOCKS: the most blocks a standalone sum may have (hidden <= 16384)
GEMV_TP_MAX_BLOCKS = 1024  # the most blocks a resid_tp GEMV may have (its epochs: one per block and buffer)
# Ring slots of each first-round tile of a later GEMV (ops/gemv.py head_l2) asked into L2 while a GEMV has nothing
# else to do; one slot, because more gain nothing while the ranks meet and four slow the step (they evict more):
WAIT_HEAD_SLOTS = 1  # by resid_tp while it waits for the other ranks: the next GEMV's
QKV_HEAD_SLOTS = 1   # by QKV after its epilogue: o_proj's
CU_FILES = ("tp_comm.cu", "tp_ll.cuh", "argmax_common.cuh", "common.cuh")
CU_DEFINES = {"TP_MAX_RANKS": TP_MAX_RANKS, "TP_AR_THREADS": TP_AR_THREADS, "TP_SUM_BLOCKS": TP_SUM_BLOCKS}
KERNELS = {"tp_comm.cu": ("tp_allreduce_add", "tp_argmax_combine")}  # launched here, defined there (nvrtc.KernelLib)
PATHS = ("peer", "nccl")
SUM_ROLES = ("wo", "wd")  # the residual GEMVs whose partial products are summed across ranks
ALIGN = 256


def sum_blocks(n: int) -> int:
    """Blocks of one standalone tp_allreduce_add over n fp32 values."""
    g = -(-n // TP_AR_THREADS)
    if g > TP_SUM_BLOCKS:
        raise AtomflowError(f"tensor-parallel sum: hidden size {n} needs {g} blocks, at most {TP_SUM_BLOCKS}")
    return g


def exported_layout(hidden: int, am_blocks: int, n_ranks: int) -> dict[str, tuple[int, tuple, np.dtype]]:
    """Regions of the buffer each rank exports to its peers: name -> (byte offset, shape, dtype). The same on every
    rank (am_blocks: the most lm_head blocks any rank launches). gemv0/1: the resid_tp GEMVs' LL buffers (o_proj,
    down), sum0/1: the standalone sum's; each [ranks][hidden] u64 (tp_ll.cuh)."""
    ll = (n_ranks, hidden)
    regions = [("gemv0", ll, np.uint64), ("gemv1", ll, np.uint64), ("sum0", ll, np.uint64), ("sum1", ll, np.uint64),
               ("flags", (TP_MAX_RANKS,), np.uint32), ("am_val", (am_blocks,), np.float32),
               ("am_idx", (am_blocks,), np.int32)]
    out, off = {}, 0
    for name, shape, dt in regions:
        off = -(-off // ALIGN) * ALIGN
        out[name] = (off, shape, np.dtype(dt))
        off += int(np.prod(shape)) * np.dtype(dt).itemsize
    out["_bytes"] = (off, (), np.dtype(np.uint8))
    return out


def allreduce_launch(lib, h, x, slots_ptrs, seq, rank: int, n_ranks: int, taps=None) -> Launch:
    """h += the sum over ranks of their x (the standalone one-shot sum; `slots_ptrs`: device array [n_ranks] uint64
    of the ranks' LL buffers for this sum, `seq`: this buffer's epochs [TP_SUM_BLOCKS] uint32)."""
    n = h.size
    g = sum_blocks(n)
    lib.declare(KERNELS)  # the wing's kernels are not the one-GPU ops' (gpu/ops declared_kernels)
    return Launch(lib["tp_allreduce_add"], "tp_allreduce_add", (g,), (TP_AR_THREADS,),
                  (h, x, slots_ptrs, seq, i32(n), i32(rank), i32(n_ranks)), 0, taps or {},
                  n * 4 * 3 + n * 8 * 2 * n_ranks, f"tp sum peer {n * 4} B x {n_ranks}")


def argmax_combine_launch(lib, vals_ptrs, idxs_ptrs, offsets, flags, peer_flags, seq, rank: int, n_ranks: int,
                          state: tuple, advance: bool = True) -> Launch:
    """The greedy token over the ranks' (value, local index) pairs (+ offsets) and the step's bookkeeping; `state` =
    (pos, cur_token, prompt, prompt_len, out_tokens). peer_flags None: no barrier (the pairs are local)."""
    lib.declare(KERNELS)
    return Launch(lib["tp_argmax_combine"], "tp_argmax_combine", (1,), (32,),
                  (vals_ptrs, idxs_ptrs, offsets, NULL if flags is None else flags,
                   NULL if peer_flags is None else peer_flags, seq, i32(rank), i32(n_ranks), *state,
                   i32(1 if advance else 0)), 0, {}, 8 * n_ranks, f"tp argmax combine x {n_ranks}")


class RowSums:
    """The batched prefill's sums across ranks: rank 0's o_proj / down GEMM adds its product to the residual rows
    (`adds_residual`), the other ranks' GEMMs store theirs in them, and the call on (rows, m), an in-place NCCL
    all-reduce of rows[:m] (fp32), leaves h + the sum of the products on every rank, bit-identical, as the step's nccl
    path does for its one row. Queued on the current stream, so a chunk's CUDA graph captures it."""

    def __init__(self, group):
        self.group = group
        self.adds_residual = group.rank == 0

    def __call__(self, rows, m: int) -> None:
        self.group.allreduce_rows(rows, m)


class TpComm:
    """One rank's side of the exchanges: buffers, peer addresses, and the launches the step inserts (the engine's
    sums hook: gpu/step.py reads only this object's methods and the two constants below)."""

    WAIT_HEAD_SLOTS = WAIT_HEAD_SLOTS
    QKV_HEAD_SLOTS = QKV_HEAD_SLOTS

    def __init__(self, group, lib, hidden: int, am_blocks: int, vocab_offsets: list[int], path: str = "auto",
                 gpu_key: tuple = ()):
        """`path`: peer, nccl, or auto (peer where every rank can map the others' memory and the ranks' GPUs agree
        (`gpu_key`: integers that fix the GEMV plans, e.g. compute capability, SMs, shared memory per block: the
        resid_tp GEMVs' grids must be the same on every rank), else nccl)."""
        import cupy  # optional extra: imported where a GPU is used

        if path not in PATHS + ("auto",):
            raise AtomflowError(f"--allreduce {path!r}: one of {', '.join(PATHS)}, auto")
        if group.size > TP_MAX_RANKS:
            raise AtomflowError(f"tensor parallel over {group.size} ranks: at most {TP_MAX_RANKS}")
        self.group, self.lib, self.rank, self.n = group, lib, group.rank, group.size
        self.hidden = hidden
        sum_blocks(hidden)
        lay = exported_layout(hidden, am_blocks, self.n)
        self.peer_reason = None
        buf = addrs = None
        try:  # every rank tries (the mapping is collective), whatever path the step takes
            buf, addrs = group.peer_buffer(lay["_bytes"][0])
        except (AtomflowError, cupy.cuda.runtime.CUDARuntimeError) as e:
            self.peer_reason = str(e).splitlines()[0]
        keys = group.allgather_host(np.asarray(tuple(gpu_key) or (0,), np.int64))  # collective too
        if addrs is not None and not (keys == keys[0]).all():
            addrs = None
            self.peer_reason = (f"the ranks' GPUs differ ({', '.join(map(str, keys.tolist()))}): the summing GEMVs' "
                                "grids would too")
        if buf is None:
            buf = cupy.zeros(lay["_bytes"][0], dtype=cupy.uint8)
        if path == "peer" and addrs is None:
            raise AtomflowError(f"--allreduce peer: {self.peer_reason} (use --allreduce nccl)")
        self.peer = addrs is not None
        self.path = ("peer" if self.peer else "nccl") if path == "auto" else path
        self.buf = buf

        def view(name):
            off, shape, dt = lay[name]
            return buf[off:off + int(np.prod(shape)) * dt.itemsize].view(dt).reshape(shape)

        self.ll = {k: view(k) for k in ("gemv0", "gemv1", "sum0", "sum1")}
        self.flags, self.am_val, self.am_idx = view("flags"), view("am_val"), view("am_idx")
        self.gemv_seq = cupy.zeros((2, GEMV_TP_MAX_BLOCKS), dtype=cupy.uint32)
        self.sum_seq = cupy.zeros((2, TP_SUM_BLOCKS), dtype=cupy.uint32)
        self.combine_seq = cupy.zeros(1, dtype=cupy.uint32)
        self.local_scratch = cupy.zeros(hidden, dtype=cupy.float32)  # the `local` path's partial products
        self.offsets = cupy.asarray(np.asarray(vocab_offsets, dtype=np.int32))
        u64 = lambda xs: cupy.asarray(np.asarray(xs, dtype=np.uint64))  # noqa: E731
        if self.peer:
            self.slots = {k: u64([a + lay[k][0] for a in addrs]) for k in self.ll}
            self.peer_flags = u64([a + lay["flags"][0] for a in addrs])
            self.peer_val = u64([a + lay["am_val"][0] for a in addrs])
            self.peer_idx = u64([a + lay["am_idx"][0] for a in addrs])
        # the NCCL path's gathered pairs
        self.g_val = cupy.zeros(self.n, dtype=cupy.float32)
        self.g_idx = cupy.zeros(self.n, dtype=cupy.int32)
        self.g_val_ptrs = u64([self.g_val.data.ptr + 4 * s for s in range(self.n)])
        self.g_idx_ptrs = u64([self.g_idx.data.ptr + 4 * s for s in range(self.n)])
        self.row_sums = RowSums(group)  # the batched prefill's sums (Engine.prefills asks for them)

    # ---- what the step asks ---------------------------------------------------------------------------------------
    def gemv_target(self, role: str, h, path: str | None = None) -> tuple[str, object, tuple | None]:
        """(GEMV variant, output, its TpArgs or None) of the residual GEMV `role` (wo | wd) on this rank; `path` as
        the step's (None), or peer | nccl | local."""
        path = path or self.path
        if path == "peer":
            b = SUM_ROLES.index(role)
            return "resid_tp", h, (self.slots[f"gemv{b}"], self.gemv_seq[b], self.rank, self.n)
        if path == "local":
            return "partial", self.local_scratch, None
        return ("resid" if self.rank == 0 else "partial"), h, None

    def sum_launches(self, role: str, h, path: str | None = None) -> list:
        """The launches after the residual GEMV `role` that leave h summed over the ranks (none where the GEMV sums
        itself)."""
        path = path or self.path
        if path == "nccl":
            return [self.group.allreduce_op(h)]
        return []

    def gather_vocab(self, local, vocab: int):
        """Every rank's values over its vocabulary rows (e.g. its logits), concatenated in rank order: [vocab] fp32
        on the host (collective: every rank calls it)."""
        rows = -(-vocab // self.n)
        mine = np.zeros(rows, np.float32)
        local = np.asarray(local, np.float32).reshape(-1)
        mine[:local.size] = local
        return self.group.allgather_host(mine).reshape(-1)[:vocab]

    def argmax_arrays(self) -> tuple:
        """Where the rank's lm_head keeps its argmax partials (its best ends in element 0)."""
        return self.am_val, self.am_idx

    def argmax_launches(self, state: tuple, path: str | None = None) -> list:
        path = path or self.path
        if path == "peer":
            return [argmax_combine_launch(self.lib, self.peer_val, self.peer_idx, self.offsets, self.flags,
                                          self.peer_flags, self.combine_seq, self.rank, self.n, state)]
        if path == "local":
            return []
        return [self.group.allgather_op(self.am_val[:1], self.g_val),
                self.group.allgather_op(self.am_idx[:1], self.g_idx),
                argmax_combine_launch(self.lib, self.g_val_ptrs, self.g_idx_ptrs, self.offsets, None, None,
                                      self.combine_seq, self.rank, self.n, state)]

    def sum_alone_launch(self, buffer: int, h, x) -> Launch:
        """The standalone peer sum h += sum over ranks of x through LL buffer `buffer` (0 | 1)."""
        return allreduce_launch(self.lib, h, x, self.slots[f"sum{buffer}"], self.sum_seq[buffer], self.rank, self.n)

    def comm_only_launches(self, path: str, sums: int, scratch_h) -> list:
        """`sums` sums of hidden fp32 on `scratch_h` (peer: the standalone one-shot sum of a scratch vector into it,
        alternating its two buffers as a step does; nccl: in-place all-reduces): the step's cross-rank sums without
        its GEMVs, to time them inside a graph (values meaningless)."""
        if path == "peer":
            return [self.sum_alone_launch(c % 2, scratch_h, self.local_scratch) for c in range(sums)]
        return [self.group.allreduce_op(scratch_h) for _ in range(sums)]
