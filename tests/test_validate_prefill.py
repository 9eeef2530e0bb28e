"""validate's prefill path on the CPU: the judging of positions that lack probes, the record's "prefill" section and
its part in the verdict, the report's lines, and the note where the path is not checked.

The engine is replaced by the truth's own vectors (exact) with chosen faults, so each check knows its answer; the GPU
side (the prefill's taps against HF) is tests/test_validate_prefill_gpu.py.
"""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from rich.console import Console

from atomflow_bench.gpu.prefill import ROLES
from atomflow_bench.validate import check, metrics, print_result, probes, truth
from helpers_cli import invoke

TH = metrics.THRESHOLDS["fp16"]


class TableTruth:
    """A truth of random vectors, `get(variant, position, probe)` as validate.truth.Truth's."""

    def __init__(self, n_pos: int, names: list[str], predicted: list[int], seed: int = 0):
        rng = np.random.default_rng(seed)
        self.v = {(s, n): rng.standard_normal(32).astype(np.float32) for s in range(n_pos) for n in names}
        self._predicted = predicted

    def get(self, variant, pos, probe):
        return self.v[(pos, probe)]

    def predicted(self, variant):
        return self._predicted


def exact(t: TableTruth, n_pos: int, names: list[str]) -> list[dict]:
    return [{n: t.get("fp16", s, n).copy() for n in names} for s in range(n_pos)]


def test_worst_positions_judges_each_probe_where_it_is():
    names = probes.probe_names(1)  # embed, layers.0.attn, layers.0.mlp, final_norm, logits
    n_pos, P = 6, 4
    t = TableTruth(n_pos, names, [0, 0, 0])
    pos = exact(t, n_pos, names)
    for s in range(P - 1):  # the prefill's positions: no final_norm, no logits
        del pos[s]["final_norm"], pos[s]["logits"]
    pos[1]["layers.0.attn"] = -pos[1]["layers.0.attn"]  # a fault at a prefill position
    worst, kls = metrics.worst_positions(pos, t, "fp16", names)
    assert list(worst) == names
    assert {n: w["positions"] for n, w in worst.items()} == {"embed": 6, "layers.0.attn": 6, "layers.0.mlp": 6,
                                                             "final_norm": 3, "logits": 3}
    assert worst["layers.0.attn"]["worst_pos"] == 1 and worst["layers.0.attn"]["cos"] == pytest.approx(-1.0)
    assert worst["final_norm"]["worst_pos"] >= P - 1 and worst["embed"]["cos"] == pytest.approx(1.0)
    assert len(kls) == n_pos - (P - 1) and max(kls) == pytest.approx(0.0, abs=1e-12)
    rows = metrics.judge_probes(worst, names, TH)
    assert [r["name"] for r in rows if not r["pass"]] == ["layers.0.attn"]
    # a probe that no position has gets no row (it is not judged as a perfect 1.0)
    for p in pos:
        p.pop("layers.0.mlp")
    worst, _ = metrics.worst_positions(pos, t, "fp16", names)
    assert "layers.0.mlp" not in worst
    assert [r["name"] for r in metrics.judge_probes(worst, names, TH)] == ["embed", "layers.0.attn", "final_norm",
                                                                            "logits"]


def test_judge_path_summary():
    names = probes.probe_names(2)
    n_pos, P = 8, 5
    t = TableTruth(n_pos, names, [7, 7, 7, 7])
    pos = exact(t, n_pos, names)
    for s in range(P - 1):
        del pos[s]["final_norm"], pos[s]["logits"]
    for s in range(P - 1, n_pos):  # the engine's argmax: 7 at two of the four decode positions
        pos[s]["logits"] = pos[s]["logits"].copy()
        if s % 2:
            pos[s]["logits"][7] = 100.0
    rows, s = check.judge_path(pos, t, "fp16", names, P)
    assert s["greedy_total"] == 4 and s["greedy_agree"] == 2 and len(s["engine_ids"]) == 4
    assert s["probes_total"] == len(names) and s["first_fail"] == "logits"
    assert not s["kl_pass"] and not s["pass"]  # the changed logits of the last position
    for j in range(P - 1, n_pos):
        pos[j]["logits"] = t.get("fp16", j, "logits").copy()
    pos[2]["layers.1.mlp"] = pos[2]["layers.1.mlp"] * 1.2  # a scale error: rel L2 0.2
    rows, s = check.judge_path(pos, t, "fp16", names, P)
    assert s["kl_pass"] and s["first_fail"] == "layers.1.mlp" and s["probes_pass"] == len(names) - 1
    assert not s["pass"] and s["max_rel_l2"] == pytest.approx(0.2, rel=1e-5)


# ---- the prefill's taps to positions (probes.prefill_probes) with a stand-in engine -------------------------------
class Rows:
    """What Prefill.fill hands a tap: h[:m], with `.get()` to the host."""

    def __init__(self, a):
        self.a, self.shape = a, a.shape

    def get(self):
        return self.a


class StandInPrefill:
    """Prefill.fill's contract: chunks of `chunk` positions up to `upto`, every op tapped in chunk_ops' order with the
    chunk's rows; row r of the chunk at `start` carries position start + r (and the op's number) in its values."""

    def __init__(self, eng, chunk, whole):
        self.eng, self.chunk = eng, chunk
        self.lm_head = "the lm_head launch" if whole else None  # one GPU: the prefill makes the first token

    def fill(self, ids, graph=True, upto=None, taps=None):
        assert self.eng.cache_zeroed and self.eng.position == 0
        assert (upto is None) == (self.lm_head is not None)
        n = len(ids) if upto is None else upto
        ops = ["embed"] + [f"layers.{i}.{r}" for i in range(self.eng.cfg.num_hidden_layers) for r in ROLES]
        for start in range(0, n, self.chunk):
            m = min(self.chunk, n - start)
            last = ["last_row", "lm_head"] if upto is None and start + m == n else []
            for k, op in enumerate(ops + last):
                if op == "lm_head":  # the last row's final norm and logits, where the step's lm_head leaves them
                    self.eng.arena["xnorm"] = Rows(np.array([n - 1, -2, 0], np.float32))
                    self.eng.arena["logits"] = Rows(np.array([n - 1, -3, 0], np.float32))
                taps(op, Rows(np.array([[start + r, k, 0] for r in range(m)], np.float32)))
        self.eng.position = n


class StandInEngine:
    prefills = True

    def __init__(self, n_layers, chunk, whole=True):
        from types import SimpleNamespace

        self.cfg = SimpleNamespace(num_hidden_layers=n_layers)
        self.pf, self.position, self.cache_zeroed = StandInPrefill(self, chunk, whole), 0, False
        self.arena = {"k_cache": self, "v_cache": self}  # its own fill(0) notes the zeroed cache
        self.stream = self  # `with eng.stream:`

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def fill(self, v):
        self.cache_zeroed = v == 0

    def prefiller(self):
        return self.pf

    def reset(self, ids):
        self.position, self.cache_zeroed = 0, False

    def step_eager(self, taps=False):
        s, self.position = self.position, self.position + 1
        return {n: np.array([s, -1, 0.0], np.float32) for n in probes.probe_names(self.cfg.num_hidden_layers)}


@pytest.mark.parametrize("whole", [True, False])  # one GPU: the lm_head on the last row; tensor parallel: not
@pytest.mark.parametrize("chunk", [1, 3, 4, 64])
def test_prefill_taps_land_at_their_positions(chunk, whole):
    from types import SimpleNamespace

    L, P, n_pos = 2, 9, 12
    names = probes.probe_names(L)
    eng = StandInEngine(L, chunk, whole)
    got = probes.prefill_probes(eng, SimpleNamespace(whole_logits=lambda e, z: z), list(range(n_pos + 1)), P, n_pos,
                                names)
    batched = P if whole else P - 1
    assert got["chunk"] == chunk and len(got["positions"]) == n_pos and got["batched"] == batched
    op_number = {"embed": 0, **{f"layers.{i}.{p}": 1 + i * len(ROLES) + ROLES.index(r) for i in range(L)
                                for p, r in (("attn", "o_proj"), ("mlp", "down"))}}
    for s, p in enumerate(got["positions"]):
        if s < batched:  # the prefill's rows: the op that ends each probe, at this position
            assert sorted(p) == sorted(op_number if s < P - 1 else names)
            for name, k in op_number.items():
                np.testing.assert_array_equal(p[name], [s, k, 0], err_msg=f"{name} at {s}")
            if s == P - 1:  # the lm_head's outputs at the last prompt position
                np.testing.assert_array_equal(p["final_norm"], [s, -2, 0])
                np.testing.assert_array_equal(p["logits"], [s, -3, 0])
        else:  # the decode steps from the prefill's cache, at their own positions
            assert sorted(p) == sorted(names) and all(v[0] == s and v[1] == -1 for v in p.values())


# ---- validate with the engine replaced: the record and the verdict ---------------------------------------------
@pytest.fixture(scope="module")
def tiny_truth(tiny_llama_dir, tmp_path_factory):
    pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("tiny-truth-prefill") / "truth"
    truth.generate_truth(tiny_llama_dir, d, prompt="w5 w17 w42 w99 w150", steps=4, device="cpu")
    return d


def truth_engine(t, fault=None, chunk=2):
    """An engine_probes that answers with the truth's vectors: the decode path exact, the prefill path exact with
    `fault(positions)` applied, its positions 0 .. P-2 without final_norm and logits (P positions batched, the
    last with the lm_head's, as on one GPU)."""
    def engine_probes(model_dir, weights, sequence, n_positions, names, backend, forms, context, prompt_len=None,
                      prefill_chunk=None):
        want = [{n: t.get(weights, s, n) for n in names} for s in range(n_positions)]
        pre = [dict(p) for p in want]
        for p in pre[:prompt_len - 1]:
            del p["final_norm"], p["logits"]
        if fault:
            fault(pre)
        info = {"kind": "gpu", "label": "GPU engine (the truth's vectors)"}
        return info, want, {"chunk": prefill_chunk or chunk, "batched": prompt_len, "positions": pre}
    return engine_probes


def test_validate_record_with_the_prefill_section(tiny_llama_dir, tiny_truth, monkeypatch, capsys):
    t = truth.Truth(tiny_truth)
    monkeypatch.setattr(check, "engine_probes", truth_engine(t))
    res = check.validate(tiny_llama_dir, weights="fp16", truth_dir=tiny_truth, prefill_chunk=3)
    P = len(t.manifest["prompt_ids"])  # <s> + 5 words
    pre = res["prefill"]
    assert P == 6 and pre["chunk"] == 3 and pre["prompt_tokens"] == P
    assert pre["batched_positions"] == P and pre["decode_positions"] == 3
    assert "final_norm and logits at positions 0..4" in pre["not_computed"]
    by = {p["name"]: p for p in pre["probes"]}
    assert len(by) == 9 and by["embed"]["positions"] == P + 3 and by["logits"]["positions"] == 4
    assert pre["summary"]["pass"] and pre["summary"]["greedy_agree"] == pre["summary"]["greedy_total"] == 4
    assert res["summary"]["pass"] and not any("prefill" in n for n in res["notes"])
    json.dumps(res)  # the record is data

    def fault(pre):  # layer 1's attention block dropped at the second chunk's first position
        pre[3]["layers.1.attn"] = pre[3]["layers.0.mlp"]
    monkeypatch.setattr(check, "engine_probes", truth_engine(t, fault))
    res = check.validate(tiny_llama_dir, weights="fp16", truth_dir=tiny_truth)
    s, ps = res["summary"], res["prefill"]["summary"]
    assert s["probes_pass"] == s["probes_total"] and s["kl_pass"]  # the decode path passes ...
    assert ps["first_fail"] == "layers.1.attn" and not ps["pass"]  # ... the prefill path does not
    assert not s["pass"]
    worst = {p["name"]: p for p in res["prefill"]["probes"]}["layers.1.attn"]
    assert worst["worst_pos"] == 3 and not worst["pass"]
    print_result(res, Console(file=sys.stdout, width=200), None)
    out = capsys.readouterr().out
    assert "9/9 probes PASS" in out and "prefill path (positions 0-5 batched in chunks of 2" in out
    assert "8/9 probes PASS  (first FAIL: layers.1.attn)" in out
    assert "prefill FAIL layers.1.attn: cos" in out and "(worst at position 3)" in out
    assert out.rstrip().splitlines()[-1].startswith("FAIL — fp16 on GPU engine") and "prefill paths" in out


def test_numpy_validate_notes_the_prefill_path_unchecked(tiny_llama_dir, tiny_truth, tmp_path, capsys):
    js = tmp_path / "v.json"
    code, out, err = invoke(capsys, "validate", tiny_llama_dir, "--backend", "numpy", "--weights", "fp16",
                            "--truth", tiny_truth, "--json", js, "--prefill-chunk", "2")
    assert code == 0, out + err
    res = json.loads(js.read_text())
    assert res["prefill"] is None and res["summary"]["pass"]
    [note] = [n for n in res["notes"] if "prefill" in n]
    assert "not checked" in note and "NumPy reference" in note and "\n" not in note
    assert f"note: {note}" in " ".join(out.split()) and "prefill path (" not in out


def prefill_record(fails: int) -> dict:
    names = probes.probe_names(4)
    rows = [{"name": n, "cos": 0.99, "rel_l2": 0.2, "max_abs": 1.0, "worst_pos": 2, "positions": 9,
             "pass": i < len(names) - fails} for i, n in enumerate(names)]
    s = {"probes_pass": len(names) - fails, "probes_total": len(names),
         "first_fail": names[len(names) - fails] if fails else None, "greedy_agree": 3, "greedy_total": 4,
         "engine_ids": [1, 2, 3, 4], "kl_last": 2e-6, "kl_max_over_positions": 3e-6, "kl_pass": True,
         "min_cos": 0.99, "max_rel_l2": 0.2, "pass": not fails}
    return {"chunk": 512, "prompt_tokens": 6, "batched_positions": 5, "decode_positions": 4,
            "not_computed": "…", "probes": rows, "summary": s}


@pytest.mark.parametrize("fmt", ["json", None])
def test_report_prints_the_prefill_lines_beside_the_table(capsys, fmt):
    from test_output import validate_result

    res = validate_result()
    res["prefill"] = prefill_record(fails=6)
    print_result(res, Console(file=sys.stdout, width=300), fmt)
    out, err = capsys.readouterr()
    lines = err if fmt else out
    if fmt == "json":
        rows = json.loads(out)  # stdout holds the decode path's table alone
        assert [r["probe"] for r in rows] == ["layer 0", "layer 1", "layer 2"]
    assert "prefill path (positions 0-4 batched in chunks of 512, then 4 decode steps from its cache): " \
           "5/11 probes PASS  (first FAIL: layers.2.attn); greedy agreement 3/4; KL last 2.000e-06 PASS; FAIL" in lines
    named = [ln for ln in lines.splitlines() if "prefill FAIL" in ln]
    assert [ln.split()[2] for ln in named] == ["layers.2.attn:", "layers.2.mlp:", "layers.3.attn:", "layers.3.mlp:"]
    assert "and 2 more failing prefill probes" in lines
    res["prefill"] = prefill_record(fails=0)
    print_result(res, Console(file=sys.stdout, width=300), None)
    out = capsys.readouterr().out
    assert "11/11 probes PASS; greedy agreement 3/4" in out and "prefill FAIL" not in out
    del res["prefill"]  # a record without the section: as before it
    print_result(res, Console(file=sys.stdout, width=300), None)
    out = capsys.readouterr().out
    assert "prefill" not in out and "FAIL — fp16 on NumPy reference (CPU)" in out
