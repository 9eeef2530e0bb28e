"""The whole GPU engine against the NumPy reference decoder (GPU).

* tiny random models (tied and untied lm_head, GQA, llama3 RoPE, non-trivial norm weights) and the
  synthetic Llama-3.2-1B shape: every probe of every layer at every step, cosine >= 0.999 (fp16) /
  >= 0.99 (fp8; the reference runs the same FP8-quantised weights), teacher-forced on the same tokens;
* greedy tokens identical to the reference wherever the reference's top-1 margin exceeds the format's
  measured logit error;
* graph replay gives bit-identical tokens and logits to eager launches;
* no device allocation during decode (an allocator that raises is installed after set-up);
* a model that does not fit is refused before anything is allocated.
"""
from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save_file

from atomflow_bench.arena import Arena, plan_arena
from atomflow_bench.config import CATALOG, ModelConfig
from atomflow_bench.errors import AtomflowError
from atomflow_bench.reference import ReferenceDecoder
from atomflow_bench.store import write_json_atomic
from atomflow_bench.weights import Checkpoint

pytestmark = pytest.mark.gpu

COS_MIN = {"fp16": 0.999, "fp8": 0.99}


def tiny_config(tied: bool) -> ModelConfig:
    return ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=704, num_hidden_layers=3,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=64, rope_theta=500000.0,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                       rms_norm_eps=1e-5, tie_word_embeddings=tied, max_position_embeddings=4096)


def write_random_model(cfg: ModelConfig, out, seed: int) -> None:
    """Random fp16 weights with std 0.05 and norm weights around 1 (so a norm-weight bug shows)."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "config.json", cfg.to_hf_dict())
    tensors = {}
    for name, shape in cfg.tensor_shapes().items():
        if len(shape) == 1:
            tensors[name] = (1 + 0.2 * rng.standard_normal(shape)).astype(np.float16)
        else:
            tensors[name] = (0.05 * rng.standard_normal(shape)).astype(np.float16)
    save_file(tensors, str(out / "model.safetensors"))


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "model"
    write_random_model(tiny_config(request.param), d, seed=int(np.random.SeedSequence().entropy % 2**31))
    return d


@pytest.fixture(scope="module")
def llama1b_dir(tmp_path_factory):
    from atomflow_bench.sources.synthetic import make_synthetic

    d = tmp_path_factory.mktemp("llama1b") / "model"
    make_synthetic(CATALOG["llama-3.2-1b"], d, seed=1)
    return d


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def compare_probes(model_dir, fmt: str, prompt_len: int, n_new: int):
    """Teacher-forced probe comparison over prompt + reference continuation; returns (min cos, worst probe,
    reference greedy ids, reference margins, max |logit diff| at each step)."""
    from atomflow_bench.engine import Engine

    ckpt = Checkpoint(model_dir)
    cfg = ckpt.config
    rng = np.random.default_rng()
    prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, prompt_len)]
    ref = ReferenceDecoder(ckpt, weights=fmt, max_seq=prompt_len + n_new, record_taps=True)
    seq, ref_taps, margins = list(prompt), [], []
    for i in range(prompt_len + n_new - 1):
        logits = ref.step(seq[i])
        ref_taps.append(dict(ref.taps))
        top2 = np.sort(logits)[-2:]
        margins.append(float(top2[1] - top2[0]))
        if i >= prompt_len - 1:
            seq.append(int(np.argmax(logits)))
    eng = Engine(model_dir, weights=fmt, max_seq=prompt_len + n_new)
    eng.reset(seq)  # the whole sequence as "prompt": the engine is teacher-forced on the same tokens
    worst, worst_name, logit_err = 1.0, None, []
    for i in range(len(seq) - 1):
        taps = eng.step_eager(taps=True)
        for name, got in taps.items():
            c = cosine(got, ref_taps[i][name])
            if c < worst:
                worst, worst_name = c, f"step {i} {name}"
        logit_err.append(float(np.abs(taps["logits"] - ref_taps[i]["logits"]).max()))
    return eng, worst, worst_name, seq, margins, logit_err


def assert_matches_reference(model_dir, fmt: str, prompt_len: int, n_new: int, label: str) -> None:
    eng, worst, where, seq, margins, err = compare_probes(model_dir, fmt, prompt_len, n_new)
    print(f"{label} {fmt}: min probe cosine {worst:.6f} at {where}; max |logit diff| {max(err):.3e}")
    assert worst >= COS_MIN[fmt], f"probe cosine {worst} < {COS_MIN[fmt]} at {where}"
    check_greedy(eng, seq, prompt_len, margins, err)


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_tiny_engine_matches_reference(tiny_dir, fmt):
    assert_matches_reference(tiny_dir, fmt, prompt_len=7, n_new=9, label="tiny")


@pytest.mark.parametrize("att", ["short", "split"])
@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_tiny_long_context(tiny_dir, fmt, att, monkeypatch):
    """300 positions through both attention kernels (forced, not measured): the short one (the K/V range in shared
    memory) and the split one (10 splits combined by the last block)."""
    monkeypatch.setenv("ATOMFLOW_ATTENTION", att)
    assert_matches_reference(tiny_dir, fmt, prompt_len=300, n_new=3, label=f"tiny ctx 300 {att} attention")


def test_attention_buckets(tiny_dir):
    """The engine runs every step with its length's bucket: graph replays crossing from the short kernel into the
    split kernel give the same tokens and logits as eager steps, and the host's copy of the position stays
    equal to the device's."""
    from atomflow_bench.engine import Engine

    eng = Engine(tiny_dir, weights="fp16", max_seq=900, attention="short")
    cap = eng.att_caps[-1]
    assert eng.att_caps == [cap] and cap < 900 and list(eng.variants) == [cap, None]
    assert [len(eng.variants[k][2].grid) for k in eng.variants] == [1, 2]  # short: (n_kv,), split: (n_kv, splits)
    assert eng.bucket(1) == eng.bucket(cap) == cap and eng.bucket(cap + 1) is None
    rng = np.random.default_rng()
    for start in (120, cap - 6):  # inside the short bucket; across into the split kernel
        prompt = [int(t) for t in rng.integers(0, 1000, start)]
        eager = eng.generate(prompt, 16, graph=False)
        eager_logits = eng.arena["logits"].get()
        assert eng.position == int(eng.arena["pos"].get()[0]) == start + 15
        graph = eng.generate(prompt, 16, graph=True)
        eng.stream.synchronize()
        assert eng.position == int(eng.arena["pos"].get()[0]) == start + 15
        np.testing.assert_array_equal(graph, eager)
        np.testing.assert_array_equal(eng.arena["logits"].get(), eager_logits)
    with pytest.raises(AtomflowError, match="exceed max_seq"):
        eng.run(900 - eng.position + 1)


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_attention_auto(tiny_dir, fmt):
    """attention="auto": both forms of the step are timed at the short kernel's longest length and half of it and
    the faster (mean) is kept; the measurement leaves nothing behind (position 0, the same tokens as an engine forced to that form)."""
    from atomflow_bench.engine import Engine

    eng = Engine(tiny_dir, weights=fmt, max_seq=900)
    ch = eng.attention_choice
    assert ch["mode"] == "auto" and ch["length"] == ch["short_cap"] == 512 and ch["lengths"] == [256, 512]
    assert all(v > 0 for v in ch["step_us"].values())
    assert ch["chosen"] == min(ch["step_us"], key=ch["step_us"].get)
    assert (eng.att_caps, list(eng.variants)) == (([512], [512, None]) if ch["chosen"] == "short" else ([], [None]))
    assert eng.position == int(eng.arena["pos"].get()[0]) == 0
    prompt = [int(t) for t in np.random.default_rng().integers(0, 1000, 40)]
    forced = Engine(tiny_dir, weights=fmt, max_seq=900, attention=ch["chosen"])
    assert forced.attention_choice == {"mode": ch["chosen"], "short_cap": 512 if ch["chosen"] == "short" else None}
    assert eng.generate(prompt, 12) == forced.generate(prompt, 12)
    with pytest.raises(AtomflowError, match="attention must be"):
        Engine(tiny_dir, weights=fmt, max_seq=64, attention="fast")


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_gemv_auto(tiny_dir, fmt):
    """gemv="auto" (sm_90+): the layer-GEMV forms (warp-specialised with each count of ring slots before the wait
    that step.GEMV_WS_PRE_TRY lists, the ring, and the ring with the roles of step.GEMV_MIXED_TRY warp-specialised)
    are timed with the attention forms and the fastest pair is kept; every layer GEMV then runs its role's part of
    that form. The forms sum in the same mma order, so engines forced to another form, another slot count or
    another mix give the same greedy tokens."""
    from atomflow_bench.engine import Engine, gemv_form, l2_suffix
    from atomflow_bench.step import GEMV_MIXED_TRY, GEMV_NEXT_L2_TRY, GEMV_WS_PRE, GEMV_WS_PRE_TRY

    eng = Engine(tiny_dir, weights=fmt, max_seq=900)
    g = eng.gemv_choice
    if float(eng.gpu["cc"]) < 9.0:
        assert g == {"mode": "auto", "chosen": "ring"}
        return
    assert g["mode"] == "auto" and g["length"] == eng.attention_choice["length"] == 512 and g["lengths"] == [256, 512]
    bases = ({"ws", "ring"} | {f"ws-pre{n}" for n in GEMV_WS_PRE_TRY[fmt]}
             | {"+".join(("ring",) + r) for r in GEMV_MIXED_TRY[fmt]})
    assert set(g["step_us"]) == {f"{b}/l2={t}" for b in bases for t in GEMV_NEXT_L2_TRY}  # the defaults: sizes too
    assert all(v > 0 for v in g["step_us"].values())
    assert g["chosen"] == min(g["step_us"], key=g["step_us"].get)
    ws, pre, ws_roles, _ = gemv_form(g["chosen"])
    layer_gemvs = [ln for ln in eng.launches if ln.name.startswith("gemv_") and " lm_head " not in ln.label]
    for ln in layer_gemvs:  # the role's form; warp-specialised: the slots-before-the-wait argument, last
        role_ws = ws or ln.label.split()[2] in ws_roles
        assert ln.block[0] == (288 if role_ws else 256), ln.label
        if role_ws:
            assert int(ln.args[-1]) == (GEMV_WS_PRE[fmt] if pre is None else pre)
    assert len(layer_gemvs) == 4 * eng.cfg.num_hidden_layers
    assert eng.position == int(eng.arena["pos"].get()[0]) == 0
    prompt = [int(t) for t in np.random.default_rng().integers(0, 1000, 40)]
    want = eng.generate(prompt, 12)
    for other in ("ring" if ws else "ws", "ws-pre1", "ring+wd+wqkv"):
        forced = Engine(tiny_dir, weights=fmt, max_seq=900, gemv=other, attention=eng.attention_choice["chosen"])
        assert forced.gemv_choice["mode"] == other and l2_suffix(forced.gemv_choice["chosen"])[0] == other
        assert forced.generate(prompt, 12) == want, other
    for bad in ("fast", "ws-pre", "ws-prex", "ring+wx", "ring+wd+wd", "ws+wd"):
        with pytest.raises(AtomflowError, match="gemv must be"):
            Engine(tiny_dir, weights=fmt, max_seq=64, gemv=bad)


def launch_shape(launches) -> list:
    """What makes a step's form: each launch's kernel, grid, block, shared memory and integer arguments (the
    pointers differ between engines; the slot counts and L2 prefetch sizes do not)."""
    return [(ln.name, ln.grid, ln.block, ln.shmem, [int(x) for x in ln.args if isinstance(x, (int, np.integer))])
            for ln in launches]


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_gemv_auto_split_bucket(tiny_dir, fmt):
    """With the short attention chosen and lengths beyond its capacity (max_seq 900 > 512), the split bucket's
    GEMV form is timed on its own at max_seq and half-way from the capacity (PERF_NOTES v34): its step is the
    chosen form's, the short bucket keeps the form chosen at the short lengths, and tokens generated across the
    boundary are those of an engine forced to one form (the forms sum in the same order)."""
    from atomflow_bench.engine import Engine

    eng = Engine(tiny_dir, weights=fmt, max_seq=900)
    g = eng.gemv_choice
    if float(eng.gpu["cc"]) < 9.0:
        pytest.skip("one GEMV form below sm_90: nothing to choose")
    if eng.attention_choice["chosen"] == "split":
        assert "split" not in g and list(eng.variants) == [None]
        pytest.skip("the split attention won at the short lengths: one bucket")
    sp = g["split"]
    assert sp["lengths"] == [706, 900]
    assert set(sp["step_us"]) == set(g["step_us"]) and all(v > 0 for v in sp["step_us"].values())
    assert sp["chosen"] == min(sp["step_us"], key=sp["step_us"].get)
    assert (eng.gemv_form_of(512), eng.gemv_form_of(513), eng.gemv_form_of(900)) == (g["chosen"], sp["chosen"],
                                                                                    sp["chosen"])
    for form, key in ((g["chosen"], 512), (sp["chosen"], None)):
        forced = Engine(tiny_dir, weights=fmt, max_seq=900, gemv=form, attention="short")
        assert forced.gemv_choice == {"mode": form, "chosen": form} and list(forced.variants) == [512, None]
        assert launch_shape(eng.variants[key]) == launch_shape(forced.variants[key]), (form, key)
    prompt = [int(t) for t in np.random.default_rng().integers(0, 1000, 500)]
    assert eng.generate(prompt, 24) == forced.generate(prompt, 24)  # lengths 500-524: both buckets


def check_greedy(eng, seq, prompt_len, margins, logit_err):
    """Engine greedy (graph) == reference greedy up to the first step whose reference margin is within the
    format's error (2x the largest logit difference measured in the teacher-forced run)."""
    n_new = len(seq) - prompt_len
    got = eng.generate(seq[:prompt_len], n_new)
    tol = 2 * max(logit_err)
    for j in range(n_new):
        step = prompt_len - 1 + j
        if got[j] != seq[prompt_len + j]:
            assert margins[step] <= tol, (f"token {j} differs ({got[j]} vs {seq[prompt_len + j]}) although the "
                                          f"reference margin {margins[step]:.4g} > error {tol:.4g}")
            return
    print(f"greedy: all {n_new} tokens identical")


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_llama1b_engine_matches_reference(llama1b_dir, fmt):
    assert_matches_reference(llama1b_dir, fmt, prompt_len=5, n_new=4, label="llama-3.2-1b synthetic")


def dyn_launches_of(eng, roles) -> None:
    """The engine's layer GEMVs of `roles` run the DYN kernels (GEMV_DYN_THREADS, their own counter pair: layer and role)
    and the others do not."""
    from atomflow_bench.step import GEMV_DYN_THREADS, GEMV_ROLES

    layer = [ln for ln in eng.launches if ln.name.startswith("gemv_") and " lm_head " not in ln.label]
    assert len(layer) == 4 * eng.cfg.num_hidden_layers
    ctr = eng.arena["gemv_dyn_ctr"]
    for i, ln in enumerate(layer):
        role = ln.label.split()[2]
        dyn = ln.block[0] == GEMV_DYN_THREADS
        assert dyn == (role in roles), ln.label
        if dyn:
            assert ln.args[-2].data.ptr == ctr[i // 4, GEMV_ROLES.index(role)].data.ptr
            assert ln.args[-1].data.ptr == eng.arena["gemv_dyn_part"].data.ptr


@pytest.mark.parametrize("gemv,roles", [("dyn", ("wqkv", "wo", "wgu", "wd")), ("ring+dyn:wgu", ("wgu",))])
@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_dyn_engine_matches_reference(llama1b_dir, tiny_dir, fmt, gemv, roles, monkeypatch):
    """The DYN layer GEMVs (dynamic split-K units; gemv_common.cuh, PERF_NOTES v33) in the whole step: every probe
    against the NumPy reference on the 1B shapes (several units per tile in every role) and greedy within the
    format's error; on the tiny model graph replays equal eager launches bit for bit (the cross-block sums are in a
    fixed order) and the counters and the partial-sum scratch are clear after every step."""
    from atomflow_bench.engine import Engine
    from atomflow_bench.step import GEMV_DYN_SENTINEL

    import cupy as cp

    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("the DYN GEMVs are sm_90+ (bulk copies)")
    monkeypatch.setenv("ATOMFLOW_GEMV", gemv)
    eng, worst, where, seq, margins, err = compare_probes(llama1b_dir, fmt, prompt_len=5, n_new=4)
    print(f"llama-3.2-1b {fmt} gemv={gemv}: min probe cosine {worst:.6f} at {where}; max |logit diff| {max(err):.3e}")
    assert eng.gemv_choice["chosen"].split("/l2=")[0] == gemv
    dyn_launches_of(eng, roles)
    assert worst >= COS_MIN[fmt], f"probe cosine {worst} < {COS_MIN[fmt]} at {where}"
    check_greedy(eng, seq, 5, margins, err)
    tiny = Engine(tiny_dir, weights=fmt, max_seq=200)
    dyn_launches_of(tiny, roles)
    prompt = [int(t) for t in np.random.default_rng().integers(0, 1000, 70)]
    eager = tiny.generate(prompt, 30, graph=False)
    eager_logits = tiny.arena["logits"].get()
    graph = tiny.generate(prompt, 30, graph=True)
    np.testing.assert_array_equal(graph, eager)
    np.testing.assert_array_equal(tiny.arena["logits"].get(), eager_logits)
    tiny.stream.synchronize()
    assert not tiny.arena["gemv_dyn_ctr"].get().any()
    assert (tiny.arena["gemv_dyn_part"].view(np.uint32).get() == GEMV_DYN_SENTINEL).all()


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_graph_bit_identical_to_eager(tiny_dir, fmt):
    from atomflow_bench.engine import Engine

    eng = Engine(tiny_dir, weights=fmt, max_seq=200)
    prompt = [int(t) for t in np.random.default_rng().integers(0, 1000, 70)]  # > one attention chunk
    eager = eng.generate(prompt, 40, graph=False)
    eager_logits = eng.arena["logits"].get()
    graph = eng.generate(prompt, 40, graph=True)
    np.testing.assert_array_equal(graph, eager)
    np.testing.assert_array_equal(eng.arena["logits"].get(), eager_logits)


@pytest.mark.parametrize("knobs,tail", [
    ("LMHEAD_ARGMAX=0", ["gemv_fp16_f32", "argmax_advance"]),
    ("LMHEAD_NORM=0", ["rmsnorm_f32_f16", "gemv_fp16_f32_argmax"]),
    ("LMHEAD_NORM=0 LMHEAD_ARGMAX=0", ["rmsnorm_f32_f16", "gemv_fp16_f32", "argmax_advance"])])
def test_separate_tail_same_tokens(tiny_dir, monkeypatch, knobs, tail):
    """The knobs LMHEAD_ARGMAX=0 (lm_head, then argmax_advance) and LMHEAD_NORM=0 (rmsnorm_f32_f16, then lm_head)
    generate the tokens and the logits of the default step (norm and argmax inside the lm_head launch), bit for
    bit, and give the same `final_norm` probe; each knob costs its step one launch more."""
    from atomflow_bench.engine import Engine

    prompt = [int(t) for t in np.random.default_rng().integers(0, 1000, 20)]
    forms = {"attention": "short", "gemv": "ring"}  # the same forms in both (no measured choice between them)
    fused = Engine(tiny_dir, weights="fp16", max_seq=64, **forms)
    want, want_logits = fused.generate(prompt, 24), fused.arena["logits"].get()
    fused.reset(prompt)
    want_taps = fused.step_eager(taps=True)
    monkeypatch.setenv("ATOMFLOW_KERNEL_DEFINES", knobs)
    split = Engine(tiny_dir, weights="fp16", max_seq=64, **forms)
    assert [ln.name for ln in fused.launches][-2:] == ["gemv_fp16_resid", "gemv_fp16_f32_argmax"]
    assert [ln.name for ln in split.launches][-len(tail):] == tail
    assert len(split.launches) == len(fused.launches) + len(tail) - 1
    np.testing.assert_array_equal(split.generate(prompt, 24), want)
    np.testing.assert_array_equal(split.arena["logits"].get(), want_logits)
    split.reset(prompt)
    taps = split.step_eager(taps=True)
    for name in ("final_norm", "logits"):
        np.testing.assert_array_equal(taps[name], want_taps[name], err_msg=name)


def test_l2_keep_same_tokens_and_set_aside(tiny_dir, monkeypatch):
    """LMHEAD_L2_KEEP = N (the lm_head's last N MB loaded evict-last, PERF_NOTES v35) sets aside N MB of L2 for
    persisting lines (clamped to the device's maximum), records it, and changes no result: the tokens and logits of
    the default step, bit for bit; the copy roofline is measured with nothing set aside and the set-aside is back
    after it; LMHEAD_L2_SETASIDE=0 keeps the hint and sets nothing aside; the next engine without the knob sets the
    set-aside back to 0."""
    from atomflow_bench.bench import copy_bandwidth
    from atomflow_bench.engine import Engine
    from atomflow_bench.kernels import no_persisting_l2, persisting_l2

    prompt = [int(t) for t in np.random.default_rng().integers(0, 1000, 20)]
    forms = {"attention": "short", "gemv": "ring"}
    base = Engine(tiny_dir, weights="fp16", max_seq=64, **forms)
    want, want_logits = base.generate(prompt, 24), base.arena["logits"].get()
    assert base.l2_keep == {"keep_mb": 0, "set_aside_bytes": 0}
    monkeypatch.setenv("ATOMFLOW_KERNEL_DEFINES", "LMHEAD_L2_KEEP=4")
    kept = Engine(tiny_dir, weights="fp16", max_seq=64, **forms)
    most = kept.gpu["l2_persist_max_bytes"]
    assert most > 0 and kept.l2_keep["keep_mb"] == 4
    assert 0 < kept.l2_keep["set_aside_bytes"] <= most
    np.testing.assert_array_equal(kept.generate(prompt, 24), want)
    np.testing.assert_array_equal(kept.arena["logits"].get(), want_logits)
    with no_persisting_l2():
        assert persisting_l2() == 0
    assert persisting_l2() == kept.l2_keep["set_aside_bytes"]
    copy_bandwidth(1 << 26, reps=3, warmup=1)  # measured with nothing set aside, and the set-aside back after it
    assert persisting_l2() == kept.l2_keep["set_aside_bytes"]
    monkeypatch.setenv("ATOMFLOW_KERNEL_DEFINES", "LMHEAD_L2_KEEP=4 LMHEAD_L2_SETASIDE=0")
    hint_only = Engine(tiny_dir, weights="fp16", max_seq=64, **forms)
    assert hint_only.l2_keep == {"keep_mb": 4, "set_aside_bytes": 0} and persisting_l2() == 0
    np.testing.assert_array_equal(hint_only.generate(prompt, 24), want)
    monkeypatch.setenv("ATOMFLOW_KERNEL_DEFINES", "")
    Engine(tiny_dir, weights="fp16", max_seq=64, **forms)
    assert persisting_l2() == 0


@pytest.mark.parametrize("defines", ["GEMV_NEXT_L2=1", "GEMV_NEXT_L2=2", "GEMV_NEXT_L2=1 GEMV_NEXT_L2_GU=1",
                                     "GEMV_NEXT_L2=1 GEMV_NEXT_L2_TAIL=1 GEMV_EVICT_FIRST=1", "GEMV_EVICT_FIRST=1"])
@pytest.mark.parametrize("fmt,gemv", [("fp16", "ws"), ("fp8", "ring"), ("fp8", "ws")])
def test_next_weights_l2_same_tokens(tiny_dir, monkeypatch, fmt, gemv, defines):
    """The knob GEMV_NEXT_L2 (QKV's blocks ask L2 for o_proj's weights, with GEMV_NEXT_L2_GU = N MB also for the start
    of gate/up's, with GEMV_NEXT_L2_TAIL = N MB for gate/up's last N MB instead: PERF_NOTES v30.1-v30.3) hands every QKV
    launch that range, and GEMV_EVICT_FIRST (the weight copies' L2 evict-first policy) changes no result either: the
    tokens and logits of the step with both off, bit for bit, graph and eager. Knobs a case does not name are set off
    (the defaults would measure the size: test_next_l2_tail_measured)."""
    from atomflow_bench.engine import Engine

    prompt = [int(t) for t in np.random.default_rng().integers(0, 1000, 20)]
    forms = {"attention": "short", "gemv": gemv}
    monkeypatch.setenv("ATOMFLOW_KERNEL_DEFINES", "GEMV_NEXT_L2=0 GEMV_EVICT_FIRST=0")
    base = Engine(tiny_dir, weights=fmt, max_seq=64, **forms)
    want, want_logits = base.generate(prompt, 24), base.arena["logits"].get()
    qkv = [ln for ln in base.launches if "qkv_rope" in ln.name]
    assert qkv and all(int(ln.args[-2 if gemv == "ws" else -1]) == 0 for ln in qkv)  # no size: nothing asked
    unnamed = [f"{k}=0" for k in ("GEMV_NEXT_L2", "GEMV_NEXT_L2_TAIL", "GEMV_EVICT_FIRST") if k + "=" not in defines]
    monkeypatch.setenv("ATOMFLOW_KERNEL_DEFINES", " ".join([defines, *unnamed]))
    eng = Engine(tiny_dir, weights=fmt, max_seq=64, **forms)
    assert eng.gemv_choice == {"mode": gemv, "chosen": gemv}  # a fixed size: none measured
    qkv = [ln for ln in eng.launches if "qkv_rope" in ln.name]
    cfg = eng.cfg
    for i, ln in enumerate(qkv):
        wo, wgu = eng.arena[f"L{i}.wo"], eng.arena[f"L{i}.wgu"]
        nxt, size = ln.args[-3:-1] if gemv == "ws" else ln.args[-2:]
        assert wo.nbytes == cfg.hidden_size * cfg.q_dim * (2 if fmt == "fp16" else 1)
        if "NEXT_L2=" not in defines:  # GEMV_EVICT_FIRST alone: nothing asked
            assert int(size) == 0
        elif "TAIL" in defines:  # the last MB of gate/up's weights (the tiny model's are smaller: all of them)
            tail = min(1 << 20, wgu.nbytes) & ~15
            assert nxt.data.ptr == wgu.data.ptr + wgu.nbytes - tail and int(size) == tail
        else:
            assert nxt.data.ptr == wo.data.ptr
            want_size = wgu.data.ptr - wo.data.ptr + min(1 << 20, wgu.nbytes) if "GU" in defines else wo.nbytes
            assert int(size) == want_size
    np.testing.assert_array_equal(eng.generate(prompt, 24), want)
    np.testing.assert_array_equal(eng.arena["logits"].get(), want_logits)
    np.testing.assert_array_equal(eng.generate(prompt, 24, graph=False), want)


def test_next_l2_tail_measured(tiny_dir, monkeypatch):
    """With GEMV_NEXT_L2=1 and GEMV_NEXT_L2_TAIL=-1 (the defaults since v31) the engine times every layer-GEMV form
    with every size of step.GEMV_NEXT_L2_TRY ("<form>/l2=<MB>", engine.l2_suffix) and keeps the fastest; the chosen
    step's QKV launches ask L2 for that size of gate/up's tail (0: nothing), and the tokens are those of the step with
    the prefetch and the evict-first policy off."""
    from atomflow_bench.engine import Engine, gemv_form, l2_suffix
    from atomflow_bench.step import GEMV_NEXT_L2_TRY

    prompt = [int(t) for t in np.random.default_rng().integers(0, 1000, 30)]
    monkeypatch.setenv("ATOMFLOW_KERNEL_DEFINES", "")
    eng = Engine(tiny_dir, weights="fp8", max_seq=900)
    g = eng.gemv_choice
    if float(eng.gpu["cc"]) < 9.0:
        pytest.skip("the prefetch is sm_90+ (bulk copies)")
    bases = {l2_suffix(f)[0] for f in g["step_us"]}
    assert set(g["step_us"]) == {f"{b}/l2={t}" for b in bases for t in GEMV_NEXT_L2_TRY}
    assert g["chosen"] == min(g["step_us"], key=g["step_us"].get)
    base, tail = l2_suffix(g["chosen"])
    ws = gemv_form(base)[0]
    qkv = [ln for ln in eng.launches if "qkv_rope" in ln.name]
    for i, ln in enumerate(qkv):
        wgu = eng.arena[f"L{i}.wgu"]
        nxt, size = ln.args[-3:-1] if ws else ln.args[-2:]
        want = min(tail << 20, wgu.nbytes) & ~15
        assert int(size) == want
        if want:
            assert nxt.data.ptr == wgu.data.ptr + wgu.nbytes - want
    got = eng.generate(prompt, 12)
    monkeypatch.setenv("ATOMFLOW_KERNEL_DEFINES", "GEMV_NEXT_L2=0 GEMV_EVICT_FIRST=0")
    plain = Engine(tiny_dir, weights="fp8", max_seq=900, gemv=base, attention=eng.attention_choice["chosen"])
    assert plain.gemv_choice == {"mode": base, "chosen": base}
    assert plain.generate(prompt, 12) == got
    monkeypatch.setenv("ATOMFLOW_KERNEL_DEFINES", "GEMV_NEXT_L2=0")
    with pytest.raises(AtomflowError, match="needs GEMV_NEXT_L2=1"):
        Engine(tiny_dir, weights="fp8", max_seq=64, gemv="ring/l2=8")


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_group8_matches_reference(tmp_path, fmt):
    """8 q heads per one kv head (the attention kernel's largest group) through the whole engine."""
    cfg = ModelConfig(vocab_size=300, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=8, num_key_value_heads=1, head_dim=64)
    write_random_model(cfg, tmp_path / "g8", seed=int(np.random.SeedSequence().entropy % 2**31))
    assert_matches_reference(tmp_path / "g8", fmt, prompt_len=40, n_new=4, label="group 8")


def test_no_device_allocation_during_decode(tiny_dir):
    import cupy as cp

    from atomflow_bench.engine import Engine

    eng = Engine(tiny_dir, weights="fp8", max_seq=128)
    prompt = [1, 2, 3, 4]
    calls = []

    def refuse(nbytes):
        calls.append(nbytes)
        raise MemoryError(f"device allocation of {nbytes} bytes during decode")

    old = cp.cuda.get_allocator()
    cp.cuda.set_allocator(refuse)
    try:
        eng.generate(prompt, 8, graph=False)
        eng.step_eager(taps=True)
        eng.generate(prompt, 8, graph=True)  # includes the graph capture
        eng.generate(prompt, 8, graph=True)
    finally:
        cp.cuda.set_allocator(old)
    assert calls == []
    # the test itself can fail: the same allocator does catch an allocation
    cp.cuda.set_allocator(refuse)
    try:
        with pytest.raises(MemoryError):
            cp.empty(16, dtype=cp.float32)
    finally:
        cp.cuda.set_allocator(old)


def test_refuses_model_that_does_not_fit():
    import cupy as cp

    huge = ModelConfig(vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                       num_attention_heads=128, num_key_value_heads=16, head_dim=128)
    plan = plan_arena(huge, "fp16", 4096)
    free_before = cp.cuda.runtime.memGetInfo()[0]
    with pytest.raises(AtomflowError, match="does not fit"):
        Arena(plan)
    assert cp.cuda.runtime.memGetInfo()[0] >= free_before - (64 << 20)  # nothing was allocated


def test_profile_roles_in_graph(tiny_dir):
    """`profile`'s graph-mode breakdown: every role of the step left out once, the position never advanced
    (step.hold_position), bytes per role from the launches, and the eager table covers the step."""
    from atomflow_bench.bench import copy_bandwidth
    from atomflow_bench.engine import Engine
    from atomflow_bench.profile import profile_step, role_marginals, step_role

    eng = Engine(tiny_dir, weights="fp8", max_seq=200)
    copy = copy_bandwidth(nbytes=1 << 26, reps=5)
    p = profile_step(eng, context=40, steps=4, copy=copy)
    pos_after = int(eng.arena["pos"].get()[0])
    m = p["role_marginals"]
    L = eng.cfg.num_hidden_layers
    assert {r["role"]: r["count"] for r in m["rows"]} == {
        "embed_lookup": 1, "wqkv": L, "attention_decode": L, "wo": L, "wgu": L, "wd": L, "lm_head": 1}
    assert m["length"] == pos_after + 1 == p["attention_graph"]["length"]
    by_role = {r["role"]: r for r in m["rows"]}
    assert by_role["wgu"]["bytes"] == sum(ln.bytes_moved for ln in eng.launches if step_role(ln) == "wgu")
    assert by_role["attention_decode"]["bytes"] == L * 2 * m["length"] * eng.cfg.kv_dim * 2
    for r in m["rows"]:
        assert r["step_without_us"]["median"] > 0 and np.isfinite(r["saved_us"])
        assert r["excess_us"] == pytest.approx(r["saved_us"] - r["floor_us"])
    assert m["step_us"]["median"] > 0
    assert sum(r["count"] for r in p["rows"]) == len(eng.launches)
    assert p["forms"] == {"length": 40, "attention": "short" if eng.att_caps else "split",
                          "gemv": eng.gemv_choice["chosen"]}
    again = role_marginals(eng, copy, replays=3)
    assert int(eng.arena["pos"].get()[0]) == pos_after  # the role graphs leave the position alone
    assert again["length"] == m["length"]


@pytest.mark.parametrize("att", ["short", "split"])
def test_timeline_instrument(tiny_dir, att, monkeypatch):
    """`profile --timeline`: the instrumented build decodes the same tokens as the plain one; one replay's
    records cover every block of every launch, their grid ids map onto the step's launches in order (else
    timeline.launch_times raises), and the per-role spans add up to the replay. Both attention kernels."""
    from atomflow_bench import timeline
    from atomflow_bench.engine import Engine
    from atomflow_bench.profile import step_role

    monkeypatch.setenv("ATOMFLOW_ATTENTION", att)
    t = timeline.record(tiny_dir, "fp8", context=40, replays=4, copy={"median": 3000.0}, plain_step_us=1.0)
    prompt = [int(x) for x in np.random.default_rng().integers(0, 1000, 50)]
    plain = Engine(tiny_dir, weights="fp8", max_seq=t["max_seq"])  # the same launch shapes as the recorded one
    inst = Engine(tiny_dir, weights="fp8", max_seq=t["max_seq"], kernel_defines=(timeline.DEFINE,))
    assert inst.generate(prompt, 16) == plain.generate(prompt, 16)
    L = plain.cfg.num_hidden_layers
    assert {r["role"]: r["count"] for r in t["rows"]} == {
        "embed_lookup": 1, "wqkv": L, "attention_decode": L, "wo": L, "wgu": L, "wd": L,
        "lm_head": 1}  # the final norm and the argmax are lm_head's prologue and epilogue
    assert [x["role"] for x in t["per_launch"]] == [step_role(ln) for ln in plain.launches]
    assert t["blocks_per_step"] == sum(int(np.prod(ln.grid)) for ln in plain.launches)
    assert t["length"] == 40 + 1 + (4 - 1) // 2  # the median position of the recorded replays
    assert t["attention"] == att  # the form asked for ($ATOMFLOW_ATTENTION here; profile passes the plain one's)
    assert sum(r["us_per_step"] for r in t["rows"]) == pytest.approx(t["step_us"]["median"], rel=0.1)
    for r in t["rows"]:
        assert r["span_us"] >= 0 and r["tail_us"] >= 0
        if r["release_us"] is not None:
            assert r["start_us"] <= r["release_us"]  # every block starts before its wait returns
    assert 0 < t["clock_granularity_ns"] <= 1000 and t["instrumented_replay_us"] > 0
    # the kernels' stage marks, from each block's own wait: in program order (medians of ordered values)
    by = {r["role"]: r["marks_us"] for r in t["rows"]}
    for role in ("wqkv", "wo", "wgu", "wd"):  # x staged <= dot products done <= epilogue done
        assert None not in by[role][:3] and 0 <= by[role][0] <= by[role][1] <= by[role][2]
    a = by["attention_decode"]
    if att == "split":  # q loaded <= passes done; at length 41-44 (2 splits): stored <= ticket back
        assert None not in a and 0 <= a[0] <= a[1] and a[2] <= a[3]
    else:  # q and K/V in shared memory <= scores and maxima <= probabilities <= P.V done
        assert None not in a and 0 <= a[0] <= a[1] <= a[2] <= a[3]


def test_gemv_bench_isolated_and_chained():
    """`atomflow-bench gemv`: every GEMV shape of a (tiny) model in both formats, lm_head once, each timed as
    isolated launches and as a PDL chain captured in one graph; bytes per launch from the operands."""
    from atomflow_bench.kernels import KernelLib
    from atomflow_bench.profile import gemv_bench, gemv_shapes

    cfg = tiny_config(tied=False)
    lib = KernelLib()
    g = gemv_bench(cfg, lib, 132, ("fp16", "fp8"), reps=10, l2_bytes=1 << 20, copy={"median": 3000.0})
    shapes = gemv_shapes(cfg)
    assert [(r["role"], r["format"]) for r in g["rows"]] == (
        [(role, "fp16") for role, *_ in shapes] + [(role, "fp8") for role, *_ in shapes if role != "lm_head"])
    for r in g["rows"]:
        w = r["rows"] * r["k"] * (1 if r["format"] == "fp8" else 2)
        assert w < r["bytes"] < w * 1.2  # weights (+ fp8 scales) + x + y
        assert r["chain_launches"] >= 2 and r["chained_us"]["n"] >= 5
        assert 0 < r["chained_us"]["median"] and 0 < r["us"]["median"]
        assert r["chained_pct_of_copy"] == pytest.approx(100 * r["chained_gbs"] / 3000.0)
        floor = r["bytes"] / 3000e9 * 1e6
        assert 0 < r["isolated_ceiling_pct"] < 100
        assert r["isolated_ceiling_pct"] == pytest.approx(100 * floor / (floor + g["empty_launch_us"]["median"]))
    assert 0 < g["empty_launch_us"]["median"] < 50  # an empty launch between two events, no host time inside
