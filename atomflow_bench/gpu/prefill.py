"""Prefill: the prompt's K/V rows computed as batched work (M tokens a chunk) instead of one decode step per token.

    pf = Prefill(engine)              # row-major fp16 copies of the layer weights, chunk buffers: made once
    pf.run(prompt_ids)                # K/V of positions 0 .. n-1 in the cache, the first new token made
    engine.run(n_new - 1)             # the decode step continues at position n, reading that token

Per chunk of up to `chunk` tokens (positions start .. start+m-1), per layer, as the decode step does for one token:
RMSNorm rows -> QKV GEMM -> RoPE + K/V into the cache -> causal attention over the cache before the chunk and the
chunk (ops/attention_prefill.py) -> o_proj GEMM added into the fp32 residual -> RMSNorm rows -> gate/up GEMM ->
SwiGLU rows -> down GEMM added into the residual. The GEMMs run on cuBLAS (ops/prefill_rows.py Gemm) over row-major
fp16 copies of the layer weights made once from the arena's tiled ones (fp8: dequantised, each weight times its
group's scale, rounded to fp16); those copies cost the fp16 model's layer bytes of device memory. After the last
chunk its last row goes through the decode step's lm_head kernel alone (final norm, logits, argmax, position + 1),
which makes the first new token without a decode step's weight reads. One GPU only (the tensor-parallel prefill is not
built).
"""
from __future__ import annotations

import numpy as np

from ..config import GROUP
from ..errors import AtomflowError
from .graph import StepGraph
from .ops.attention_prefill import attention_prefill_launch
from .ops.gemv import ROLE_PAIRING, linear_regions, tile_scale_view, tile_view
from .ops.lm_head import lm_head_launch
from .ops.prefill_rows import (Gemm, embed_rows_launch, rmsnorm_rows_launch, rope_kv_rows_launch,
                               swiglu_rows_launch)

# What each layer runs, in order (chunk_ops' names).
ROLES = ("attn_norm", "qkv", "rope_kv", "attention", "o_proj", "mlp_norm", "gate_up", "swiglu", "down")
D2D = 3  # cudaMemcpyDeviceToDevice
PREFILL_CHUNK = 4096  # tokens per chunk: cuBLAS runs the layer GEMMs at M = 4096 near its 8192-cube rate (M = 512:
# 0.4-0.75x of it); an 8192-token 3B prompt takes 143 ms in chunks of 4096, 147 in 2048, 166 in 512 (one H200). The
# buffers' rows cost ~85 KB a token for 3B, ~130 KB for 8B.


def prefill_flops(cfg, n: int) -> float:
    """FLOPs of a whole `n`-token prompt, prompt in to first token out: the layer GEMMs over n rows, the causal
    attention (query at position p: QK^T and PV over p + 1 rows, 4 * head_dim * heads * (p + 1)), and the lm_head
    of the last position. Row ops (norms, RoPE, SwiGLU) are left out: a few FLOPs a byte, not tensor-core work."""
    gemms = 2.0 * n * cfg.layer_linear_params()
    attention = 4.0 * cfg.head_dim * cfg.num_attention_heads * (n * (n + 1) / 2) * cfg.num_hidden_layers
    return gemms + attention + 2.0 * cfg.vocab_size * cfg.hidden_size


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
    """The batched prefill of a one-GPU engine (see the module docstring)."""

    def __init__(self, engine, chunk: int = PREFILL_CHUNK):
        import cupy as cp

        if engine.group is not None:
            raise AtomflowError("prefill under tensor parallel is not built; run without --tp")
        cfg = engine.layer_cfg
        self.eng, self.cfg, self.chunk = engine, cfg, max(1, min(chunk, engine.max_seq))
        a = engine.arena
        need = sum(r * k * 2 for r, k in linear_regions(cfg).values()) * cfg.num_hidden_layers
        c, H, inter = self.chunk, cfg.hidden_size, cfg.intermediate_size
        need += c * (H * 6 + cfg.qkv_dim * 2 + cfg.q_dim * 2 + inter * 6 + 4)
        free = cp.cuda.runtime.memGetInfo()[0]
        if need > free:
            raise AtomflowError(f"prefill needs {need / 2**30:.2f} GiB for its fp16 weights and buffers, "
                                f"{free / 2**30:.2f} GiB are free")
        half = cfg.head_dim // 2
        self.w = {f"L{i}.{r}": row_major(a, f"L{i}.{r}", engine.fmt, half)
                  for i in range(cfg.num_hidden_layers) for r in ("wqkv", "wo", "wgu", "wd")}
        self.tokens = cp.zeros(c, dtype=cp.int32)
        self.h = cp.zeros((c, H), dtype=cp.float32)
        self.x = cp.zeros((c, H), dtype=cp.float16)
        self.qkv = cp.zeros((c, cfg.qkv_dim), dtype=cp.float16)
        self.att = cp.zeros((c, cfg.q_dim), dtype=cp.float16)
        self.gu = cp.zeros((c, 2 * inter), dtype=cp.float16)
        self.act = cp.zeros((c, inter), dtype=cp.float16)
        self.gemm = Gemm()
        # the first new token: the decode step's lm_head (final norm, logits, argmax, position + 1) on the last row;
        # tensor parallel runs its vocabulary shards and their combine in the decode step instead
        self.lm_head = lm_head_launch(engine.lib, a, cfg, engine.gpu["sms"]) if engine.group is None else None
        self.graphs: dict = {}  # (start, m): the chunk's work captured once (its ~9 calls per layer replay at once)

    def chunk_ops(self, start: int, m: int, last: bool = False) -> list[tuple[str, object]]:
        """Chunk [start, start + m)'s work in order, tokens already in place: (name, op) pairs, each op a launch or a
        cuBLAS call (callable). Names are "embed" and "layers.{i}.{role}" with role one of ROLES; after
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
            w = {r: self.w[f"L{i}.{r}"] for r in ("wqkv", "wo", "wgu", "wd")}
            ops = [
                rmsnorm_rows_launch(lib, h, a[f"L{i}.attn_norm"], x, m, eps),
                lambda w=w: self.gemm(x, w["wqkv"], qkv, m),
                rope_kv_rows_launch(lib, qkv, a["rope_cs"], a["k_cache"][i], a["v_cache"][i], n_q, n_kv, hd, start, m),
                attention_prefill_launch(lib, qkv, a["k_cache"][i], a["v_cache"][i], start, m, att, n_kv,
                                         cfg.group_size, hd, cfg.qkv_dim, cfg.q_dim),
                lambda w=w: self.gemm(att, w["wo"], h, m, accumulate=True),
                rmsnorm_rows_launch(lib, h, a[f"L{i}.mlp_norm"], x, m, eps),
                lambda w=w: self.gemm(x, w["wgu"], gu, m),
                swiglu_rows_launch(lib, gu, act, m),
                lambda w=w: self.gemm(act, w["wd"], h, m, accumulate=True),
            ]
            out += [(f"layers.{i}.{r}", op) for r, op in zip(ROLES, ops)]
        if last:
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
        eager chunk costs a Python call per op: 3B's 28 layers x 9 take ~6 ms of host time per chunk."""
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
