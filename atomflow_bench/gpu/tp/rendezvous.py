"""The ranks' rendezvous and their watch on each other, in plain Python sockets (no GPU), bounded in time.

Rank 0 listens on host:port; every other rank connects, says who it is, and gets an immediate acknowledgement (so a
port held by another program, e.g. torchrun's agent store, is told apart from a rank 0 that is late). Once all
ranks are in, rank 0 answers each one, and later sends them the NCCL id (`share`). Any step that cannot complete
within `timeout` seconds is an `AtomflowError` naming the cause.

The connections then stay open for the rank's life: a peer that exits or is killed closes its end (the kernel does
so even on SIGKILL), so a rank whose peer is gone learns it within a second, while its main thread may be blocked
in a collective that would wait for that peer forever. The watch thread then prints one line naming that rank and
ends the process (after `GRACE` seconds, so that a launcher watching the ranks names the one that failed first and
stops the others itself). `bye()` tells the peers this rank is done with the group: its exit is then no failure.
"""
from __future__ import annotations

import errno
import os
import select
import socket
import struct
import sys
import threading
import time

from ...errors import AtomflowError

MAGIC = b"AFTP1"
GRACE = 1.0        # seconds a rank waits, once a peer is gone, before it ends itself (see the module docstring)
ACK_WAIT = 5.0     # seconds a connected rank waits for rank 0's acknowledgement before it calls the port foreign
EXIT_PEER_GONE = 1
SETS_THE_WAIT = "--tp-timeout or ATOMFLOW_TP_TIMEOUT"  # what the timeout messages name


def _send(sock, kind: bytes, payload: bytes = b"") -> None:
    sock.sendall(kind + struct.pack("<I", len(payload)) + payload)


def _recv_exact(sock, n: int, deadline: float) -> bytes | None:
    """n bytes, or None at end of stream; TimeoutError past the deadline."""
    buf = b""
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _recv(sock, deadline: float) -> tuple[bytes, bytes] | None:
    head = _recv_exact(sock, 5, deadline)
    if head is None:
        return None
    n = struct.unpack("<I", head[1:])[0]
    if n > 1 << 16:
        raise ValueError("message too long")
    body = _recv_exact(sock, n, deadline) if n else b""
    return None if body is None else (head[:1], body)


def _keepalive(sock) -> None:
    """A peer host that vanishes without closing its connections is noticed within about 15 s."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 5)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class Rendezvous:
    """This rank's place in a group of `size`: the handshake in the constructor, then `share`, `bye`."""

    def __init__(self, rank: int, size: int, host: str, port: int, timeout: float):
        self.rank, self.size, self.host, self.port, self.timeout = rank, size, host, port, timeout
        self.where = f"{host}:{port}"
        self._peers: dict[int, socket.socket] = {}   # rank 0: every other rank; others: {0: rank 0}
        self._done: set[int] = set()                  # peers that said bye
        self._shared: bytes | None = None
        self._got = threading.Event()
        self._closed = False
        deadline = time.monotonic() + timeout
        if size > 1:
            (self._serve if rank == 0 else self._join)(deadline)
            threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    # ---- the handshake -------------------------------------------------------------------------------------------
    def _serve(self, deadline: float) -> None:
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind((self.host, self.port))
        except OSError as e:
            srv.close()
            why = "port in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
            raise AtomflowError(f"cannot serve the ranks' rendezvous on {self.where}: {why} (set ATOMFLOW_TP_PORT "
                                "to a free port on every rank)") from None
        with srv:
            srv.listen(self.size)
            while len(self._peers) < self.size - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, self.size)) - set(self._peers))
                    raise AtomflowError(f"rendezvous on {self.where}: rank{'s' * (len(missing) > 1)} "
                                        f"{', '.join(map(str, missing))} did not join within {self.timeout:g} s "
                                        f"({SETS_THE_WAIT})")
                srv.settimeout(left)
                try:
                    conn, _ = srv.accept()
                except TimeoutError:
                    continue
                try:
                    msg = _recv(conn, min(deadline, time.monotonic() + ACK_WAIT))
                except (OSError, TimeoutError, ValueError):
                    msg = None
                if msg is None or msg[0] != b"H" or len(msg[1]) != len(MAGIC) + 8 or not msg[1].startswith(MAGIC):
                    conn.close()  # not one of our ranks (a port scan, another program): not counted
                    continue
                r, n = struct.unpack("<ii", msg[1][len(MAGIC):])
                _send(conn, b"A", struct.pack("<i", self.size))
                if n != self.size or r in self._peers or not 0 < r < self.size:
                    conn.close()
                    raise AtomflowError(f"rendezvous on {self.where}: a rank {r} of a group of {n} joined this group "
                                        f"of {self.size}" + (" twice" if r in self._peers else ""))
                _keepalive(conn)
                self._peers[r] = conn
        for conn in self._peers.values():
            _send(conn, b"G")

    def _join(self, deadline: float) -> None:
        refused = "connection refused"
        while True:
            if time.monotonic() >= deadline:
                raise AtomflowError(f"rendezvous: no rank 0 answered at {self.where} within {self.timeout:g} s "
                                    f"({refused}; is rank 0 running? {SETS_THE_WAIT} sets the wait)")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.settimeout(max(0.1, min(2.0, deadline - time.monotonic())))
            try:
                sock.connect((self.host, self.port))
            except OSError as e:
                sock.close()
                refused = "connection refused" if isinstance(e, ConnectionRefusedError) else (e.strerror or str(e))
                time.sleep(0.2)
                continue
            try:
                _send(sock, b"H", MAGIC + struct.pack("<ii", self.rank, self.size))
                ack = _recv(sock, min(deadline, time.monotonic() + ACK_WAIT))
            except (OSError, ValueError, TimeoutError):
                ack = None
            if ack is None or ack[0] != b"A" or len(ack[1]) != 4:
                sock.close()
                raise AtomflowError(f"rendezvous: {self.where} answers but is not rank 0's rendezvous (another "
                                    "program holds the port, e.g. torchrun's own store: set ATOMFLOW_TP_PORT to a "
                                    "free port on every rank)")
            n = struct.unpack("<i", ack[1])[0]
            if n != self.size:
                sock.close()
                raise AtomflowError(f"rendezvous on {self.where}: rank 0 leads a group of {n}, this rank was told "
                                    f"WORLD_SIZE={self.size}")
            try:
                go = _recv(sock, deadline)
            except TimeoutError:
                sock.close()
                raise AtomflowError(f"rendezvous on {self.where}: rank 0 is there but not every rank joined within "
                                    f"{self.timeout:g} s ({SETS_THE_WAIT})") from None
            except OSError:
                go = None
            if go is None or go[0] != b"G":
                sock.close()
                raise AtomflowError(f"rendezvous on {self.where}: rank 0 left before every rank joined")
            _keepalive(sock)
            sock.settimeout(None)
            self._peers[0] = sock
            return

    # ---- after the handshake -------------------------------------------------------------------------------------
    def share(self, value: bytes | None) -> bytes:
        """Rank 0's `value` on every rank (rank 0 passes it, the others None), within the timeout."""
        if self.size == 1:
            return value
        if self.rank == 0:
            for r, conn in self._peers.items():
                try:
                    _send(conn, b"I", value)
                except OSError:
                    raise AtomflowError(f"rank {r} left the group before it got the NCCL id") from None
            return value
        if not self._got.wait(self.timeout):
            raise AtomflowError(f"rank 0 sent no NCCL id within {self.timeout:g} s ({SETS_THE_WAIT})")
        return self._shared

    def bye(self) -> None:
        """This rank is done with the group: peers take its exit as the end of its work, and the watch stops."""
        if self._closed:
            return
        self._closed = True
        for conn in self._peers.values():
            try:
                _send(conn, b"B")
            except OSError:
                pass

    def _gone(self, who: int, why: str) -> None:
        if self._closed:
            return
        if self.rank == 0:  # tell the others which rank went, so their line names it too
            for r, conn in self._peers.items():
                if r != who:
                    try:
                        _send(conn, b"D", struct.pack("<i", who))
                    except OSError:
                        pass
        time.sleep(GRACE)
        if self._closed:
            return
        sys.stderr.write(f"error: rank {self.rank}: rank {who} {why}; this rank stops too\n")
        sys.stderr.flush()
        os._exit(EXIT_PEER_GONE)  # the main thread may be blocked in a collective that never returns

    def _watch(self) -> None:
        """Reads every message from the peers for the rank's life (the main thread only writes)."""
        live = dict(self._peers)
        while live and not self._closed:
            ready, _, _ = select.select(list(live.values()), [], [], 1.0)
            for conn in ready:
                r = next(k for k, c in live.items() if c is conn)
                try:
                    msg = _recv(conn, time.monotonic() + 30.0)
                except (OSError, TimeoutError, ValueError):
                    msg = None
                if msg is None:
                    del live[r]
                    if r not in self._done:
                        self._gone(r, "left the group before the run ended (it exited or was killed)")
                    continue
                kind, body = msg
                if kind == b"I":
                    self._shared = body
                    self._got.set()
                elif kind == b"B":
                    self._done.add(r)
                elif kind == b"D":
                    self._gone(struct.unpack("<i", body)[0],
                               "left the group before the run ended (it exited or was killed; rank 0 saw it)")
