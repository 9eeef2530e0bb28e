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
