"""The tensor-parallel sharding plan (CPU, NumPy): atomflow_bench/gpu/tp/plan.py.

Coverage (every row / column / head / vocab row held by exactly one rank), the per-rank shapes against the tiled GEMV
rules, the byte accounting against ModelConfig.weight_bytes and arena.plan_arena, refusals, and the math: the
sharded layer (QKV by heads -> attention -> o_proj partial sums; gate/up -> SwiGLU -> down partial sums) and the
vocab-split lm_head with the combined argmax reproduce the unsharded computation."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from atomflow_bench.config import CATALOG, GROUP, ModelConfig
from atomflow_bench.errors import AtomflowError
from atomflow_bench.gpu import tp
from atomflow_bench.gpu.arena import plan_arena
from atomflow_bench.gpu.ops import attention
from atomflow_bench.gpu.ops.gemv import linear_regions

NS = (1, 2, 4, 8)

LLAMA_70B = ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                        tie_word_embeddings=False)
LLAMA_405B = ModelConfig(vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                         num_attention_heads=128, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                         tie_word_embeddings=False)
CONFIGS = {**{name: p.config for name, p in CATALOG.items()}, "llama-3.1-70b": LLAMA_70B,
           "llama-3.1-405b": LLAMA_405B}
CASES = [(name, n) for name, cfg in CONFIGS.items() for n in NS if cfg.num_key_value_heads % n == 0]
REFUSED = [(name, n) for name, cfg in CONFIGS.items() for n in NS if cfg.num_key_value_heads % n]


def _once(total: int, ranges) -> None:
    """Every index of range(total) lies in exactly one of `ranges`."""
    hits = np.zeros(total, dtype=np.int64)
    for a, b in ranges:
        assert 0 <= a <= b <= total, (a, b, total)
        hits[a:b] += 1
    assert (hits == 1).all(), f"indices held {sorted(set(hits.tolist()))} times"


def test_cases_cover_the_catalog():
    assert {name for name, _ in CASES} == set(CONFIGS)
    assert ("smollm2-135m", 2) in REFUSED  # 3 kv heads


@pytest.mark.parametrize("name,n", CASES)
def test_shards_cover_everything_once(name, n):
    cfg = CONFIGS[name]
    shards = tp.plan(cfg, n)
    assert [s.rank for s in shards] == list(range(n)) and all(s.n == n for s in shards)
    full = linear_regions(cfg)
    for role, (rows, k) in full.items():
        if role in ("wo", "wd"):  # split by input columns: every rank all rows, its columns
            _once(k, [s.cols(role) for s in shards])
            assert all(s.rows(role) == [(0, rows)] for s in shards)
        else:  # split by output rows: every rank all columns
            _once(rows, [r for s in shards for r in s.rows(role)])
            assert all(s.cols(role) == (0, k) for s in shards)
    _once(cfg.num_attention_heads, [s.q_heads for s in shards])
    _once(cfg.num_key_value_heads, [s.kv_heads for s in shards])
    _once(cfg.vocab_size, [s.vocab_rows for s in shards])
    c = -(-cfg.vocab_size // n)
    assert all(s.vocab_rows[1] - s.vocab_rows[0] == c for s in shards[:-1])
    assert 0 < shards[-1].vocab_rows[1] - shards[-1].vocab_rows[0] <= c
    hd, g = cfg.head_dim, cfg.group_size
    for s in shards:
        # a rank's q heads are exactly those of its kv heads (query head j reads kv head j // group)
        assert {j // g for j in range(*s.q_heads)} == set(range(*s.kv_heads))
        assert s.q_rows == (s.q_heads[0] * hd, s.q_heads[1] * hd) == s.wo_cols
        assert s.k_rows == (cfg.q_dim + s.kv_heads[0] * hd, cfg.q_dim + s.kv_heads[1] * hd)
        assert s.v_rows == (s.k_rows[0] + cfg.kv_dim, s.k_rows[1] + cfg.kv_dim)
        # SwiGLU local: the same slice of gate and of up, and down's columns are that slice
        assert s.up_rows == (s.gate_rows[0] + cfg.intermediate_size, s.gate_rows[1] + cfg.intermediate_size)
        assert s.wd_cols == s.gate_rows


@pytest.mark.parametrize("name,n", CASES)
def test_per_rank_shapes_take_the_tiled_layout(name, n):
    cfg = CONFIGS[name]
    loc = tp.local_config(cfg, n)
    for s in tp.plan(cfg, n):
        assert s.shapes == linear_regions(loc)
        for role, (rows, k) in s.shapes.items():
            assert rows % 16 == 0 and k % 32 == 0, (role, rows, k)
            assert rows == sum(b - a for a, b in s.rows(role))
            c0, c1 = s.cols(role)
            assert k == c1 - c0
        rows = s.shapes["wqkv"][0]
        assert rows % cfg.head_dim == 0 and (cfg.head_dim // 2) % 8 == 0  # RoPE pairs within whole heads
        assert s.shapes["wgu"][0] % 16 == 0
    tp.check_kernels(cfg, n)  # 405B: 16 q heads per kv head (two attention blocks per kv head)
    for fmt in ("fp16", "fp8"):
        plan_arena(loc, fmt, 64)  # the single-GPU arena planner accepts every rank's shape


@pytest.mark.parametrize("name,n", CASES)
def test_shard_bytes_account_for_the_whole_model(name, n):
    cfg = CONFIGS[name]
    E, Nb = tp.embed_bytes(cfg), tp.norm_bytes(cfg)
    assert E == 2 * cfg.vocab_size * cfg.hidden_size
    aligned = all(k % GROUP == 0 for _, k in tp.plan(cfg, n)[0].shapes.values()) or n == 1
    for fmt in ("fp16", "fp8"):
        held, streamed = tp.shard_bytes(cfg, fmt, n, held=True), tp.shard_bytes(cfg, fmt, n)
        assert len(held) == len(streamed) == n
        if fmt == "fp16" or aligned:
            assert sum(held) == cfg.weight_bytes(fmt) + (n - 1) * (Nb + E)
            assert sum(streamed) == cfg.weight_bytes(fmt) - (0 if cfg.tie_word_embeddings else E) + (n - 1) * Nb
        # ranks differ only by their lm_head rows
        v = [s.vocab_rows[1] - s.vocab_rows[0] for s in tp.plan(cfg, n)]
        assert [b - 2 * r * cfg.hidden_size for b, r in zip(streamed, v)] == [streamed[0] - 2 * v[0] * cfg.hidden_size] * n
        if n == 1:
            assert held[0] == cfg.weight_bytes(fmt)
        if n == 1 and cfg.group_size in attention.GROUPS:
            assert streamed[0] == plan_arena(cfg, fmt, 16).streamed_weight_bytes()
    assert n * tp.kv_bytes_per_token(cfg, n) == cfg.kv_bytes_per_token()


def test_byte_figures_70b_405b():
    """Pins the figures the report quotes (fp8 is about half of fp16 and falls ~1/n)."""
    s = {(m, n, f): max(tp.shard_bytes(c, f, n)) for m, c in (("70b", LLAMA_70B), ("405b", LLAMA_405B))
         for n in NS for f in ("fp16", "fp8")}
    for m in ("70b", "405b"):
        for f in ("fp16", "fp8"):
            for n in (2, 4, 8):
                assert s[(m, 1, f)] / n < s[(m, n, f)] < 1.01 * s[(m, 1, f)] / n + tp.norm_bytes(
                    LLAMA_70B if m == "70b" else LLAMA_405B)
    # per rank, 70B fp16 at n=8: layer projections / 8 + all norms + 1/8 of lm_head
    c = LLAMA_70B
    proj = c.num_hidden_layers * sum(r * k for r, k in linear_regions(c).values())
    assert s[("70b", 8, "fp16")] == 2 * proj // 8 + tp.norm_bytes(c) + 2 * (c.vocab_size // 8) * c.hidden_size


def test_eight_kv_heads_over_eight_ranks_is_one_head_each():
    for cfg in (LLAMA_70B, LLAMA_405B, CATALOG["llama-3.1-8b"].config):
        for s in tp.plan(cfg, 8):
            assert s.kv_heads == (s.rank, s.rank + 1)
            assert s.q_heads == (s.rank * cfg.group_size, (s.rank + 1) * cfg.group_size)
            assert s.shapes["wqkv"] == ((cfg.group_size + 2) * cfg.head_dim, cfg.hidden_size)


@pytest.mark.parametrize("name,n", REFUSED)
def test_kv_heads_not_divisible_are_refused(name, n):
    kv = CONFIGS[name].num_key_value_heads
    with pytest.raises(AtomflowError, match=rf"over {n} ranks needs num_key_value_heads = {kv} divisible by {n}"):
        tp.plan(CONFIGS[name], n)


def test_refusals_name_the_numbers():
    base = CATALOG["llama-3.2-1b"].config
    with pytest.raises(AtomflowError, match=r"num_key_value_heads = 3 divisible by 2"):
        tp.plan(dataclasses.replace(base, num_attention_heads=9, num_key_value_heads=3, head_dim=64), 2)
    bad_i = dataclasses.replace(base, intermediate_size=8192 + 32)  # 4112 per rank: K % 32 != 0
    with pytest.raises(AtomflowError, match=r"intermediate_size = 8224 / 2 = 4112 per rank"):
        tp.plan(bad_i, 2)
    tp.plan(bad_i, 1)
    with pytest.raises(AtomflowError, match=r"intermediate_size = 8200 / 8 = 1025"):
        tp.shard_bytes(dataclasses.replace(base, intermediate_size=8200), "fp8", 8)
    with pytest.raises(AtomflowError, match=r"vocab_size = 9 in rows of 3 leaves rank 3"):
        tp.plan(dataclasses.replace(base, vocab_size=9), 4)
    for n in (0, -2, 1.5, True):
        with pytest.raises(AtomflowError, match="positive number of ranks"):
            tp.plan(base, n)
    with pytest.raises(AtomflowError, match="unknown weight format"):
        tp.shard_bytes(base, "int4", 2)
    for err in (tp.plan, tp.comm_bytes_per_token):  # one line each
        try:
            err(dataclasses.replace(base, num_key_value_heads=8, num_attention_heads=32), 16)
        except AtomflowError as e:
            assert "\n" not in str(e) and "8" in str(e) and "16" in str(e)
        else:
            pytest.fail("16 ranks over 8 kv heads was accepted")


def test_comm_bytes_per_token():
    assert tp.comm_bytes_per_token(LLAMA_70B, 1)["total"] == 0
    for cfg in (LLAMA_70B, LLAMA_405B):
        for n in (2, 4, 8):
            c = tp.comm_bytes_per_token(cfg, n)
            assert c["allreduce"] == 2 * cfg.num_hidden_layers * cfg.hidden_size * 4  # fp32 residual, 2 per layer
            assert c["argmax"] == 8 * n and c["total"] == c["allreduce"] + c["argmax"]
            assert c["collectives"] == 2 * cfg.num_hidden_layers + 1
    assert tp.comm_bytes_per_token(LLAMA_70B, 8)["total"] == 5_242_944


# ---- the math -----------------------------------------------------------------------------------------------------

TINY = ModelConfig(vocab_size=1003, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                   num_attention_heads=16, num_key_value_heads=8, head_dim=64, tie_word_embeddings=False)


def _weights(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape) / np.sqrt(shape[-1]) for name, shape in cfg.tensor_shapes().items()}


def _rope(x, pos, hd):
    """Rotate-half RoPE (HF Llama) on [heads, hd]."""
    half = hd // 2
    ang = pos / 10000.0 ** (np.arange(half) / half)
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[:, :half], x[:, half:]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=1)


def _attend(q, k_new, v_new, k_cache, v_cache, pos, hd, group):
    """One decode position: q [nq, hd]; caches [T, nkv*hd]; -> [nq*hd]."""
    nq = q.shape[0]
    q, k_new = _rope(q, pos, hd), _rope(k_new.reshape(-1, hd), pos, hd).ravel()
    K = np.vstack([k_cache, k_new]).reshape(-1, nq // group, hd)
    V = np.vstack([v_cache, v_new]).reshape(-1, nq // group, hd)
    out = []
    for j in range(nq):
        sc = K[:, j // group] @ q[j] / np.sqrt(hd)
        p = np.exp(sc - sc.max())
        out.append((p / p.sum()) @ V[:, j // group])
    return np.concatenate(out)


def _swiglu(gu, inter):
    g, u = gu[:inter], gu[inter:]
    return g / (1 + np.exp(-g)) * u


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_sharded_layer_reproduces_the_full_layer(n):
    cfg, hd, g = TINY, TINY.head_dim, TINY.group_size
    W = _weights(cfg)
    rng = np.random.default_rng(n)
    L = "model.layers.0."
    x = rng.standard_normal(cfg.hidden_size)
    T, pos = 7, 7
    k_cache, v_cache = rng.standard_normal((T, cfg.kv_dim)), rng.standard_normal((T, cfg.kv_dim))
    wqkv = np.vstack([W[L + f"self_attn.{p}_proj.weight"] for p in "qkv"])
    wgu = np.vstack([W[L + "mlp.gate_proj.weight"], W[L + "mlp.up_proj.weight"]])
    wo, wd = W[L + "self_attn.o_proj.weight"], W[L + "mlp.down_proj.weight"]
    # unsharded
    qkv = wqkv @ x
    q, k, v = np.split(qkv, [cfg.q_dim, cfg.q_dim + cfg.kv_dim])
    att = _attend(q.reshape(-1, hd), k, v, k_cache, v_cache, pos, hd, g)
    o_full = wo @ att
    mlp_full = wd @ _swiglu(wgu @ x, cfg.intermediate_size)
    # sharded
    o_parts, mlp_parts, att_parts = [], [], []
    for s in tp.plan(cfg, n):
        loc = tp.local_config(cfg, n)
        fused = np.vstack([tp.slice_weight(L + f"self_attn.{p}_proj.weight", W[L + f"self_attn.{p}_proj.weight"],
                                           s, cfg) for p in "qkv"])
        assert np.array_equal(fused, s.take("wqkv", wqkv)) and fused.shape == s.shapes["wqkv"]
        qr, kr, vr = np.split(fused @ x, [loc.q_dim, loc.q_dim + loc.kv_dim])
        kv_cols = slice(s.kv_heads[0] * hd, s.kv_heads[1] * hd)  # the rank's KV cache: its kv heads
        a = _attend(qr.reshape(-1, hd), kr, vr, k_cache[:, kv_cols], v_cache[:, kv_cols], pos, hd, g)
        att_parts.append(a)
        wo_r = tp.slice_weight(L + "self_attn.o_proj.weight", wo, s, cfg)
        assert np.array_equal(wo_r, s.take("wo", wo)) and wo_r.shape == s.shapes["wo"]
        o_parts.append(wo_r @ a)
        gu_r = np.vstack([tp.slice_weight(L + f"mlp.{p}_proj.weight", W[L + f"mlp.{p}_proj.weight"], s, cfg)
                          for p in ("gate", "up")])
        assert np.array_equal(gu_r, s.take("wgu", wgu)) and gu_r.shape == s.shapes["wgu"]
        wd_r = tp.slice_weight(L + "mlp.down_proj.weight", wd, s, cfg)
        assert np.array_equal(wd_r, s.take("wd", wd)) and wd_r.shape == s.shapes["wd"]
        mlp_parts.append(wd_r @ _swiglu(gu_r @ x, loc.intermediate_size))
        for name in ("model.embed_tokens.weight", L + "input_layernorm.weight", "model.norm.weight"):
            assert np.array_equal(tp.slice_weight(name, W[name], s, cfg), W[name])  # replicated
    np.testing.assert_allclose(np.concatenate(att_parts), att, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.sum(o_parts, axis=0), o_full, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.sum(mlp_parts, axis=0), mlp_full, rtol=1e-10, atol=1e-12)
    if n > 1:  # one rank's partial alone is not the answer (the sum across ranks is needed)
        assert not np.allclose(o_parts[0], o_full) and not np.allclose(mlp_parts[0], mlp_full)


def test_slice_weight_refuses_unknown_tensors_and_wrong_shapes():
    s = tp.plan(TINY, 2)[1]
    with pytest.raises(AtomflowError, match="no sharding rule"):
        tp.slice_weight("model.layers.0.self_attn.rotary_emb.inv_freq", np.zeros(32), s)
    with pytest.raises(AtomflowError, match="no sharding rule"):
        tp.slice_weight("model.layers.0.mlp.gate_proj.bias", np.zeros(512), s)
    with pytest.raises(AtomflowError, match=r"has shape \(512, 255\)"):
        tp.slice_weight("model.layers.3.mlp.gate_proj.weight", np.zeros((512, 255)), s, TINY)
    w = np.arange(TINY.vocab_size * 2).reshape(-1, 2)
    assert np.array_equal(tp.slice_weight("lm_head.weight", w, s), w[502:1003])


def _ref_argmax(logits):
    """The kernel's rule on the whole vector: first maximum among non-NaN values; 0 when all are NaN."""
    ok = np.flatnonzero(~np.isnan(logits))
    return 0 if ok.size == 0 else int(ok[np.argmax(logits[ok])])


def _sharded_argmax(logits, shards, order=None):
    bests = [tp.local_argmax(logits[slice(*s.vocab_rows)], s.vocab_rows[0]) for s in shards]
    if order is not None:
        bests = [bests[i] for i in order]
    return tp.combine_argmax([b[0] for b in bests], [b[1] for b in bests])[1]


@pytest.mark.parametrize("n", NS)
def test_vocab_split_lm_head_and_combined_argmax(n):
    cfg = TINY
    shards = tp.plan(cfg, n)
    rng = np.random.default_rng(10 + n)
    W = rng.standard_normal((cfg.vocab_size, cfg.hidden_size)).astype(np.float32)
    x = rng.standard_normal(cfg.hidden_size).astype(np.float32)
    parts = [tp.slice_weight("lm_head.weight", W, s, cfg) @ x for s in shards]
    np.testing.assert_allclose(np.concatenate(parts), W @ x, rtol=1e-5, atol=1e-4)
    full = np.concatenate(parts)  # the argmax checks below run on these very values
    assert _sharded_argmax(full, shards) == int(np.argmax(full))
    last = shards[-1].vocab_rows
    cases = []
    # ties across ranks: the max in the last rank and in the first rank -> the smaller global index
    t = full.copy(); t[last[1] - 1] = t[3] = 1e4; cases.append((t, 3))
    # ties inside one rank and across two later ranks, presented in reverse rank order
    if n > 1:
        r1, r2 = shards[1].vocab_rows, shards[-1].vocab_rows
        t = full.copy(); t[[r2[1] - 1, r1[0] + 5, r1[0] + 2]] = 2e4; cases.append((t, r1[0] + 2))
    # NaN never wins: NaN before the max (numpy.argmax would pick the NaN), a rank entirely NaN
    t = full.copy(); t[0] = np.nan; t[last[0]] = 3e4; cases.append((t, last[0]))
    t = full.copy(); t[slice(*shards[0].vocab_rows)] = np.nan; cases.append((t, _ref_argmax(t)))
    t = full.copy(); t[slice(*last)] = np.nan; t[last[0] - 1 if n > 1 else 0] = 4e4
    cases.append((t, last[0] - 1 if n > 1 else 0))
    # -inf and NaN only: the first -inf (the kernel's -inf == -inf tie), never a NaN; all NaN -> token 0
    t = np.full(cfg.vocab_size, -np.inf, np.float32); t[:5] = np.nan; cases.append((t, 5))
    cases.append((np.full(cfg.vocab_size, np.nan, np.float32), 0))
    for t, want in cases:
        assert _ref_argmax(t) == want
        assert _sharded_argmax(t, shards) == want
        assert _sharded_argmax(t, shards, order=list(range(n))[::-1]) == want
        if not np.isnan(t).any():
            assert want == int(np.argmax(t))


def test_combine_argmax_rules():
    inf = float("inf")
    assert tp.combine_argmax([1.0, 3.0, 3.0], [7, 90, 40]) == (3.0, 40)
    assert tp.combine_argmax([np.nan, 2.0], [0, 9]) == (2.0, 9)
    assert tp.combine_argmax([np.nan, -inf], [0, 9]) == (-inf, 9)
    assert tp.combine_argmax([-inf, -inf], [tp.NO_INDEX, tp.NO_INDEX]) == (-inf, 0)
    assert tp.combine_argmax([-inf, -inf], [12, 4]) == (-inf, 4)
    assert tp.local_argmax(np.array([np.nan, 1.0, 1.0]), 100) == (1.0, 101)
    assert tp.local_argmax(np.array([np.nan, np.nan]), 100) == (-inf, tp.NO_INDEX)
    with pytest.raises(AtomflowError, match="2 values but 1 indices"):
        tp.combine_argmax([1.0, 2.0], [1])
