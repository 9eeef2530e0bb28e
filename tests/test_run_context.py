"""The run context (CPU): forms resolved before the engine is made, so a run with given or saved forms builds its steps
once; the tensor-parallel context's forms; the one reader of a manifest's source. The engine is a stand-in that
records how it was made (the GPU tests build real ones)."""
from __future__ import annotations

import json

import pytest

from atomflow_bench.config import get_preset
from atomflow_bench.gpu.forms import Forms
from atomflow_bench.measure import context as context_mod
from atomflow_bench.measure import tune
from atomflow_bench.measure.context import RunContext
from atomflow_bench.store.listing import manifest_source, source_label

CFG = get_preset("llama-3.2-1b").config
GPU = "NVIDIA H100 80GB HBM3"
SAVED = Forms.parse("short:ring/l2=8;split:ring/l2=0")


class _Engine:
    """Made once per test through RunContext.engine; counts the builds (`use` after the constructor's)."""
    made: list = []

    def __init__(self, model_dir, weights, max_seq, forms=None, progress=None, source=None, lib=None, **k):
        self.cfg, self.fmt, self.max_seq, self.gpu, self.lib, self.pdl = CFG, weights, max_seq, {"name": GPU}, lib, True
        self.forms = forms or Forms.parse("short:ws/l2=8")  # the engine's own defaults when none are passed
        self.builds = 1
        _Engine.made.append(self)

    def use(self, forms):
        self.forms = forms
        self.builds += 1


@pytest.fixture
def ctx(monkeypatch, tmp_path):
    monkeypatch.setenv("ATOMFLOW_HOME", str(tmp_path))
    monkeypatch.delenv("ATOMFLOW_FORMS", raising=False)
    monkeypatch.setattr(context_mod, "Engine", _Engine)
    monkeypatch.setattr(context_mod, "Checkpoint", lambda d: type("Ckpt", (), {"config": CFG, "dir": d})())
    monkeypatch.setattr(context_mod, "kernel_lib", lambda: type("Lib", (), {"defines": ("ATT_TMA=1",)})())
    monkeypatch.setattr(context_mod, "gpu_info", lambda: {"name": GPU})
    monkeypatch.setattr(context_mod, "compute_capability", lambda: 90)
    monkeypatch.setattr("atomflow_bench.measure.run_record.source_sha256", lambda: "0" * 16)
    _Engine.made = []
    return RunContext("llama-3.2-1b", tmp_path / "model", "synthetic")


def _save(max_seq: int):
    key = tune.key_of(GPU, CFG, "fp8", ("ATT_TMA=1",), True)
    p = tune.path_of(key, max_seq)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"schema": tune.SCHEMA, "forms": SAVED.text}))
    return p


def test_a_saved_tune_is_found_without_an_engine(ctx):
    key = tune.key_of(GPU, CFG, "fp8", ("ATT_TMA=1",), True)
    assert tune.choose(key, 384) == (None, None)
    p = _save(384)
    assert tune.choose(key, 384) == (SAVED, {"forms": SAVED.text, "origin": "saved", "path": str(p)})
    assert tune.choose(key, 512) == (None, None)  # another max_seq: `run` tunes for its own
    assert tune.choose(key, 512, nearest=True)[0] == SAVED  # validate / profile take the nearest
    assert tune.choose(key, 384, retune=True) == (None, None)
    given = Forms.parse("split:ring/l2=0")
    assert tune.choose(key, 384, given) == (given, {"forms": given.text, "origin": "given"})
    other = tune.key_of(GPU, CFG, "fp16", ("ATT_TMA=1",), True)
    assert tune.choose(other, 384) == (None, None)


def test_the_engine_is_built_once_with_saved_or_given_forms(ctx):
    p = _save(384)
    eng = ctx.engine("fp8", 384)
    assert eng.forms == SAVED and eng.builds == 1 and ctx.forms == {"forms": SAVED.text, "origin": "saved",
                                                                    "path": str(p)}
    given = Forms.parse("split:ring/l2=0")
    eng = ctx.engine("fp8", 384, given=given)
    assert eng.forms == given and eng.builds == 1 and ctx.forms["origin"] == "given"
    assert len(_Engine.made) == 2


def test_without_a_saved_tune_the_defaults_or_a_tune_now(ctx, monkeypatch):
    eng = ctx.engine("fp8", 384, tune_missing=False)
    assert eng.builds == 1 and ctx.forms == {"forms": "short:ws/l2=8;split:ws/l2=8", "origin": "default"}
    monkeypatch.setattr(tune, "tune", lambda engine, progress=None: (SAVED, {"step_us": {}}))
    eng = ctx.engine("fp8", 384)
    assert eng.forms == SAVED and ctx.forms["origin"] == "tuned now" and tune.choose(
        tune.key(eng), 384)[0] == SAVED  # saved where the next run finds it before building


def test_tensor_parallel_forms_are_given_or_the_defaults(monkeypatch):
    from atomflow_bench.gpu.tp.figures import choose_forms, default_origin

    monkeypatch.delenv("ATOMFLOW_FORMS", raising=False)
    assert choose_forms(None) == (None, None)
    assert choose_forms(SAVED) == (SAVED, {"forms": SAVED.text, "origin": "given"})
    monkeypatch.setenv("ATOMFLOW_FORMS", "split:ring/l2=0")
    assert choose_forms(None)[1]["origin"] == "given"
    eng = type("E", (), {"forms": SAVED})()
    assert default_origin(eng) == {"forms": SAVED.text, "origin": "default (tensor parallel: not tuned)"}


def test_one_reader_of_a_manifest_source(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    assert manifest_source(d) == ("no manifest", "") and source_label(d) == "local"
    (d / "manifest.json").write_text(json.dumps({"model": "acme/x", "source": {"kind": "hf"}}))
    assert manifest_source(d) == ("hf", "acme/x") and source_label(d) == "hf"
    (d / "manifest.json").write_text(json.dumps({"model": "acme/x"}))
    assert source_label(d) == "unknown"
    (d / "manifest.json").write_text("{not json")
    assert manifest_source(d) == ("unreadable manifest", "")
