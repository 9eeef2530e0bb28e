"""The run context: what `run`, `profile`, `validate` and `sweep` measure on, made once per command.

`RunContext` is one GPU: the model's directory, the record's source label, and how the engine is made (forms
resolved before it is built: given, saved by `tune`, tuned now, or the defaults), how energy is metered and what a
record adds. Tensor parallel is a subclass in the TP wing (gpu/tp/context.py TpContext) that answers the same
questions for a group of ranks, so the commands never ask which one they hold; gpu/tp/context.py `open_context`
makes either.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ..gpu.device import compute_capability, gpu_info
from ..gpu.engine import Engine, pdl_default
from ..gpu.ops import kernel_lib
from ..store.checkpoint import Checkpoint
from . import tune
from .decode import benchmark, energy_passes
from .peers import measure_peers
from .prefill_profile import prefill_fields, prefill_table
from .profile import attention_table, marginal_table, profile_step, profile_table


@dataclass
class RunContext:
    model: str                     # MODEL as the user named it (the record's name)
    model_dir: Path | None         # the checkpoint; None where the weights are generated on the GPUs
    source: str                    # the record's source label (store/listing.py source_label)
    weight_source: object = None   # what the engine loads instead of model_dir (gpu/synthetic.py GpuSynthetic)
    group: object = None           # tensor parallel: this rank's gpu/tp/group.py Group
    allreduce: str | None = None   # tensor parallel: the sums' path (peer, nccl, auto)
    forms: dict | None = None      # the forms of the last engine made and where they came from
    load_seconds: float = 0.0      # how long the last engine took to load and build (tuning not included)

    @property
    def writes(self) -> bool:
        """Whether this process writes the records (one GPU: yes; a group: rank 0)."""
        return True

    def close(self) -> None:
        """Nothing to release on one GPU."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- the engine ------------------------------------------------------------------------------------------
    def engine(self, weights: str, max_seq: int, given=None, retune: bool = False, tune_missing: bool = True,
               progress=None) -> Engine:
        """The engine of this run, its steps built once from forms resolved before it is made (tune.choose: given,
        else a saved tune of this GPU, shape, format, max_seq and source); with no saved tune, `tune_missing` tunes
        now (the engine built with the defaults, then the winner), else the defaults. `self.forms` says which."""
        ckpt = self.weight_source if self.weight_source is not None else Checkpoint(self.model_dir)
        lib = kernel_lib()
        key = tune.key_of(gpu_info()["name"], ckpt.config, weights, lib.defines, pdl_default(compute_capability()))
        forms, self.forms = tune.choose(key, max_seq, given, retune=retune, nearest=not tune_missing)
        t0 = time.perf_counter()
        eng = Engine(None, weights=weights, max_seq=max_seq, forms=forms, progress=progress, source=ckpt, lib=lib)
        self.load_seconds = time.perf_counter() - t0
        if forms is None:
            self.forms = (tune.tune_and_save(eng, progress=progress) if tune_missing
                          else {"forms": eng.forms.text, "origin": "default"})
        return eng

    def describe(self, eng, info: dict) -> None:
        """What `validate` adds to its backend's description: nothing on one GPU."""

    def whole_logits(self, eng, logits):
        """The logits over the whole vocabulary from this process's share: all of them on one GPU."""
        return logits

    def measure(self, weights: str, context: int, tokens: int, repeats: int, *, forms=None, retune: bool = False,
                progress=None, peers: bool = False, baselines_dir=None) -> tuple[dict, list | None]:
        """`run`'s measurement (decode.benchmark) and, with `peers`, the HF transformers peers on the same weights:
        (the record, the peers' records or None). A sweep cell is this."""
        rec = benchmark(self, weights, context, tokens, repeats, progress=progress, forms=forms, retune=retune)
        return rec, (measure_peers(self.model_dir, context=context, tokens=tokens, repeats=min(repeats, 3),
                                   weights="fp16") if peers else None)

    # ---- what a measurement adds -------------------------------------------------------------------------------
    def energy(self, eng, prompt, tokens: int, meter, tpot_ms: float) -> dict:
        """Joules per token of the graph replays (decode.energy_passes)."""
        return energy_passes(eng, prompt, tokens, meter)

    def figures(self, eng, copy: dict, tpot: dict, nbytes: dict, context: int) -> dict:
        """What the run record adds beyond decode.benchmark's fields: nothing on one GPU."""
        return {}

    def profile(self, eng, context: int, steps: int, prompt_tokens: int | None = None) -> tuple[dict, list]:
        """`profile`: (the record's figures, the tables): the step taken apart kernel by kernel and role by role, and
        the last prefill chunk of a prompt of `prompt_tokens` (default `context`) op by op (prefill_profile.py)."""
        p = profile_step(eng, context, steps)
        p["forms_origin"] = self.forms["origin"]
        p.update(prefill_fields(eng, prompt_tokens or context, p["copy_bandwidth_gbs"]["median"]))
        return p, [profile_table(p), marginal_table(p), attention_table(p), prefill_table(p)]
