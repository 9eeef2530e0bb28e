"""The decode step captured once into a CUDA Graph and replayed.

Because the step reads the token and position from device memory and advances them itself (the lm_head
GEMV's epilogue, argmax_common.cuh), N tokens are N replays queued back to back: no host round trip, no
per-token Python launch overhead.
"""
from __future__ import annotations

from .launch import Launch


class StepGraph:
    def __init__(self, launches: list[Launch], stream):
        self.stream = stream
        with stream:
            stream.begin_capture()
            try:
                for ln in launches:
                    ln()
            finally:
                self.graph = stream.end_capture()
        self.graph.upload(stream)
        # the graph holds the launches' argument pointers, not their arrays: a buffer made for one launch alone (the
        # prefill attention's tensor maps) lives as long as the graph that reads it
        self.launches = tuple(launches)
        self.n_nodes = len(self.launches)

    def replay(self, n: int = 1) -> None:
        """Queue `n` decode steps on the stream (asynchronous)."""
        g, s = self.graph, self.stream
        for _ in range(n):
            g.launch(stream=s)
