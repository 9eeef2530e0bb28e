"""The lm_head: the step's tail after the last layer, in one launch (kernels_cu/lm_head.cu gemv_f16_f32_argmax, built
on gemv_rows.cuh and argmax_common.cuh): the final RMSNorm in its prologue (block 0 also stores the
normalised x: the `final_norm` probe), logits = lm_head . x in fp32, and in its epilogue the greedy argmax and the
step's bookkeeping (out_tokens[pos] = best; cur_token = the prompt's next id or best; pos += 1).

fp16 row-major weights, shared with the embedding when tied (HF's layout: ~100% of the copy bandwidth as it is):
a warp per output row, 16-byte streaming loads. One launch, not an RMSNorm, a GEMV and an argmax kernel: the
separate kernels measured slower.
"""
from __future__ import annotations

import numpy as np

from ...errors import AtomflowError
from ..device import blocks_fit, smem_limits
from ..launch import NULL, Launch, allow_dynamic_smem, i32, with_last_arg
from ..nvrtc import KernelLib
from .gemv import GEMV_THREADS

ROWS_WARPS = GEMV_THREADS // 32  # a warp per output row at a time
ROWS_MIN_BLOCKS = 4              # gemv_rows.cuh ROWS_MIN_BLOCKS: the grid is at most this many blocks per SM
CU_FILES = ("gemv_rows.cuh", "lm_head.cu", "argmax_common.cuh")
CU_DEFINES = {"ROWS_MIN_BLOCKS": ROWS_MIN_BLOCKS}
# The kernels this module launches, by the .cu that defines them (as ops/gemv.py KERNELS).
KERNELS = {"lm_head.cu": ("gemv_f16_f32", "gemv_f16_f32_argmax")}


def partial_blocks(vocab: int, n_sm: int) -> int:
    """Argmax partials the arena holds: one per block of the lm_head launch."""
    return min(-(-vocab // ROWS_WARPS), ROWS_MIN_BLOCKS * n_sm)


def rows_launch(lib: KernelLib, w, x, y, n_out: int, k: int, n_sm: int, norm_w=None, eps: float = 1e-5,
                x_out=None, taps=None, argmax: tuple = (), advance: bool = True) -> Launch:
    """y (fp32) = W . x for fp16 row-major W [n_out, k]. With `norm_w`, x is the fp32 residual and the prologue is
    the final RMSNorm (`x_out`, fp16 [k]: where block 0 stores the normalised x). `argmax` = (part_val, part_idx,
    counter, pos, cur_token, prompt, prompt_len, out_tokens): the greedy token and the step state in the epilogue
    (gemv_f16_f32_argmax, advancing the position unless `advance` is False: tensor parallel leaves that to the
    combine across ranks); without it the plain gemv_f16_f32 (the `gemv` benchmark)."""
    if tuple(w.shape) != (n_out, k) or w.dtype != np.float16 or k % 8:
        raise AtomflowError(f"lm_head GEMV needs fp16 weights [{n_out}, {k}] with K % 8 == 0, got {w.dtype} "
                            f"{tuple(w.shape)}")
    shmem = k * 2 if norm_w is None else k * 8 + 128  # x (+ h fp32, norm_w, the norm's scratch)
    per_sm = max(1, min(ROWS_MIN_BLOCKS, blocks_fit(shmem, smem_limits())))
    grid = (min(-(-n_out // ROWS_WARPS), n_sm * per_sm),)
    moved = w.nbytes + x.nbytes + y.nbytes
    moved += 0 if norm_w is None else norm_w.nbytes + (0 if x_out is None else x_out.nbytes)
    args = (w, NULL, x, NULL if norm_w is None else norm_w, np.float32(eps), y, i32(n_out), i32(k),
            NULL if x_out is None else x_out)
    name = "gemv_f16_f32"
    if argmax:
        if argmax[0].shape[0] < grid[0]:
            raise AtomflowError(f"argmax partials for {argmax[0].shape[0]} blocks, lm_head has {grid[0]}")
        name, args = "gemv_f16_f32_argmax", args + tuple(argmax) + (i32(1 if advance else 0),)
    fn = lib[name]
    allow_dynamic_smem(fn, shmem)
    return Launch(fn, "gemv_fp16_f32_argmax" if argmax else "gemv_fp16_f32", grid, (GEMV_THREADS,), args, shmem,
                  taps or {}, moved, f"gemv fp16 lm_head {n_out}x{k}")


def lm_head_launch(lib: KernelLib, a, cfg, n_sm: int, shard: tuple[int, int] | None = None,
                   partials: tuple | None = None) -> Launch:
    """The step's tail over the arena `a`: xnorm = RMSNorm(h) * final_norm, logits, the greedy token, pos += 1.
    Tensor parallel: `shard` = the rank's vocabulary rows (start, stop), `partials` = where its argmax partials go
    (gpu/tp/sums.py TpComm.argmax_arrays); the rank's best is left in partials[0] and the position is not advanced (the
    combine across ranks does that)."""
    r0, r1 = shard or (0, cfg.vocab_size)
    if cfg.tie_word_embeddings:
        head = a["embed"][r0:r1]
    else:
        head = a["lm_head"]
        if head.shape[0] != r1 - r0:
            raise AtomflowError(f"lm_head region holds {head.shape[0]} rows, the shard {r1 - r0}")
    val, idx = partials or (a["am_val"], a["am_idx"])
    logits = a["logits"][: r1 - r0]
    return rows_launch(lib, head, a["h"], logits, r1 - r0, cfg.hidden_size, n_sm,
                       norm_w=a["final_norm"], eps=cfg.rms_norm_eps, x_out=a["xnorm"],
                       taps={"final_norm": a["xnorm"], "logits": logits},
                       argmax=(val, idx, a["am_counter"], a["pos"], a["cur_token"], a["prompt"],
                               a["prompt_len"], a["out_tokens"]), advance=shard is None)


def hold_position(ln: Launch) -> Launch:
    """The lm_head launch with advance = 0: it still finds the token (the time includes the argmax) but leaves the
    position where it is (timing runs that replay one length many times)."""
    return with_last_arg(ln, i32(0)) if ln.name == "gemv_fp16_f32_argmax" else ln
