"""The timeline instrument's analysis (CPU): records of one replay -> per-launch times -> per-role summary."""
from __future__ import annotations

import numpy as np
import pytest

from atomflow_bench.errors import AtomflowError
from lab.timeline import (
    MARKS,
    check_blocks,
    granularity_ns,
    launch_times,
    relative,
    summarize_roles,
)


def records(launches, rng):
    """launches: [(grid id, [(start, wait, end, *marks) per block])] -> shuffled [N, 4 + MARKS] uint64 rows (ns +
    a base; a wait or mark of 0 stays 0 = not reached)."""
    base = 10**12 + int(rng.integers(0, 10**6))
    at = lambda v: base + v if v else 0
    rows = [(g, base + b[0], at(b[1]), base + b[2], *[at(m) for m in (tuple(b[3:]) + (0,) * MARKS)[:MARKS]])
            for g, blocks in launches for b in blocks]
    rows = np.array(rows, dtype=np.uint64)
    return rows[rng.permutation(len(rows))]


def test_launch_times_and_spans():
    rng = np.random.default_rng()
    step = [(40, [(0, 0, 1000), (100, 0, 1200)]),                         # no PDL wait recorded
            (41, [(900, 1500, 3000), (950, 1400, 3500), (2000, 2100, 3100)]),  # started before 40 ended
            (47, [(3600, 3700, 4000)])]
    t = launch_times(records(step, rng), [2, 3, 1])
    np.testing.assert_allclose(t[0, :4], [0, np.nan, 1100, 1200])
    np.testing.assert_allclose(t[1, :4], [900, 1400, 3100, 3500])
    np.testing.assert_allclose(t[2, :4], [3600, 3700, 4000, 4000])
    assert np.isnan(t[:, 4:]).all()  # no marks recorded
    rel = relative(t)
    # start, release, span, tail relative to the predecessor's last end (first launch: its own start)
    np.testing.assert_allclose(rel[1, :4], [900 - 1200, 1400 - 1200, 3500 - 1200, 3500 - 3100])
    np.testing.assert_allclose(rel[2, :4], [100, 200, 500, 0])
    assert rel[:, 2].sum() == t[-1, 3] - t[0, 0]  # the spans add up to the replay


def test_launch_times_refuses_a_wrong_mapping():
    rng = np.random.default_rng()
    step = [(5, [(0, 0, 10)]), (6, [(5, 6, 20), (7, 8, 30)])]
    with pytest.raises(AtomflowError, match="expected the step's 2 launches"):
        launch_times(records(step, rng), [2, 1])
    with pytest.raises(AtomflowError, match="3 launches"):
        launch_times(records(step, rng), [1, 2, 1])


def test_check_blocks_wants_each_block_of_each_grid_once():
    rng = np.random.default_rng()
    grids = [(3,), (2, 4)]  # launch order = grid id order
    blocks = [(0, x, 0, 0) for x in range(3)] + [(1, x, y, 0) for x in range(2) for y in range(4)]
    order = rng.permutation(len(blocks))
    rec = np.array([(g + 7, 1, 2, 3) + (0,) * MARKS for g, *_ in blocks], np.uint64)[order]
    idx = np.array([b[1:] for b in blocks], np.int64)[order]
    check_blocks(rec, idx, grids)
    twice = idx.copy()
    twice[np.flatnonzero(rec[:, 0] == 8)[:2]] = (1, 3, 0)  # two records of block (1, 3) of the second launch
    with pytest.raises(AtomflowError, match=r"launch 1 \(grid \(2, 4\)\)"):
        check_blocks(rec, twice, grids)
    outside = idx.copy()
    outside[np.flatnonzero(rec[:, 0] == 7)[0]] = (3, 0, 0)  # x past the first grid
    with pytest.raises(AtomflowError, match="launch 0"):
        check_blocks(rec, outside, grids)
    with pytest.raises(AtomflowError, match="3 launches"):
        check_blocks(rec, idx, grids + [(1,)])


def test_summarize_roles_and_granularity():
    rng = np.random.default_rng()
    roles = ["embed", "qkv", "att", "qkv", "att"]
    nbytes = [0, 3000, 10, 3000, 10]
    rels = []
    for _ in range(3):
        r = np.zeros((5, 4))
        r[:, 2] = [500, 2000 + rng.integers(0, 50), 1000, 2100, 900]  # spans, ns
        r[:, 1] = [np.nan, 300, 400, 350, 450]
        r[:, 3] = [0, 100, 50, 100, 50]
        rels.append(r)
    s = summarize_roles(rels, roles, nbytes, bw_gbs=3.0)  # 3 GB/s: 1 byte = 1/3 ns
    by = {r["role"]: r for r in s["rows"]}
    assert by["qkv"]["count"] == 2 and by["att"]["us_per_step"] == pytest.approx(1.9)
    assert by["qkv"]["floor_us"] == pytest.approx(1.0)  # 3000 bytes at 3 GB/s per launch
    assert by["embed"]["release_us"] is None and by["att"]["release_us"] == pytest.approx(0.425)
    assert sum(r["us_per_step"] for r in s["rows"]) == pytest.approx(s["step_us"]["median"], abs=0.06)
    assert sum(r["pct_of_step"] for r in s["rows"]) == pytest.approx(100, abs=2)
    rec = records([(1, [(0, 0, 64), (32, 0, 96)])], rng)
    assert granularity_ns(rec) == 32


def test_marks_are_per_block_from_its_own_wait():
    rng = np.random.default_rng()
    # mark 0 reached by every block, mark 2 by one (the others stop earlier), marks 1 and 3 by none;
    # a block that never waited does not count
    step = [(3, [(0, 100, 900, 300), (10, 200, 1000, 600, 0, 900), (20, 0, 50, 40)])]
    t = launch_times(records(step, rng), [3])
    np.testing.assert_allclose(t[0, 4:4 + MARKS], [300, np.nan, 700, np.nan])  # median(200, 400); 900 - 200
    rel = relative(t)
    np.testing.assert_allclose(rel[0, 4:], t[0, 4:])
    s = summarize_roles([rel, rel], ["x"], [0], bw_gbs=1.0)
    assert s["rows"][0]["marks_us"] == [pytest.approx(0.3), None, pytest.approx(0.7), None]
