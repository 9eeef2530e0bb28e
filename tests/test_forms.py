"""Launch forms (gpu/forms.py), the interleaved timing that picks them (measure.timing.fastest, scripted timers) and\nthe saved choices of `tune` (CPU)."""
from __future__ import annotations

import pytest

from atomflow_bench.measure.timing import fastest
from atomflow_bench.errors import AtomflowError


def scripted(times: dict):
    """A timer answering each candidate's next scripted time, recording the order it was asked in."""
    order, it = [], {c: iter(v) for c, v in times.items()}

    def time_once(c):
        order.append(c)
        return next(it[c])

    return time_once, order


def test_interleaved_rounds_best_kept():
    # "a" is timed first while the clocks ramp (slow first round), yet it is the faster form
    time_once, order = scripted({"a": [130.0, 100.0, 101.0], "b": [110.0, 109.0, 111.0]})
    best, us = fastest(time_once, ["a", "b"], rounds=3)
    assert best == "a" and us == {"a": 100.0, "b": 109.0}
    assert order == ["a", "b"] * 3  # interleaved, not one candidate after the other


def test_tuple_candidates_and_ties():
    time_once, _ = scripted({("ws", 416): [5.0, 5.0], ("ws", None): [5.0, 6.0], ("ring", 416): [7.0, 4.0]})
    best, us = fastest(time_once, [("ws", 416), ("ws", None), ("ring", 416)], rounds=2)
    assert best == ("ring", 416) and us[("ws", 416)] == us[("ws", None)] == 5.0
    time_once, _ = scripted({"x": [3.0], "y": [3.0]})
    assert fastest(time_once, ["x", "y"], rounds=1)[0] == "x"  # a tie keeps the earlier candidate


@pytest.mark.parametrize("candidates,rounds", [([], 3), (["a"], 0)])
def test_refuses_nothing_to_time(candidates, rounds):
    with pytest.raises(AtomflowError, match="nothing to time"):
        fastest(lambda c: 1.0, candidates, rounds)


def test_gemv_form_text_round_trips():
    from atomflow_bench.gpu.forms import GemvForm

    for text in ("ring/l2=0", "ws/l2=8", "ws-pre2/l2=16", "ws-pre0/l2=24"):
        assert GemvForm.parse(text).text == text
    assert GemvForm.parse("ring") == GemvForm(False, None, 0)  # no /l2=: nothing asked
    assert GemvForm.parse("ws-pre2/l2=8") == GemvForm(True, 2, 8)
    for bad in ("ring/l2=", "ring/l2=x", "ring/l2=-4", "fast", "ws-pre", "ws-prex", "ring+wd", "dyn"):
        with pytest.raises(AtomflowError, match="GEMV form"):
            GemvForm.parse(bad)
    with pytest.raises(AtomflowError, match="ws-pre<N> needs the ws form"):
        GemvForm(False, 2, 0)


def test_o_proj_slots_before_the_wait():
    """/wo-pre=<N>: o_proj's own count of ring slots before its wait (forms.GemvForm.wo_pre), ws only, after /l2=; the other
    roles keep the form's count (None: the format's default)."""
    from atomflow_bench.gpu.forms import GemvForm
    from atomflow_bench.gpu.ops.gemv import GEMV_WS_MAX

    g = GemvForm.parse("ws/l2=16/wo-pre=2")
    assert g == GemvForm(True, None, 16, 2) and g.text == "ws/l2=16/wo-pre=2"
    assert [g.slots_before_wait(r) for r in ("wqkv", "wo", "wgu", "wd")] == [None, 2, None, None]
    h = GemvForm.parse("ws-pre3/l2=8/wo-pre=0")
    assert [h.slots_before_wait(r) for r in ("wqkv", "wo", "wgu", "wd")] == [3, 0, 3, 3]
    assert GemvForm.parse("ws/wo-pre=1") == GemvForm(True, None, 0, 1)  # no /l2=: nothing asked
    assert GemvForm.parse("ws-pre2/l2=8").slots_before_wait("wo") == 2  # without it, o_proj as the rest
    for bad in ("ws/l2=8/wo-pre=", "ws/l2=8/wo-pre=x", "ws/wo-pre=2/l2=8", "ws/l2=8/wo-pre=-1"):
        with pytest.raises(AtomflowError, match="GEMV form"):
            GemvForm.parse(bad)
    for bad in ("ring/l2=8/wo-pre=2", f"ws/l2=8/wo-pre={GEMV_WS_MAX + 1}"):
        with pytest.raises(AtomflowError, match="wo-pre=<N> needs the ws form"):
            GemvForm.parse(bad)


def test_tune_tries_o_proj_counts_for_w8a16_only():
    """forms.candidates: W8A16 on sm_90+ adds ws with o_proj's WO_PRE_TRY counts at every L2 size (it pays on 8B
    W8A16); fp16 (slower with any o_proj count) and sm_89 add none."""
    from atomflow_bench.gpu.forms import L2_TAILS, WO_PRE_TRY, GemvForm, candidates

    fp8 = candidates("fp8", 90, 1)[0]
    assert WO_PRE_TRY["fp8"] and all(GemvForm(True, None, t, n) in fp8 for n in WO_PRE_TRY["fp8"] for t in L2_TAILS)
    assert not any(g.wo_pre is not None for g in candidates("fp16", 90, 1)[0] + candidates("fp8", 89, 1)[0])
    assert len(set(fp8)) == len(fp8)


def test_forms_text_round_trips_and_refuses_nonsense():
    from atomflow_bench.gpu.forms import Forms, GemvForm

    f = Forms.parse("short:ws-pre2/l2=8;split:ring/l2=0")
    assert f == Forms(True, GemvForm(True, 2, 8), GemvForm(False, None, 0)) and Forms.parse(f.text) == f
    tp = Forms.parse("short:ws/l2=16/wo-pre=2;split:ws/l2=16/wo-pre=2")
    assert tp.gemv == tp.gemv_split == GemvForm(True, None, 16, 2) and Forms.parse(tp.text) == tp
    only_split = Forms.parse("split:ring/l2=4")
    assert not only_split.short_attention and only_split.gemv_split == GemvForm(False, None, 4)
    assert Forms.parse(only_split.text) == only_split
    same = Forms.parse("short:ws/l2=8")  # no split entry: the split bucket runs the short bucket's form
    assert same.gemv_split == same.gemv == GemvForm(True, None, 8)
    for bad in ("", "long:ring", "short:ring;short:ws", "ring", "short=ring"):
        with pytest.raises(AtomflowError, match="forms"):
            Forms.parse(bad)


def test_forms_before_sm90_refuse_bulk_copies():
    from atomflow_bench.gpu.forms import Forms

    Forms.parse("short:ring/l2=0").check(89)
    for text in ("short:ws/l2=0", "split:ring/l2=8"):
        with pytest.raises(AtomflowError, match="need sm_90"):
            Forms.parse(text).check(89)
        Forms.parse(text).check(90)


def test_defaults_and_candidates():
    """The defaults (no tune): short attention where it fits; sm_90 fp16 ws, fp8 ring, 8 MB of L2 tail; the ring
    alone before sm_90. The tuner's candidates: 3 GEMV bases (fp16: ws, ws-pre2, ring; fp8: ws, ws with o_proj's
    count, ring) x the L2 sizes, each bucket."""
    from atomflow_bench.gpu.forms import L2_TAILS, GemvForm, candidates, default_forms

    assert default_forms("fp16", 90, 416).text == "short:ws/l2=8;split:ws/l2=8"
    assert default_forms("fp8", 90, 416).text == "short:ring/l2=8;split:ring/l2=8"
    assert default_forms("fp8", 89, 0).text == "split:ring/l2=0"
    gemv, shorts = candidates("fp16", 90, 416)
    assert len(gemv) == 3 * len(L2_TAILS) and len(set(gemv)) == len(gemv) and shorts == [True, False]
    assert GemvForm(True, 2, 0) in gemv and GemvForm(False, None, 24) in gemv and 0 in L2_TAILS
    assert len(candidates("fp8", 90, 416)[0]) == 3 * len(L2_TAILS)
    assert candidates("fp8", 89, 0) == ([GemvForm()], [False])


def test_run_table_explains_the_forms():
    from atomflow_bench.measure.run_record import forms_text

    t = forms_text("short:ws-pre2/l2=8;split:ring/l2=0")
    assert "warp-specialised" in t and "2 ring slots filled before the PDL wait" in t
    assert "the last 8 MB of gate/up's weights" in t and t.endswith("QKV asks L2 for nothing")
    assert forms_text("split:ring/l2=4").startswith("split attention at every length")
    assert "o_proj 2 before its wait" in forms_text("split:ws/l2=16/wo-pre=2")


def test_kernel_defines_name_only_what_the_kernels_read(monkeypatch):
    """Launch policy is a Forms value now: ATOMFLOW_KERNEL_DEFINES takes only the portable forms and instruments."""
    from atomflow_bench.gpu.nvrtc import instrument_defines, parse_defines

    assert parse_defines("ATT_TMA=0 GEMV_BULK=0 AF_NO_WAIT=15 AF_TIMELINE=64") == (
        "ATT_TMA=0", "GEMV_BULK=0", "AF_NO_WAIT=15", "AF_TIMELINE=64")
    for bad in ("GEMV_WS=2", "LMHEAD_L2_KEEP=8", "ATT_TMA", "ATT_TMA=x"):
        with pytest.raises(AtomflowError, match="ATOMFLOW_KERNEL_DEFINES"):
            parse_defines(bad)
    assert instrument_defines(("AF_NO_SCALES=1", "AF_TIMELINE=64", "ATT_TMA=1")) == ["AF_NO_SCALES=1"]


class _Cfg:
    def to_hf_dict(self):
        return {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "tie_word_embeddings": True,
                "rope_theta": 1e4}


class _Engine:
    """What the saved-choice key reads of an engine (CPU: the key and the store, not a GPU result)."""

    def __init__(self, gpu="NVIDIA H100 80GB HBM3", fmt="fp8", max_seq=384):
        self.cfg, self.gpu, self.fmt, self.max_seq = _Cfg(), {"name": gpu}, fmt, max_seq
        self.forms, self.used = None, []

    def use(self, forms):
        self.forms = forms
        self.used.append(forms)


def test_saved_choice_is_keyed_and_read_back(tmp_path, monkeypatch):
    from atomflow_bench.gpu.forms import Forms
    from atomflow_bench.measure import tune

    monkeypatch.setenv("ATOMFLOW_HOME", str(tmp_path))
    monkeypatch.delenv("ATOMFLOW_FORMS", raising=False)
    eng = _Engine()
    assert tune.load(eng) is None
    forms = Forms.parse("short:ring/l2=8;split:ring/l2=0")
    p = tune.save(eng, forms, {"lengths": [192, 384], "step_us": {"short:ring/l2=8": 1450.0}})
    assert p.parent.parent == tmp_path / "tuning" and tune.load(eng) == (forms, p)
    r = tune.resolve(eng)
    assert r["origin"] == "saved" and r["forms"] == forms.text and eng.forms == forms
    # a different GPU, format, max_seq or source names another key
    for other in (_Engine(gpu="NVIDIA H200"), _Engine(fmt="fp16"), _Engine(max_seq=2176)):
        assert tune.path_of(tune.key(other), other.max_seq) != p and tune.load(other) is None
    other_build = _Engine()
    other_build.lib = type("Lib", (), {"defines": ("AF_NO_WAIT=15",)})()
    assert tune.load(other_build) is None  # an instrumented build is another key
    # validate / generate / profile (tune_missing=False) reuse the same key's tune at the nearest max_seq
    longer = _Engine(max_seq=2176)
    assert tune.load(longer, nearest=True) == (forms, p)
    assert tune.resolve(longer, tune_missing=False)["origin"] == "saved"
    monkeypatch.setattr("atomflow_bench.measure.run_record.source_sha256", lambda: "0" * 16)
    assert tune.load(_Engine()) is None
    # a given form wins, and validate/generate (tune_missing=False) get the defaults without timing
    given = Forms.parse("split:ring/l2=0")
    assert tune.resolve(eng, given)["origin"] == "given" and eng.forms == given
    fresh = _Engine(fmt="fp16")
    fresh.forms = Forms.parse("short:ws/l2=8")
    assert tune.resolve(fresh, tune_missing=False) == {"forms": "short:ws/l2=8;split:ws/l2=8", "origin": "default"}
    monkeypatch.setenv("ATOMFLOW_FORMS", "split:ring/l2=4")
    assert tune.resolve(fresh, tune_missing=False)["origin"] == "given"


def test_unreadable_saved_choice_is_tuned_again(tmp_path, monkeypatch):
    from atomflow_bench.measure import tune

    monkeypatch.setenv("ATOMFLOW_HOME", str(tmp_path))
    eng = _Engine()
    p = tune.path_of(tune.key(eng), eng.max_seq)
    p.parent.mkdir(parents=True)
    p.write_text("{not json")
    assert tune.load(eng) is None
