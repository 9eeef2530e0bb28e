"""The process group of a tensor-parallel run: one process per GPU, NCCL between them (cupy.cuda.nccl), bootstrapped through
our own rendezvous (rendezvous.py: rank 0 serves it on MASTER_ADDR:ATOMFLOW_TP_PORT, by default MASTER_PORT + 1, and
hands the NCCL unique id to the others; every wait is bounded by the command's --tp-timeout, else
ATOMFLOW_TP_TIMEOUT; then each rank watches the others and ends when one is gone).

Conventions (torchrun's; mpirun's and srun's names are read where those are unset, envs.py): RANK, WORLD_SIZE,
LOCAL_RANK (the GPU of this host; default RANK), MASTER_ADDR. `launch` starts the N processes of one host itself and
stops them all when one fails; under a launcher that already set RANK / WORLD_SIZE every process joins instead, so
two hosts need no code change. NCCL variables the user set are left as they are; NVLink multicast (NVLS) is off
unless the user set NCCL_NVLS_ENABLE (the lent machines need it off).

`Group` holds the communicator and the collectives the decode step captures (`allreduce_op`, `allgather_op`: host
ops queued on the current stream, so a CUDA graph records them), plus the host-side exchanges the engine needs
once (`allgather_host`: IPC handles, copy bandwidths; `agree`: one choice for every rank) and the peer-memory
mapping of the fast path (`peer_buffer`); the batched prefill's sums of rows (`allreduce_rows`, sums.py RowSums).
It is also what the engine plugs in (`shard_plan`, `sums`, `agree`): the engine asks the group for the rank's shard,
its sums and one prefill weights form for every rank, and knows nothing else of tensor parallel.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ... import envs
from ...errors import AtomflowError
from ..device import require_gpu
from .plan import RankShard, check_kernels, plan
from .rendezvous import SETS_THE_WAIT, Rendezvous
from .sums import TpComm


def joined() -> bool:
    """True in a process a launcher started as one rank of several (RANK and WORLD_SIZE > 1 set; a launcher's single
    task, e.g. `srun -n 1`, starts its ranks itself)."""
    return envs.RANK is not None and (envs.WORLD_SIZE or 0) > 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_port() -> int:
    """ATOMFLOW_TP_PORT, else MASTER_PORT + 1: MASTER_PORT itself is the launcher's (torchrun's store holds it)."""
    port = envs.ATOMFLOW_TP_PORT
    return envs.MASTER_PORT + 1 if port is None else port


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def launch(n: int, argv: list[str], gpus: int, command: list[str] | None = None) -> int:
    """Run `python -m atomflow_bench.cli ARGV` (or `command` + ARGV) as `n` ranks on this host (GPU r for rank r) and
    return the exit code: 0 when every rank succeeded, else the failing rank's code (128 + the signal when one was
    killed, with one line naming it; a rank that exits with a code printed its own line). The others are stopped at
    once (SIGTERM, then SIGKILL after KILL_AFTER seconds): a rank waiting in a collective for a dead peer would wait
    forever. Ranks still running EXIT_GRACE seconds after one exited 0 are stopped too, with one line, and the code
    is 1. Rank 0 keeps stdout; the others' stdout is dropped (they print nothing but errors, which go to stderr)."""
    if n > gpus:
        raise AtomflowError(f"--tp {n} needs {n} GPUs on this host, {gpus} visible")
    command = [sys.executable, "-m", "atomflow_bench.cli"] if command is None else list(command)
    port = free_port()
    procs = {}
    first_done = None  # when the first rank exited 0
    try:
        with _signals_deferred():  # a Ctrl-C or SIGTERM while a rank starts lands once every started rank is known
            for r in range(n):
                env = envs.rank_environment(r, n, port)
                procs[r] = subprocess.Popen([*command, *argv], env=env, stdout=None if r == 0 else subprocess.DEVNULL)
        while procs:
            ended = {r: p.returncode for r, p in procs.items() if p.poll() is not None}
            for r in ended:
                del procs[r]
            if first_done is None and 0 in ended.values():
                first_done = time.monotonic()
            if procs and first_done is not None and time.monotonic() - first_done > EXIT_GRACE:
                rest = sorted(procs)
                _stop(procs)
                print(f"error: rank{'s' * (len(rest) > 1)} {', '.join(map(str, rest))} did not exit within "
                      f"{EXIT_GRACE:g} s of a rank that finished; stopped", file=sys.stderr, flush=True)
                return 1
            failed = sorted((rc >= 0, r) for r, rc in ended.items() if rc != 0)  # a signal death first: the cause
            if failed:
                r = failed[0][1]
                rc = ended[r]
                _stop(procs)
                if rc < 0:
                    rest = sorted(procs)
                    others = (f"; rank{'s' * (len(rest) > 1)} {', '.join(map(str, rest))} "
                              f"{'were' if len(rest) > 1 else 'was'} stopped") if rest else ""
                    print(f"error: rank {r} was killed by {_signal_name(-rc)}{others}", file=sys.stderr, flush=True)
                    return 128 - rc
                return rc
            time.sleep(0.05)
    except BaseException:  # Ctrl-C, SIGTERM (errors.Terminated), a bug: no rank is left running on a GPU
        _stop(procs)
        raise
    return 0


@contextlib.contextmanager
def _signals_deferred():
    """Holds SIGINT and SIGTERM back while the ranks start, then delivers them to the handlers they had. Raised inside
    subprocess.Popen, between the child's exec and Popen's return, their exception would lose the child (no Popen
    object to stop it): that rank would keep running, on its GPU. Only the main thread can swap handlers; elsewhere,
    or where a handler was not set from Python, the signals are not held."""
    pending, old = [], {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(s) is not None:
                old[s] = signal.signal(s, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    for s in dict.fromkeys(pending):
        signal.raise_signal(s)  # to its own handler now: in launch, inside the try that stops the ranks


KILL_AFTER = 3.0  # seconds a stopped rank gets to exit on SIGTERM before SIGKILL
# Seconds the other ranks get to exit once one has exited 0. Every rank leaves through the same closing barrier, so
# they finish within moments of each other; one still running long after is stuck (e.g. in a destructor at exit)
# and would otherwise hold the command forever.
EXIT_GRACE = 60.0


def _stop(procs: dict) -> None:
    """End every rank in `procs` within KILL_AFTER seconds (SIGTERM, then SIGKILL for any still running)."""
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + KILL_AFTER
    for p in procs.values():
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@dataclass
class HostOp:
    """A collective in the step's list of launches: called on the current stream (captured into the graph like a
    kernel). Same fields the step, graph, validation and profile read from a Launch."""
    call: object
    name: str
    label: str
    bytes_moved: int = 0
    taps: dict = field(default_factory=dict)
    grid: tuple = (0,)
    block: tuple = (0,)
    args: tuple = ()
    shmem: int = 0
    pdl: bool = False

    def __call__(self):
        self.call()

    def enable_pdl(self) -> None:
        """Collectives launch without the PDL attribute; the kernel after one waits for it to complete (a kernel that
        never triggers its dependents releases them at its end)."""


class Group:
    """This process's rank in a group of `size` ranks, one GPU each; `timeout` (seconds) bounds every wait of the
    rendezvous and NCCL's set-up (None: ATOMFLOW_TP_TIMEOUT)."""

    def __init__(self, size: int | None = None, timeout: float | None = None):
        self.rank, self.size = envs.RANK, envs.WORLD_SIZE
        if self.rank is None or self.size is None:
            raise AtomflowError("tensor parallel: RANK and WORLD_SIZE are not set")
        self.local_rank = self.rank if envs.LOCAL_RANK is None else envs.LOCAL_RANK
        if size is not None and size != self.size:
            raise AtomflowError(f"--tp {size} but the launcher started WORLD_SIZE={self.size} processes")
        if not 0 <= self.rank < self.size:
            raise AtomflowError(f"RANK={self.rank} is not in 0..{self.size - 1}")
        timeout = envs.ATOMFLOW_TP_TIMEOUT if timeout is None else timeout
        # Every rank is there before any touches a GPU, within the timeout; from here on each rank watches the others
        # (rendezvous.py), so a rank that fails below ends its peers too.
        self.rendezvous = Rendezvous(self.rank, self.size, envs.MASTER_ADDR, rendezvous_port(), timeout)
        cupy = require_gpu()
        from cupy.cuda import nccl  # optional extra, as cupy above

        n_dev = cupy.cuda.runtime.getDeviceCount()
        if self.local_rank >= n_dev:
            raise AtomflowError(f"LOCAL_RANK={self.local_rank} but this host has {n_dev} GPUs")
        envs.set_default("NCCL_NVLS_ENABLE")
        cupy.cuda.Device(self.local_rank).use()
        uid = self.rendezvous.share(nccl.get_unique_id() if self.rank == 0 else None)
        done = threading.Event()
        threading.Thread(target=self._nccl_deadline, args=(done, timeout), daemon=True).start()
        self.comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        done.set()
        self._nccl = nccl
        self.nccl_version = nccl.get_version()
        self._peer_handles: list = []
        host_id = int.from_bytes(hashlib.sha256(socket.gethostname().encode()).digest()[:7], "little")
        me = np.array([host_id, self.local_rank], dtype=np.int64)
        seen = self.allgather_host(me)
        self.same_host = bool((seen[:, 0] == seen[0, 0]).all())
        self.devices = [int(d) for d in seen[:, 1]]  # every rank's GPU index on its host

    def _nccl_deadline(self, done: threading.Event, timeout: float) -> None:
        """NCCL's communicator is made within the timeout, or this rank ends with one line (its creation blocks in C,
        where no exception reaches it)."""
        if not done.wait(timeout):
            sys.stderr.write(f"error: rank {self.rank}: NCCL did not make its communicator within {timeout:g} s "
                             f"({SETS_THE_WAIT})\n")
            sys.stderr.flush()
            os._exit(1)

    # ---- the engine's seams ----------------------------------------------------------------------------------------
    def shard_plan(self, cfg) -> list[RankShard]:
        """Every rank's shard of `cfg` (plan.py), refused in one line where a rank's shapes don't run."""
        check_kernels(cfg, self.size)
        return plan(cfg, self.size)

    def sums(self, lib, hidden: int, am_blocks: int, vocab_offsets: list[int], allreduce: str | None,
             gpu_key: tuple) -> TpComm:
        """This rank's side of the sums across ranks (sums.py), on the path `allreduce` (None: auto)."""
        return TpComm(self, lib, hidden, am_blocks, vocab_offsets, allreduce or "auto", gpu_key=gpu_key)

    # ---- collectives queued on the current stream (capturable) ---------------------------------------------------
    def allreduce_op(self, buf) -> HostOp:
        """In-place sum of the fp32 device array `buf` over the ranks."""
        import cupy  # optional extra: imported where a GPU is used

        nccl, comm, n = self._nccl, self.comm, buf.size
        if buf.dtype != np.float32:
            raise AtomflowError(f"allreduce: fp32 buffers only, got {buf.dtype}")

        def call():
            comm.allReduce(buf.data.ptr, buf.data.ptr, n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                           cupy.cuda.get_current_stream().ptr)
        return HostOp(call, "nccl_allreduce", f"nccl allreduce {buf.nbytes} B", 2 * buf.nbytes)

    def allreduce_rows(self, rows, m: int) -> None:
        """In-place sum over the ranks of rows[:m] of the C-contiguous fp32 device array `rows`, queued on the current
        stream (capturable): the batched prefill's sums (sums.py RowSums). The leading rows of a C-contiguous array
        are one contiguous buffer, which allreduce_op sums in place."""
        if rows.dtype != np.float32 or not rows.flags.c_contiguous:
            raise AtomflowError(f"allreduce_rows: C-contiguous fp32 rows only, got {rows.dtype}")
        self.allreduce_op(rows[:m])()

    def agree(self, choice: str, options: tuple) -> str:
        """The option furthest along `options` that any rank chose (collective): one choice for every rank, the
        most cautious where they differ (options ordered from the most demanding)."""
        picks = self.allgather_host(np.array([options.index(choice)], np.int32))
        return options[int(picks.max())]

    def allgather_op(self, send, recv) -> HostOp:
        """recv[r * send.size:(r + 1) * send.size] = rank r's send (4-byte elements)."""
        import cupy  # optional extra: imported where a GPU is used

        nccl, comm, n = self._nccl, self.comm, send.size
        if send.itemsize != 4 or recv.size != n * self.size:
            raise AtomflowError("allgather: 4-byte elements, recv = size x send")

        def call():
            comm.allGather(send.data.ptr, recv.data.ptr, n, nccl.NCCL_INT32, cupy.cuda.get_current_stream().ptr)
        return HostOp(call, "nccl_allgather", f"nccl allgather {send.nbytes} B x {self.size}", recv.nbytes)

    # ---- host-side exchanges (once, at setup) ---------------------------------------------------------------------
    def allgather_host(self, values) -> np.ndarray:
        """Every rank's `values` (a small array of 4- or 8-byte numbers or bytes), stacked [size, ...], through NCCL."""
        import cupy  # optional extra: imported where a GPU is used

        a = np.ascontiguousarray(values)
        raw = np.frombuffer(a.tobytes() + b"\0" * (-a.nbytes % 4), dtype=np.int32)
        stream = cupy.cuda.get_current_stream()  # the copies below are queued on it too
        send = cupy.asarray(raw)
        recv = cupy.empty(raw.size * self.size, dtype=cupy.int32)
        self.comm.allGather(send.data.ptr, recv.data.ptr, raw.size, self._nccl.NCCL_INT32, stream.ptr)
        stream.synchronize()
        out = recv.get().view(np.uint8).reshape(self.size, -1)[:, :a.nbytes]
        return np.stack([np.frombuffer(row.tobytes(), dtype=a.dtype).reshape(a.shape) for row in out])

    def barrier(self) -> None:
        self.allgather_host(np.zeros(1, np.int32))

    def _agree(self, ok: bool, reason: str) -> None:
        """Every rank learns whether all ranks succeeded (so none is left alone in a later collective)."""
        oks = self.allgather_host(np.array([1 if ok else 0], np.int32))[:, 0]
        if not oks.all():
            bad = int(np.flatnonzero(oks == 0)[0])
            raise AtomflowError(reason if not ok else f"rank {bad} cannot map its peers' memory")

    def peer_buffer(self, nbytes: int):
        """A device buffer of `nbytes` (its own cudaMalloc, so its IPC handle maps from its start) and the addresses
        of every rank's buffer of the same size in this process (this rank's own at index rank), through CUDA IPC.
        AtomflowError on every rank when any rank cannot map its peers' memory (other hosts, no peer access): the
        fast path is then off."""
        import cupy  # optional extra: imported where a GPU is used

        rt = cupy.cuda.runtime
        reason = ""
        if not self.same_host:
            reason = "the ranks are on different hosts: no peer memory between them"
        else:
            for d in self.devices:
                if d != self.local_rank and not rt.deviceCanAccessPeer(self.local_rank, d):
                    reason = f"GPU {self.local_rank} cannot access GPU {d}'s memory (no peer access)"
        self._agree(not reason, reason)
        ptr = rt.malloc(nbytes)
        rt.memset(ptr, 0, nbytes)
        self._owned = getattr(self, "_owned", []) + [ptr]
        mem = cupy.cuda.UnownedMemory(ptr, nbytes, self)
        local = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        handles = self.allgather_host(np.frombuffer(rt.ipcGetMemHandle(ptr), dtype=np.uint8))
        addrs, opened = [], []
        try:
            for r in range(self.size):
                if r == self.rank:
                    addrs.append(ptr)
                else:
                    addrs.append(rt.ipcOpenMemHandle(handles[r].tobytes()))
                    opened.append(addrs[-1])
            reason = ""
        except rt.CUDARuntimeError as e:
            reason = f"CUDA IPC: {e}"
        self._peer_handles += opened
        self._agree(not reason, reason)
        return local, addrs

    def close(self, ok: bool = True) -> None:
        """Release the peer memory once every rank is done (a barrier), and tell the peers this rank's exit is no
        failure. Not `ok` (this rank is failing): nothing waits on the peers, which may be inside another collective;
        the exit ends them (rendezvous.py)."""
        import cupy  # optional extra: imported where a GPU is used

        gc.collect()  # graphs left in reference cycles go now, while the communicator whose work they captured lives
        if not ok:
            return
        rt = cupy.cuda.runtime
        try:
            cupy.cuda.Device().synchronize()
            self.barrier()  # no rank unmaps while a peer may still read its memory
            self.rendezvous.bye()  # every rank is past its last collective: its exit is no failure now
            for p in self._peer_handles:
                rt.ipcCloseMemHandle(p)
            self._peer_handles = []
            for p in getattr(self, "_owned", []):
                rt.free(p)
            self._owned = []
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
