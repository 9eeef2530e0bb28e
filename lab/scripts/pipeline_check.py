#!/usr/bin/env python3
"""The prefill attention's cp.async pipelines, simulated (CPU): every tile is in shared memory before a warp reads it,
and no slot is written while a warp may still read it.

    lab/scripts/pipeline_check.py [--tiles 6]

Each `*_schedule` function replays one kernel's sequence of shared-memory events for a block of `n_tiles` K/V tiles,
line for line with its source: kernels_cu/attention_prefill.cu (`product`, two stages), lab/kernels/
attention_prefill_v2.cu (`v2`: prefetch distance S - 1, one barrier a tile) and attention_prefill_v3.cu (`v3`: a K ring
one tile ahead of the V ring, tile k + 1's scores beside tile k's softmax). The events are those of one thread (every
thread issues the same copies, commits, waits and barriers; the zero-filled rows of a tile are plain stores in the
same place, which land no later than the copies) and the reads of every warp, each warp taking tiles 0 .. w_last
(-1: a warp whose rows all lie past the chunk). `Pipeline` applies cp.async's rules: a copy joins the open group;
commit closes it (empty or not); wait_group N completes every committed group but the newest N; a barrier makes
visible to every warp what the completed groups wrote. A read must find its tile visible in its slot and no write to
the slot pending; a write must not share a barrier interval with a read of its slot (another warp may be reading it);
at the end no copy may be in flight. The mutations (`MUTATIONS`) are kernels one line wrong, each of which the check
must refuse (tests/test_lab_prefill_att.py)."""
from __future__ import annotations

import argparse
import sys


class PipelineError(AssertionError):
    pass


class Pipeline:
    """Shared memory of one block as cp.async and barriers see it: slots by name ("q", ("K", s), ("V", s))."""

    def __init__(self):
        self.groups: list[list] = []  # committed groups: their writes (slot, tile)
        self.open: list = []          # copies issued since the last commit
        self.done = 0                 # groups[:done] have completed (this thread's copies landed)
        self.visible: dict = {}       # slot -> the tile every warp sees there
        self.pending: dict = {}       # slot -> (tile, group index or None while open): written, not yet visible
        self.interval = 0             # barriers passed
        self.last_read: dict = {}     # slot -> the barrier interval of its latest read

    def copy(self, slot, tile):
        if self.last_read.get(slot, -1) >= self.interval:
            raise PipelineError(f"{slot} <- {tile}: written in the barrier interval {self.interval} where a warp reads "
                                f"it")
        if slot in self.pending:
            raise PipelineError(f"{slot} <- {tile}: {self.pending[slot][0]} is still being written there")
        self.pending[slot] = (tile, None)
        self.open.append((slot, tile))

    def commit(self):
        for slot, tile in self.open:
            self.pending[slot] = (tile, len(self.groups))
        self.groups.append(self.open)
        self.open = []

    def wait(self, n: int):
        self.done = max(self.done, len(self.groups) - n)

    def barrier(self):
        self.interval += 1
        for slot, (tile, g) in list(self.pending.items()):
            if g is not None and g < self.done:
                self.visible[slot] = tile
                del self.pending[slot]

    def read(self, slot, tile):
        if slot in self.pending:
            raise PipelineError(f"{slot} read for {tile} while {self.pending[slot][0]} is written there")
        if self.visible.get(slot) != tile:
            raise PipelineError(f"{slot} read for {tile} holds {self.visible.get(slot)}")
        self.last_read[slot] = self.interval

    def end(self):
        if self.open or any(g is not None and g >= self.done for _, g in self.pending.values()):
            raise PipelineError(f"the block ends with copies in flight: {sorted(map(str, self.pending))}")


def product_schedule(p: Pipeline, n_tiles: int, warps: list[int], stages: int = 2, mut: str = ""):
    """kernels_cu/attention_prefill.cu: tile kt + 1 issued at the top of iteration kt, a barrier at each end."""
    assert stages == 2
    p.copy("q", "q")
    p.copy(("S", 0), ("KV", 0))
    p.commit()
    for kt in range(n_tiles):
        if kt + 1 < n_tiles:
            p.copy(("S", (kt + 1) % 2), ("KV", kt + 1))
            p.commit()
            p.wait(1)
        else:
            p.wait(0)
        p.barrier()
        for w_last in warps:
            if w_last >= 0 and kt == 0:
                p.read("q", "q")
            if kt <= w_last:
                p.read(("S", kt % 2), ("KV", kt))
        if mut != "no-end-barrier":
            p.barrier()
    p.end()


def v2_schedule(p: Pipeline, n_tiles: int, warps: list[int], stages: int = 3, mut: str = ""):
    """lab/kernels/attention_prefill_v2.cu: stage s holds tile t = s mod S (K and V together)."""
    S = stages
    p.copy("q", "q")
    for t in range(S - 1):  # the prologue
        if t < n_tiles:
            p.copy(("S", t), ("KV", t))
        if mut != "no-empty-commit" or t < n_tiles:
            p.commit()
    for kt in range(n_tiles):
        if mut == "issue-before-barrier":
            if kt + S - 1 < n_tiles:
                p.copy(("S", (kt + S - 1) % S), ("KV", kt + S - 1))
            p.commit()
        p.wait(S - 1 if mut == "wait-one-more" else S - 2)
        p.barrier()
        if mut != "issue-before-barrier":
            if kt + S - 1 < n_tiles:
                p.copy(("S", (kt + S - 1) % S), ("KV", kt + S - 1))
            if mut != "no-empty-commit" or kt + S - 1 < n_tiles:
                p.commit()
        for w_last in warps:
            if w_last >= 0 and kt == 0:
                p.read("q", "q")
            if kt <= w_last:
                p.read(("S", kt % S), ("KV", kt))
    p.end()


def v3_schedule(p: Pipeline, n_tiles: int, warps: list[int], stages: int = 3, mut: str = ""):
    """lab/kernels/attention_prefill_v3.cu: K tile t in K slot t mod S, V tile t in V slot t mod S; group -1 = q and
    K 0, group t = K t + 1 and V t; a warp computes tile 0's scores before the walk, tile kt + 1's in iteration kt."""
    S = stages
    p.copy("q", "q")
    p.copy(("K", 0), ("K", 0))
    p.commit()
    for t in range(S - 1):  # the prologue: groups 0 .. S - 2
        if t + 1 < n_tiles:
            p.copy(("K", (t + 1) % S), ("K", t + 1))
        if t < n_tiles:
            p.copy(("V", t), ("V", t))
        p.commit()
    p.wait(S if mut == "prologue-no-wait" else S - 1)
    p.barrier()
    for w_last in warps:
        if w_last >= 0:
            p.read("q", "q")
            p.read(("K", 0), ("K", 0))
    for kt in range(n_tiles):
        p.wait(S - 2)
        p.barrier()
        k_slot = (kt + S - 1) % S if mut == "k-ring-unshifted" else kt % S
        if kt + S < n_tiles:
            p.copy(("K", k_slot), ("K", kt + S))
        if kt + S - 1 < n_tiles:
            p.copy(("V", kt % S if mut == "v-slot-of-kt" else (kt + S - 1) % S), ("V", kt + S - 1))
        p.commit()
        for w_last in warps:
            if kt > w_last:
                continue
            if kt < w_last:
                p.read(("K", (kt + 1) % S), ("K", kt + 1))
            p.read(("V", kt % S), ("V", kt))
    p.end()


SCHEDULES = {"product": (product_schedule, (2,)), "v2": (v2_schedule, (2, 3, 4)), "v3": (v3_schedule, (2, 3, 4))}
# (schedule, stages, mutation): one line of the kernel changed; each must fail for some n_tiles
MUTATIONS = [("product", 2, "no-end-barrier"), ("v2", 3, "no-empty-commit"), ("v2", 3, "wait-one-more"),
             ("v2", 3, "issue-before-barrier"), ("v2", 2, "issue-before-barrier"), ("v3", 3, "k-ring-unshifted"),
             ("v3", 3, "prologue-no-wait"), ("v3", 3, "v-slot-of-kt"), ("v3", 2, "v-slot-of-kt")]


def check(name: str, stages: int, n_tiles: int, mut: str = "") -> None:
    """Raises PipelineError where schedule `name` at `stages` breaks a rule for a block of `n_tiles` tiles, with warps
    taking every prefix of the tiles (and one taking none)."""
    fn, _ = SCHEDULES[name]
    for warps in [list(range(-1, n_tiles))] + [[w] for w in range(-1, n_tiles)]:
        fn(Pipeline(), n_tiles, warps, stages, mut)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", type=int, default=6, help="blocks of 1 .. TILES K/V tiles")
    a = ap.parse_args(argv)
    bad = 0
    for name, (_, stage_list) in SCHEDULES.items():
        for stages in stage_list:
            for n in range(1, a.tiles + 1):
                try:
                    check(name, stages, n)
                except PipelineError as e:
                    bad += 1
                    print(f"{name} S={stages} n_tiles={n}: {e}")
            print(f"{name} S={stages}: n_tiles 1..{a.tiles} checked")
    for name, stages, mut in MUTATIONS:
        caught = []
        for n in range(1, a.tiles + 1):
            try:
                check(name, stages, n, mut)
            except PipelineError as e:
                caught.append(f"n_tiles={n}: {e}")
        bad += not caught
        print(f"mutation {name} S={stages} {mut}: " + (f"refused ({caught[0]})" if caught else "NOT CAUGHT"))
    print("ok" if not bad else f"{bad} failures")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
