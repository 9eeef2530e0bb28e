"""`profile`'s prefill breakdown: one chunk of the batched prefill (gpu/prefill.py) taken apart op by op.

The chunk is the LAST one of a prompt's prefill: of a prompt of n tokens the prefill runs positions 0 .. n-1 in chunks
of up to `chunk` rows, then the lm_head on the last row (as in `run`'s time to first token); the last chunk, positions
start .. n-1, is the one whose attention reads the most cache. The cache before it is filled first (Engine.reset +
Prefill.fill up to `start`), then the chunk's ops (Prefill.chunk_ops with `last`: "embed", "layers.{i}.{role}",
"last_row", "lm_head"; the lm_head holding the position, so that repetitions do not advance it) run one by one, `reps`
times in order, with an event pair around each, all queued behind a spin kernel (timing.queued_event_us: no host time
inside a pair, a cuBLAS call timed as a kernel launch is); running the chunk again rewrites the same cache rows and
residual, so every repetition does the same work.

Per role (embed, prefill.ROLES and the lm_head with the copy of its row), over the layers: µs summed, µs per layer, share of the ops' sum; the achieved
TFLOPS of the four GEMMs (2 m rows K per layer) and of the attention (causal: the query row at position p reads
p + 1 keys, 4 head_dim n_q_heads (p + 1) FLOPs); the achieved GB/s of the row ops (the rows they read and write, as
their launches count them; the lm_head: its weights). Beside it the chunk as one CUDA graph of the same ops: the graph minus
the ops' sum is idle time between kernels when positive; negative, what the graph saves over the ops one by one
(each isolated op pays its own launch latency).
"""
from __future__ import annotations

import numpy as np

from ..errors import AtomflowError
from ..gpu.graph import StepGraph
from ..gpu.ops.gemv import linear_regions
from ..gpu.ops.lm_head import hold_position
from ..gpu.prefill import ROLES
from ..output import Tab, num
from .decode import synthetic_prompt
from .timing import queued_event_us, replay_us, summarize

GEMMS = {"qkv": "wqkv", "o_proj": "wo", "gate_up": "wgu", "down": "wd"}  # role -> its weight (linear_regions)
PREFILL_ROLES = ("embed",) + ROLES + ("lm_head",)


def role_flops(cfg, role: str, start: int, m: int) -> int | None:
    """FLOPs of one launch of `role` on chunk [start, start + m) (a layer's; None for the row ops)."""
    if role in GEMMS:
        rows, k = linear_regions(cfg)[GEMMS[role]]
        return 2 * m * rows * k
    if role == "attention":  # the query rows at positions start .. start+m-1, each over p + 1 keys
        return 4 * cfg.head_dim * cfg.num_attention_heads * (m * start + m * (m + 1) // 2)
    return None


def role_bytes(cfg, role: str, m: int) -> int | None:
    """Bytes one launch of row op `role` reads and writes over m rows (None for the GEMMs and the attention)."""
    H, inter = cfg.hidden_size, cfg.intermediate_size
    return {"embed": m * H * (2 + 4),               # fp16 embedding row in, fp32 residual row out
            "attn_norm": m * H * (4 + 2),           # fp32 residual row in, fp16 normalised row out
            "mlp_norm": m * H * (4 + 2),
            "rope_kv": m * cfg.qkv_dim * 2 * 2,     # the fp16 q|k|v row in; q in place, k and v into the cache
            "swiglu": m * inter * (2 * 2 + 2),      # fp16 gate and up rows in, fp16 activation out
            "lm_head": cfg.vocab_size * H * 2}.get(role)  # one row against the fp16 head's every row


def op_names(role: str, layers: int) -> list[str]:
    if role in ("embed", "lm_head"):
        return ["last_row", "lm_head"] if role == "lm_head" else ["embed"]
    return [f"layers.{i}.{role}" for i in range(layers)]


def prefill_breakdown(cfg, op_us: dict, graph_us: dict, *, prompt_tokens: int, chunk: int, start: int, m: int,
                      copy_gbs: float | None = None) -> dict:
    """The record's `prefill` from the timings: `op_us` {op name: µs of each repetition} (chunk_ops' names),
    `graph_us` the chunk graph's replays (timing.summarize of µs), `copy_gbs` the copy bandwidth (or None)."""
    L = cfg.num_hidden_layers
    rows = []
    for role in PREFILL_ROLES:
        names = op_names(role, L)
        us = float(np.median(np.sum([op_us[n] for n in names], axis=0)))  # median over repetitions of the layers' sum
        f, b = role_flops(cfg, role, start, m), role_bytes(cfg, role, m)
        times = 1 if role in ("embed", "lm_head") else L  # the work is a layer's, or once per chunk
        flops = None if f is None else f * times
        nbytes = None if b is None else b * times
        gbs = None if nbytes is None else nbytes / (us * 1e-6) / 1e9
        rows.append({"role": role, "count": len(names), "us": us,
                     "us_per_layer": None if role in ("embed", "lm_head") else us / len(names),
                     "flops": flops, "tflops": None if flops is None else flops / (us * 1e-6) / 1e12,
                     "bytes": nbytes, "gbs": gbs,
                     "pct_of_copy": 100 * gbs / copy_gbs if gbs is not None and copy_gbs else None})
    total = sum(r["us"] for r in rows)
    for r in rows:
        r["share"] = r["us"] / total
    flops = sum(r["flops"] or 0 for r in rows)
    g = graph_us["median"]
    return {"prompt_tokens": prompt_tokens, "chunk": chunk, "start": start, "m": m, "layers": L,
            "reps": len(op_us["embed"]), "rows": rows, "op_sum_us": total, "chunk_graph_us": graph_us,
            "gap_us": g - total, "flops": flops, "chunk_tflops": flops / (g * 1e-6) / 1e12,
            "tok_per_s": m / (g * 1e-6)}


def last_chunk(prompt_tokens: int, chunk: int) -> tuple[int, int]:
    """(start, m) of the last chunk of the prefill of a prompt of `prompt_tokens` (positions 0 .. n-1)."""
    n = prompt_tokens
    start = (n - 1) // chunk * chunk
    return start, n - start


def profile_prefill(engine, prompt_tokens: int, copy_gbs: float | None = None, reps: int = 5,
                    replays: int = 10) -> dict:
    """The last chunk of a synthetic prompt's prefill, op by op and as its graph (module docstring)."""
    pf = engine.prefiller()
    start, m = last_chunk(prompt_tokens, pf.chunk)
    prompt = synthetic_prompt(engine.cfg.vocab_size, prompt_tokens)
    engine.reset(prompt)
    pf.fill(prompt, upto=start)
    pf.tokens[:m].set(np.asarray(prompt[start:start + m], np.int32), stream=engine.stream)
    engine.arena["pos"].set(np.array([prompt_tokens - 1], np.int32), stream=engine.stream)  # the lm_head's row
    ops = [(name, hold_position(op) if name == "lm_head" else op) for name, op in pf.chunk_ops(start, m, last=True)]
    with engine.stream:
        for _, op in ops:  # kernels loaded, cuBLAS warmed up
            op()
    us = np.array(queued_event_us(engine.lib, [op for _, op in ops] * reps, engine.stream)).reshape(reps, len(ops))
    op_us = {name: us[:, j].tolist() for j, (name, _) in enumerate(ops)}
    replayed = summarize(replay_us(StepGraph([op for _, op in ops], engine.stream), engine.stream, replays))
    return prefill_breakdown(pf.cfg, op_us, replayed, prompt_tokens=prompt_tokens, chunk=pf.chunk, start=start, m=m,
                             copy_gbs=copy_gbs)


def prefill_fields(engine, prompt_tokens: int, copy_gbs: float | None = None) -> dict:
    """The profile record's `prefill` (profile_prefill), or None and `prefill_note` saying why there is none: tensor
    parallel (the breakdown is taken on one GPU: a rank's chunk holds the sums across ranks, and its lm_head is the
    decode step's), an engine that walks its prompts, or a prefill whose memory cannot be had."""
    if engine.group is not None:
        return {"prefill": None, "prefill_note": "no prefill breakdown under tensor parallel: profile takes the "
                                                 "prefill apart on one GPU"}
    if not engine.prefills:
        return {"prefill": None, "prefill_note": "no prefill breakdown: this engine walks its prompts through the "
                                                 "decode step (no batched prefill planned)"}
    try:
        engine.prefiller()
    except AtomflowError as e:
        return {"prefill": None, "prefill_note": f"no prefill breakdown: {e}"}
    return {"prefill": profile_prefill(engine, prompt_tokens, copy_gbs)}


def prefill_table(p: dict):
    """The record's `prefill` as an output.Tab (no rows, the note as its caption, when it is None)."""
    cols = ["role", "launches", "µs", "µs per layer", "% of chunk", "TFLOPS", "GB/s", "% copy BW"]
    pre = p.get("prefill")
    if pre is None:
        return Tab("prefill chunk profile", cols, key="prefill", right=tuple(cols[1:]),
                   caption=p.get("prefill_note", ""))
    last = pre["start"] + pre["m"] - 1
    t = Tab(f"prefill chunk profile (the last chunk of a {pre['prompt_tokens']}-token prompt: positions "
            f"{pre['start']}-{last}, {pre['m']} rows; ops one by one, events per op; {pre['reps']} repetitions)",
            cols, key="prefill", right=tuple(cols[1:]))
    for r in pre["rows"]:
        t.add(r["role"], num(r["count"]), num(r["us"], ".1f"), num(r["us_per_layer"], ".2f", none="-"),
              num(100 * r["share"], ".1f"), num(r["tflops"], ".1f", none="-"), num(r["gbs"], ".0f", none="-"),
              num(r["pct_of_copy"], ".0f", none="-"))
    g, gap = pre["chunk_graph_us"], pre["gap_us"]
    what = "idle gap" if gap >= 0 else "the graph is shorter than the ops one by one by"
    t.caption = (f"sum of ops (each alone, launch latency included) {pre['op_sum_us']:.1f} µs; the chunk's graph "
                 f"{g['median']:.1f} µs (p10-p90 {g['p10']:.1f}-{g['p90']:.1f}); {what} {abs(gap):.1f} µs; in the "
                 f"graph the GEMMs and the attention reach {pre['chunk_tflops']:.1f} TFLOPS, "
                 f"{pre['tok_per_s']:.0f} tokens/s")
    return t

