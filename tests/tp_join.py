"""One rank joining its group as `run --tp N` does under a launcher (gpu/tp/group.py Group), on a machine that may have
no GPU: the rendezvous comes first, then the GPU. Prints the CLI's one line on failure and exits with its codes (1
an error, 3 no usable GPU). Usage: [torchrun ...] python tests/tp_join.py N"""
from __future__ import annotations

import sys

from atomflow_bench import envs
from atomflow_bench.errors import AtomflowError, GpuUnavailable
from atomflow_bench.gpu.tp.group import Group

if __name__ == "__main__":
    try:
        Group(int(sys.argv[1])).close()
    except AtomflowError as e:
        print(f"error: rank {envs.RANK}: {e}", file=sys.stderr)
        sys.exit(3 if isinstance(e, GpuUnavailable) else 1)
