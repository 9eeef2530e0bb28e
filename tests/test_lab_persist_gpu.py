"""The lab's persistent decode step (lab/persist.py, lab/kernels/decode_persist.cu) on the GPU.

* the scheduler: every op runs once on the blocks it should (every block, the attention on the last n_att), each op
  starts only after every block it depends on has ended it (a global sequence stamped at each op's start and end;
  split-K units: after the last tile of the op before was finished), the counters are back at zero after every
  launch, graph replays included;
* results: the same device functions as the warp-specialised form, so tokens, logits and every probe equal the `ws`
  form's bit for bit (graph and eager, buffers poisoned before each step); split-K units add a tile's parts in
  another order, so there the tokens are equal and the logits within fp32 rounding; deterministic across replays;
* against the NumPy reference (tiny tied/untied, both formats; the synthetic Llama-3.2-1B shape), as the graph is.
"""
from __future__ import annotations

import numpy as np
import pytest

from atomflow_bench.gpu.device import smem_limits
from atomflow_bench.gpu.engine import Engine
from atomflow_bench.gpu.forms import Forms
from atomflow_bench.gpu.graph import StepGraph
from atomflow_bench.gpu.step import run_eager
from lab import persist
from lab.persist import PersistStep

from test_engine_gpu import (LLAMA1B_LENGTHS, _references, compare_probes, check_greedy,  # noqa: F401
                             device_cc, llama1b_in_background, tiny_dir, tiny_model)  # noqa: F811

pytestmark = pytest.mark.gpu

WS = Forms.parse("short:ws;split:ws")
ACTIVATIONS = ("h", "qkv", "attn_out", "act", "xnorm", "logits")


@pytest.fixture(autouse=True)
def needs_sm90():
    if device_cc() < 90:
        pytest.skip("the persistent step needs sm_90+ (bulk copies)")


MODES = ["static", "dyn", "split"]


def persistent(model_dir, fmt: str, max_seq: int, mode: str = "static") -> tuple[Engine, PersistStep]:
    """An engine of the ws form whose short bucket replays the persistent step in `mode` (lab/persist.py MODES)."""
    eng = Engine(model_dir, weights=fmt, max_seq=max_seq, forms=WS)
    step = PersistStep(eng, mode)
    step.install()
    return eng, step


def poison(eng) -> None:
    """NaN into every activation buffer: a value the step does not write stays NaN and shows."""
    for name in ACTIVATIONS:
        eng.arena[name].fill(np.nan)


def prompt_of(eng, n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, eng.cfg.vocab_size, n)]


def trace_of(step: PersistStep, replays: int = 1):
    """Run the whole persistent step `replays` times with a trace; (the trace of the last, the counters after)."""
    import cupy as cp

    total, n_sm = persist.n_ops(step.cfg), step.n_sm
    trace = cp.zeros(1 + 2 * total * n_sm, dtype=cp.uint32)
    ln = step.launch(trace=trace)
    with step.eng.stream:
        for _ in range(replays):
            trace.fill(0)
            ln()
    step.eng.stream.synchronize()
    return trace.get()[1:].reshape(total, n_sm, 2), step.counters.get()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_every_op_once_in_dependency_order(tiny_model, fmt, mode):
    eng, step = persistent(tiny_model, fmt, 64, mode)
    eng.reset(prompt_of(eng, 9))
    n_sm, cfg = step.n_sm, step.cfg
    stamps, counters = trace_of(step, replays=3)
    assert not counters.any(), f"counters left after the launch: {counters}"
    att_blocks = set(range(n_sm - cfg.num_key_value_heads, n_sm))
    names = persist.op_names(cfg)
    for o, name in enumerate(names):
        ran = {b for b in range(n_sm) if stamps[o, b, 0]}
        assert ran == (att_blocks if name.endswith("attention") else set(range(n_sm))), name
        # split GEMVs: a block's end is the last tile its reducer finished (none when it finished none)
        tiled = mode == "split" and name not in ("embed",) and not name.endswith("attention")
        assert all(stamps[o, b, 1] > stamps[o, b, 0] for b in ran if stamps[o, b, 1] or not tiled), name
        assert stamps[o, :, 1].any(), name
        if o == 0:
            continue
        dep = stamps[o - 1][[b for b in range(n_sm) if stamps[o - 1, b, 1]]]
        assert min(stamps[o, b, 0] for b in ran) > dep[:, 1].max(), f"{name} started before {names[o - 1]} ended"
    s = stamps[stamps > 0]  # every op start and end counted once (split: a block keeps its last tile's end)
    if mode == "split":
        assert len(set(s.tolist())) == s.size
    else:
        assert sorted(s) == list(range(1, s.size + 1))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_same_bits_as_the_ws_form(tiny_model, fmt, mode):
    """Tokens and logits equal the ws form's bit for bit (graph and eager, poisoned buffers); every probe of the
    one-op-per-launch step equals the ws form's. With dynamic tiles too: a tile's sums are one block's whichever.
    Split-K units add a tile's parts in part order after each part's warps: the same tokens, every value within
    fp32 rounding of the ws form's."""
    ws = Engine(tiny_model, weights=fmt, max_seq=96, forms=WS)
    ps, step = persistent(tiny_model, fmt, 96, mode)
    def same(got, want, err_msg=""):
        if mode != "split":
            np.testing.assert_array_equal(got, want, err_msg=err_msg)
        else:
            assert np.isfinite(got).all(), err_msg
            assert np.abs(got - want).max() <= 1e-2 * max(float(np.abs(want).max()), 1e-3), err_msg
    assert [ln.name for ln in ps.variants[ps.short_capacity]] == ["decode_persist", "gemv_fp16_f32_argmax"]
    prompt = prompt_of(ws, 30, seed=1)
    poison(ws)
    want = ws.generate(prompt, 40)
    want_logits = ws.arena["logits"].get()
    for graph in (True, False):
        poison(ps)
        assert ps.generate(prompt, 40, graph=graph) == want, f"graph={graph}"
        same(ps.arena["logits"].get(), want_logits)
        for name in ("h", "qkv", "attn_out", "act"):
            assert not np.isnan(ps.arena[name].get()).any(), f"{name} not overwritten"
    seq = prompt + want  # probes, teacher-forced over the same tokens
    probes = step.probe_launches()
    for eng in (ws, ps):
        eng.reset(seq)
        poison(eng)
    for i in range(12):
        a, b = ws.step_eager(taps=True), {}
        with ps.stream:
            run_eager(probes, b)
        ps.position += 1
        assert set(a) == set(b)
        for name in a:
            same(b[name].astype(np.float32), a[name].astype(np.float32), err_msg=f"step {i} {name}")


@pytest.mark.parametrize("mode", MODES)
def test_replays_are_deterministic(tiny_model, mode):
    eng, step = persistent(tiny_model, "fp8", 64, mode)
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
    assert not step.counters.get().any()


def assert_persist_matches_reference(model_dir, fmt: str, prompt_len: int, n_new: int, label: str, mode="static"):
    """The probes of every op against the NumPy reference (test_engine_gpu's thresholds), then greedy."""
    from test_engine_gpu import COS_MIN, cosine, reference_run

    seq, ref_taps, margins = reference_run(model_dir, fmt, prompt_len, n_new)
    eng, step = persistent(model_dir, fmt, prompt_len + n_new, mode)
    probes = step.probe_launches()
    eng.reset(seq)
    worst, where, err = 1.0, None, []
    for i in range(len(seq) - 1):
        taps = {}
        with eng.stream:
            run_eager(probes, taps)
        eng.position += 1
        for name, got in taps.items():
            c = cosine(got, ref_taps[i][name])
            if c < worst:
                worst, where = c, f"step {i} {name}"
        err.append(float(np.abs(taps["logits"] - ref_taps[i]["logits"]).max()))
    print(f"{label} {fmt}: min probe cosine {worst:.6f} at {where}; max |logit diff| {max(err):.3e}")
    assert worst >= COS_MIN[fmt], f"probe cosine {worst} < {COS_MIN[fmt]} at {where}"
    check_greedy(eng, seq, prompt_len, margins, err)


@pytest.mark.parametrize("mode", ["static", "split"])
@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_tiny_persist_matches_reference(tiny_dir, fmt, mode):
    assert_persist_matches_reference(tiny_dir, fmt, 7, 9, f"tiny persist {mode}", mode)


def test_beyond_the_attention_capacity(tiny_model):
    """Lengths past the kernel's own attention capacity (its K/V walked in chunks) stay close to the short kernel's
    (another summation order: not bit for bit)."""
    ps, step = persistent(tiny_model, "fp16", 600)
    cap = persist.plan(step.cfg, "fp16", smem_limits())["att_cap"]
    if cap >= ps.short_capacity:
        pytest.skip(f"the persistent attention holds the whole short bucket here ({cap})")
    ws = Engine(tiny_model, weights="fp16", max_seq=600, forms=WS)
    prompt = prompt_of(ws, cap + 20, seed=3)
    want = ws.generate(prompt, 8)
    got = ps.generate(prompt, 8)
    a, b = ws.arena["logits"].get(), ps.arena["logits"].get()
    assert np.abs(a - b).max() <= 1e-2 * np.abs(a).max()
    assert got[:4] == want[:4]


@pytest.mark.parametrize("mode", ["dyn", "split"])
@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_llama1b_persist_matches_reference(llama1b_in_background, fmt, mode):
    model_dir, refs = llama1b_in_background
    _references.update(refs.result())
    assert_persist_matches_reference(model_dir, fmt, *LLAMA1B_LENGTHS, f"llama-3.2-1b synthetic persist {mode}", mode)
