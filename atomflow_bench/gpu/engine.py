"""The GPU engine: load, build, capture, replay (used by run, validate, generate, profile, tune).

    eng = Engine(model_dir, weights="fp8", max_seq=512, forms=f)    # load: arena + weights; build: f's steps, once
    ids = eng.generate(prompt_ids, 32)                             # capture once per bucket, then graph replays
    eng.reset(prompt_ids); taps = eng.step_eager(taps=True)        # probes from the same launches

The step exists in one form per attention bucket: with `forms.short_attention` the short kernel serves the lengths
up to its capacity and the split kernel those beyond, each bucket with its own layer-GEMV form (forms.Forms). The
step advances the position by exactly one, so the engine keeps a host copy of it and runs every step with the
bucket of its context length. The forms come in resolved (given, saved by `tune`: measure/tune.py choose, or
forms.default_forms when none are passed) and the steps are built once from them; the engine never times anything
itself (`use` rebuilds for other forms: tuning's candidates, tests).

Tensor parallel plugs in through `group` (gpu/tp/group.py Group, one process per GPU), the engine's only seam: the
group hands the engine the rank's shard (`shard_plan`; the weights are loaded sliced from the checkpoint, or generated
on the GPU by gpu/synthetic.py) and its sums across ranks (`sums`: what the step runs after o_proj and down and after
the lm_head; `allreduce` = "peer", "nccl", or "auto" / None: peer where the ranks can map each other's memory).
Every rank must make the same calls in the same order (the collectives are inside the step), so nothing here depends
on a rank's own timings.

The batched prefill (gpu/prefill.py, `fill`) has its memory planned with the arena's (`batched_prefill`, default on):
the arena refuses in one line before allocating anything when not even its staged form fits beside the model, and
chooses its weights form (`arena.prefill_form`; tensor parallel: the ranks agree on one); the Prefill allocates it
on first use.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import envs
from ..errors import AtomflowError
from ..store.checkpoint import Checkpoint
from .arena import Arena, plan_arena
from .device import compute_capability, gpu_info, require_gpu, smem_limits
from .forms import Forms, GemvForm, default_forms, tp_defaults
from .graph import StepGraph
from .nvrtc import KernelLib
from .ops import kernel_lib
from .ops.attention import short_capacity
from .ops.lm_head import partial_blocks
from .prefill import FORMS, PREFILL_CHUNK, Prefill
from .step import build_step, run_eager
from .upload import upload_weights


def pdl_default(cc: int) -> bool:
    """Programmatic dependent launch (Hopper+): each kernel may start while its predecessor drains; it requests
    weights and waits (griddepcontrol.wait) before touching the predecessor's outputs. ATOMFLOW_PDL=0: off (A/B)."""
    return cc >= 90 and envs.ATOMFLOW_PDL


class Engine:
    def __init__(self, model_dir: str | Path | None, weights: str = "fp8", max_seq: int = 2048,
                 forms: Forms | None = None, progress=None, pdl: bool | None = None, kernel_defines: tuple = (),
                 group=None, allreduce: str | None = None, source=None, lib: KernelLib | None = None,
                 batched_prefill: bool = True):
        cupy = require_gpu()
        # load
        self.ckpt = source if source is not None else Checkpoint(model_dir)  # source: e.g. synthetic.GpuSynthetic
        self.cfg = self.ckpt.config
        self.fmt = weights
        self.gpu = gpu_info()
        self.cc = compute_capability()
        self.group = group
        self.shard = None
        self.layer_cfg = self.cfg  # the shapes the layer kernels see (a rank's share under tensor parallel)
        lm_rows = None
        if group is not None:
            self.shards = group.shard_plan(self.cfg)
            self.shard = self.shards[group.rank]
            self.layer_cfg = self.shard.config
            lm_rows = self.shard.vocab_rows[1] - self.shard.vocab_rows[0]
        self.plan = plan_arena(self.layer_cfg, weights, max_seq, self.gpu["sms"],
                               lm_head_rows=None if self.cfg.tie_word_embeddings else lm_rows,
                               prefill_chunk=min(PREFILL_CHUNK, max_seq) if batched_prefill else None)
        self.max_seq = max_seq
        # kernel_defines: e.g. the timeline instrument; `lib`: one made already (its defines keyed a saved tune)
        self.lib = lib if lib is not None else kernel_lib(extra_defines=kernel_defines)
        self.arena = Arena(self.plan)              # refuses before allocating when it does not fit
        if group is not None and self.arena.prefill_form is not None:
            self.arena.prefill_form = group.agree(self.arena.prefill_form, FORMS)
        self.load_info = upload_weights(self.ckpt, self.arena, weights, self.lib, progress, shard=self.shard)
        self.tp = None
        if group is not None:
            rows = max(s.vocab_rows[1] - s.vocab_rows[0] for s in self.shards)
            offsets = [s.vocab_rows[0] for s in self.shards]
            self.tp = group.sums(self.lib, self.cfg.hidden_size, partial_blocks(rows, self.gpu["sms"]), offsets,
                                 allreduce, gpu_key=(self.cc, self.gpu["sms"], *smem_limits()))
        self.short_capacity = short_capacity(self.cfg.head_dim, smem_limits())
        self.pdl = bool(pdl_default(self.cc) if pdl is None else pdl)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._prompt_ids = np.zeros(0, np.int32)
        self.position = 0  # host copy of the device's pos (the next step attends over position + 1 rows)
        self._prefill = None  # gpu/prefill.py Prefill, made on first use
        # build
        if forms is None:
            forms = default_forms(weights, self.cc, self.short_capacity)
            if group is not None:
                forms = tp_defaults(forms, weights, self.cc)
        self.use(forms)

    # ---- build ---------------------------------------------------------------------------------------------------
    def bucket_launches(self, cap: int | None, form: GemvForm, tp_path: str | None = None) -> list:
        """One bucket's step: the short attention kernel at capacity `cap`, or (None) the split kernel. `tp_path`:
        the exchanges' path if not the run's (gpu/tp/sums.py; "local": none at all, for timing)."""
        launches = build_step(self.layer_cfg, self.fmt, self.arena, self.lib, self.gpu["sms"], cap, form, tp=self.tp,
                              vocab_rows=self.shard.vocab_rows if self.shard else None, tp_path=tp_path)
        if self.pdl:
            for ln in launches[1:]:
                ln.enable_pdl()
        return launches

    def use(self, forms: Forms) -> None:
        """Build the steps of `forms` (its kernels compiled now, before anything is timed); graphs are captured on
        first replay."""
        self.forms = forms.check(self.cc)
        cap = self.short_capacity if forms.short_attention else 0
        self.att_caps = [cap] if cap else []
        self.variants = {cap: self.bucket_launches(cap, forms.gemv)} if cap else {}
        if not cap or self.max_seq > cap:  # lengths beyond the short bucket
            self.variants[None] = self.bucket_launches(None, forms.gemv_split)
        self._graphs: dict = {}

    # ---- state ---------------------------------------------------------------------------------------------------
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
        a["prompt"][: ids.size].set(ids)
        a["prompt_len"].set(np.array([ids.size], np.int32))
        a["pos"].set(np.zeros(1, np.int32))
        a["cur_token"].set(ids[:1])
        self._prompt_ids = ids
        self.position = 0

    def bucket(self, length: int):
        """The attention bucket of a step at context length `length` (capacity, or None: the split kernel)."""
        return next((c for c in self.att_caps if length <= c), None)

    def gemv_form_of(self, length: int) -> GemvForm:
        """The layer-GEMV form of the step at context length `length` (its bucket's)."""
        return self.forms.bucket_form(self.bucket(length) is not None)

    @property
    def launches(self) -> list:
        """The launches of the next step (the bucket of its length: position + 1)."""
        return self.variants[self.bucket(self.position + 1)]

    # ---- capture, replay -----------------------------------------------------------------------------------------
    def graph(self, key) -> StepGraph:
        if key not in self._graphs:
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

    @property
    def prefills(self) -> bool:
        """Whether `fill` runs the batched prefill: its memory is planned (`batched_prefill`) and, under tensor
        parallel, the group sums a chunk's rows across ranks."""
        return self.arena.prefill_form is not None and (self.tp is None or self.tp.row_sums is not None)

    def prefill(self, prompt_ids, graph: bool = True) -> None:
        """Reset to the prompt and run it through the batched prefill (gpu/prefill.py; each chunk a graph replay, or
        launch by launch), which makes the first new token; the next step reads it."""
        self.reset(prompt_ids)
        self.prefiller().fill(prompt_ids, graph)

    def prefiller(self):
        """The engine's gpu/prefill.py Prefill, made on first use (its weights and buffers only then)."""
        if self._prefill is None:
            self._prefill = Prefill(self)
        return self._prefill

    def start(self, prompt_ids, graph: bool = True, upto: int | None = None) -> None:
        """Reset to the prompt and process it (`fill`)."""
        self.reset(prompt_ids)
        self.fill(graph, upto)

    def fill(self, graph: bool = True, upto: int | None = None) -> None:
        """After `reset`: the prompt's n tokens through the model and the first new token made, the next step at
        position n; by the batched prefill where it is built (`prefills`), else walked through the decode step.
        `upto`: only positions 0 .. upto-1 into the cache; the next step is the one at `upto` (it reads prompt token
        `upto`). Queued on the engine's stream (no host synchronisation), so CUDA events around it time it: with
        `upto` None, the time to first token."""
        if self.prefills:
            self.prefiller().fill(self._prompt_ids, graph, upto)
        else:
            self.run(self._prompt_ids.size if upto is None else upto, graph)

    def generate(self, prompt_ids, n_new: int, graph: bool = True, prefill: bool = False) -> list[int]:
        """Greedy: the prompt is fed token by token through the same step (or, `prefill`, batched: gpu/prefill.py);
        returns the n_new new ids."""
        n = np.asarray(prompt_ids).size
        if n + n_new - 1 > self.max_seq:
            raise AtomflowError(f"prompt + {n_new} tokens exceed max_seq {self.max_seq}")
        if prefill:
            self.prefill(prompt_ids)
            self.run(n_new - 1, graph)
        else:
            self.reset(prompt_ids)
            self.run(n - 1 + n_new, graph)
        return self.tokens(n - 1, n_new)

    def close(self) -> None:
        """Release the CUDA graphs (the decode steps' and the prefill's chunks). Under tensor parallel they hold
        captured NCCL work, and a communicator destroyed while such graphs live can hang the process's exit (both
        ranks stuck in the collector at shutdown): released here, before the group closes, the exit does not depend
        on the order the collector frees objects in. The engine captures them again if it is used after this."""
        self._graphs = {}
        if self._prefill is not None:
            self._prefill.graphs = {}

    # ---- what it holds and reads ---------------------------------------------------------------------------------
    def vram(self) -> dict:
        v = self.arena.vram()
        v["total"] = sum(v.values())
        return v

    def streamed_bytes(self, context: float) -> dict:
        """Bytes one decode step must read at a given context length (weights in full + K and V rows); tensor
        parallel: this rank's."""
        w = self.plan.streamed_weight_bytes() if self.shard is None else self.shard.streamed_bytes(self.cfg, self.fmt)
        kv = int(round(context * self.layer_cfg.kv_bytes_per_token()))
        return {"weights": w, "kv": kv, "total": w + kv}
