"""Prefill: the prompt's K/V rows computed as batched work (M tokens a chunk) instead of one decode step per token.

    pf = Prefill(engine)              # row-major fp16 weights (copies, or one staged scratch), chunk buffers: made once
    pf.run(prompt_ids)                # K/V of positions 0 .. n-1 in the cache, the first new token made
    engine.run(n_new - 1)             # the decode step continues at position n, reading that token

Per chunk of up to `chunk` tokens (positions start .. start+m-1), per layer, as the decode step does for one token:
RMSNorm rows -> QKV GEMM -> RoPE + K/V into the cache -> causal attention over the cache before the chunk and the
chunk (ops/attention_prefill.py) -> o_proj GEMM added into the fp32 residual -> RMSNorm rows -> gate/up GEMM ->
SwiGLU rows -> down GEMM added into the residual. The GEMMs run on cuBLAS (ops/prefill_rows.py Gemm) over row-major
fp16 weights made from the arena's tiled ones (fp8: dequantised, each weight times its group's scale, rounded to
fp16). After the last chunk its last row goes through the decode step's lm_head kernel alone (final norm, logits,
argmax, position + 1), which makes the first new token without a decode step's weight reads (tensor parallel: the
last prompt token goes through the decode step, whose lm_head shards and their combine give the first token).

The weights' form (`weights_form`) is chosen by memory, before anything is allocated (gpu/arena.py fit: `form_bytes`
counted beside the model): "copies" makes every layer's row-major weights once (the fp16 model's layer bytes);
"staged", where those do not fit, keeps one scratch of the largest weight and fills it from the arena's tiled weight
(kernels_cu/untile.cu: un-tiled, fp8 dequantised) right before each GEMM, every chunk. Staging costs a pass over the
weights per chunk besides the GEMM's own: 4 bytes moved per fp16 weight, 3 per fp8 weight (read, written as fp16),
while a chunk of m tokens does 2m flops per weight. At m = 512 on an H100 (3.35 TB/s, ~990 dense fp16 TFLOPS) a
weight is staged in about the time the GEMM computes it at peak, so the GEMMs' time up to doubles; longer chunks
pay the same pass for more work (figures from those peaks, not measured).

Tensor parallel (the engine's `tp`, gpu/tp/sums.py RowSums): each rank runs its heads and its share of the MLP on
its own shard (the arena's, `layer_cfg` shapes); after o_proj and after down the ranks' partial products are summed
by an in-place NCCL all-reduce of the chunk's rows of h (rank 0's GEMM adds its product to the residual, the others'
store theirs), queued on the stream like the GEMMs, so each chunk's CUDA graph captures it. Every rank makes the
same calls in the same order: the chunks are the prompt's, the same on every rank.
"""
from __future__ import annotations

import math

import numpy as np

from ..config import GROUP
from ..errors import AtomflowError
from .graph import StepGraph
from .ops.attention_prefill import attention_prefill_launch, wgmma_default
from .ops.gemv import ROLE_PAIRING, linear_regions, tile_scale_view, tile_view
from .ops.lm_head import lm_head_launch
from .ops.prefill_rows import (Gemm, embed_rows_launch, rmsnorm_rows_launch, rope_kv_rows_launch,
                               swiglu_rows_launch)
from .ops.untile import untile_launch

# What each layer runs, in order (chunk_ops' names).
ROLES = ("attn_norm", "qkv", "rope_kv", "attention", "o_proj", "mlp_norm", "gate_up", "swiglu", "down")
D2D = 3  # cudaMemcpyDeviceToDevice
PREFILL_CHUNK = 4096  # tokens per chunk: cuBLAS runs the layer GEMMs at M = 4096 near its 8192-cube rate (M = 512:
# 0.4-0.75x of it); an 8192-token 3B prompt takes 143 ms in chunks of 4096, 147 in 2048, 166 in 512 (one H200). The
# buffers' rows cost ~85 KB a token for 3B, ~130 KB for 8B.
FORMS = ("copies", "staged")  # the weights' forms, in the order memory tries them (gpu/arena.py fit)
WEIGHTS = ("wqkv", "wo", "wgu", "wd")  # each layer's GEMM weights (ops/gemv.py linear_regions)


def prefill_flops(cfg, n: int) -> float:
    """FLOPs of a whole `n`-token prompt, prompt in to first token out: the layer GEMMs over n rows, the causal
    attention (query at position p: QK^T and PV over p + 1 rows, 4 * head_dim * heads * (p + 1)), and the lm_head
    of the last position. Row ops (norms, RoPE, SwiGLU) are left out: a few FLOPs a byte, not tensor-core work."""
    gemms = 2.0 * n * cfg.layer_linear_params()
    attention = 4.0 * cfg.head_dim * cfg.num_attention_heads * (n * (n + 1) / 2) * cfg.num_hidden_layers
    return gemms + attention + 2.0 * cfg.vocab_size * cfg.hidden_size


def buffer_shapes(cfg, chunk: int) -> dict[str, tuple[tuple, type]]:
    """The chunk buffers of a layer config `cfg` (tensor parallel: the rank's): name -> (shape, dtype)."""
    H, inter = cfg.hidden_size, cfg.intermediate_size
    return {"tokens": ((chunk,), np.int32), "h": ((chunk, H), np.float32), "x": ((chunk, H), np.float16),
            "qkv": ((chunk, cfg.qkv_dim), np.float16), "att": ((chunk, cfg.q_dim), np.float16),
            "gu": ((chunk, 2 * inter), np.float16), "act": ((chunk, inter), np.float16)}


def form_bytes(cfg, fmt: str, chunk: int) -> dict[str, int]:
    """Device bytes of each weights form (FORMS order), chunk buffers included. copies: every layer's weights in
    fp16 (the fp16 model's layer bytes; tensor parallel: the rank's shard, `cfg` its local config), and for fp8 what
    making one takes besides (row_major: the codes, the scales and one group of fp32 products of the largest weight);
    staged: one fp16 scratch of the largest weight."""
    buffers = sum(math.prod(s) * np.dtype(d).itemsize for s, d in buffer_shapes(cfg, chunk).values())
    shapes = linear_regions(cfg).values()
    making = 0 if fmt == "fp16" else 4 * 256 + max(r * k + 4 * r * -(-k // GROUP) + 10 * r * min(k, GROUP)
                                                    for r, k in shapes)
    copies = 2 * sum(r * k for r, k in shapes) * cfg.num_hidden_layers + making
    return {"copies": copies + buffers, "staged": 2 * max(r * k for r, k in shapes) + buffers}


def e4m3_table():
    """The 256 FP8-E4M3 codes' values as fp32 (NaN codes as 0: the quantiser never writes them)."""
    from ..quant import e4m3_decode

    v = e4m3_decode(np.arange(256, dtype=np.uint8)).astype(np.float32)
    return np.where(np.isfinite(v), v, 0.0).astype(np.float32)


def row_major(a, name: str, fmt: str, half: int):
    """The arena's tiled weight `name` as a row-major fp16 device array (fp8: dequantised)."""
    import cupy as cp

    tiled = a[name]
    rows, k = tiled.shape
    pairing = ROLE_PAIRING[name.split(".", 1)[1]]
    if fmt == "fp16":
        out = cp.empty((rows, k), dtype=cp.float16)
        v = tile_view(out, fmt, pairing, half)
        v[...] = tiled.reshape(v.shape)
        return out
    codes = cp.empty((rows, k), dtype=cp.uint8)
    v = tile_view(codes, fmt, pairing, half)
    v[...] = tiled.reshape(v.shape)
    scales = cp.empty(a[name + ".scale"].shape, dtype=cp.float32)
    sv = tile_scale_view(scales, pairing, half)
    sv[...] = a[name + ".scale"].reshape(sv.shape)
    table = cp.asarray(e4m3_table())
    out = cp.empty((rows, k), dtype=cp.float16)
    for g in range(scales.shape[1]):  # a group of GROUP inputs at a time: no fp32 copy of the whole matrix
        sl = slice(g * GROUP, min(k, (g + 1) * GROUP))
        out[:, sl] = (table[codes[:, sl]] * scales[:, g:g + 1]).astype(cp.float16)
    return out


class Prefill:
    """The batched prefill of an engine (see the module docstring). `weights_form`: "copies" or "staged" (None: the
    form the engine's arena planned, else the first that fits the memory free at construction)."""

    def __init__(self, engine, chunk: int = PREFILL_CHUNK, weights_form: str | None = None):
        import cupy as cp

        cfg = engine.layer_cfg
        self.eng, self.cfg, self.chunk = engine, cfg, max(1, min(chunk, engine.max_seq))
        a = engine.arena
        need = form_bytes(cfg, engine.fmt, self.chunk)
        free = cp.cuda.runtime.memGetInfo()[0] + cp.get_default_memory_pool().free_bytes()
        form = weights_form or a.prefill_form or next((f for f in FORMS if need[f] <= free), FORMS[-1])
        if form not in FORMS:
            raise AtomflowError(f"prefill weights form {form!r}: one of {', '.join(FORMS)}")
        if need[form] > free:
            raise AtomflowError(f"the batched prefill ({form} weights, chunks of {self.chunk} tokens) needs "
                                f"{need[form] / 2**30:.2f} GiB, {free / 2**30:.2f} GiB are free; try a smaller --ctx "
                                "or more GPUs (--tp)")
        self.weights_form = form
        self.wgmma = wgmma_default()  # the attention on Hopper's warpgroup MMA where the device runs it
        self.sums = None if engine.tp is None else engine.tp.row_sums  # tensor parallel: the sums of the rows
        half = cfg.head_dim // 2
        names = [f"L{i}.{r}" for i in range(cfg.num_hidden_layers) for r in WEIGHTS]
        self.w, self.staged = {}, {}
        if form == "copies":
            self.w = {n: row_major(a, n, engine.fmt, half) for n in names}
        else:  # one scratch; each weight's un-tiling into it, launched right before its GEMM
            scratch = cp.empty(max(r * k for r, k in linear_regions(cfg).values()), dtype=cp.float16)
            for n in names:
                rows, k = a[n].shape
                view = scratch[:rows * k].reshape(rows, k)
                scales = a[n + ".scale"] if engine.fmt == "fp8" else None
                self.staged[n] = (untile_launch(engine.lib, engine.fmt, a[n], scales, view,
                                                ROLE_PAIRING[n.split(".", 1)[1]], half), view)
        b = {name: cp.zeros(shape, dtype=dt) for name, (shape, dt) in buffer_shapes(cfg, self.chunk).items()}
        cp.cuda.Device().synchronize()  # the copies and buffers are made on CuPy's stream, read on the engine's
        self.tokens, self.h, self.x, self.qkv, self.att, self.gu, self.act = (
            b[k] for k in ("tokens", "h", "x", "qkv", "att", "gu", "act"))
        self.gemm = Gemm()
        # the first new token: the decode step's lm_head (final norm, logits, argmax, position + 1) on the last row;
        # tensor parallel runs its vocabulary shards and their combine in the decode step instead
        self.lm_head = lm_head_launch(engine.lib, a, cfg, engine.gpu["sms"]) if engine.group is None else None
        self.graphs: dict = {}  # (start, m, last): the chunk's work captured once (~9 calls a layer replay at once)

    def weight(self, name: str):
        """Weight `name` (e.g. "L3.wo") row-major fp16 for the GEMM about to run: its copy, or (staged) the scratch,
        its un-tiling queued on the current stream by this call."""
        if self.weights_form == "copies":
            return self.w[name]
        fill, view = self.staged[name]
        fill()
        return view

    def resid(self, x, w, m: int) -> None:
        """h[:m] += x[:m] W^T; tensor parallel: + the other ranks' products (rank 0's GEMM adds its product to h,
        the others' store theirs in h, and the sum of the rows across ranks leaves the total on every rank)."""
        s = self.sums
        self.gemm(x, w, self.h, m, accumulate=s is None or s.adds_residual)
        if s is not None:
            s(self.h, m)

    def chunk_ops(self, start: int, m: int, last: bool = False) -> list[tuple[str, object]]:
        """Chunk [start, start + m)'s work in order, tokens already in place: (name, op) pairs, each op a launch or a
        cuBLAS call (callable; staged: the weight's un-tiling and the call; tensor parallel, o_proj and down: the call
        and the sum across ranks). Names are "embed" and "layers.{i}.{role}" with role one of ROLES; after
        "layers.{i}.o_proj" h[:m] holds the decode step's probe "layers.{i}.attn", after "layers.{i}.down" its
        "layers.{i}.mlp". `last`: the prompt's last chunk, followed by "last_row" (its last row into the step's
        residual) and "lm_head" (the first new token; the device's position must be the last row's)."""
        import cupy as cp

        cfg, a, lib = self.cfg, self.eng.arena, self.eng.lib
        eps, hd = cfg.rms_norm_eps, cfg.head_dim
        n_q, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        h, x, qkv, att, gu, act = self.h, self.x, self.qkv, self.att, self.gu, self.act
        out = [("embed", embed_rows_launch(lib, self.tokens, a["embed"], h, m))]
        for i in range(cfg.num_hidden_layers):
            w = lambda r, i=i: self.weight(f"L{i}.{r}")  # noqa: E731 - staged: filled as its GEMM is queued
            ops = [
                rmsnorm_rows_launch(lib, h, a[f"L{i}.attn_norm"], x, m, eps),
                lambda w=w: self.gemm(x, w("wqkv"), qkv, m),
                rope_kv_rows_launch(lib, qkv, a["rope_cs"], a["k_cache"][i], a["v_cache"][i], n_q, n_kv, hd, start, m),
                attention_prefill_launch(lib, qkv, a["k_cache"][i], a["v_cache"][i], start, m, att, n_kv,
                                         cfg.group_size, hd, cfg.qkv_dim, cfg.q_dim, wgmma=self.wgmma),
                lambda w=w: self.resid(att, w("wo"), m),
                rmsnorm_rows_launch(lib, h, a[f"L{i}.mlp_norm"], x, m, eps),
                lambda w=w: self.gemm(x, w("wgu"), gu, m),
                swiglu_rows_launch(lib, gu, act, m),
                lambda w=w: self.resid(act, w("wd"), m),
            ]
            out += [(f"layers.{i}.{r}", op) for r, op in zip(ROLES, ops)]
        if last and self.lm_head is not None:  # tensor parallel: the decode step makes the first token
            src, dst, nbytes = h[m - 1].data.ptr, a["h"].data.ptr, a["h"].nbytes
            out += [("last_row", lambda: cp.cuda.runtime.memcpyAsync(dst, src, nbytes, D2D,
                                                                     cp.cuda.get_current_stream().ptr)),
                    ("lm_head", self.lm_head)]
        return out

    def chunk_launches(self, start: int, m: int, last: bool = False) -> list:
        """chunk_ops without the names."""
        return [op for _, op in self.chunk_ops(start, m, last)]

    def chunk_graph(self, start: int, m: int, last: bool = False) -> StepGraph:
        """The chunk's work as a CUDA graph, captured on first use after one eager run (which loads the kernels and
        cuBLAS's workspace; running a chunk again writes the same values). Replaying it costs one launch where the
        eager chunk costs a Python call per op: 3B's 28 layers x 9 take ~6 ms of host time per chunk. Tensor
        parallel: the sums across ranks are captured with the rest (NCCL takes part in stream capture)."""
        key = (start, m, last)
        if key not in self.graphs:
            ops = self.chunk_launches(start, m, last)
            with self.eng.stream:
                for op in ops:
                    op()
            self.graphs[key] = StepGraph(ops, self.eng.stream)
        return self.graphs[key]

    def run(self, prompt_ids, graph: bool = True) -> None:
        """Reset the engine to `prompt_ids`, fill the cache and make the first new token (`fill`)."""
        self.eng.reset(prompt_ids)
        self.fill(prompt_ids, graph)

    def fill(self, prompt_ids, graph: bool = True, upto: int | None = None, taps=None) -> None:
        """After the engine's reset to `prompt_ids` (or to a longer sequence that starts with them): every prompt
        position through the layers by chunks, each a graph replay (or, `graph` False or `taps` given, launch by
        launch), then the lm_head on the last one: the first new token is made and the engine's next decode step is
        the one at position n. `upto`: positions 0 .. upto-1 only, no lm_head; the next step is the one at `upto`
        (it reads token `upto`). Queued on the engine's stream, no host synchronisation. `taps(name, rows)`: called
        after each op with its name and h[:m] (the fp32 residual rows of the chunk's positions), in order; the stream
        is synchronised before each call."""
        e = self.eng
        ids = np.asarray(prompt_ids, dtype=np.int32).reshape(-1)
        if upto is None and self.lm_head is None:  # tensor parallel: the last position is the decode step's
            self.fill(ids, graph, ids.size - 1, taps)
            e.run(1, graph)
            return
        n = ids.size if upto is None else upto
        if not 0 <= n <= ids.size:
            raise AtomflowError(f"prefill of {n} positions from a prompt of {ids.size} tokens")
        a = e.arena
        with e.stream:
            for start in range(0, n, self.chunk):
                m = min(self.chunk, n - start)
                last = upto is None and start + m == n
                self.tokens[:m].set(ids[start:start + m], stream=e.stream)
                g = self.chunk_graph(start, m, last) if graph and taps is None else None  # first use: eager + capture
                if last:  # after that first use, whose lm_head advanced the position
                    a["pos"].set(np.array([n - 1], np.int32), stream=e.stream)
                if taps is not None:
                    for name, op in self.chunk_ops(start, m, last):
                        op()
                        e.stream.synchronize()
                        taps(name, self.h[:m])
                elif g is not None:
                    g.replay()
                else:
                    for op in self.chunk_launches(start, m, last):
                        op()
            if upto is not None:
                a["pos"].set(np.array([n], np.int32), stream=e.stream)
                a["cur_token"].set(ids[n:n + 1], stream=e.stream)
        e.position = n
