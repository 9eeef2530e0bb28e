"""The persistent decode step (gpu/ops/persist.py, kernels_cu/decode_persist.cu) on the GPU.

* the scheduler: every op runs once on the blocks it should (every block, the attention on the last n_att), each op
  starts only after every block it depends on has ended it (a global sequence stamped at each op's start and end),
  the counters are back at zero after every launch, graph replays included;
* results: the same device functions as the warp-specialised form, so tokens, logits and every probe equal the `ws`
  form's bit for bit (graph and eager, buffers poisoned before each step), deterministic across replays;
* against the NumPy reference (tiny tied/untied, both formats; the synthetic Llama-3.2-1B shape), as the graph form is.
"""
from __future__ import annotations

import numpy as np
import pytest

from atomflow_bench.errors import AtomflowError
from atomflow_bench.gpu.device import smem_limits
from atomflow_bench.gpu.engine import Engine
from atomflow_bench.gpu.forms import Forms
from atomflow_bench.gpu.graph import StepGraph
from atomflow_bench.gpu.ops import persist

from test_engine_gpu import (LLAMA1B_LENGTHS, _references, assert_matches_reference, device_cc,  # noqa: F401
                             llama1b_in_background, tiny_dir, tiny_model)  # noqa: F811

pytestmark = pytest.mark.gpu

PERSIST = Forms.parse("short:persist;split:ws")
WS = Forms.parse("short:ws;split:ws")
ACTIVATIONS = ("h", "qkv", "attn_out", "act", "xnorm", "logits")


@pytest.fixture(autouse=True)
def needs_sm90():
    if device_cc() < 90:
        pytest.skip("the persistent step needs sm_90+ (bulk copies)")


def poison(eng) -> None:
    """NaN into every activation buffer: a value the step does not write stays NaN and shows."""
    for name in ACTIVATIONS:
        eng.arena[name].fill(np.nan)


def prompt_of(eng, n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, eng.cfg.vocab_size, n)]


def test_forms_refuse_persist_outside_the_short_bucket():
    with pytest.raises(AtomflowError, match="short bucket"):
        Forms.parse("split:persist")
    with pytest.raises(AtomflowError, match="short bucket"):
        Forms.parse("short:persist")
    assert PERSIST.text == "short:persist;split:ws/l2=0"


def trace_of(eng, n_sm: int, replays: int = 1):
    """Run the whole persistent step `replays` times with a trace; (the trace of the last, the counters after)."""
    import cupy as cp

    cfg, a = eng.layer_cfg, eng.arena
    total = persist.n_ops(cfg)
    trace = cp.zeros(1 + 2 * total * n_sm, dtype=cp.uint32)
    ln = persist.persist_launch(eng.lib, a, cfg, eng.fmt, n_sm, taps={}, trace=trace)
    with eng.stream:
        for _ in range(replays):
            trace.fill(0)
            ln()
    eng.stream.synchronize()
    return trace.get()[1:].reshape(total, n_sm, 2), a["ps_counters"].get()


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_every_op_once_in_dependency_order(tiny_model, fmt):
    eng = Engine(tiny_model, weights=fmt, max_seq=64, forms=PERSIST)
    eng.reset(prompt_of(eng, 9))
    n_sm = eng.gpu["sms"]
    cfg = eng.layer_cfg
    n_att = cfg.num_key_value_heads
    stamps, counters = trace_of(eng, n_sm, replays=3)
    assert not counters.any(), f"counters left after the launch: {counters}"
    att_blocks = set(range(n_sm - n_att, n_sm))
    for o, name in enumerate(persist.op_names(cfg)):
        ran = {b for b in range(n_sm) if stamps[o, b, 0]}
        assert ran == (att_blocks if name.endswith("attention") else set(range(n_sm))), name
        assert all(stamps[o, b, 1] > stamps[o, b, 0] for b in ran), name
        if o == 0:
            continue
        dep = stamps[o - 1][[b for b in range(n_sm) if stamps[o - 1, b, 1]]]
        start = min(stamps[o, b, 0] for b in ran)
        assert start > dep[:, 1].max(), f"{name} started before {persist.op_names(cfg)[o - 1]} ended everywhere"
    # the stamps are a permutation of 1..2 * runs: every op start and end counted once
    s = stamps[stamps > 0]
    assert sorted(s) == list(range(1, s.size + 1))


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_same_bits_as_the_ws_form(tiny_model, fmt):
    """Tokens and logits of the persistent step equal the ws form's bit for bit (graph and eager, with poisoned
    buffers), and every probe of the one-op-per-launch steps equals the ws form's probes."""
    ws = Engine(tiny_model, weights=fmt, max_seq=96, forms=WS)
    ps = Engine(tiny_model, weights=fmt, max_seq=96, forms=PERSIST)
    assert [ln.name for ln in ps.variants[ps.short_capacity]] == ["decode_persist", "gemv_fp16_f32_argmax"]
    prompt = prompt_of(ws, 30, seed=1)
    for eng in (ws, ps):
        poison(eng)
    want = ws.generate(prompt, 40)
    want_logits = ws.arena["logits"].get()
    for graph in (True, False):
        poison(ps)
        assert ps.generate(prompt, 40, graph=graph) == want, f"graph={graph}"
        np.testing.assert_array_equal(ps.arena["logits"].get(), want_logits)
        for name in ("h", "qkv", "attn_out", "act"):
            assert not np.isnan(ps.arena[name].get()).any(), f"{name} not overwritten"
    # probes, teacher-forced over the same tokens
    seq = prompt + want
    for eng in (ws, ps):
        eng.reset(seq)
        poison(eng)
    for i in range(12):
        a, b = ws.step_eager(taps=True), ps.step_eager(taps=True)
        assert set(a) == set(b)
        for name in a:
            np.testing.assert_array_equal(b[name], a[name], err_msg=f"step {i} {name}")


def test_persist_after_other_forms(tiny_model):
    """An engine built with other forms runs the persistent step once `use` (or `tune`) builds it: the layer table is
    filled when the weights are loaded, whatever the forms."""
    eng = Engine(tiny_model, weights="fp8", max_seq=64)
    assert not eng.forms.gemv.persist
    prompt = prompt_of(eng, 10, seed=4)
    want = eng.generate(prompt, 12)
    eng.use(PERSIST)
    assert eng.generate(prompt, 12) == want


def test_replays_are_deterministic(tiny_model):
    eng = Engine(tiny_model, weights="fp8", max_seq=64, forms=PERSIST)
    prompt = prompt_of(eng, 12, seed=2)
    first = eng.generate(prompt, 20)
    logits = eng.arena["logits"].get()
    for _ in range(3):
        assert eng.generate(prompt, 20) == first
        np.testing.assert_array_equal(eng.arena["logits"].get(), logits)
    g = StepGraph(eng.variants[eng.short_capacity], eng.stream)
    eng.reset(prompt)
    g.replay(5)
    eng.stream.synchronize()
    assert not eng.arena["ps_counters"].get().any()


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_tiny_persist_matches_reference(tiny_dir, fmt):
    assert_matches_reference(tiny_dir, fmt, prompt_len=7, n_new=9, label="tiny persist", forms=PERSIST)


def test_beyond_the_attention_capacity(tiny_model):
    """Lengths past the persistent kernel's own attention capacity (its K/V walked in chunks) stay close to the
    short kernel's (another summation order: not bit for bit) and the tokens agree."""
    ps = Engine(tiny_model, weights="fp16", max_seq=600, forms=PERSIST)
    cap = persist.plan(ps.layer_cfg, "fp16", smem_limits())["att_cap"]
    if cap >= ps.short_capacity:
        pytest.skip(f"the persistent attention holds the whole short bucket here ({cap})")
    ws = Engine(tiny_model, weights="fp16", max_seq=600, forms=WS)
    prompt = prompt_of(ws, cap + 20, seed=3)
    want = ws.generate(prompt, 8)
    got = ps.generate(prompt, 8)
    a, b = ws.arena["logits"].get(), ps.arena["logits"].get()
    assert np.abs(a - b).max() <= 1e-2 * np.abs(a).max()
    assert got[:4] == want[:4]


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_llama1b_persist_matches_reference(llama1b_in_background, fmt):
    model_dir, refs = llama1b_in_background
    _references.update(refs.result())
    assert_matches_reference(model_dir, fmt, *LLAMA1B_LENGTHS, label="llama-3.2-1b synthetic persist", forms=PERSIST)
