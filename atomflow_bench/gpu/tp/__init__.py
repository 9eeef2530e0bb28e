"""Tensor parallel, in one wing: it plugs into the engine and the measurements; they do not import it.

    plan.py     which rows and columns of every weight each rank holds, the per-rank shapes and bytes
    group.py    the process group: launch the ranks or join under a launcher, the collectives, teardown; the
                engine's seam (`shard_plan`, `sums`)
    rendezvous.py  the ranks' rendezvous (bounded in time) and their watch on each other once it is done
    sums.py     the sums across ranks inside the step (peer memory or NCCL) and the greedy token's combine
    figures.py  what a tensor-parallel run adds to its record: forms, energy over the GPUs, the exchanges timed
    context.py  the run context of `run`, `profile`, `validate` and `sweep`: one GPU or a group of ranks

The plan's names are re-exported here (`from atomflow_bench.gpu import tp; tp.plan(cfg, 2)`).
"""
from .plan import (NO_INDEX, RankShard, check, check_kernels, combine_argmax, comm_bytes_per_token, embed_bytes,
                   kv_bytes_per_token, local_argmax, local_config, norm_bytes, plan, ranks_table, shard_bytes,
                   slice_index, slice_shape, slice_weight)

__all__ = ["NO_INDEX", "RankShard", "check", "check_kernels", "combine_argmax", "comm_bytes_per_token", "embed_bytes",
           "kv_bytes_per_token", "local_argmax", "local_config", "norm_bytes", "plan", "ranks_table", "shard_bytes",
           "slice_index", "slice_shape", "slice_weight"]
