"""The engine's measured choice between step forms (engine.fastest), with a scripted timer (CPU)."""
from __future__ import annotations

import pytest

from atomflow_bench.engine import fastest
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


def test_l2_suffix_and_forms():
    """A layer-GEMV form may carry the L2 prefetch size the engine measured ("/l2=<MB>", PERF_NOTES v30.4): the base
    form parses as before, the size separately; a malformed size or form is refused with the form named."""
    from atomflow_bench.engine import gemv_form, l2_suffix

    assert l2_suffix("ring") == ("ring", None)
    assert l2_suffix("ring/l2=8") == ("ring", 8) and l2_suffix("ws-pre2/l2=0") == ("ws-pre2", 0)
    assert gemv_form("ws-pre2/l2=16") == gemv_form("ws-pre2") == (True, 2, (), ())
    assert gemv_form("ring+wd/l2=4") == (False, None, ("wd",), ())
    for bad in ("ring/l2=", "ring/l2=x", "ring/l2=-4"):
        with pytest.raises(AtomflowError, match="integer MB"):
            l2_suffix(bad)
    with pytest.raises(AtomflowError, match="gemv must be"):
        gemv_form("fast/l2=8")


def test_l2_tails_only_when_asked():
    """The engine times the gate/up tail sizes only with GEMV_NEXT_L2=1 and GEMV_NEXT_L2_TAIL=-1 (the defaults since
    v31); a fixed size or the prefetch off leaves the forms alone."""
    from atomflow_bench.step import GEMV_NEXT_L2_TRY, l2_tails

    assert l2_tails(()) == l2_tails(("GEMV_NEXT_L2=1",)) == GEMV_NEXT_L2_TRY
    assert l2_tails(("GEMV_NEXT_L2=0",)) == l2_tails(("GEMV_NEXT_L2_TAIL=0",)) == ()
    assert l2_tails(("GEMV_NEXT_L2=1", "GEMV_NEXT_L2_TAIL=8")) == ()
    assert l2_tails(("GEMV_NEXT_L2=2", "GEMV_NEXT_L2_TAIL=-1")) == ()
    assert l2_tails(("GEMV_NEXT_L2=1", "GEMV_NEXT_L2_TAIL=-1")) == GEMV_NEXT_L2_TRY
    assert 0 in GEMV_NEXT_L2_TRY  # "ask nothing" is always a candidate


def test_run_table_names_the_l2_size():
    from atomflow_bench.report import gemv_form_text

    assert gemv_form_text("ring/l2=8").endswith("; QKV asks L2 for the last 8 MB of gate/up's weights")
    assert gemv_form_text("ring/l2=8").startswith(gemv_form_text("ring"))
    assert gemv_form_text("ws-pre2/l2=0").endswith("QKV asks L2 for nothing")


def test_dyn_forms():
    """The DYN layer GEMVs as engine forms (PERF_NOTES v33): "dyn"/"dyn-pre<N>" every role, "+dyn:<role>" entries some
    roles of another form; a role named twice, an unknown role or ws roles beside a ws/dyn base are refused."""
    from atomflow_bench.engine import gemv_form
    from atomflow_bench.step import GEMV_ROLES

    assert gemv_form("dyn") == (True, None, (), GEMV_ROLES)
    assert gemv_form("dyn-pre2/l2=8") == (True, 2, (), GEMV_ROLES)
    assert gemv_form("ring+dyn:wgu") == (False, None, (), ("wgu",))
    assert gemv_form("ring+wd+dyn:wgu+dyn:wo") == (False, None, ("wd",), ("wgu", "wo"))
    assert gemv_form("ws-pre3+dyn:wd") == (True, 3, (), ("wd",))
    for bad in ("dyn+wd", "dyn+dyn:wd", "dyn-pre", "dyn-prex", "ring+dyn:wgu+dyn:wgu", "ring+wd+dyn:wd",
                "ring+dyn:wx", "ws+wd", "dynx"):
        with pytest.raises(AtomflowError, match="gemv must be"):
            gemv_form(bad)


@pytest.mark.parametrize("defines,gpu,message", [
    (("LMHEAD_L2_KEEP=-1",), {"name": "H100", "l2_persist_max_bytes": 32768000}, "LMHEAD_L2_KEEP=-1: must be >= 0"),
    (("LMHEAD_L2_KEEP=8",), {"name": "Old GPU", "l2_persist_max_bytes": 0}, "Old GPU has no persisting L2 set-aside")])
def test_l2_keep_refuses_bad_input_before_touching_the_device(defines, gpu, message):
    """LMHEAD_L2_KEEP (PERF_NOTES v35): a negative size, or a size on a GPU without a persisting set-aside, is a
    one-line error raised before any CUDA call (these run without a GPU)."""
    from atomflow_bench.engine import l2_keep
    from atomflow_bench.errors import AtomflowError

    with pytest.raises(AtomflowError, match=message):
        l2_keep(defines, gpu)
