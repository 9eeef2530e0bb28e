"""`profile`'s prefill breakdown from recorded-style timings (CPU): measure/prefill_profile.py's arithmetic (FLOPs,
bytes, shares, the graph against the ops' sum), which chunk is the last, its table (numbers under --format json), why
a record has none, and the record through its reader (plot.read_profile). The timings themselves:
test_prefill_gpu.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

from atomflow_bench.config import ModelConfig
from atomflow_bench.errors import AtomflowError
from atomflow_bench.gpu.prefill import ROLES
from atomflow_bench.measure import plot
from atomflow_bench.measure.prefill_profile import last_chunk, prefill_breakdown, prefill_fields, prefill_table
from atomflow_bench.output import text

L, H, INTER, NQ, NKV, HD = 3, 256, 704, 8, 2, 64
START, M = 512, 100


def cfg() -> ModelConfig:
    return ModelConfig(vocab_size=1000, hidden_size=H, intermediate_size=INTER, num_hidden_layers=L,
                       num_attention_heads=NQ, num_key_value_heads=NKV, head_dim=HD)


def fake_times() -> dict:
    """µs of 3 repetitions per op: role j of layer i takes (j + 1) * (i + 1) µs in every repetition, except
    attention, whose repetitions differ by layer so that the median of the layers' sum (the figure) is not the sum of
    the layers' medians."""
    us = {"embed": [2.0, 2.0, 2.0]}
    for i in range(L):
        for j, r in enumerate(ROLES):
            us[f"layers.{i}.{r}"] = [float((j + 1) * (i + 1))] * 3
    us["last_row"], us["lm_head"] = [1.0] * 3, [30.0] * 3
    us["layers.0.attention"], us["layers.1.attention"], us["layers.2.attention"] = \
        [1.0, 10.0, 2.0], [5.0, 1.0, 1.0], [1.0, 1.0, 1.0]  # sums 7, 12, 4: median 7 (the medians' sum is 4)
    return us


GRAPH = {"median": 150.0, "p10": 149.0, "p90": 152.0, "mean": 150.0, "min": 148.0, "max": 153.0, "n": 10}


def breakdown() -> dict:
    return prefill_breakdown(cfg(), fake_times(), GRAPH, prompt_tokens=613, chunk=512, start=START, m=M,
                             copy_gbs=3000.0)


def test_roles_times_and_shares():
    p = breakdown()
    rows = {r["role"]: r for r in p["rows"]}
    assert [r["role"] for r in p["rows"]] == ["embed", *ROLES, "lm_head"]
    assert rows["embed"]["count"] == 1 and rows["embed"]["us_per_layer"] is None
    assert rows["lm_head"]["count"] == 2 and rows["lm_head"]["us"] == 31.0 and rows["lm_head"]["us_per_layer"] is None
    assert rows["qkv"]["count"] == L and rows["qkv"]["us"] == 2 * (1 + 2 + 3)  # role 2 of layers 1..3: 2 + 4 + 6
    assert rows["qkv"]["us_per_layer"] == 4.0
    assert rows["down"]["us"] == 9 * 6
    assert rows["attention"]["us"] == 7.0  # the median of the per-repetition sums
    total = 2 + sum((j + 1) * 6 for j in range(len(ROLES))) - 4 * 6 + 7 + 31  # attention (j = 3): its 7
    assert p["op_sum_us"] == total
    assert rows["qkv"]["share"] == pytest.approx(12 / total) and rows["embed"]["share"] == pytest.approx(2 / total)
    assert sum(r["share"] for r in p["rows"]) == pytest.approx(1.0)
    assert p["gap_us"] == 150.0 - total and p["chunk_graph_us"] == GRAPH and p["reps"] == 3
    assert (p["start"], p["m"], p["layers"], p["prompt_tokens"], p["chunk"]) == (START, M, L, 613, 512)


def test_flops_and_tflops():
    p = breakdown()
    rows = {r["role"]: r for r in p["rows"]}
    qkv_dim = (NQ + 2 * NKV) * HD
    want = {"qkv": 2 * M * qkv_dim * H, "o_proj": 2 * M * H * NQ * HD, "gate_up": 2 * M * 2 * INTER * H,
            "down": 2 * M * H * INTER,
            "attention": sum(4 * HD * NQ * (pos + 1) for pos in range(START, START + M))}  # causal, row by row
    for role, per_layer in want.items():
        assert rows[role]["flops"] == per_layer * L, role
        assert rows[role]["tflops"] == pytest.approx(per_layer * L / (rows[role]["us"] * 1e-6) / 1e12), role
        assert rows[role]["bytes"] is None and rows[role]["gbs"] is None
    assert rows["attention"]["flops"] == 3 * 4 * 64 * 8 * 56250  # positions 512..611 read 513..612 keys
    assert p["flops"] == sum(want.values()) * L
    assert p["chunk_tflops"] == pytest.approx(p["flops"] / 150e-6 / 1e12)
    assert p["tok_per_s"] == pytest.approx(M / 150e-6)


def test_row_op_bytes_and_bandwidth():
    rows = {r["role"]: r for r in breakdown()["rows"]}
    want = {"embed": M * H * 6, "attn_norm": M * H * 6 * L, "mlp_norm": M * H * 6 * L,
            "rope_kv": M * (NQ + 2 * NKV) * HD * 4 * L, "swiglu": M * INTER * 6 * L, "lm_head": 1000 * H * 2}
    for role, nbytes in want.items():
        r = rows[role]
        assert r["bytes"] == nbytes and r["flops"] is None and r["tflops"] is None, role
        assert r["gbs"] == pytest.approx(nbytes / (r["us"] * 1e-6) / 1e9), role
        assert r["pct_of_copy"] == pytest.approx(100 * r["gbs"] / 3000.0), role
    no_copy = prefill_breakdown(cfg(), fake_times(), GRAPH, prompt_tokens=613, chunk=512, start=START, m=M)
    assert all(r["pct_of_copy"] is None for r in no_copy["rows"])


@pytest.mark.parametrize("prompt, chunk, want", [
    (128, 512, (0, 128)),      # positions 0..127: one chunk
    (1, 512, (0, 1)),
    (512, 512, (0, 512)),      # 512 positions: exactly one chunk
    (513, 512, (512, 1)),
    (2048, 512, (1536, 512)),
    (700, 48, (672, 28)),
])
def test_last_chunk(prompt, chunk, want):
    assert last_chunk(prompt, chunk) == want


def test_table_holds_numbers():
    from test_output_numbers import as_json, md_lines

    p = {"prefill": breakdown()}
    t = prefill_table(p)
    data = as_json(t)  # no number disguised as text
    qkv = next(r for r in data if r["role"] == "qkv")
    assert qkv == {"role": "qkv", "launches": 3, "µs": 12.0, "µs per layer": 4.0,
                   "% of chunk": pytest.approx(100 * 12 / p["prefill"]["op_sum_us"]),
                   "TFLOPS": pytest.approx(2 * M * 768 * H * 3 / 12e-6 / 1e12), "GB/s": None, "% copy BW": None}
    embed = data[0]
    assert embed["µs per layer"] is None and embed["TFLOPS"] is None
    assert embed["GB/s"] == pytest.approx(M * H * 6 / 2e-6 / 1e9)
    assert "positions 512-611, 100 rows" in t.title
    assert md_lines(t)[4].startswith("| embed | 1 | 2.0 | - | ")
    assert t.caption == ("sum of ops (each alone, launch latency included) 286.0 µs; the chunk's graph 150.0 µs "
                         "(p10-p90 149.0-152.0); the graph is shorter than the ops one by one by 136.0 µs; in the graph "
                         f"the GEMMs and the attention reach {p['prefill']['chunk_tflops']:.1f} TFLOPS, 666667 tokens/s")
    slow = prefill_table({"prefill": {**p["prefill"], "chunk_graph_us": {**GRAPH, "median": 300.0}, "gap_us": 45.0}})
    assert "300.0 µs (p10-p90 149.0-152.0); idle gap 45.0 µs;" in slow.caption


def test_no_prefill_is_a_table_without_rows_and_its_note():
    t = prefill_table({"prefill": None, "prefill_note": "no prefill breakdown: why"})
    assert t.rows == [] and t.caption == "no prefill breakdown: why" and json.loads(text(t, "json")) == []


class FakeEngine:
    def __init__(self, prefills: bool, refuse: str | None = None, group=None):
        self.prefills, self.refuse, self.group = prefills, refuse, group

    def prefiller(self):
        if self.refuse:
            raise AtomflowError(self.refuse)
        raise AssertionError("prefill_fields asked for the prefill where it has none to make")


@pytest.mark.parametrize("engine, prompt, note", [
    (FakeEngine(prefills=True, group="a TP2 group"), 128, "under tensor parallel: profile takes the prefill apart"),
    (FakeEngine(prefills=False), 128, "this engine walks its prompts"),
    (FakeEngine(prefills=True, refuse="prefill needs 9.00 GiB for its fp16 weights and buffers, 1.00 GiB are free"),
     128, "no prefill breakdown: prefill needs 9.00 GiB"),
])
def test_why_a_record_has_no_prefill(engine, prompt, note):
    got = prefill_fields(engine, prompt, 3000.0)
    assert got["prefill"] is None and note in got["prefill_note"]


def profile_rec(prefill) -> dict:
    rec = {"schema": "atomflow-bench/profile/2", "gpu": {"name": "NVIDIA H200"}, "model": "llama-3.2-1b",
           "weights": "fp16", "context": 128,
           "role_marginals": {"length": 129, "step_us": {"median": 900.0},
                              "rows": [{"role": "wqkv", "count": 16, "saved_us": 90.0, "floor_us": 80.0}]}}
    if prefill != "absent":
        rec["prefill"] = prefill
    return rec


@pytest.mark.parametrize("prefill, refused", [
    ("absent", False),          # the earlier profile/2 records
    (None, False),              # tensor parallel: null, with its note
    ("breakdown", False),
    ({"rows": "nope"}, True),
    ({"rows": []}, True),       # no chunk_graph_us
])
def test_the_reader_takes_the_prefill_field(tmp_path, prefill, refused):
    f = tmp_path / "p.json"
    rec = profile_rec(breakdown() if prefill == "breakdown" else prefill)
    f.write_text(json.dumps(rec))
    if refused:
        with pytest.raises(AtomflowError, match="prefill lacks rows or chunk_graph_us"):
            plot.load_records([f])
    else:
        [(_, got)] = plot.load_records([f])["profiles"]
        assert got.get("prefill") == rec.get("prefill")
        if prefill == "breakdown":
            assert np.isclose(sum(r["share"] for r in got["prefill"]["rows"]), 1.0)
