"""The whole GPU engine against the NumPy reference decoder, its launch forms and their tuning (GPU).

* tiny random models (tied and untied lm_head, GQA, llama3 RoPE, non-trivial norm weights) and the
  synthetic Llama-3.2-1B shape: every probe of every layer at every step, cosine >= 0.999 (fp16) /
  >= 0.99 (fp8; the reference runs the same FP8-quantised weights), teacher-forced on the same tokens;
* greedy tokens identical to the reference wherever the reference's top-1 margin exceeds the format's
  measured logit error;
* graph replay gives bit-identical tokens and logits to eager launches;
* every layer-GEMV form (gpu/forms.py GemvForm: ring, ws, ws-pre<N>, each /l2=<MB>) and both attention buckets give
  the tokens of the default forms; PDL on and off too;
* measure/tune.py: `tune` picks among forms.candidates and reports every pair it timed; `resolve` saves, reuses,
  retunes, takes given forms and falls back to the defaults without timing anything;
* an engine compiles only the .cu files its step launches; the kernel -D's it refuses;
* no device allocation during decode (an allocator that raises is installed after set-up);
* a model that does not fit is refused before anything is allocated;
* profile, the GEMV microbenchmark, the timeline instrument and the `run` record's instrument marks.
"""
from __future__ import annotations

import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from atomflow_bench.config import CATALOG, ModelConfig
from atomflow_bench.errors import AtomflowError
from atomflow_bench.gpu.arena import Arena, plan_arena
from atomflow_bench.gpu.engine import Engine
from atomflow_bench.gpu.forms import Forms, GemvForm, candidates, default_forms
from atomflow_bench.gpu.ops.attention_prefill import wgmma_default
from lab import KERNELS_DIR as LAB_KERNELS_DIR
from lab.timeline import DEFINE as TIMELINE_DEFINE
from atomflow_bench.store.checkpoint import Checkpoint
from atomflow_bench.store.sources.synthetic import make_synthetic
from atomflow_bench.store.store import write_json_atomic
from atomflow_bench.reference import ReferenceDecoder

pytestmark = pytest.mark.gpu

COS_MIN = {"fp16": 0.999, "fp8": 0.99}
# A build with wrong-result timing instruments (the run record marks it); also the build whose -D's
# test_removed_kernel_defines_refused shows are taken. Every -D set is a compile of its own.
INSTRUMENTED = ("AF_NO_WAIT=15", "AF_NO_SCALES=1")
STEP_FILES = ("embedding.cu", "gemv_fp16.cu", "gemv_fp8.cu", "quantize_fp8.cu", "attention_short.cu", "attention.cu")
# The kernel builds these tests compile (conftest.compiled_kernels compiles them in parallel before the first test):
# the default build (gemv_bench and profile's timing use spin.cu too), the timeline's and the instrumented step.
KERNEL_BUILDS = [(None, (), None), (None, (TIMELINE_DEFINE,), STEP_FILES), (None, INSTRUMENTED, STEP_FILES[:5])]


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
    """Tied and untied: for the tests that compare the logits with the reference (the lm_head read from the embedding
    or from its own matrix)."""
    d = tmp_path_factory.mktemp("tiny") / "model"
    write_random_model(tiny_config(request.param), d, seed=int(np.random.SeedSequence().entropy % 2**31))
    return d


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The untied tiny model (the lm_head its own matrix): for the tests whose subject does not depend on tying
    (forms, buckets, tuning, PDL, graphs, builds, profile, records)."""
    d = tmp_path_factory.mktemp("tiny-untied") / "model"
    write_random_model(tiny_config(False), d, seed=int(np.random.SeedSequence().entropy % 2**31))
    return d


@pytest.fixture
def tuning_home(tmp_path, monkeypatch) -> Path:
    """$ATOMFLOW_HOME in a fresh tmp dir (saved tunes land in its tuning/), no ATOMFLOW_FORMS and no kernel -D's from
    the caller's environment."""
    home = tmp_path / "home"
    monkeypatch.setenv("ATOMFLOW_HOME", str(home))
    monkeypatch.delenv("ATOMFLOW_FORMS", raising=False)
    monkeypatch.delenv("ATOMFLOW_KERNEL_DEFINES", raising=False)
    return home


def device_cc() -> int:
    from atomflow_bench.gpu.device import compute_capability

    return compute_capability()


def forms_with(fmt: str, short: bool) -> Forms:
    """The default forms of `fmt` on this GPU with the short attention bucket on or off (the split kernel for every
    length)."""
    d = default_forms(fmt, device_cc(), 1)
    return Forms(short, d.gemv, d.gemv_split)


def crossing_prompt(eng, n_new: int = 24) -> list[int]:
    """A random prompt whose `n_new` generated tokens cross from the short bucket into the split one (when the
    engine has the short bucket's capacity below max_seq)."""
    start = eng.short_capacity - n_new // 2 if eng.short_capacity else 100
    assert start + n_new <= eng.max_seq
    return [int(t) for t in np.random.default_rng().integers(0, eng.cfg.vocab_size, start)]


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


_references: dict = {}


def reference_run(model_dir, fmt: str, prompt_len: int, n_new: int):
    """The NumPy reference's teacher-forced run over a random prompt and its greedy continuation: (the sequence
    (prompt + reference greedy ids), each step's taps, each step's top-1 margin). One per (model, format, lengths):
    the tests that run other engine forms over the same lengths compare against the same run."""
    key = (str(model_dir), fmt, prompt_len, n_new)
    if key not in _references:
        ckpt = Checkpoint(model_dir)
        prompt = [int(t) for t in np.random.default_rng().integers(0, ckpt.config.vocab_size, prompt_len)]
        ref = ReferenceDecoder(ckpt, weights=fmt, max_seq=prompt_len + n_new, record_taps=True)
        seq, ref_taps, margins = list(prompt), [], []
        for i in range(prompt_len + n_new - 1):
            logits = ref.step(seq[i])
            ref_taps.append(dict(ref.taps))
            top2 = np.sort(logits)[-2:]
            margins.append(float(top2[1] - top2[0]))
            if i >= prompt_len - 1:
                seq.append(int(np.argmax(logits)))
        _references[key] = seq, ref_taps, margins
    return _references[key]


def compare_probes(model_dir, fmt: str, prompt_len: int, n_new: int, forms: Forms | None = None):
    """Teacher-forced probe comparison over prompt + reference continuation; returns (engine, min cos, worst probe,
    the sequence (prompt + reference greedy ids), reference margins, max |logit diff| at each step)."""
    seq, ref_taps, margins = reference_run(model_dir, fmt, prompt_len, n_new)
    eng = Engine(model_dir, weights=fmt, max_seq=prompt_len + n_new, forms=forms)
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


def assert_matches_reference(model_dir, fmt: str, prompt_len: int, n_new: int, label: str,
                             forms: Forms | None = None):
    eng, worst, where, seq, margins, err = compare_probes(model_dir, fmt, prompt_len, n_new, forms)
    print(f"{label} {fmt}: min probe cosine {worst:.6f} at {where}; max |logit diff| {max(err):.3e}")
    assert worst >= COS_MIN[fmt], f"probe cosine {worst} < {COS_MIN[fmt]} at {where}"
    check_greedy(eng, seq, prompt_len, margins, err)
    return eng


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
def test_tiny_engine_matches_reference(tiny_dir, fmt):
    assert_matches_reference(tiny_dir, fmt, prompt_len=7, n_new=9, label="tiny")


@pytest.mark.parametrize("att", ["short", "split"])
@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_tiny_long_context(tiny_dir, fmt, att):
    """300 positions through both attention kernels (given by the forms, not measured): the short one (the K/V range
    in shared memory) and the split one (10 splits combined by the last block)."""
    forms = forms_with(fmt, att == "short")
    eng = assert_matches_reference(tiny_dir, fmt, prompt_len=300, n_new=3, label=f"tiny ctx 300 {att} attention",
                                   forms=forms)
    assert eng.forms == forms
    assert bool(eng.att_caps) == (att == "short" and eng.short_capacity > 0)
    grids = {len(ln.grid) for ln in eng.launches if ln.name == "attention_decode"}
    assert grids == ({1} if eng.att_caps else {2})  # short: (n_kv,), split: (n_kv, splits)


def test_attention_buckets(tiny_model):
    """The engine runs every step with its length's bucket: graph replays crossing from the short kernel into the
    split kernel give the same tokens and logits as eager steps, and the host's copy of the position stays
    equal to the device's."""
    eng = Engine(tiny_model, weights="fp16", max_seq=900, forms=forms_with("fp16", True))
    cap = eng.att_caps[-1]
    assert eng.att_caps == [cap] == [eng.short_capacity] and cap < 900 and list(eng.variants) == [cap, None]
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
    split_only = Engine(tiny_model, weights="fp16", max_seq=900, forms=forms_with("fp16", False))
    assert split_only.att_caps == [] and list(split_only.variants) == [None]
    assert split_only.bucket(1) is None and len(split_only.launches[2].grid) == 2


def layer_gemvs(launches) -> list:
    return [ln for ln in launches if ln.name.startswith("gemv_") and " lm_head " not in ln.label]


def check_gemv_launches(eng, key, form: GemvForm) -> None:
    """The layer GEMVs of bucket `key` run `form`: warp-specialised (288 threads, the slots-before-the-wait argument
    last: the format's default for plain ws, o_proj's own with /wo-pre=) or the ring (256 threads); every QKV launch
    asks L2 for the last `form.l2_tail_mb` MB of its layer's gate/up weights (all of them when smaller; nothing for
    0)."""
    from atomflow_bench.gpu.ops.gemv import GEMV_WS_PRE

    layer = layer_gemvs(eng.variants[key])
    assert len(layer) == 4 * eng.cfg.num_hidden_layers
    for ln in layer:
        assert ln.block[0] == (288 if form.ws else 256), (form.text, ln.label)
        if form.ws:
            role = ln.label.split()[2]  # "gemv <fmt> <role> <rows>x<k>" (ops/gemv.py gemv_launch)
            pre = form.slots_before_wait(role)
            assert int(ln.args[-1]) == (GEMV_WS_PRE[eng.fmt] if pre is None else pre), ln.label
    qkv = [ln for ln in layer if "qkv_rope" in ln.name]
    assert len(qkv) == eng.cfg.num_hidden_layers
    for i, ln in enumerate(qkv):
        wgu = eng.arena[f"L{i}.wgu"]
        nxt, size = ln.args[15:17]  # after the 8 GemvArgs and the 7 rope arguments (ops/gemv.py gemv_launch)
        want = min(form.l2_tail_mb << 20, wgu.nbytes) & ~15
        assert int(size) == want, (form.text, i)
        if want:
            assert nxt.data.ptr == wgu.data.ptr + wgu.nbytes - want
        else:
            assert int(nxt) == 0


def gemv_forms_to_try(fmt: str, cc: int) -> list[GemvForm]:
    """Every form tune times (forms.candidates: ws, ws-pre<N> of WS_PRE_TRY, ws with o_proj's counts of WO_PRE_TRY
    and ring at every L2_TAILS size on sm_90+) and slot counts it does not (ws-pre0, ws-pre1, o_proj's 0 and 1)."""
    forms = candidates(fmt, cc, 1)[0]
    if cc >= 90:
        forms += [GemvForm(True, 0, 0), GemvForm(True, 1, 8), GemvForm(True, None, 8, 1), GemvForm(True, 3, 0, 0)]
    return forms


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_every_gemv_form_same_tokens(tiny_model, fmt):
    """Every layer-GEMV form (GemvForm: ring, ws, ws-pre<N>, each /l2=<MB>) runs its launches in both buckets, and the
    forms sum in the same mma order: the greedy tokens of the default forms across the short/split boundary, graph
    and eager; the L2 prefetch of gate/up's tail changes no bit of the logits. Different forms per bucket, and the
    split kernel for every length, give the same tokens too; before sm_90 the ws and /l2 forms are refused."""
    eng = Engine(tiny_model, weights=fmt, max_seq=900)
    assert eng.forms == default_forms(fmt, eng.cc, eng.short_capacity)
    keys = [eng.short_capacity, None] if eng.short_capacity else [None]
    assert list(eng.variants) == keys
    prompt = crossing_prompt(eng)
    want = eng.generate(prompt, 24)
    logits_of = {replace(eng.forms.gemv, l2_tail_mb=0): eng.arena["logits"].get()}
    tried = gemv_forms_to_try(fmt, eng.cc)
    assert eng.forms.gemv in tried
    for g in tried:
        eng.use(Forms(True, g, g))
        assert eng.forms == Forms(True, g, g) and list(eng.variants) == keys
        for key in keys:
            check_gemv_launches(eng, key, g)
        assert eng.generate(prompt, 24) == want, g.text
        logits = eng.arena["logits"].get()
        base = replace(g, l2_tail_mb=0)
        if base in logits_of:
            np.testing.assert_array_equal(logits, logits_of[base], err_msg=g.text)
        else:
            logits_of[base] = logits
        assert eng.generate(prompt, 24, graph=False) == want, f"{g.text} eager"
        np.testing.assert_array_equal(eng.arena["logits"].get(), logits, err_msg=f"{g.text} eager")
    if eng.cc >= 90:
        short_g, split_g = GemvForm(False, None, 0), GemvForm(True, 1, 8)
        for a, b in ((short_g, split_g), (split_g, short_g)):
            eng.use(Forms(True, a, b))
            if eng.short_capacity:
                check_gemv_launches(eng, eng.short_capacity, a)
                assert eng.gemv_form_of(eng.short_capacity) == a and eng.gemv_form_of(eng.short_capacity + 1) == b
            check_gemv_launches(eng, None, b)
            assert eng.generate(prompt, 24) == want, (a.text, b.text)
    else:
        for text in ("split:ws", "split:ring/l2=8", "short:ring;split:ws-pre1"):
            with pytest.raises(AtomflowError, match="sm_90"):
                eng.use(Forms.parse(text))
    default = default_forms(fmt, eng.cc, eng.short_capacity)  # the forms `want` was generated with
    eng.use(Forms(False, eng.forms.gemv, eng.forms.gemv_split))
    assert eng.att_caps == [] and list(eng.variants) == [None]
    got = eng.generate(prompt, 24)
    if got != want:  # the split kernel sums in another order than the short one: a near-tie may flip, nothing more
        j = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        eng.use(default)
        eng.generate(prompt + want[:j], 1)
        logits = np.sort(eng.arena["logits"].get())
        margin, scale = float(logits[-1] - logits[-2]), float(np.abs(logits).max())
        assert margin <= 1e-2 * scale, f"split-only token {j} differs at a margin of {margin:.4g} (scale {scale:.4g})"


def launch_shape(launches) -> list:
    """What makes a step's form: each launch's kernel, grid, block, shared memory and integer arguments (the
    pointers differ between engines; the slot counts and L2 prefetch sizes do not)."""
    return [(ln.name, ln.grid, ln.block, ln.shmem, [int(x) for x in ln.args if isinstance(x, (int, np.integer))])
            for ln in launches]


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_tune_chooses_among_candidates(tiny_model, fmt):
    """measure.tune.tune: every (GEMV form, attention bucket) pair of forms.candidates timed at the short bucket's
    longest length and half of it, the fastest kept; with the short attention chosen and lengths beyond its capacity
    (max_seq 900), the split bucket's GEMV form timed on its own at max_seq and half-way from the capacity. Nothing
    is left behind (the engine's forms and position); the tuned forms' steps are those of an engine given them, and
    their tokens those of the default forms across the bucket boundary."""
    from atomflow_bench.measure.tune import tune

    eng = Engine(tiny_model, weights=fmt, max_seq=900)
    default, cap = eng.forms, eng.short_capacity
    gemvs, shorts = candidates(fmt, eng.cc, cap)
    forms, rep = tune(eng)
    assert isinstance(forms, Forms)
    assert forms.short_attention in shorts and forms.gemv in gemvs and forms.gemv_split in gemvs
    length = min(cap or 900, 900)
    assert rep["lengths"] == sorted({length // 2, length})
    pairs = {f"{'short' if s else 'split'}:{g.text}" for g in gemvs for s in shorts}
    assert len(pairs) == len(gemvs) * len(shorts) and set(rep["step_us"]) == pairs
    assert all(np.isfinite(v) and v > 0 for v in rep["step_us"].values())
    chosen = f"{'short' if forms.short_attention else 'split'}:{forms.gemv.text}"
    assert chosen == min(rep["step_us"], key=rep["step_us"].get)
    if forms.short_attention and len(gemvs) > 1:
        sp = rep["split"]
        assert sp["lengths"] == [(cap + 1 + 900) // 2, 900]
        assert set(sp["step_us"]) == {g.text for g in gemvs}
        assert all(np.isfinite(v) and v > 0 for v in sp["step_us"].values())
        assert forms.gemv_split.text == min(sp["step_us"], key=sp["step_us"].get)
    else:
        assert "split" not in rep and forms.gemv_split == forms.gemv
    assert eng.forms == default  # tune only measures: resolve puts the forms on the engine
    assert eng.position == int(eng.arena["pos"].get()[0]) == 0
    prompt = crossing_prompt(eng)
    want = eng.generate(prompt, 24)
    eng.use(forms)
    given = Engine(tiny_model, weights=fmt, max_seq=900, forms=forms)
    assert list(eng.variants) == list(given.variants) == ([cap, None] if forms.short_attention and cap else [None])
    for key in eng.variants:
        assert launch_shape(eng.variants[key]) == launch_shape(given.variants[key]), key
    if forms.short_attention and cap:
        assert (eng.gemv_form_of(cap), eng.gemv_form_of(cap + 1), eng.gemv_form_of(900)) == (
            forms.gemv, forms.gemv_split, forms.gemv_split)
    assert eng.generate(prompt, 24) == want
    assert given.generate(prompt, 24) == want


def test_resolve_saves_reuses_and_retunes(tiny_model, tuning_home, monkeypatch):
    """measure.tune.resolve: the first call tunes and saves under $ATOMFLOW_HOME/tuning; a fresh engine of the same
    key gets the saved forms without timing anything; retune=True times again; given forms (argument, else
    ATOMFLOW_FORMS) win over a saved choice; with tune_missing=False a key with nothing saved (or an unreadable
    file) gets the default forms and nothing is timed. Tokens under the tuned forms are those of the defaults."""
    from atomflow_bench.measure import tune as tune_mod

    calls = []
    real_tune = tune_mod.tune

    def counting_tune(engine, *args, **kw):
        calls.append(engine)
        return real_tune(engine, *args, **kw)

    monkeypatch.setattr(tune_mod, "tune", counting_tune)
    eng = Engine(tiny_model, weights="fp8", max_seq=64)
    default = eng.forms
    first = tune_mod.resolve(eng)
    assert calls == [eng] and first["origin"] == "tuned now" and "not_saved" not in first
    path = Path(first["path"])
    assert path.is_file() and path.parent.parent == tuning_home / "tuning"
    assert path == tune_mod.path_of(tune_mod.key(eng), 64)
    saved = json.loads(path.read_text())
    assert saved["schema"] == tune_mod.SCHEMA and saved["forms"] == first["forms"]
    assert saved["key"] == tune_mod.key(eng) and saved["max_seq"] == 64 and saved["key"]["weights"] == "fp8"
    assert saved["timed"] == first["timed"] and first["timed"]["lengths"] == [32, 64]
    assert eng.forms == Forms.parse(first["forms"]) and eng.forms.text == first["forms"]

    fresh = Engine(tiny_model, weights="fp8", max_seq=64)
    assert fresh.forms == default
    again = tune_mod.resolve(fresh)
    assert again == {"forms": first["forms"], "origin": "saved", "path": first["path"]} and calls == [eng]
    assert fresh.forms == eng.forms
    assert tune_mod.resolve(fresh, tune_missing=False)["origin"] == "saved" and calls == [eng]

    retuned = tune_mod.resolve(fresh, retune=True)
    assert calls == [eng, fresh] and retuned["origin"] == "tuned now" and retuned["path"] == first["path"]
    assert "timed" in retuned and fresh.forms.text == retuned["forms"]
    assert json.loads(path.read_text())["forms"] == retuned["forms"]

    ring = Forms.parse("split:ring/l2=0")
    assert tune_mod.resolve(fresh, given=ring) == {"forms": "split:ring/l2=0", "origin": "given"}
    assert fresh.forms == ring and list(fresh.variants) == [None]
    monkeypatch.setenv("ATOMFLOW_FORMS", "short:ring/l2=0")
    assert tune_mod.resolve(fresh) == {"forms": "short:ring/l2=0;split:ring/l2=0", "origin": "given"}
    assert fresh.forms == Forms.parse("short:ring/l2=0")
    assert tune_mod.resolve(fresh, given=ring)["forms"] == ring.text and fresh.forms == ring  # the argument wins
    monkeypatch.setenv("ATOMFLOW_FORMS", "fast")
    with pytest.raises(AtomflowError, match="forms"):
        tune_mod.resolve(fresh)
    monkeypatch.delenv("ATOMFLOW_FORMS")
    assert calls == [eng, fresh]

    other = Engine(tiny_model, weights="fp8", max_seq=48)  # another max_seq: validate/generate take the nearest tune
    assert tune_mod.path_of(tune_mod.key(other), 48) != path
    assert tune_mod.resolve(other, tune_missing=False) == {"forms": retuned["forms"], "origin": "saved",
                                                           "path": str(path)}
    other.use(default)
    assert calls == [eng, fresh]
    assert [p for p in (tuning_home / "tuning").rglob("*") if p.is_file()] == [path]
    path.write_text("{")  # unreadable: as if nothing were saved
    assert tune_mod.resolve(Engine(tiny_model, weights="fp8", max_seq=64), tune_missing=False)["origin"] == "default"
    assert calls == [eng, fresh]

    prompt = [int(t) for t in np.random.default_rng().integers(0, 1000, 20)]  # 20 + 24 - 1 <= 48
    fresh.use(Forms.parse(retuned["forms"]))  # both tunes' forms against the defaults
    assert eng.generate(prompt, 24) == fresh.generate(prompt, 24) == other.generate(prompt, 24)


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_graph_bit_identical_to_eager(tiny_model, fmt):
    eng = Engine(tiny_model, weights=fmt, max_seq=200)
    prompt = [int(t) for t in np.random.default_rng().integers(0, 1000, 70)]  # > one attention chunk
    eager = eng.generate(prompt, 40, graph=False)
    eager_logits = eng.arena["logits"].get()
    graph = eng.generate(prompt, 40, graph=True)
    np.testing.assert_array_equal(graph, eager)
    np.testing.assert_array_equal(eng.arena["logits"].get(), eager_logits)


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_pdl_on_off_same_tokens(tiny_model, fmt, monkeypatch):
    """Programmatic dependent launch: on by default from sm_90 (every launch after the step's first carries it),
    off with ATOMFLOW_PDL=0 or pdl=False; the argument wins over the environment. Both give the same tokens and
    logits, graph and eager, across the bucket boundary. The position-holding step that tune times
    (step.hold_position) keeps each launch's PDL and leaves the position alone."""
    from atomflow_bench.gpu.graph import StepGraph
    from atomflow_bench.gpu.step import hold_position

    monkeypatch.delenv("ATOMFLOW_PDL", raising=False)
    on = Engine(tiny_model, weights=fmt, max_seq=900)
    assert on.pdl == (on.cc >= 90)
    off = Engine(tiny_model, weights=fmt, max_seq=900, pdl=False)
    monkeypatch.setenv("ATOMFLOW_PDL", "0")
    assert Engine(tiny_model, weights=fmt, max_seq=64).pdl is False
    if on.cc >= 90:
        assert Engine(tiny_model, weights=fmt, max_seq=64, pdl=True).pdl is True
    assert off.pdl is False and list(off.variants) == list(on.variants)
    for key in on.variants:
        assert not any(ln.pdl for ln in off.variants[key])
        launches = on.variants[key]
        assert [ln.pdl for ln in launches] == [False] + [on.pdl] * (len(launches) - 1)
        held = hold_position(launches)
        assert [ln.pdl for ln in held] == [ln.pdl for ln in launches]
        assert all(a is b for a, b in zip(held[:-1], launches[:-1]))
        assert held[-1].name == launches[-1].name == "gemv_fp16_f32_argmax"
        assert (int(launches[-1].args[-1]), int(held[-1].args[-1])) == (1, 0)
    prompt = crossing_prompt(on)
    want = off.generate(prompt, 24)
    want_logits = off.arena["logits"].get()
    for eng, graph in ((on, True), (on, False), (off, False)):
        assert eng.generate(prompt, 24, graph=graph) == want, (eng.pdl, graph)
        np.testing.assert_array_equal(eng.arena["logits"].get(), want_logits)
    on.reset(prompt)
    on.run(10)
    on.stream.synchronize()
    state = {k: on.arena[k].get() for k in ("pos", "cur_token", "out_tokens")}
    g = StepGraph(hold_position(on.launches), on.stream)
    g.replay(5)
    on.stream.synchronize()
    pos = int(on.arena["pos"].get()[0])
    assert pos == on.position == 10 and int(on.arena["cur_token"].get()[0]) == prompt[10]
    for k, v in state.items():  # advance = 0: the step state is left as it is
        np.testing.assert_array_equal(on.arena[k].get(), v, err_msg=k)
    on.run(len(prompt) - 1 + 24 - pos)  # the held replays left nothing behind: the decode goes on as before
    assert on.tokens(len(prompt) - 1, 24) == want


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_compiles_only_what_the_step_launches(tiny_model, fmt, monkeypatch):
    """An engine compiles the .cu files of the kernels its step launches (and fp8's load-time quantiser), nothing
    else: no fp8 GEMVs for fp16 weights, no lab or timing kernel, the split attention only with its bucket. The
    step's tail is one fused lm_head launch (final norm, logits and argmax)."""
    monkeypatch.delenv("ATOMFLOW_KERNEL_DEFINES", raising=False)
    eng = Engine(tiny_model, weights=fmt, max_seq=64)
    files = eng.lib.compiled_files()
    att = {"attention_short.cu"} if eng.att_caps else {"attention.cu"}
    fp8 = {"gemv_fp8.cu", "quantize_fp8.cu"}
    assert set(files) == {"embedding.cu", "lm_head.cu"} | att | (fp8 if fmt == "fp8" else {"gemv_fp16.cu"})
    assert len(files) == len(set(files))
    if fmt == "fp16":
        assert not fp8 & set(files)
    else:
        assert fp8 <= set(files)
    lab = {p.name for p in LAB_KERNELS_DIR.glob("*.cu")}
    assert "probe_stream.cu" in lab and not lab & set(files) and "spin.cu" not in files
    both = Engine(tiny_model, weights=fmt, max_seq=900)
    assert set(both.lib.compiled_files()) == set(files) | ({"attention.cu", "attention_short.cu"} if both.att_caps
                                                           else set())
    L = eng.cfg.num_hidden_layers
    names = [ln.name for ln in eng.launches]
    assert len(names) == 2 + 5 * L
    assert names[0] == "embed_lookup" and names[-2:] == [f"gemv_{fmt}_resid", "gemv_fp16_f32_argmax"]
    assert set(eng.launches[-1].taps) == {"final_norm", "logits"}


@pytest.mark.parametrize("knob", ["LMHEAD_NORM=0", "LMHEAD_ARGMAX=0", "LMHEAD_L2_KEEP=4", "GEMV_NEXT_L2=1",
                                  "GEMV_NEXT_L2_GU=1", "ATT_CLUSTER=2", "ATT_COMBINE_SLICES=1", "ATT_BULK=1",
                                  "GEMV_WS=1", "GEMV_STAGES=4"])
def test_removed_kernel_defines_refused(tiny_model, monkeypatch, knob):
    """ATOMFLOW_KERNEL_DEFINES (and kernel_defines) take only what the kernels read (ATT_TMA, GEMV_BULK and the
    instruments): a removed knob is a one-line AtomflowError, not a silently different build."""
    monkeypatch.setenv("ATOMFLOW_KERNEL_DEFINES", knob)
    with pytest.raises(AtomflowError, match="ATOMFLOW_KERNEL_DEFINES"):
        Engine(tiny_model, weights="fp16", max_seq=64)
    monkeypatch.setenv("ATOMFLOW_KERNEL_DEFINES", " ".join(INSTRUMENTED))
    with pytest.raises(AtomflowError, match="ATOMFLOW_KERNEL_DEFINES"):
        Engine(tiny_model, weights="fp16", max_seq=64, kernel_defines=(knob,))
    # the check can pass (the run record's instrumented build: no compile of its own)
    assert set(INSTRUMENTED) <= set(Engine(tiny_model, weights="fp16", max_seq=64).lib.defines)


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_group8_matches_reference(tmp_path, fmt):
    """8 q heads per one kv head (the attention kernel's largest group) through the whole engine."""
    cfg = ModelConfig(vocab_size=300, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=8, num_key_value_heads=1, head_dim=64)
    write_random_model(cfg, tmp_path / "g8", seed=int(np.random.SeedSequence().entropy % 2**31))
    assert_matches_reference(tmp_path / "g8", fmt, prompt_len=40, n_new=4, label="group 8")


def test_no_device_allocation_during_decode(tiny_model):
    import cupy as cp

    eng = Engine(tiny_model, weights="fp8", max_seq=128)
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


def test_profile_roles_in_graph(tiny_model):
    """`profile`'s graph-mode breakdown: every role of the step left out once, the position never advanced
    (step.hold_position), bytes per role from the launches, and the eager table covers the step; the record names
    the forms the engine ran and the profiled bucket's attention and layer-GEMV form."""
    from atomflow_bench.measure.profile import profile_step, role_marginals, step_role
    from atomflow_bench.measure.timing import copy_bandwidth

    eng = Engine(tiny_model, weights="fp8", max_seq=200)
    if eng.cc >= 90:  # not the defaults, and a split bucket form that must not be reported for length 40
        eng.use(Forms.parse("short:ws-pre1/l2=4;split:ring/l2=0"))
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
    assert p["forms_used"] == eng.forms.text
    assert p["forms"] == {"length": 40, "attention": "short" if eng.att_caps else "split",
                          "gemv": eng.gemv_form_of(40).text}
    if eng.cc >= 90 and eng.att_caps:
        assert p["forms"]["gemv"] == "ws-pre1/l2=4"
    again = role_marginals(eng, copy, replays=3)
    assert int(eng.arena["pos"].get()[0]) == pos_after  # the role graphs leave the position alone
    assert again["length"] == m["length"]


@pytest.mark.parametrize("att", ["short", "split"])
def test_timeline_instrument(tiny_model, att):
    """`lab.timeline.record`: the instrumented build decodes the same tokens as the plain one; one replay's
    records cover every block of every launch, their grid ids map onto the step's launches in order (else
    timeline.launch_times raises), and the per-role spans add up to the replay. Both attention kernels."""
    from lab import timeline
    from atomflow_bench.measure.profile import step_role

    forms = forms_with("fp8", att == "short")
    t = timeline.record(tiny_model, "fp8", context=40, replays=4, copy={"median": 3000.0}, plain_step_us=1.0,
                        forms=forms)
    prompt = [int(x) for x in np.random.default_rng().integers(0, 1000, 50)]
    plain = Engine(tiny_model, weights="fp8", max_seq=t["max_seq"], forms=forms)  # the launch shapes recorded
    inst = Engine(tiny_model, weights="fp8", max_seq=t["max_seq"], forms=forms, kernel_defines=(TIMELINE_DEFINE,))
    assert TIMELINE_DEFINE in inst.lib.defines and TIMELINE_DEFINE not in plain.lib.defines
    assert inst.generate(prompt, 16) == plain.generate(prompt, 16)
    L = plain.cfg.num_hidden_layers
    assert {r["role"]: r["count"] for r in t["rows"]} == {
        "embed_lookup": 1, "wqkv": L, "attention_decode": L, "wo": L, "wgu": L, "wd": L,
        "lm_head": 1}  # the final norm and the argmax are lm_head's prologue and epilogue
    assert [x["role"] for x in t["per_launch"]] == [step_role(ln) for ln in plain.launches]
    assert t["blocks_per_step"] == sum(int(np.prod(ln.grid)) for ln in plain.launches)
    assert t["length"] == 40 + 1 + (4 - 1) // 2  # the median position of the recorded replays
    assert t["attention"] == ("short" if plain.att_caps else "split") == att  # the forms handed in
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


def test_run_record_forms_and_instruments(tiny_model, tuning_home, monkeypatch):
    """The `run` record (measure.decode.benchmark): "forms" is resolve's answer (tuned now, then saved for the same
    key, given when passed), "compiled" the .cu files the engine built, and a build with a timing instrument
    (AF_NO_WAIT, AF_NO_SCALES: wrong outputs on purpose) is marked in "instrument" and "kernel_defines"."""
    from atomflow_bench.measure import context
    from atomflow_bench.measure.context import RunContext
    from atomflow_bench.measure.decode import benchmark, synthetic_prompt

    # One metered pass per record: at least ENERGY_MIN_S of these 8-token passes would be thousands of passes, each
    # with its NVML reads and sampler thread (minutes here); test_run_record_energy checks the energy figures.
    energy_passes = context.energy_passes
    monkeypatch.setattr(context, "energy_passes",
                        lambda engine, prompt, tokens, meter: energy_passes(engine, prompt, tokens, meter, passes=1))
    args = dict(weights="fp8", context=16, tokens=8, repeats=1, eager_tokens=4)
    plain = benchmark(RunContext("tiny", tiny_model, "test"), **args)
    f = plain["forms"]
    assert f["origin"] == "tuned now" and Path(f["path"]).parent.parent == tuning_home / "tuning"
    assert Forms.parse(f["forms"]).text == f["forms"]
    assert plain["instrument"] == [] and not any(d.startswith("AF_") for d in plain["kernel_defines"])
    assert plain["eager"]["same_tokens"] is True and len(plain["generated"]["token_ids"]) == 8
    # the first token is the TTFT's (the batched prefill and its lm_head), the other 7 are TPOT samples
    assert plain["tpot_ms"]["n"] == 7 and plain["ttft_ms"]["n"] == 1
    pf, tc = plain["prefill"], plain["tensor_core_tflops"]
    assert pf["path"] == "batched" and pf["prompt_tokens"] == 16 and pf["chunk"] >= 16 and pf["weights_form"] == "copies"
    assert pf["attention"] == ("wgmma" if wgmma_default() else "mma.sync")
    assert pf["tok_per_s"] == pytest.approx(16 / (plain["ttft_ms"]["median"] * 1e-3))
    assert 10 < tc["median"] < 5000 and tc["shape"] == [8192] * 3  # TFLOPS of a fp16 GEMM on any recent GPU
    assert 0 < pf["pct_of_peak"] < 100
    other = Engine(tiny_model, weights="fp8", max_seq=24)  # the timed tokens are the prefill + greedy steps' tokens
    assert other.generate(synthetic_prompt(other.cfg.vocab_size, 16), 8, prefill=True) == plain["generated"]["token_ids"]
    assert {"gemv_fp8.cu", "quantize_fp8.cu", "embedding.cu"} <= set(plain["compiled"])
    assert "spin.cu" not in plain["compiled"] and "probe_stream.cu" not in plain["compiled"]
    for gone in ("attention_choice", "gemv_choice", "l2_keep"):
        assert gone not in plain
    again = benchmark(RunContext("tiny", tiny_model, "test"), **args)
    assert again["forms"] == {"forms": f["forms"], "origin": "saved", "path": f["path"]}
    assert again["generated"]["token_ids"] == plain["generated"]["token_ids"]
    monkeypatch.setenv("ATOMFLOW_KERNEL_DEFINES", " ".join(INSTRUMENTED))
    inst = benchmark(RunContext("tiny", tiny_model, "test"), **args, forms=Forms.parse(f["forms"]))
    assert inst["forms"] == {"forms": f["forms"], "origin": "given"}
    assert inst["instrument"] == ["AF_NO_WAIT=15", "AF_NO_SCALES=1"] == list(INSTRUMENTED)
    assert {"AF_NO_WAIT=15", "AF_NO_SCALES=1"} <= set(inst["kernel_defines"])
    assert inst["launches_per_step"] == plain["launches_per_step"] and inst["pdl"] == plain["pdl"]


def test_gemv_bench_isolated_and_chained():
    """`atomflow-bench gemv`: every GEMV shape of a (tiny) model in both formats, lm_head once, each timed as
    isolated launches and as a PDL chain captured in one graph; bytes per launch from the operands."""
    from atomflow_bench.gpu.ops import kernel_lib
    from atomflow_bench.measure.profile import gemv_bench, gemv_shapes

    cfg = tiny_config(tied=False)
    lib = kernel_lib()
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
    assert g["chained_pdl"] == (device_cc() >= 90)


def test_run_record_energy(tiny_model, tuning_home):
    """`run` records the energy of the graph replays through NVML (measure/power.py, bench.energy_passes: passes of
    their own after the timed repeats, at least ENERGY_MIN_S of replays) on the GPU CuPy runs on (by PCI bus id):
    positive J/token, a plausible average power, one region per pass; `unavailable` is accepted only where pynvml is
    not installed (then skipped)."""
    import cupy as cp

    from atomflow_bench.measure.context import RunContext
    from atomflow_bench.measure.decode import ENERGY_MIN_S, benchmark
    from atomflow_bench.measure.power import COUNTER, SAMPLES, bus_key

    tokens, repeats = 1024, 3
    rec = benchmark(RunContext("tiny", tiny_model, "test"), weights="fp16", context=16, tokens=tokens,
                    repeats=repeats, eager_tokens=4, forms=forms_with("fp16", True))
    e = rec["energy"]
    if "unavailable" in e:
        pytest.importorskip("pynvml", reason=f"energy unavailable: {e['unavailable']}")
        pytest.fail(f"pynvml is installed, yet energy is unavailable: {e['unavailable']}")
    assert e["joules_per_token"] > 0 and 10 <= e["avg_watts"] <= 2000, e
    passes = e["segments"]
    assert passes >= 1 and e["tokens"] == tokens * passes and e["event_seconds"] >= ENERGY_MIN_S
    assert e["method"] == COUNTER or e["method"].startswith(SAMPLES)
    assert e["joules"] == pytest.approx(e["joules_per_token"] * e["tokens"])
    assert e["avg_watts"] == pytest.approx(e["joules"] / e["seconds"])
    assert 0 < e["event_seconds"] <= e["seconds"]
    w = e["watts"]
    assert w["n"] >= 2 * passes and 0 < w["min"] <= w["median"] <= w["max"] < 2000
    assert bus_key(e["gpu_pci_bus_id"]) == bus_key(cp.cuda.Device().pci_bus_id)
    if e["method"] == COUNTER and e["sampled_joules"]:
        assert 0.5 < e["sampled_joules"] / e["counter_joules"] < 2.0, e  # two NVML readings of one region agree


# ---- the synthetic Llama-3.2-1B shape: the real vocabulary and depth; in fp16 the only arena here past 2^31 bytes ----
LLAMA1B_LENGTHS = (5, 4)  # prompt, new tokens


def llama1b_references(model_dir: str) -> dict:
    """The synthetic Llama-3.2-1B checkpoint written to `model_dir` and the NumPy reference's runs on it in both
    formats (reference_run's entries). On the CPU alone: about a minute, most of it the fp8 reference quantising
    ~1B weights, so llama1b_in_background runs it in a process of its own while the other tests use the GPU."""
    make_synthetic(CATALOG["llama-3.2-1b"], Path(model_dir), seed=1)
    for fmt in ("fp16", "fp8"):
        reference_run(model_dir, fmt, *LLAMA1B_LENGTHS)
    return _references


@pytest.fixture(scope="module", autouse=True)
def llama1b_in_background(request, tmp_path_factory):
    """(model directory, future of llama1b_references), started before this module's first test when a llama1b test
    is selected (else None). A spawned process: the parent holds a CUDA context, the child needs none."""
    if not any(getattr(it, "module", None) is request.module and "llama1b" in it.name for it in request.session.items):
        yield None
        return
    d = tmp_path_factory.mktemp("llama1b") / "model"
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield d, pool.submit(llama1b_references, str(d))


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_llama1b_engine_matches_reference(llama1b_in_background, fmt):
    model_dir, refs = llama1b_in_background
    _references.update(refs.result())
    assert_matches_reference(model_dir, fmt, *LLAMA1B_LENGTHS, label="llama-3.2-1b synthetic")
