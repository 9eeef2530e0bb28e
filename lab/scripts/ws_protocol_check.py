#!/usr/bin/env python3
"""The warp-specialised prefill attention's barrier protocol, explored over every interleaving (CPU): no deadlock,
every K/V tile in its stage before a consumer's products read it, no stage refilled while a product may read it, the
consumers' bursts in strict turns, and nothing left armed at the end.

    lab/scripts/ws_protocol_check.py [--tiles 6]

The kernel is lab/kernels/attention_prefill_v11.cu (ATP_INTRA 0 and 1; and the sm_90a product kernel of
lab/records/v59/fa3.patch, the same protocol): a producer thread streams tile kt into stage kt % STAGES (waiting on the stage's "empty" mbarrier from
the stage's second use on, arming its "full" mbarrier with the tile's bytes, issuing the copies), and two consumers
(each one warpgroup: its 4 warps move together between its wgmma waits) walk the same tiles. `producer_ops` and
`consumer_ops` list each agent's barrier and shared-memory events line for line with the kernel's source; `explore`
runs every interleaving of the three agents and of the copies' landings (a copy lands at any point after it is
issued), memoising states. The rules, as the hardware applies them:
- mbarrier (full: count 1, empty: count 8 a phase, one arrival a consumer warp): an arrival takes one from the phase's
  count, expect_tx is an arrival that also adds the tile's bytes, a landing copy removes them; the phase completes
  when both are zero; a wait for parity P passes once the current phase's parity is not P (so a wait for the phase
  before the first passes at once).
- named barrier (3 + c: consumer c's turn; 256 threads = both consumers' 128): a bar.sync and a bar.arrive each add
  128 threads; the barrier completes at 256 and starts over; a bar.sync's threads wait for the completion their
  arrival belongs to.
- a read (a wgmma group's operand) lasts from its issue to the consumer's wait_group 0; it must find its tile landed
  in the stage, and no copy may be issued into a stage while a read of it lasts.
`MUTATIONS` are kernels one line wrong; the check must refuse each (tests/test_lab_prefill_att.py)."""
from __future__ import annotations

import argparse
import sys

STAGES = 2
EMPTY_COUNT = 8  # one arrival a consumer warp, 4 warps a consumer


class ProtocolError(AssertionError):
    pass


def producer_ops(n_tiles: int, mut: str | None = None) -> list[tuple]:
    """The producer thread: `if (kt >= STAGES) mbar_wait(&empty[s], (kt / STAGES - 1) & 1); atp_tma_kv(...)` a tile."""
    ops = []
    for kt in range(n_tiles):
        s = kt % STAGES
        if kt >= STAGES:
            ops.append(("mbar_wait", "empty", s, (kt // STAGES - (0 if mut == "empty_parity" else 1)) & 1))
        ops += [("expect_tx", s), ("copy", s, kt)]
    return ops


def consumer_ops(c: int, n_tiles: int, last: int, pingpong: bool = True, mut: str | None = None,
                 intra: bool = False) -> list[tuple]:
    """Consumer c, which takes tiles 0 .. last (c_takes; -1: its rows all lie past the chunk): the prologue (tile 0's
    scores, by every consumer), then per tile its turn, tile kt's P.V, the wait for tile kt + 1 and its scores, the
    hand-over, wait_group 0, the warps' releases of tile kt's stage. `intra` (ATP_INTRA 1): the wait for tile kt + 1
    and its scores first, as the older wgmma group, then tile kt's P.V; wait_group 1 ends the scores' read."""
    ops = []
    turn = lambda: [("turn_arrive", c), ("turn_wait", c)] if pingpong else []  # noqa: E731 - bar.sync: both halves
    hand = lambda: [("pass", c)] if pingpong else []  # noqa: E731
    if c == 1 and mut != "no_first_pass":
        ops += hand()
    ops += turn() + [("mbar_wait", "full", 0, 0), ("read", 0, 0)] + hand() + [("wait0",)]
    for kt in range(n_tiles):
        nxt = kt + 1 < n_tiles
        if not (mut == "idle_no_turn" and kt > last):
            ops += turn()
        pv = [("read", kt % STAGES, kt)] if kt <= last else []
        scores = []
        if nxt:
            parity = ((kt + 1) // STAGES + (1 if mut == "full_parity" else 0)) & 1
            scores.append(("mbar_wait", "full", (kt + 1) % STAGES, parity))
            if kt + 1 <= last:
                scores.append(("read", (kt + 1) % STAGES, kt + 1))
        ops += scores + pv if intra else pv + scores
        if (nxt or c == 0 or mut == "last_pass") and not (mut == "idle_no_turn" and kt > last):
            ops += hand()
        if intra and nxt and kt + 1 <= last:
            ops.append(("wait1", (kt + 1) % STAGES))
        release = [("arrive", "empty", kt % STAGES, 4)]
        ops += release + [("wait0",)] if mut == "release_early" else [("wait0",)] + release
    return ops


class State:
    """One reachable state: each agent's next op and pending bar.sync generation, the barriers, the stages."""

    def __init__(self, empty_count: int):
        self.pc = [0, 0, 0]                    # producer, consumer 0, consumer 1
        self.sync_gen = [None, None, None]     # the named-barrier generation an agent's bar.sync arrived in
        self.named = {3: [0, 0], 4: [0, 0]}    # barrier -> [threads in units of 128, generation]
        init = {"full": 1, "empty": empty_count}
        self.init = init
        # mbarrier (kind, stage) -> [completed phases, arrivals left, bytes (tiles) in flight]
        self.mbar = {(k, s): [0, init[k], 0] for k in init for s in range(STAGES)}
        self.stage = [None] * STAGES           # the tile landed in each stage
        self.copying: list[tuple] = []         # issued copies not yet landed: (stage, tile)
        self.reads: list[tuple] = []           # (consumer, stage) reads lasting
        self.turns = 0                         # turns taken, in order 0, 1, 0, 1, ...

    def key(self):
        return (tuple(self.pc), tuple(self.sync_gen), tuple((b, *v) for b, v in sorted(self.named.items())),
                tuple((k, *v) for k, v in sorted(self.mbar.items())), tuple(self.stage), tuple(sorted(self.copying)),
                tuple(sorted(self.reads)), self.turns)

    def copy(self):
        n = State.__new__(State)
        n.pc, n.sync_gen = list(self.pc), list(self.sync_gen)
        n.named = {b: list(v) for b, v in self.named.items()}
        n.init = self.init
        n.mbar = {k: list(v) for k, v in self.mbar.items()}
        n.stage, n.copying, n.reads, n.turns = list(self.stage), list(self.copying), list(self.reads), self.turns
        return n

    def arrive(self, kind: str, s: int, n: int = 1, tx: int = 0):
        b = self.mbar[(kind, s)]
        b[2] += tx
        if n > b[1]:
            raise ProtocolError(f"{kind}[{s}]: {n} arrivals where its phase {b[0]} expects {b[1]} more")
        b[1] -= n
        self.complete(kind, s)

    def complete(self, kind: str, s: int):
        b = self.mbar[(kind, s)]
        if b[1] == 0 and b[2] == 0:
            b[0], b[1] = b[0] + 1, self.init[kind]


def step(st: State, agent: int, op: tuple, pingpong: bool) -> State | None:
    """The state after `agent` runs `op`, or None while it is blocked."""
    n = st.copy()
    kind = op[0]
    c = agent - 1
    if kind == "mbar_wait":
        if (n.mbar[(op[1], op[2])][0] & 1) == op[3]:
            return None
    elif kind == "expect_tx":
        n.arrive("full", op[1], 1, tx=1)
    elif kind == "copy":
        _, s, tile = op
        if any(rs == s for _, rs in n.reads):
            raise ProtocolError(f"tile {tile} copied into stage {s} while a consumer's products read it")
        if any(cs == s for cs, _ in n.copying):
            raise ProtocolError(f"tile {tile} copied into stage {s} while another copy lands there")
        n.copying.append((s, tile))
    elif kind == "read":
        _, s, tile = op
        if n.stage[s] != tile or any(cs == s for cs, _ in n.copying):
            raise ProtocolError(f"consumer {c} reads tile {tile} in stage {s}, which holds {n.stage[s]}"
                                f"{' with a copy landing' if any(cs == s for cs, _ in n.copying) else ''}")
        n.reads.append((c, s))
    elif kind == "wait0":
        n.reads = [r for r in n.reads if r[0] != c]
    elif kind == "wait1":  # the older group (the scores of stage op[1]) is done; the P.V may still read
        n.reads.remove((c, op[1]))
    elif kind == "arrive":
        n.arrive(op[1], op[2], op[3])
    elif kind in ("turn_arrive", "pass"):
        b = n.named[3 + c if kind == "turn_arrive" else 4 - c]
        if kind == "turn_arrive":
            n.sync_gen[agent] = b[1]
        b[0] += 1
        if b[0] == 2:
            b[0], b[1] = 0, b[1] + 1
    elif kind == "turn_wait":
        if n.named[3 + c][1] <= n.sync_gen[agent]:
            return None
        n.sync_gen[agent] = None
        if n.turns % 2 != c:
            raise ProtocolError(f"consumer {c} takes turn {n.turns}: the turns do not alternate from consumer 0")
        n.turns += 1
    else:
        raise ValueError(op)
    n.pc[agent] += 1
    return n


def explore(n_tiles: int, lasts: tuple[int, int], pingpong: bool = True, mut: str | None = None,
            limit: int = 2_000_000, intra: bool = False) -> int:
    """Every interleaving of the producer, the consumers (taking tiles 0 .. lasts[c]) and the copies' landings; the
    number of distinct states, or ProtocolError at the first broken rule (a deadlock included)."""
    progs = [producer_ops(n_tiles, mut), consumer_ops(0, n_tiles, lasts[0], pingpong, mut, intra),
             consumer_ops(1, n_tiles, lasts[1], pingpong, mut, intra)]
    start = State(4 if mut == "empty_count_4" else EMPTY_COUNT)
    seen, todo = {start.key()}, [start]
    while todo:
        st = todo.pop()
        nexts = []
        for agent, prog in enumerate(progs):
            if st.pc[agent] < len(prog):
                n = step(st, agent, prog[st.pc[agent]], pingpong)
                if n is not None:
                    nexts.append(n)
        for i, (s, tile) in enumerate(st.copying):  # a copy lands
            n = st.copy()
            del n.copying[i]
            n.stage[s] = tile
            n.mbar[("full", s)][2] -= 1
            n.complete("full", s)
            nexts.append(n)
        if not nexts:
            if any(st.pc[a] < len(p) for a, p in enumerate(progs)):
                waiting = [f"{name} at {p[st.pc[a]]}" for a, (name, p) in
                           enumerate(zip(("producer", "consumer 0", "consumer 1"), progs)) if st.pc[a] < len(p)]
                raise ProtocolError(f"deadlock: {'; '.join(waiting)}")
            left = {b: v for b, v in st.named.items() if v[0]}
            if left:
                raise ProtocolError(f"named barriers left with arrivals at the end: {left}")
            armed = {k: v for k, v in st.mbar.items() if v[1] != st.init[k[0]] or v[2]}
            if armed:
                raise ProtocolError(f"mbarriers left mid-phase at the end: {armed}")
        for n in nexts:
            k = n.key()
            if k not in seen:
                seen.add(k)
                todo.append(n)
        if len(seen) > limit:
            raise RuntimeError(f"more than {limit} states")
    return len(seen)


def configs(n_tiles: int) -> list[tuple[int, int]]:
    """(last tile consumer 0 takes, consumer 1's): both all; consumer 0 one fewer (its rows end a tile earlier); the
    second consumer's rows all past the chunk (the block's tiles are consumer 0's)."""
    out = [(n_tiles - 1, n_tiles - 1), (n_tiles - 1, -1)]
    return out + ([(n_tiles - 2, n_tiles - 1)] if n_tiles >= 2 else [])


def check(n_tiles: int, pingpong: bool = True, mut: str | None = None, intra: bool = False) -> int:
    return sum(explore(n_tiles, lasts, pingpong, mut, intra=intra) for lasts in configs(n_tiles))


# kernels one line wrong: (name, what the line does)
MUTATIONS = [
    ("no_first_pass", "consumer 1 does not hand consumer 0 the first turn"),
    ("last_pass", "consumer 1 hands on its last turn too (an arrival left on barrier 3)"),
    ("empty_parity", "the producer waits for the empty phase of the stage's current use, not the previous one"),
    ("empty_count_4", "the empty barrier counts one consumer's 4 warps"),
    ("release_early", "the warps release the stage before wait_group 0"),
    ("full_parity", "a consumer waits for the full barrier's other parity"),
    ("idle_no_turn", "a consumer skips its turns on tiles it does not take"),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", type=int, default=6)
    a = ap.parse_args(argv)
    for pingpong, intra in ((True, False), (False, False), (True, True)):
        for n in range(1, a.tiles + 1):
            print(f"pingpong {int(pingpong)} intra {int(intra)} tiles {n}: {check(n, pingpong, intra=intra)} states, "
                  "holds", flush=True)
    for mut, what in MUTATIONS:
        caught = []
        for n in range(1, a.tiles + 1):
            try:
                check(n, True, mut)
            except ProtocolError as e:
                caught.append(f"{n} tiles: {e}")
        print(f"{mut} ({what}): {'refused, ' + caught[0] if caught else 'NOT REFUSED'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
