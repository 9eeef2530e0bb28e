"""What a tensor-parallel `run` / `profile` adds to the record (every rank calls these in lockstep; rank 0 records).

* `choose_forms`: the launch forms, before the rank's engine is made: given (--forms / ATOMFLOW_FORMS) or the
  engine's defaults (gpu/forms.py tp_defaults); never tuned (a tune times candidates on each rank and could choose
  differently per rank). `tp_forms` does the same for an engine already built.
* `tp_energy`: energy passes of the same count on every rank (rank 0's count from its TPOT), each rank metering its
  own GPU; the record's joules per token are the sum over the GPUs.
* `tp_measure`: every rank's copy bandwidth, bytes per token and TPOT; the roofline per GPU (the slowest rank's
  bytes / its own copy bandwidth, against the step time); and the time of the cross-rank exchanges:
    - `sum_us`: one sum of hidden fp32 inside a CUDA graph (2 x layers of them replayed back to back, per call),
      for each path that could be set up (peer: the standalone one-shot sum tp_allreduce_add; NCCL's all-reduce),
      the path the step runs marked;
    - `per_token_us`: the graph of one token's exchanges alone (2 x layers sums + the argmax combine);
    - `in_step_us`: the step's graph time minus the same step without its exchanges (the "local" step: o_proj and
      down store their partial products and nothing is exchanged or combined, so its values are wrong and its time
      is a bound): what the exchanges cost inside the step, overlap included — for the peer path the only measure of
      the sums fused into the GEMVs. Both graphs hold the position (no advance).
"""
from __future__ import annotations

import math

import numpy as np

from ...measure.decode import ENERGY_MIN_S, energy_passes
from ...measure.profile import role_marginals
from ...measure.timing import copy_bandwidth, replay_us, summarize
from ...output import Tab
from ..forms import Forms, from_env
from ..graph import StepGraph
from ..step import hold_position
from .plan import comm_bytes_per_token

COMM_REPLAYS = 50
COMM_WARMUP = 10


def choose_forms(given: Forms | None = None) -> tuple[Forms | None, dict | None]:
    """The forms a rank's engine is built with, before it is made: given (--forms, else ATOMFLOW_FORMS), else None
    (the engine's tensor-parallel defaults; `default_origin` then names them)."""
    given = given or from_env()
    if given is not None:
        return given, {"forms": given.text, "origin": "given"}
    return None, None


def default_origin(engine) -> dict:
    return {"forms": engine.forms.text, "origin": "default (tensor parallel: not tuned)"}


def tp_forms(engine, given: Forms | None = None) -> dict:
    """choose_forms for an engine already built (validate's probes): the given forms put on it, else its defaults."""
    forms, chosen = choose_forms(given)
    if forms is not None:
        engine.use(forms)
    return chosen or default_origin(engine)


def _gather(group, values) -> np.ndarray:
    return group.allgather_host(np.asarray(values, dtype=np.float64))


def tp_energy(engine, prompt, tokens: int, meter, tpot_ms: float) -> dict:

    group = engine.group
    ok = _gather(group, [1.0 if meter.measures else 0.0])[:, 0]
    passes = int(_gather(group, [math.ceil(ENERGY_MIN_S * 1e3 / max(tokens * tpot_ms, 1e-3))])[0, 0])
    if not ok.all():
        bad = int(np.flatnonzero(ok == 0)[0])
        res = meter.result() if not meter.measures else {"unavailable": f"rank {bad} has no power meter"}
        _gather(group, [0.0, 0.0])  # the ranks' exchange below, kept in step
        return res
    res = energy_passes(engine, prompt, tokens, meter, passes=passes)
    jpt = res.get("joules_per_token")
    w = res.get("avg_watts")
    got = _gather(group, [jpt if jpt is not None else float("nan"), w if w is not None else float("nan")])
    if np.isnan(got).any():
        return {**res, "tp_note": "a rank's energy is unavailable: the figures are rank 0's GPU alone"}
    return {**res, "joules_per_token": float(got[:, 0].sum()), "avg_watts": float(got[:, 1].sum()),
            "per_gpu": [{"joules_per_token": float(a), "avg_watts": float(b)} for a, b in got],
            "tp_note": f"sum over the {group.size} GPUs (each metered by its own NVML counter)"}


def _graph_us(launches, stream, replays: int = COMM_REPLAYS) -> dict:
    return summarize(replay_us(StepGraph(launches, stream), stream, replays, warmup=COMM_WARMUP))


def local_step(engine) -> list:
    """The rank's step at the current length without its exchanges (tp path "local"), the position held."""
    length = engine.position + 1
    return hold_position(engine.bucket_launches(engine.bucket(length), engine.gemv_form_of(length), tp_path="local"))


def comm_times(engine, local: list | None = None) -> dict:
    """The exchanges timed on their own and inside the step (see the module docstring); every rank in lockstep.
    `local`: local_step(engine), if already built."""
    import cupy  # optional extra: imported where a GPU is used

    tpc, L, stream = engine.tp, engine.cfg.num_hidden_layers, engine.stream
    scratch = cupy.zeros(engine.cfg.hidden_size, dtype=cupy.float32)
    a = engine.arena
    state = (a["pos"], a["cur_token"], a["prompt"], a["prompt_len"], a["out_tokens"])
    paths = ["peer", "nccl"] if tpc.peer else ["nccl"]
    out = {"sum_bytes": engine.cfg.hidden_size * 4, "sums_per_token": 2 * L, "paths": {}}
    for path in paths:
        sums = tpc.comm_only_launches(path, 2 * L, scratch)
        if engine.pdl:  # chained as in the step
            for ln in sums[1:]:
                ln.enable_pdl()
        t_sums = _graph_us(sums, stream)
        t_token = _graph_us(hold_position(sums + tpc.argmax_launches(state, path=path)), stream)
        out["paths"][path] = {"sum_us": t_sums["median"] / (2 * L), "sums_graph_us": t_sums,
                              "per_token_us": t_token["median"], "token_graph_us": t_token}
    step = hold_position(engine.variants[engine.bucket(engine.position + 1)])
    local = local_step(engine) if local is None else local
    t_step, t_local = _graph_us(step, stream), _graph_us(local, stream)
    out["in_step_us"] = t_step["median"] - t_local["median"]
    out["step_graph_us"], out["step_without_exchanges_us"] = t_step, t_local
    out["path"] = tpc.path
    return out


def tp_measure(engine, copy: dict, tpot: dict, nbytes: dict, context: int) -> dict:
    group = engine.group
    rows = _gather(group, [copy["median"], nbytes["total"], nbytes["weights"], tpot["median"]])
    floors = rows[:, 1] / (rows[:, 0] * 1e9) * 1e3  # ms: each rank's bytes at its own copy bandwidth
    floor = float(floors.max())
    comm = comm_times(engine)
    return {
        "n": group.size, "allreduce": engine.tp.path,
        "peer_available": bool(engine.tp.peer), "peer_reason": engine.tp.peer_reason,
        "nccl_version": group.nccl_version, "same_host": group.same_host, "devices": group.devices,
        "per_rank": [{"rank": r, "copy_bandwidth_gbs": float(c), "bytes_per_token": int(b), "weight_bytes": int(w),
                      "tpot_ms": float(t), "floor_ms": float(f)}
                     for r, ((c, b, w, t), f) in enumerate(zip(rows, floors))],
        "roofline": {"tpot_floor_ms": floor, "pct": 100.0 * floor / tpot["median"],
                     "basis": "per GPU: the slowest rank's bytes per token / its copy bandwidth, same run"},
        "comm_bytes_per_token": comm_bytes_per_token(engine.cfg, group.size),
        "comm": comm,
        "weights_source": "generated on the GPUs (gpu/synthetic.py)" if engine.ckpt.dir is None else "checkpoint",
    }


def tp_profile(engine) -> dict:
    """`profile --tp`'s figures at the engine's position: comm_times, and what each role adds to the rank's step
    without exchanges (every rank takes its own apart, so none waits for another; rank 0's is reported)."""
    local = local_step(engine)
    comm = comm_times(engine, local)  # the ranks in lockstep first
    roles = role_marginals(engine, copy_bandwidth(), launches=local)
    return {"comm": comm,
            "role_marginals": {**roles, "step": f"rank {engine.group.rank}'s step without its exchanges (tp path "
                                                "local)"}}


def tp_profile_table(p: dict, engine):
    """`profile --tp`: the step's graph time and the exchanges' time (comm_times)."""
    c = p["comm"]
    t = Tab(f"profile --tp {p['tp']} — ctx {p['context']}, forms {p['forms']['forms']} ({p['forms']['origin']})",
            ["what", "us", "note"], key="tp_profile", right=("us",))
    t.add("step (graph, position held)", round(c["step_graph_us"]["median"], 2), f"the sums: {c['path']}")
    t.add("step without the exchanges", round(c["step_without_exchanges_us"]["median"], 2),
          "o_proj / down store their partials, nothing summed or combined (values wrong: a bound)")
    t.add("exchanges inside the step", round(c["in_step_us"], 2), "the difference: the role's time per token")
    for path, v in c["paths"].items():
        t.add(f"{path}: one sum of {c['sum_bytes']} B", round(v["sum_us"], 3),
              f"{'the standalone one-shot sum; ' if path == 'peer' else ''}{c['sums_per_token']} sums replayed back "
              "to back in one graph, per call")
        t.add(f"{path}: one token's exchanges alone", round(v["per_token_us"], 2),
              f"{c['sums_per_token']} sums + the argmax combine, one graph")
    return t
