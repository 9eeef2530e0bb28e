"""validate's prefill path on the GPU, against HF transformers (fp32, CPU) on a tiny random model.

* fp16 and fp8: the prefill section passes with the format's thresholds, every probe but final_norm and logits judged
  at every position (the prompt's through the batched prefill, in chunks of 8 or in the product's one chunk), those
  two at the decode steps that continue from the prefill's cache; the decode path passes too;
* a prefill broken on purpose (layer 1's row-major o_proj copy zeroed; the decode step's tiled weights untouched)
  fails the prefill section first at layers.1.attn, every earlier probe still passing, while the decode path passes:
  the verdict is FAIL.
"""
from __future__ import annotations

import numpy as np
import pytest

from atomflow_bench.validate import check, truth

from test_engine_gpu import tiny_config, write_random_model

pytestmark = pytest.mark.gpu

PROMPT, STEPS, CHUNK = 21, 6, 8  # 20 prompt positions through the prefill: chunks of 8 + 8 + 4


@pytest.fixture(scope="module")
def model_truth(tmp_path_factory):
    pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("validate-prefill")
    write_random_model(tiny_config(False), d / "model", seed=int(np.random.SeedSequence().entropy % 2**31))
    prompt = [int(t) for t in np.random.default_rng().integers(0, 1000, PROMPT)]
    truth.generate_truth(d / "model", d / "truth", steps=STEPS, prompt_ids=prompt, device="cpu")
    return d / "model", d / "truth"


@pytest.fixture(autouse=True)
def own_home(tmp_path, monkeypatch):
    """No saved tune and no kernel -D's from the caller's environment: the default forms."""
    monkeypatch.setenv("ATOMFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ATOMFLOW_FORMS", raising=False)
    monkeypatch.delenv("ATOMFLOW_KERNEL_DEFINES", raising=False)


@pytest.mark.parametrize("chunk", [CHUNK, None], ids=["chunk8", "product-chunk"])
@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_prefill_path_passes(model_truth, fmt, chunk):
    model, tdir = model_truth
    res = check.validate(model, weights=fmt, truth_dir=tdir, backend="gpu", prefill_chunk=chunk)
    n_pos = PROMPT + STEPS - 1
    pre = res["prefill"]
    assert pre is not None and res["backend"]["kind"] == "gpu", res["notes"]
    assert pre["chunk"] == (CHUNK if chunk else PROMPT + STEPS)  # the product's 512, clamped to the max_seq
    assert pre["batched_positions"] == PROMPT and pre["decode_positions"] == STEPS - 1
    by = {p["name"]: p for p in pre["probes"]}
    assert list(by) == [p["name"] for p in res["probes"]]
    for name, p in by.items():
        assert p["positions"] == (STEPS if name in ("final_norm", "logits") else n_pos), name
    ps, s = pre["summary"], res["summary"]
    print(f"\n{fmt} chunk {pre['chunk']}: prefill worst cos {ps['min_cos']:.7f}, rel L2 {ps['max_rel_l2']:.2e}, "
          f"KL {ps['kl_last']:.2e}, greedy {ps['greedy_agree']}/{ps['greedy_total']}; decode worst cos "
          f"{s['min_cos']:.7f}, rel L2 {s['max_rel_l2']:.2e}")
    assert ps["pass"] and ps["probes_pass"] == ps["probes_total"] == len(res["probes"]), ps["first_fail"]
    assert ps["greedy_total"] == STEPS and len(ps["engine_ids"]) == STEPS
    assert s["pass"] and not any("prefill" in n for n in res["notes"])


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_broken_prefill_fails(model_truth, fmt, monkeypatch):
    import atomflow_bench.gpu.prefill as prefill

    made = prefill.row_major

    def zero_o_proj(a, name, *args):
        w = made(a, name, *args)
        if name == "L1.wo":
            w.fill(0)
        return w

    monkeypatch.setattr(prefill, "row_major", zero_o_proj)
    model, tdir = model_truth
    res = check.validate(model, weights=fmt, truth_dir=tdir, backend="gpu", prefill_chunk=CHUNK)
    s, pre = res["summary"], res["prefill"]
    assert s["probes_pass"] == s["probes_total"] and s["kl_pass"]  # the decode path is untouched
    assert pre["summary"]["first_fail"] == "layers.1.attn" and not pre["summary"]["pass"]
    assert not s["pass"]
    by = {p["name"]: p for p in pre["probes"]}
    for name in ("embed", "layers.0.attn", "layers.0.mlp"):
        assert by[name]["pass"], name
    bad = by["layers.1.attn"]
    assert bad["worst_pos"] < PROMPT - 1  # at a position the prefill computed
    th = res["thresholds"]
    assert 1 - bad["cos"] > 2 * (1 - th["cos_min"]) or bad["rel_l2"] > 2 * th["rel_max"]  # by a clear margin
