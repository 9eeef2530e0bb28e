"""The GPU engine: arena + weights + step + graph behind one object (used by run, validate, generate).

    eng = Engine(model_dir, weights="fp8", max_seq=512)
    ids = eng.generate(prompt_ids, 32)              # graph replays
    eng.reset(prompt_ids); taps = eng.step_eager(taps=True)   # probes from the same launches

The step exists in one form per attention bucket (step.attention_short_cap: the short kernel for lengths up to
the positions its shared memory holds, then the split kernel), each captured into its own graph. The step
advances the position by exactly one, so the engine keeps a host copy of it and runs every step with the bucket
of its context length. Whether the short kernel is used at all is measured, not assumed (`attention="auto"`):
the engine times one step of each form at the longest length the short kernel would serve (and at half of it,
the mean of the two) and keeps the faster
(results/PERF_NOTES.md v11.2: on 8B fp16 the split kernel's longer attention hides o_proj's weight prefetch).
The layer GEMVs' form is chosen the same way (`gemv="auto"`, sm_90+): warp-specialised (producer warp + bulk
copies; "ws" with the default count of ring slots filled before the PDL wait, "ws-pre<N>" with N, the counts of
step.GEMV_WS_PRE_TRY) or the per-warp ring / register path ("ring"; "ring+wd": with the down projection
warp-specialised: only when forced, or listed in step.GEMV_MIXED_TRY), timed together with the attention forms,
the fastest pair kept (PERF_NOTES v13: the warp-specialised fp8 GEMVs are faster on 8B and slower on 3B; v16: 1B
fp16 is faster with 2 slots before the wait, 3B with 3). The DYN forms ("dyn", "<form>+dyn:<role>": dynamic split-K
units, gemv_common.cuh) run only when forced (ATOMFLOW_GEMV): measured slower on 3B W8A16 (PERF_NOTES v33).
When both buckets run (max_seq beyond the short kernel's capacity), the split bucket's GEMV form is timed again at
its own lengths and may differ (`gemv_choice["split"]`, `gemv_form_of(length)`): at ctx 8192 QKV's L2 prefetch of
gate/up's tail competes with the attention's K/V stream (PERF_NOTES v34).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .arena import Arena, plan_arena
from .errors import AtomflowError, GpuUnavailable
from .kernels import KernelLib, knob, persisting_l2, set_persisting_l2
from .step import (GEMV_MIXED_TRY, GEMV_NEXT_L2, GEMV_ROLES, GEMV_WS_PRE_TRY, attention_short_cap, build_step,
                   gemv_dyn_clear, hold_position, l2_tails, run_eager, smem_limits)
from .weights import Checkpoint, upload_weights


def l2_suffix(form: str) -> tuple[str, int | None]:
    """A layer-GEMV form with the engine's measured L2 prefetch size: "ring/l2=8" -> ("ring", 8): its QKV kernels ask
    L2 for the last 8 MB of gate/up's weights (0: nothing; step.next_l2, knob GEMV_NEXT_L2_TAIL=-1); no suffix ->
    (form, None): the knobs decide."""
    base, sep, l2 = form.partition("/l2=")
    if not sep:
        return form, None
    if not l2.isdigit():
        raise AtomflowError(f"gemv must be <form>[/l2=<MB>] with an integer MB, not {form!r}")
    return base, int(l2)


def gemv_form(form: str) -> tuple[bool, int | None, tuple, tuple]:
    """(warp-specialised, slots before the wait or None for the default, roles warp-specialised in a ring step, roles
    run by the DYN kernels) of a layer-GEMV form: "ring", "ws", "ws-pre<N>", "ring+<role>[+<role>...]" (e.g.
    ring+wd), "dyn" or "dyn-pre<N>" (every role with dynamic split-K units, step.gemv_launch dyn), any of the first
    four with "+dyn:<role>" entries (those roles DYN, e.g. ring+dyn:wgu), each optionally with the suffix
    "/l2=<MB>" (l2_suffix)."""
    base, *extra = l2_suffix(form)[0].split("+")
    roles = [r for r in extra if not r.startswith("dyn:")]
    dyn = [r[4:] for r in extra if r.startswith("dyn:")]
    ok = (all(r in GEMV_ROLES for r in roles + dyn) and len(set(roles + dyn)) == len(roles + dyn)
          and (base == "ring" or not roles))
    pre = base.partition("-pre")[2]
    if ok and base in ("dyn", "dyn-pre" + pre) and not extra and (pre.isdigit() or base == "dyn"):
        return True, int(pre) if pre else None, (), GEMV_ROLES
    if ok and base == "ring":
        return False, None, tuple(roles), tuple(dyn)
    if ok and base == "ws":
        return True, None, (), tuple(dyn)
    if ok and base.startswith("ws-pre") and pre.isdigit():
        return True, int(pre), (), tuple(dyn)
    raise AtomflowError(f"gemv must be auto, ws, ws-pre<N>, ring, ring+<{'|'.join(GEMV_ROLES)}>..., dyn, dyn-pre<N> "
                        f"(+dyn:<role>...), not {form!r}")


def require_gpu():
    """Import CuPy and check a CUDA device exists; raise GpuUnavailable with one line otherwise."""
    try:
        import cupy
    except ImportError:
        raise GpuUnavailable("CuPy is not installed (pip install 'atomflow-bench[cuda12]' or '[cuda13]')") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError when there is no driver
        raise GpuUnavailable(f"no CUDA device available ({type(e).__name__}: {e})") from None
    if n == 0:
        raise GpuUnavailable("no CUDA device available")
    return cupy


def gpu_info() -> dict:
    cupy = require_gpu()
    rt = cupy.cuda.runtime
    dev = cupy.cuda.Device()
    p = rt.getDeviceProperties(dev.id)
    name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
    dv, rv = rt.driverGetVersion(), rt.runtimeGetVersion()
    return {"name": name, "cc": f"{p['major']}.{p['minor']}", "sms": int(p["multiProcessorCount"]),
            "l2_bytes": int(p["l2CacheSize"]), "l2_persist_max_bytes": int(p.get("persistingL2CacheMaxSize", 0)),
            "memory_bytes": int(p["totalGlobalMem"]),
            "cuda_driver": f"{dv // 1000}.{dv % 1000 // 10}", "cuda_runtime": f"{rv // 1000}.{rv % 1000 // 10}",
            "cupy": cupy.__version__}


def l2_keep(defines: tuple, gpu: dict) -> dict:
    """The L2 set-aside for persisting lines that the lm_head's evict-last rows need (knob LMHEAD_L2_KEEP = N MB;
    gemv_common.cuh; results/PERF_NOTES.md v35): N MB (the driver rounds up and clamps to the device's maximum) with
    LMHEAD_L2_SETASIDE=1 (the default), else nothing — and 0 without the knob, which also resets it, so that an
    earlier engine of this process leaves nothing behind. Returns what was asked and what the device reports; refused
    on a GPU without persisting lines when N > 0."""
    mb = knob("LMHEAD_L2_KEEP", 0, defines)
    if mb < 0:
        raise AtomflowError(f"LMHEAD_L2_KEEP={mb}: must be >= 0 (MB)")
    if mb and not gpu.get("l2_persist_max_bytes"):
        raise AtomflowError(f"LMHEAD_L2_KEEP={mb}: {gpu['name']} has no persisting L2 set-aside")
    aside = min((mb if knob("LMHEAD_L2_SETASIDE", 1, defines) else 0) << 20, gpu.get("l2_persist_max_bytes", 0))
    if not aside and not persisting_l2():  # nothing to set and nothing to reset: no call that MIG or MPS could refuse
        return {"keep_mb": mb, "set_aside_bytes": 0}
    rt = require_gpu().cuda.runtime
    try:
        return {"keep_mb": mb, "set_aside_bytes": set_persisting_l2(aside)}
    except (rt.CUDARuntimeError, RuntimeError) as e:  # e.g. MIG or an MPS client: the set-aside is not theirs
        raise AtomflowError(f"LMHEAD_L2_KEEP={mb}: the device refused an L2 set-aside of {aside} bytes ({e})") from None


class Engine:
    def __init__(self, model_dir: str | Path, weights: str = "fp8", max_seq: int = 2048, progress=None,
                 pdl: bool | None = None, kernel_defines: tuple = (), attention: str | None = None,
                 gemv: str | None = None):
        cupy = require_gpu()
        self.ckpt = Checkpoint(model_dir)
        self.cfg = self.ckpt.config
        self.fmt = weights
        self.gpu = gpu_info()
        self.plan = plan_arena(self.cfg, weights, max_seq, self.gpu["sms"])
        self.max_seq = max_seq
        self.lib = KernelLib(extra_defines=kernel_defines)  # kernel_defines: e.g. the timeline instrument
        self.lib.compile_all()                     # NVRTC (or CuPy's cache) before anything is timed
        self.l2_keep = l2_keep(self.lib.defines, self.gpu)  # before any step is timed
        self.arena = Arena(self.plan)              # refuses before allocating when it does not fit
        gemv_dyn_clear(self.arena["gemv_dyn_ctr"], self.arena["gemv_dyn_part"])  # the DYN GEMVs' state
        self.load_info = upload_weights(self.ckpt, self.arena, weights, self.lib, progress)
        # one step per attention bucket (capacity -> launches; None: the split kernel, for lengths beyond).
        # attention: "auto" (measure both below), "short" or "split"; default $ATOMFLOW_ATTENTION or "auto".
        attention = attention or os.environ.get("ATOMFLOW_ATTENTION", "auto")
        if attention not in ("auto", "short", "split"):
            raise AtomflowError(f"attention must be auto, short or split, not {attention!r}")
        # gemv: "auto" (sm_90+: time the forms with the attention forms) or one form (gemv_form);
        # $ATOMFLOW_GEMV or "auto".
        gemv = gemv or os.environ.get("ATOMFLOW_GEMV", "auto")
        ws_ok = float(self.gpu["cc"]) >= 9.0
        if gemv != "auto" and not ws_ok and any(gemv_form(gemv)[i] for i in (0, 2, 3)):  # ws, or ws / DYN roles
            raise AtomflowError(f"gemv={gemv!r} needs sm_90+ (bulk copies)")
        tries = [f"ws-pre{n}" for n in GEMV_WS_PRE_TRY[weights]]
        mixed = ["+".join(("ring",) + roles) for roles in GEMV_MIXED_TRY[weights]]
        forms = (["ws", *tries, "ring", *mixed] if ws_ok else ["ring"]) if gemv == "auto" else [gemv]
        # GEMV_NEXT_L2=1 with GEMV_NEXT_L2_TAIL=-1 (the defaults): the prefetch size measured too (bulk prefetch: sm_90+)
        tails = l2_tails(self.lib.defines) if ws_ok else ()
        if gemv != "auto" and l2_suffix(gemv)[1] and knob("GEMV_NEXT_L2", GEMV_NEXT_L2, self.lib.defines) != 1:
            raise AtomflowError(f"gemv={gemv!r} asks L2 for weights: needs GEMV_NEXT_L2=1 in ATOMFLOW_KERNEL_DEFINES")
        if tails:
            forms = [f if l2_suffix(f)[1] is not None else f"{f}/l2={t}" for f in forms for t in tails]
            forms = list(dict.fromkeys(forms))
        cfg = self.cfg
        full_cap = attention_short_cap(cfg.head_dim, self.lib.defines, smem_limits())
        cap = 0 if attention == "split" else full_cap
        caps = [cap] if cap else []
        self._forms = {f: {k: build_step(cfg, weights, self.arena, self.lib, self.gpu["sms"], k, *gemv_form(f),
                                         l2_tail=l2_suffix(f)[1])
                           for k in caps + [None]} for f in forms}
        self.variants = self._forms[forms[0]]
        self.att_caps = caps
        # Programmatic dependent launch (Hopper+): each kernel may start while its predecessor drains; it
        # prefetches weights and waits (griddepcontrol.wait) before touching the predecessor's outputs.
        # ATOMFLOW_PDL=0 turns it off (A/B measurements).
        if pdl is None:
            pdl = float(self.gpu["cc"]) >= 9.0 and os.environ.get("ATOMFLOW_PDL", "1") != "0"
        self.pdl = bool(pdl)
        if self.pdl:
            for variants in self._forms.values():
                for launches in variants.values():
                    for ln in launches[1:]:
                        ln.enable_pdl()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._graphs = {}
        self._prompt_len = 0
        self.position = 0  # host copy of the device's pos (the next step attends over position + 1 rows)
        self.attention_choice = {"mode": attention, "short_cap": caps[-1] if caps else None}
        self.gemv_choice = {"mode": gemv, "chosen": forms[0]}
        keys = [caps[-1], None] if attention == "auto" and caps else [caps[-1] if caps else None]
        if len(forms) * len(keys) > 1:
            self._choose(forms, keys, min(full_cap or max_seq, max_seq))
        del self._forms
        if self.att_caps and self.att_caps[-1] >= max_seq:
            del self.variants[None]  # every length fits the short kernel

    def _choose(self, forms: list, keys: list, length: int, replays: int = 12, rounds: int = 3) -> None:
        """Time one step (step.hold_position: the position stays) of every (GEMV form, attention bucket) pair and
        keep the fastest (`fastest`: `rounds` interleaved rounds of `replays` replays each). A pair's time is the
        mean of its step at `length` (the longest length the short kernel would serve: where short attention is at
        its slowest against the split one) and at half of it (the GEMV forms' differences depend on the length: on
        1B fp16 the ring slots filled before the wait cost the same at 512 and 5 µs at 128-383, PERF_NOTES v17).
        When the short bucket wins and lengths beyond it remain (max_seq > its capacity), the split bucket gets its
        own GEMV form, timed the same way at its own lengths (max_seq and half-way from the capacity): at ctx 8192
        QKV's L2 prefetch of gate/up's tail competes with the split attention's K/V stream, and the size that is
        best at 416 is 55 µs slower there than none (PERF_NOTES v34).
        Writes nothing that a later reset() does not redo (the K/V rows of those positions are rewritten before
        they are ever read)."""
        import cupy as cp

        from .graph import StepGraph

        a = self.arena
        a["cur_token"].set(np.zeros(1, np.int32))
        graphs = {(f, k): StepGraph(hold_position(self._forms[f][k]), self.stream) for f in forms for k in keys}

        def timer(lengths):
            def time_once(pair) -> float:
                g, us = graphs[pair], []
                for n in lengths:
                    ev = [cp.cuda.Event() for _ in range(replays + 1)]
                    with self.stream as s:
                        a["pos"].set(np.array([n - 1], np.int32), stream=s)
                        g.replay(3)
                        for i in range(replays):
                            ev[i].record(s)
                            g.replay(1)
                        ev[-1].record(s)
                    ev[-1].synchronize()
                    us.append(float(np.median([cp.cuda.get_elapsed_time(ev[i], ev[i + 1]) * 1e3
                                               for i in range(replays)])))
                return float(np.mean(us))
            return time_once

        lengths = sorted({max(1, length // 2), length})
        (form, key), us = fastest(timer(lengths), list(graphs), rounds)
        self.variants = dict(self._forms[form])
        if len(forms) > 1:
            self.gemv_choice.update({"length": length, "lengths": lengths, "chosen": form,
                                     "step_us": {f: min(us[f, k] for k in keys) for f in forms}})
        if len(keys) > 1:
            self.attention_choice.update({"length": length, "lengths": lengths, "chosen": "short" if key else "split",
                                          "step_us": {"short" if k else "split": us[form, k] for k in keys}})
            if key is None:
                del self.variants[self.att_caps[-1]]
                self.att_caps = []
        if key is not None and len(forms) > 1 and self.max_seq > key:
            split_lengths = sorted({(key + 1 + self.max_seq) // 2, self.max_seq})
            for f in forms:
                if (f, None) not in graphs:
                    graphs[f, None] = StepGraph(hold_position(self._forms[f][None]), self.stream)
            (split_form, _), us = fastest(timer(split_lengths), [(f, None) for f in forms], rounds)
            self.variants[None] = self._forms[split_form][None]
            self.gemv_choice["split"] = {"lengths": split_lengths, "chosen": split_form,
                                         "step_us": {f: us[f, None] for f in forms}}
        del graphs
        a["pos"].set(np.zeros(1, np.int32))

    def gemv_form_of(self, length: int) -> str:
        """The layer-GEMV form of the step at context length `length` (its attention bucket's form)."""
        split = self.gemv_choice.get("split")
        return split["chosen"] if split and self.bucket(length) is None else self.gemv_choice["chosen"]

    # ---- state ---------------------------------------------------------------------------------
    def reset(self, prompt_ids) -> None:
        """Start a new sequence: the prompt goes to device memory; position 0; token = prompt[0]."""
        ids = np.asarray(prompt_ids, dtype=np.int32).reshape(-1)
        if ids.size == 0:
            raise AtomflowError("empty prompt")
        if ids.size > self.max_seq:
            raise AtomflowError(f"prompt of {ids.size} tokens exceeds max_seq {self.max_seq}")
        if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
            raise AtomflowError(f"prompt token ids must lie in [0, {self.cfg.vocab_size})")
        self.stream.synchronize()
        a = self.arena
        gemv_dyn_clear(a["gemv_dyn_ctr"], a["gemv_dyn_part"])  # as every DYN launch leaves it (an aborted one: not)
        a["prompt"][: ids.size].set(ids)
        a["prompt_len"].set(np.array([ids.size], np.int32))
        a["pos"].set(np.zeros(1, np.int32))
        a["cur_token"].set(ids[:1])
        self._prompt_len = int(ids.size)
        self.position = 0

    # ---- running steps -------------------------------------------------------------------------
    def bucket(self, length: int):
        """The attention bucket of a step at context length `length` (capacity, or None: the split kernel)."""
        return next((c for c in self.att_caps if length <= c), None)

    @property
    def launches(self) -> list:
        """The launches of the next step (the bucket of its length: position + 1)."""
        return self.variants[self.bucket(self.position + 1)]

    def graph(self, key):
        if key not in self._graphs:
            from .graph import StepGraph

            self._graphs[key] = StepGraph(self.variants[key], self.stream)
        return self._graphs[key]

    def step_eager(self, taps: bool = False) -> dict | None:
        out = {} if taps else None
        with self.stream:
            run_eager(self.launches, out)
        self.position += 1
        return out

    def run(self, n_steps: int, graph: bool = True) -> None:
        """Queue n decode steps (asynchronous when graph=True), each with its length's bucket."""
        if self.position + n_steps > self.max_seq:
            raise AtomflowError(f"{n_steps} steps from position {self.position} exceed max_seq {self.max_seq}")
        while n_steps > 0:
            key = self.bucket(self.position + 1)
            n = n_steps if key is None else min(n_steps, key - self.position)  # steps while length <= key
            if graph:
                self.graph(key).replay(n)
                self.position += n
            else:
                for _ in range(n):
                    self.step_eager()
            n_steps -= n

    def tokens(self, start: int, n: int) -> list[int]:
        self.stream.synchronize()
        return [int(t) for t in self.arena["out_tokens"][start:start + n].get()]

    def generate(self, prompt_ids, n_new: int, graph: bool = True) -> list[int]:
        """Greedy: the prompt is fed token by token through the same step; returns the n_new new ids."""
        self.reset(prompt_ids)
        steps = self._prompt_len - 1 + n_new
        if self._prompt_len + n_new - 1 > self.max_seq:
            raise AtomflowError(f"prompt + {n_new} tokens exceed max_seq {self.max_seq}")
        self.run(steps, graph)
        return self.tokens(self._prompt_len - 1, n_new)

    def vram(self) -> dict:
        v = self.arena.vram()
        v["total"] = sum(v.values())
        return v

    def streamed_bytes(self, context: float) -> dict:
        """Bytes one decode step must read at a given context length (weights in full + K and V rows)."""
        w = self.plan.streamed_weight_bytes()
        kv = int(round(context * self.cfg.kv_bytes_per_token()))
        return {"weights": w, "kv": kv, "total": w + kv}


def fastest(time_once, candidates: list, rounds: int = 3) -> tuple:
    """(the fastest candidate, {candidate: its best time}): every candidate is timed once per round, the rounds
    interleaved so that a clock ramp or drift during the measurement reaches all of them alike, and each keeps
    its best round (8B fp16's attention forms differ by ~1.5%, less than what timing them one after the other
    once could tell: the first-timed form lost in one build and won in another). Ties: the earlier candidate."""
    if not candidates or rounds < 1:
        raise AtomflowError("fastest: nothing to time")
    best = {c: float("inf") for c in candidates}
    for _ in range(rounds):
        for c in candidates:
            best[c] = min(best[c], float(time_once(c)))
    return min(candidates, key=best.get), best


def generate_gpu(ckpt, prompt_ids, n_tokens: int, weights: str = "fp16", stop_ids=(), console=None) -> list[int]:
    """Greedy continuation on the GPU (all n_tokens run as graph replays), cut after the first stop id."""
    eng = Engine(getattr(ckpt, "dir", ckpt), weights=weights, max_seq=len(prompt_ids) + n_tokens)
    ids = eng.generate(prompt_ids, n_tokens)
    for i, t in enumerate(ids):
        if t in stop_ids:
            return ids[: i + 1]
    return ids
