"""`profile` and `gemv`: where the decode step's time goes (GPU, CUDA events).

* `profile_step`: the step's launches run eagerly, one at a time, with an event pair around every launch, queued
  behind a spin kernel (`queued_event_us`: no host time inside a pair) — like AtomFlow's nsys table: kernel, %
  of step, count per step, mean µs, GB/s — plus the graph-mode step time measured the same way as `run`; the
  graph step minus the sum of kernel times is the idle gap when positive, and the overlap the graph and PDL
  win over the kernels one by one when negative.
* `attention_graph`: the step's attention launches alone (one per layer, as captured in the step), replayed
  as a CUDA Graph: µs per launch at the current position against its KV-bytes floor (K and V rows read once
  at the copy bandwidth). The layers' caches are read in turn, so once they exceed L2 every launch is cold.
* `role_marginals`: what each role of the step (QKV, attention, o_proj, gate/up, down, lm_head, ...) costs
  INSIDE the graph: the step replayed with that role's launches left out, against the whole step; the
  difference is what the role adds to the token time, overlap with its neighbours included (these graphs hold
  the position: step.hold_position). Next to it the role's bytes floor at the copy
  bandwidth: the excess over it is what a faster or fused version of the role could save at most.
* `gemv_bench`: every GEMV shape of a model alone, fp16 and fp8, L2-cold: the weights rotate through
  enough copies that the set is several times the L2 size, so each launch streams from DRAM. Two figures per
  shape: isolated (an event pair around every launch, all of them queued behind a spin kernel so that the host's
  submission time is not inside a pair: launch latency, ramp-up and drain included) and chained (the
  copies launched back to back with programmatic dependent launch and captured as one CUDA graph, as the decode
  step runs them: each launch requests its weights while its predecessor drains and waits for it before reading
  x; µs per launch = replay time / launches; the residual variant reads y before its wait, which races with the
  predecessor's write here — a timing, not a result).
Both report GB/s against the copy bandwidth measured in the same run.
"""
from __future__ import annotations

import numpy as np

from ..config import GROUP, ModelConfig
from ..gpu.device import compute_capability
from ..gpu.forms import default_forms
from ..gpu.ops.gemv import linear_regions
from ..gpu.ops.gemv import gemv_launch
from ..gpu.ops.lm_head import rows_launch
from ..gpu.ops.small import spin_launch
from ..gpu.step import hold_position
from ..output import Tab, num, span
from .decode import synthetic_prompt, time_decode
from .timing import copy_bandwidth, graph_replay_us, queued_event_us, summarize


L2_BYTES = 50 << 20  # H100 L2 size: a working set of 4x this is treated as L2-cold


def _kv_bytes(cfg: ModelConfig, length: int) -> int:
    return 2 * length * cfg.kv_dim * 2


def profile_step(engine, context: int = 128, steps: int = 20, copy: dict | None = None) -> dict:
    cfg = engine.cfg
    copy = copy or copy_bandwidth()
    prompt = synthetic_prompt(cfg.vocab_size, context)
    graph = time_decode(engine, context, steps, repeats=1, graph=True, prompt=prompt)["tpot_ms"]
    engine.start(prompt, upto=len(prompt) - 1)
    launches = engine.launches
    length = engine.position + 1  # the first profiled step's length: its bucket's forms
    forms = {"length": length, "attention": "short" if engine.bucket(length) else "split",
             "gemv": engine.gemv_form_of(length).text}
    n = len(launches)
    per = np.array(queued_event_us(engine.lib, launches * steps, engine.stream)).reshape(steps, n)  # µs [steps, n]
    step_us = per.sum(axis=1)
    groups: dict[str, dict] = {}
    for i, ln in enumerate(launches):
        key = ln.label or ln.name
        g = groups.setdefault(key, {"kernel": key, "count": 0, "us": [], "bytes": 0})
        g["count"] += 1
        g["us"].append(per[:, i])
        moved = ln.bytes_moved
        if ln.name == "attention_decode":  # K and V rows attended, averaged over the profiled positions
            moved = _kv_bytes(cfg, context + steps // 2)
        g["bytes"] += moved
    rows = []
    total = float(np.median(step_us))
    for g in groups.values():
        us = np.concatenate(g["us"])
        per_step = float(np.median(np.stack(g["us"]).sum(axis=0)))
        mean_us = float(np.median(us))
        bytes_per_launch = g["bytes"] / g["count"]
        rows.append({"kernel": g["kernel"], "pct": 100 * per_step / total, "count": g["count"],
                     "mean_us": mean_us, "us_per_step": per_step,
                     "gbs": bytes_per_launch / (mean_us * 1e-6) / 1e9 if bytes_per_launch else None,
                     "pct_of_copy": (bytes_per_launch / (mean_us * 1e-6) / 1e9) / copy["median"] * 100
                     if bytes_per_launch else None})
    rows.sort(key=lambda r: -r["us_per_step"])
    return {"rows": rows, "kernel_sum_us": total, "graph_step_us": graph["median"] * 1e3,
            "eager_launches": n, "idle_gap_us": graph["median"] * 1e3 - total, "copy_bandwidth_gbs": copy,
            "context": context, "steps": steps, "forms_used": engine.forms.text, "forms": forms,
            "attention_graph": attention_graph(engine, copy),
            "role_marginals": role_marginals(engine, copy)}


def step_role(ln) -> str:
    """The role of one launch of the step: the weight role of a GEMV (wqkv, wo, wgu, wd, lm_head), else the
    kernel (attention_decode, embed_lookup)."""
    if ln.name.startswith("gemv_"):
        return ln.label.split()[2]
    return ln.name


def role_marginals(engine, copy: dict, replays: int = 30, launches=None) -> dict:
    """Each role's marginal cost in the graph: step (position held: step.hold_position) minus the step without
    that role. `launches`: the step taken apart (default the engine's; `profile --tp`: the rank's step without its
    exchanges, which has nothing another rank must match)."""
    launches = hold_position(engine.launches if launches is None else launches)
    length = int(engine.arena["pos"].get()[0]) + 1
    full = graph_replay_us(launches, engine.stream, replays)
    roles = list(dict.fromkeys(step_role(ln) for ln in launches))
    bw = copy["median"] * 1e9
    rows = []
    for role in roles:
        mine = [ln for ln in launches if step_role(ln) == role]
        rest = [ln for ln in launches if step_role(ln) != role]
        without = graph_replay_us(rest, engine.stream, replays) if rest else summarize([0.0])
        nbytes = sum(_kv_bytes(engine.cfg, length) if ln.name == "attention_decode" else ln.bytes_moved
                     for ln in mine)
        saved = full["median"] - without["median"]
        floor = nbytes / bw * 1e6
        rows.append({"role": role, "count": len(mine), "step_without_us": without, "saved_us": saved,
                     "saved_us_per_launch": saved / len(mine), "bytes": nbytes, "floor_us": floor,
                     "excess_us": saved - floor})
    return {"length": length, "step_us": full, "rows": rows, "sum_saved_us": sum(r["saved_us"] for r in rows),
            "floor_us": sum(r["floor_us"] for r in rows)}


def attention_graph(engine, copy: dict, replays: int = 30) -> dict:
    """The step's attention launches (one per layer) captured alone into a graph and replayed; the position is
    wherever the engine stands. µs per launch vs the floor 2 * L * kv_dim * 2 bytes / copy bandwidth."""
    launches = [ln for ln in engine.launches if ln.name == "attention_decode"]
    length = int(engine.arena["pos"].get()[0]) + 1
    replay = graph_replay_us(launches, engine.stream, replays)
    per = {k: (v / len(launches) if k != "n" else v) for k, v in replay.items()}
    kv = _kv_bytes(engine.cfg, length)
    floor_us = kv / (copy["median"] * 1e9) * 1e6
    return {"length": length, "launches_per_replay": len(launches), "us_per_launch": per, "kv_bytes": kv,
            "floor_us": floor_us, "x_floor": per["median"] / floor_us,
            "l2_cold": kv * len(launches) > 4 * L2_BYTES}


def gemv_shapes(cfg: ModelConfig) -> list[tuple[str, int, int, str]]:
    """(role, rows, K, variant) for every GEMV of a decode step; lm_head is always fp16. QKV runs the plain
    store epilogue here (its RoPE epilogue needs the step's cache and position)."""
    out = [(role, rows, k, {"wqkv": "store", "wo": "resid", "wgu": "norm_swiglu", "wd": "resid"}[role])
           for role, (rows, k) in linear_regions(cfg).items()]
    out.append(("lm_head", cfg.vocab_size, cfg.hidden_size, "f32"))
    return out


def gemv_bench(cfg: ModelConfig, lib, n_sm: int, formats=("fp16", "fp8"), reps: int = 50, l2_bytes: int = L2_BYTES,
               copy: dict | None = None) -> dict:
    """Each GEMV shape alone, L2-cold (rotating >= 4x L2 of weights), events per launch; median µs."""
    import cupy as cp  # optional extra: imported where it is used

    copy = copy or copy_bandwidth()
    cc = compute_capability()
    pdl = cc >= 90
    stream = cp.cuda.Stream(non_blocking=True)
    empty = summarize(queued_event_us(lib, [spin_launch(lib, 0)] * (reps + 5), stream)[5:])
    rows_out = []
    rng = cp.random.default_rng(0)
    for fmt in formats:
        for role, rows, k, variant in gemv_shapes(cfg):
            f = "fp16" if role == "lm_head" else fmt
            if role == "lm_head" and fmt != formats[0]:
                continue
            wbytes = rows * k * (1 if f == "fp8" else 2)
            copies = max(2, -(-4 * l2_bytes // wbytes))
            n_out = rows // 2 if variant == "norm_swiglu" else rows
            if f == "fp8":
                wcopies = [rng.integers(0, 0x7E, (rows, k), dtype=cp.uint8) for _ in range(copies)]
                ss = [rng.random((rows, -(-k // GROUP)), dtype=cp.float32) * 1e-2 for _ in range(copies)]
            else:
                wcopies = [(rng.standard_normal((rows, k), dtype=cp.float32) * 0.02).astype(cp.float16) for _ in range(copies)]
                ss = [None] * copies
            x = rng.standard_normal(k, dtype=cp.float32) if variant.startswith("norm") else \
                rng.standard_normal(k, dtype=cp.float32).astype(cp.float16)
            nw = cp.ones(k, dtype=cp.float16) if variant.startswith("norm") else None
            y = cp.zeros(n_out, dtype=cp.float32 if variant in ("resid", "f32") else cp.float16)
            if role == "lm_head":
                launches = [rows_launch(lib, wcopies[c], x, y, n_out, k, n_sm) for c in range(copies)]
            else:  # each format in its default form (forms.default_forms)
                g = default_forms(f, cc, 0).gemv
                launches = [gemv_launch(lib, f, variant, wcopies[c], ss[c], x, y, n_out, k, n_sm, norm_w=nw, role=role,
                                        ws=g.ws, ws_pre=g.slots_before_wait(role)) for c in range(copies)]
            us = queued_event_us(lib, [launches[i % copies] for i in range(reps + 5)], stream)
            s = summarize(us[5:])
            moved = launches[0].bytes_moved
            gbs = moved / (s["median"] * 1e-6) / 1e9
            chain = chained_us(launches, pdl, reps)
            cgbs = moved / (chain["median"] * 1e-6) / 1e9
            floor_us = moved / (copy["median"] * 1e9) * 1e6
            rows_out.append({"role": role, "format": f, "rows": rows, "k": k, "bytes": moved, "us": s,
                             "gbs": gbs, "pct_of_copy": 100 * gbs / copy["median"],
                             "isolated_ceiling_pct": 100 * floor_us / (floor_us + empty["median"]),
                             "chained_us": chain,
                             "chained_gbs": cgbs, "chained_pct_of_copy": 100 * cgbs / copy["median"],
                             "chain_launches": copies})
            del wcopies, ss, launches
    return {"rows": rows_out, "copy_bandwidth_gbs": copy, "l2_rotation_bytes": 4 * l2_bytes, "chained_pdl": pdl,
            "empty_launch_us": empty}


def chained_us(launches, pdl: bool, reps: int) -> dict:
    """µs per launch of `launches` run back to back as one CUDA graph (programmatic dependent launch between
    them when `pdl`), replayed `reps` times after 2 warm-up replays; events between replays."""
    import cupy as cp  # optional extra: imported where it is used

    if pdl:
        for ln in launches[1:]:
            ln.enable_pdl()
    stream = cp.cuda.Stream(non_blocking=True)
    r = graph_replay_us(launches, stream, max(5, reps // 5))
    return {k: (v / len(launches) if k != "n" else v) for k, v in r.items()}


def profile_table(p: dict):
    """The eager per-kernel breakdown of profile_step (output.Tab)."""
    cols = ["kernel", "% of step", "count/step", "mean µs", "µs/step", "GB/s", "% copy BW"]
    t = Tab(f"decode step profile (eager, events per launch; ctx {p['context']}, {p['steps']} steps)", cols,
            key="profile", right=tuple(cols[1:]))
    for r in p["rows"]:  # a GB/s of None or 0 is no figure: "-" for people, null in json
        t.add(r["kernel"], num(r["pct"], ".1f"), num(r["count"]), num(r["mean_us"], ".2f"),
              num(r["us_per_step"], ".1f"), num(r["gbs"] or None, ".0f", none="-"),
              num(r["pct_of_copy"] or None, ".0f", none="-"))
    gap = p["idle_gap_us"]
    what = "idle gap" if gap >= 0 else "overlap: the graph step is shorter than the kernels one by one by"
    t.caption = (f"sum of kernels (each alone, launch latency included) {p['kernel_sum_us']:.1f} µs; graph step "
                 f"{p['graph_step_us']:.1f} µs; {what} {abs(gap):.1f} µs; copy bandwidth "
                 f"{p['copy_bandwidth_gbs']['median']:.0f} GB/s")
    f = p.get("forms")
    if f:  # which step ran: the attention bucket of the first profiled length and its layer-GEMV form
        t.caption += f"; the step at length {f['length']}: {f['attention']} attention, layer GEMVs {f['gemv']}"
    return t


def attention_table(p: dict):
    """The attention launches alone in a graph (profile_step's `attention_graph`) as a one-row output.Tab."""
    a = p["attention_graph"]
    u = a["us_per_launch"]
    cols = ["length", "µs per layer", "p10-p90 µs", "KV floor µs", "x the floor", "DRAM"]
    t = Tab("attention alone in a graph (the step's attention launches, one per layer)", cols, key="attention",
            right=tuple(cols[:5]))
    t.add(num(a["length"]), num(u["median"], ".2f"), span(u["p10"], u["p90"], ".2f"), num(a["floor_us"], ".2f"),
          num(a["x_floor"], ".2f", "x"), "L2-cold" if a["l2_cold"] else "caches fit in L2: not a DRAM figure")
    return t


def gemv_table(g: dict):
    """gemv_bench's rows (output.Tab)."""
    cols = ["GEMV", "format", "rows x K", "MB", "isolated µs", "p10-p90 µs", "GB/s", "% copy BW",
            "isolated ceiling %", "chained µs", "chained GB/s", "chained % copy BW"]
    t = Tab(f"GEMV microbenchmark (L2-cold: weights rotate over {g['l2_rotation_bytes'] >> 20} MiB+)", cols,
            key="gemv", right=tuple(cols[2:]))
    for r in g["rows"]:
        t.add(r["role"], r["format"], f"{r['rows']}x{r['k']}", num(r["bytes"] / 1e6, ".1f"),
              num(r["us"]["median"], ".2f"), span(r["us"]["p10"], r["us"]["p90"], ".1f"), num(r["gbs"], ".0f"),
              num(r["pct_of_copy"], ".1f"), num(r["isolated_ceiling_pct"], ".0f"),
              num(r["chained_us"]["median"], ".2f"), num(r["chained_gbs"], ".0f"), num(r["chained_pct_of_copy"], ".1f"))
    chain = "with programmatic dependent launch" if g.get("chained_pdl") else "without PDL (pre-sm_90)"
    t.caption = (f"copy bandwidth (same run) {g['copy_bandwidth_gbs']['median']:.0f} GB/s; isolated = an event pair "
                 f"around every launch (queued behind a spin: no host time inside); an empty launch takes "
                 f"{g['empty_launch_us']['median']:.2f} µs that way, so an isolated launch of B bytes reaches at most "
                 f"the ceiling floor / (floor + that); chained = the rotating copies back to back in one CUDA graph "
                 f"{chain}")
    return t


def marginal_table(p: dict):
    """The graph-mode breakdown of profile_step's `role_marginals` (output.Tab)."""
    m = p["role_marginals"]
    cols = ["role", "launches", "step without (µs)", "role adds (µs)", "per launch (µs)", "bytes floor (µs)",
            "excess (µs)"]
    whose = f"; {m['step']}" if m.get("step") else ""
    t = Tab(f"what each role adds to the graph step (left out of the graph; length {m['length']}{whose})", cols,
            key="roles", right=tuple(cols[1:]))
    for r in m["rows"]:
        t.add(r["role"], num(r["count"]), num(r["step_without_us"]["median"], ".1f"), num(r["saved_us"], ".1f"),
              num(r["saved_us_per_launch"], ".2f"), num(r["floor_us"], ".1f"), num(r["excess_us"], ".1f"))
    s = m["step_us"]
    t.caption = (f"step, position held {s['median']:.1f} µs ({s['p10']:.1f}-{s['p90']:.1f}); roles add up to "
                 f"{m['sum_saved_us']:.1f} µs; bytes floor {m['floor_us']:.1f} µs")
    return t
