"""The run context of a tensor-parallel rank, and `open_context`, the one place a command gets its run context.

`open_context(model, tp, ...)`: for one GPU a measure/context.py RunContext; for `--tp N` in the process the user
started, the ranks are started (group.launch: this command line again, one process per GPU) and the process exits
with their code; in a rank (started so, or by a launcher that set RANK / WORLD_SIZE) the rank joins the group and
gets a TpContext: the same questions answered for a group (forms never tuned, energy summed over the GPUs, the
record's `tp` figures, `profile`'s exchanges), so `run`, `profile`, `validate` and `sweep` never branch on it.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ...config import CATALOG
from ...errors import AtomflowError, FetchError
from ...measure.context import RunContext
from ...measure.decode import synthetic_prompt
from ...measure.prefill_profile import prefill_fields, prefill_table
from ...measure.profile import marginal_table
from ...measure.run_record import load
from ...store.fetch import fetch_model, resolve_model
from ...store.listing import source_label
from ..device import require_gpu
from ..engine import Engine
from ..synthetic import GpuSynthetic
from .figures import choose_forms, default_origin, tp_energy, tp_measure, tp_profile, tp_profile_table
from .group import Group, joined, launch


class TpContext(RunContext):
    """One rank of a group: every rank makes the same calls in the same order (the sums are inside the step)."""

    _engines: tuple = ()  # the engines this rank made (release_engines)

    @property
    def writes(self) -> bool:
        return self.group.rank == 0

    def close(self) -> None:
        self.release_engines()
        self.group.close()

    def __exit__(self, exc_type, *exc):
        self.release_engines()
        self.group.close(ok=exc_type is None)  # a failing rank does not wait in a barrier its peers never reach

    def release_engines(self) -> None:
        """The graphs of every engine this rank made, released before the communicator they captured work of."""
        for eng in self._engines:
            eng.close()

    def engine(self, weights: str, max_seq: int, given=None, retune: bool = False, tune_missing: bool = True,
               progress=None) -> Engine:
        """The rank's engine, built once: with the given forms, else the tensor-parallel defaults (never tuned: each
        rank would time its own candidates and could choose differently)."""
        forms, self.forms = choose_forms(given)
        t0 = time.perf_counter()
        eng = Engine(self.model_dir, weights=weights, max_seq=max_seq, forms=forms, progress=progress,
                     group=self.group, allreduce=self.allreduce, source=self.weight_source)
        self.load_seconds = time.perf_counter() - t0
        self.forms = self.forms or default_origin(eng)
        self._engines = (*self._engines, eng)
        return eng

    def describe(self, eng, info: dict) -> None:
        info["tp"] = {"n": self.group.size, "allreduce": eng.tp.path, "peer_reason": eng.tp.peer_reason}
        info["label"] += f", tensor parallel over {self.group.size} GPUs (sums: {eng.tp.path})"

    def whole_logits(self, eng, logits):
        """Every rank's vocabulary rows, in rank order (a collective: every rank calls it)."""
        return eng.tp.gather_vocab(logits, eng.cfg.vocab_size)

    def energy(self, eng, prompt, tokens: int, meter, tpot_ms: float) -> dict:
        return tp_energy(eng, prompt, tokens, meter, tpot_ms)

    def figures(self, eng, copy: dict, tpot: dict, nbytes: dict, context: int) -> dict:
        tp = tp_measure(eng, copy, tpot, nbytes, context)
        return {"tp": tp, "roofline": tp["roofline"]}

    def profile(self, eng, context: int, steps: int, prompt_tokens: int | None = None) -> tuple[dict, list]:
        """The step's graph time and its exchanges at `context` (figures.tp_profile), what each role adds, and the
        prefill's breakdown where the engine prefills (else `prefill` None and the note why)."""
        eng.start(synthetic_prompt(eng.cfg.vocab_size, context), upto=context - 1)
        p = {"tp": self.group.size, "context": context, "forms": self.forms, "source": self.source,
             **tp_profile(eng)}
        p.update(prefill_fields(eng, prompt_tokens or context))
        return p, [tp_profile_table(p, eng), marginal_table(p), prefill_table(p)]


def rank_weights(model: str, notes) -> tuple:
    """A rank's weights: the store's checkpoint when the model is there (sharded at load), else a catalog model with
    a synthetic source generated on the GPUs. (model_dir, weight source, source label)."""
    try:
        path = resolve_model(model, console=notes, fetch_if_missing=False)
        return path, None, source_label(path)
    except FetchError:
        preset = CATALOG.get(model)
        if preset is None or "synthetic" not in preset.sources:
            raise AtomflowError(f"{model}: not in the store; run `atomflow-bench fetch {model}` first (tensor-parallel "
                                "ranks generate weights on the GPUs only for the catalog's synthetic models)") from None
        return None, GpuSynthetic(preset.config), "synthetic-gpu"


def open_context(model: str, tp: int = 1, allreduce: str = "auto", *, notes=None, argv: list[str] = (),
                 source: str | None = None, before_launch=None, tp_timeout: float | None = None) -> RunContext:
    """The run context of a command on `model`: one GPU (the model resolved, fetched from `source` if given or
    missing), or a rank of `tp` (see the module docstring; `before_launch` runs once in the launching process before
    the ranks start, e.g. the fetch or the ground truth every rank reads). `tp_timeout`: a rank's bound on the
    rendezvous (None: ATOMFLOW_TP_TIMEOUT); the ranks this process starts get it in `argv`, their command line."""
    if tp == 1:
        path = fetch_model(model, source=source, console=notes) if source else resolve_model(model, console=notes)
        return RunContext(model, path, source_label(path))
    if not joined():
        cupy = require_gpu()
        if before_launch is not None:
            before_launch()
        sys.exit(launch(tp, list(argv), cupy.cuda.runtime.getDeviceCount()))
    group = Group(tp, timeout=tp_timeout)
    try:
        path, weight_source, label = rank_weights(model, notes)
    except BaseException:
        group.close(ok=False)
        raise
    return TpContext(model, path, label, weight_source=weight_source, group=group, allreduce=allreduce)


class RanksRun:
    """A sweep cell of tp > 1 seen from the sweep's process: `atomflow-bench run --tp N` as a command of its own (it
    starts its ranks), its record read back; the same `measure` as a RunContext."""

    def __init__(self, model: str, tp: int, source: str | None = None, tp_timeout: float | None = None):
        self.model, self.tp, self.source, self.tp_timeout = model, tp, source, tp_timeout

    def measure(self, weights: str, context: int, tokens: int, repeats: int, *, forms=None, retune: bool = False,
                progress=None, peers: bool = False, baselines_dir=None) -> tuple[dict, None]:
        if peers:
            raise AtomflowError("--peers runs on one GPU: not with tp > 1")
        with tempfile.TemporaryDirectory(prefix="atomflow-sweep-") as d:
            out = Path(d) / "run.json"
            argv = [sys.executable, "-m", "atomflow_bench.cli", "run", str(self.model), "--weights", weights,
                    "--ctx", str(context), "--tokens", str(tokens), "--repeats", str(repeats), "--tp", str(self.tp),
                    "--json", str(out), "--format", "json"]
            argv += ["--forms", forms.text] if forms is not None else []
            argv += ["--source", self.source] if self.source else []
            argv += ["--baselines", str(baselines_dir)] if baselines_dir else []
            argv += ["--tp-timeout", repr(self.tp_timeout)] if self.tp_timeout is not None else []
            p = subprocess.run(argv, capture_output=True, text=True)
            if p.returncode != 0 or not out.is_file():
                last = [ln for ln in p.stderr.splitlines() if ln.strip()][-1:] or [f"exit {p.returncode}"]
                raise AtomflowError(f"run --tp {self.tp}: {last[0]}")
            return load(out), None


def open_cell(model: str, tp: int = 1, *, source: str | None = None, notes=None, tp_timeout: float | None = None):
    """A sweep cell's run context: one GPU (as open_context), or for tp > 1 a RanksRun (its ranks get `tp_timeout`)."""
    return open_context(model, source=source, notes=notes) if tp == 1 else RanksRun(model, tp, source, tp_timeout)
