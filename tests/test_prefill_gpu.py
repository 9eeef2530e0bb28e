"""The batched prefill (gpu/prefill.py, kernels_cu/prefill_rows.cu, cuBLAS) on the GPU.

* the row kernels against NumPy (outputs poisoned before the launch): the embedding rows, RMSNorm rows (the decode
  prologue's rounding), RoPE + the K/V rows into the cache at the chunk's positions, SwiGLU rows;
* the GEMM wrapper against NumPy: fp16 out, and fp32 accumulated into the residual;
* the row-major weights it makes equal the checkpoint's (fp16 exactly; fp8 the dequantised codes);
* prefill then decode against the prompt walked by the decode step (chunks smaller than the prompt, so chunk
  boundaries are crossed): the cache rows and the first step's logits close (fp16 / fp8 bounds below), the greedy
  tokens the same wherever the walked run's margin exceeds the measured logit error;
* `profile`'s prefill breakdown (measure/prefill_profile.py) of the last chunk of a prompt;
* the staged weights form: untile.cu against the tiled layout, every staged weight equal to its copy, the same K/V
  and tokens as the copies form; an engine planned without the batched prefill walks its prompts.
"""
from __future__ import annotations

import numpy as np
import pytest

from atomflow_bench.errors import AtomflowError
from atomflow_bench.gpu.engine import Engine
from atomflow_bench.gpu.prefill import Prefill, e4m3_table
from atomflow_bench.gpu.ops.prefill_rows import (Gemm, embed_rows_launch, rmsnorm_rows_launch,
                                                 rope_kv_rows_launch, swiglu_rows_launch)
from atomflow_bench.store.checkpoint import Checkpoint

from test_engine_gpu import tiny_model  # noqa: F401

pytestmark = pytest.mark.gpu

# cosine of the first decode step's logits, prefill against the walked prompt (the same weights; fp16 GEMMs on
# cuBLAS against the decode GEMV's mma order: rounding only; fp8: the weights dequantised to fp16 before the GEMM
# against the decode's per-group scaling)
COS_MIN = {"fp16": 0.9999, "fp8": 0.999}


@pytest.fixture(scope="module")
def lib():
    from atomflow_bench.gpu.ops import kernel_lib

    return kernel_lib()


def rng():
    return np.random.default_rng()


@pytest.mark.parametrize("H", [512, 1000, 3072, 4100, 16384])  # the 4- and 16-float4 kernels, rows they fill in part
def test_embed_and_rmsnorm_rows(lib, H):
    import cupy as cp

    m, V = 37, 300
    emb = (rng().standard_normal((V, H)) * 0.5).astype(np.float16)
    toks = rng().integers(0, V, m).astype(np.int32)
    h = cp.full((m, H), np.nan, dtype=cp.float32)
    embed_rows_launch(lib, cp.asarray(toks), cp.asarray(emb), h, m)()
    np.testing.assert_array_equal(h.get(), emb[toks].astype(np.float32))
    w = (1 + 0.2 * rng().standard_normal(H)).astype(np.float16)
    x = cp.full((m, H), np.nan, dtype=cp.float16)
    rmsnorm_rows_launch(lib, h, cp.asarray(w), x, m, 1e-5)()
    hh = emb[toks].astype(np.float32)
    inv = 1 / np.sqrt((hh.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-5)
    want = ((hh * inv).astype(np.float16).astype(np.float32) * w.astype(np.float32)).astype(np.float16)
    got = x.get()
    assert not np.isnan(got).any()
    # the block's sum order differs from NumPy's: at most one fp16 unit in the last place, on few elements
    diff = np.abs(got.astype(np.float32) - want.astype(np.float32))
    assert diff.max() <= 2 * np.abs(want.astype(np.float32)).max() * 2 ** -10
    assert (diff > 0).mean() < 0.01


@pytest.mark.parametrize("hd,n_q,n_kv", [(64, 8, 2), (128, 24, 8)])
def test_rope_kv_rows(lib, hd, n_q, n_kv):
    import cupy as cp

    m, start, max_seq = 29, 40, 128
    qkv_dim, kv_dim, half = (n_q + 2 * n_kv) * hd, n_kv * hd, hd // 2
    qkv = (rng().standard_normal((m, qkv_dim))).astype(np.float16)
    ang = rng().uniform(0, 2 * np.pi, (max_seq, half))
    cs = np.stack([np.cos(ang), np.sin(ang)], axis=-1).astype(np.float32)
    d_qkv = cp.asarray(qkv)
    kc = cp.full((max_seq, kv_dim), np.nan, dtype=cp.float16)
    vc = cp.full((max_seq, kv_dim), np.nan, dtype=cp.float16)
    rope_kv_rows_launch(lib, d_qkv, cp.asarray(cs), kc, vc, n_q, n_kv, hd, start, m)()
    x = qkv.astype(np.float32).reshape(m, n_q + 2 * n_kv, hd)
    c, s = cs[start:start + m, None, :, 0], cs[start:start + m, None, :, 1]
    x0, x1 = x[..., :half], x[..., half:]
    rot = np.concatenate([x0 * c - x1 * s, x1 * c + x0 * s], axis=-1).astype(np.float16)
    want = qkv.reshape(m, n_q + 2 * n_kv, hd).copy()
    want[:, :n_q + n_kv] = rot[:, :n_q + n_kv]

    def close(got, ref):  # the kernel may fuse a multiply-add that NumPy rounds twice: one fp16 unit, or 1e-5
        g, r = got.astype(np.float32), ref.astype(np.float32)
        assert not np.isnan(g).any() and np.all(np.abs(g - r) <= 2 ** -10 * np.abs(r) + 1e-5)

    close(d_qkv.get().reshape(want.shape), want)
    got_k, got_v = kc.get(), vc.get()
    close(got_k[start:start + m], want[:, n_q:n_q + n_kv].reshape(m, kv_dim))
    np.testing.assert_array_equal(got_v[start:start + m], want[:, n_q + n_kv:].reshape(m, kv_dim))
    assert np.isnan(got_k[:start]).all() and np.isnan(got_k[start + m:]).all()  # no other row touched
    assert np.isnan(got_v[:start]).all() and np.isnan(got_v[start + m:]).all()


@pytest.mark.parametrize("inter", [704, 4104])  # 88 threads of 8 elements; 513: three blocks, the last with one
def test_swiglu_rows(lib, inter):
    import cupy as cp

    m = 19
    gu = (rng().standard_normal((m, 2 * inter)) * 2).astype(np.float16)
    act = cp.full((m, inter), np.nan, dtype=cp.float16)
    swiglu_rows_launch(lib, cp.asarray(gu), act, m)()
    g, u = gu[:, :inter].astype(np.float32), gu[:, inter:].astype(np.float32)
    s = (g / (1 + np.exp(-g))).astype(np.float16).astype(np.float32)
    want = (s * u).astype(np.float16)
    got = act.get().astype(np.float32)
    assert np.abs(got - want.astype(np.float32)).max() <= 2 ** -9 * np.abs(want.astype(np.float32)).max()


def test_gemm_store_and_accumulate():
    import cupy as cp

    m, n, k = 77, 384, 1024
    x = (rng().standard_normal((m, k)) * 0.5).astype(np.float16)
    w = (rng().standard_normal((n, k)) * 0.05).astype(np.float16)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    bound = 2 ** -20 * k * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T)
    y16 = cp.full((m, n), np.nan, dtype=cp.float16)
    gemm = Gemm()
    gemm(cp.asarray(x), cp.asarray(w), y16, m)
    got = y16.get().astype(np.float64)
    assert np.all(np.abs(got - want) <= bound + 2 ** -10 * np.abs(want))
    h0 = rng().standard_normal((m, n)).astype(np.float32)
    h = cp.asarray(h0)
    gemm(cp.asarray(x), cp.asarray(w), h, m, accumulate=True)
    assert np.all(np.abs(h.get() - (h0 + want)) <= bound + 2 ** -22 * np.abs(h0 + want))
    y32 = cp.full((m, n), np.nan, dtype=cp.float32)  # a tensor-parallel rank's partial product: fp32, overwritten
    gemm(cp.asarray(x), cp.asarray(w), y32, m)
    assert np.all(np.abs(y32.get() - want) <= bound + 2 ** -22 * np.abs(want))


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_row_major_weights(tiny_model, fmt):
    from atomflow_bench.quant import dequantize_fp8, quantize_fp8

    eng = Engine(tiny_model, weights=fmt, max_seq=64)
    pf = Prefill(eng, chunk=16)
    ck = Checkpoint(tiny_model)
    p = "model.layers.1."
    parts = {"wqkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "wgu": ["mlp.gate_proj", "mlp.up_proj"],
             "wo": ["self_attn.o_proj"], "wd": ["mlp.down_proj"]}
    for role, names in parts.items():
        src = np.concatenate([ck.get(p + n + ".weight") for n in names]).astype(np.float16)
        got = pf.w[f"L1.{role}"].get()
        if fmt == "fp16":
            np.testing.assert_array_equal(got, src, err_msg=role)
        else:
            q, s = quantize_fp8(src)
            want = dequantize_fp8(q, s, src.shape[1]).astype(np.float32)
            assert np.abs(got.astype(np.float32) - want).max() <= 2 ** -10 * np.abs(want).max(), role
    assert e4m3_table()[0x7f] == 0.0 and e4m3_table()[0x7e] == 448.0


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_prefill_then_decode_as_the_walked_prompt(tiny_model, fmt):
    n, n_new, chunk = 45, 6, 16  # three chunks: 16 + 16 + 12 positions
    walked = Engine(tiny_model, weights=fmt, max_seq=64)
    pre = Engine(tiny_model, weights=fmt, max_seq=64)
    pre._prefill = Prefill(pre, chunk=chunk)
    prompt = [int(t) for t in rng().integers(0, walked.cfg.vocab_size, n)]
    # the first new token's logits: after the cache of positions 0 .. n-2, the step at n-1
    walked.reset(prompt)
    walked.run(n - 1)
    walked.stream.synchronize()
    pre.start(prompt, upto=n - 1)
    pre.stream.synchronize()
    assert pre.position == walked.position == n - 1
    for name in ("k_cache", "v_cache"):
        a = walked.arena[name][:, :n - 1].get().astype(np.float32)
        b = pre.arena[name][:, :n - 1].get().astype(np.float32)
        rel = np.linalg.norm(a - b) / np.linalg.norm(a)
        assert rel < (5e-3 if fmt == "fp16" else 2e-2), f"{name}: relative difference {rel:.3g}"
    walked.run(1)
    pre.run(1)
    walked.stream.synchronize()
    pre.stream.synchronize()
    la, lb = walked.arena["logits"].get().astype(np.float64), pre.arena["logits"].get().astype(np.float64)
    assert np.linalg.norm(la) > 0 and np.linalg.norm(lb) > 0, (np.abs(la).max(), np.abs(lb).max())
    cos = la @ lb / (np.linalg.norm(la) * np.linalg.norm(lb))
    assert cos >= COS_MIN[fmt], f"first step's logits: cosine {cos:.6f}"
    err = np.abs(la - lb).max()
    # the whole prompt through the prefill, its last row through the lm_head alone: the same first token's logits
    pre.arena["logits"].fill(np.nan)
    pre.prefill(prompt)
    pre.stream.synchronize()
    lc = pre.arena["logits"].get().astype(np.float64)
    assert pre.position == n and int(pre.arena["pos"].get()[0]) == n
    cos = la @ lc / (np.linalg.norm(la) * np.linalg.norm(lc))
    assert cos >= COS_MIN[fmt], f"the prefill's lm_head logits: cosine {cos:.6f}"
    assert int(pre.arena["cur_token"].get()[0]) == int(pre.arena["out_tokens"].get()[n - 1]) == int(np.argmax(lc))
    want = walked.generate(prompt, n_new)
    got = pre.generate(prompt, n_new, prefill=True)
    top = np.sort(la)[-2:]
    for j in range(n_new):
        if got[j] != want[j]:
            assert j > 0 or top[1] - top[0] <= 2 * err, f"first token differs at a margin {top[1] - top[0]:.4g}"
            break


def test_graph_replay_as_the_launches(tiny_model):
    """A chunk replayed from its captured graph writes what its launches write one by one (caches and residual), and
    a second prompt of the same chunk shapes reuses the graphs."""
    eng = Engine(tiny_model, weights="fp16", max_seq=64)
    eng._prefill = Prefill(eng, chunk=16)
    prompt = [int(t) for t in rng().integers(0, eng.cfg.vocab_size, 40)]
    eng.prefill(prompt, graph=False)
    eng.stream.synchronize()
    k0, v0 = eng.arena["k_cache"].get()[:, :40], eng.arena["v_cache"].get()[:, :40]
    first = eng.tokens(39, 1)
    eng.arena["k_cache"].fill(np.nan)
    eng.arena["out_tokens"].fill(-1)
    eng.prefill(prompt)
    eng.stream.synchronize()
    assert sorted(eng._prefill.graphs) == [(0, 16, False), (16, 16, False), (32, 8, True)]
    np.testing.assert_allclose(eng.arena["k_cache"].get()[:, :40].astype(np.float32), k0.astype(np.float32),
                               rtol=2e-3, atol=1e-3)
    np.testing.assert_allclose(eng.arena["v_cache"].get()[:, :40].astype(np.float32), v0.astype(np.float32),
                               rtol=2e-3, atol=1e-3)
    assert eng.tokens(39, 1) == first and eng.position == 40
    other = [int(t) for t in rng().integers(0, eng.cfg.vocab_size, 40)]
    eng.prefill(other)
    assert len(eng._prefill.graphs) == 3
    want = eng.generate(other, 4)
    assert eng.generate(other, 4, prefill=True)[:1] == want[:1]


def test_graph_replay_after_the_memory_pool_is_reused(tiny_model):
    """A chunk graph's replay reads buffers made for its launches alone (the wgmma attention's tensor maps) after
    the launches themselves are gone: those buffers live as long as the graph. Freed, the pool hands their memory to
    the next small arrays (here filled with 0xff) and the replay reads those instead."""
    import cupy as cp

    eng = Engine(tiny_model, weights="fp8", max_seq=64)
    eng._prefill = Prefill(eng, chunk=16)
    prompt = [int(t) for t in rng().integers(0, eng.cfg.vocab_size, 40)]
    eng.prefill(prompt)  # each chunk: eager once, then captured
    eng.stream.synchronize()
    k0, v0, first = eng.arena["k_cache"].get()[:, :40], eng.arena["v_cache"].get()[:, :40], eng.tokens(39, 1)
    junk = []
    for stream in (cp.cuda.Stream.null, eng.stream):
        with stream:
            junk += [cp.full(n, 0xff, dtype=cp.uint8) for n in (128, 256, 512) for _ in range(256)]
    cp.cuda.Device().synchronize()
    for name in ("k_cache", "v_cache"):
        eng.arena[name].fill(np.nan)
    eng.prefill(prompt)  # every chunk replayed
    eng.stream.synchronize()
    np.testing.assert_array_equal(eng.arena["k_cache"].get()[:, :40], k0)
    np.testing.assert_array_equal(eng.arena["v_cache"].get()[:, :40], v0)
    assert eng.tokens(39, 1) == first


def test_profile_prefill_chunk(tiny_model, tmp_path):
    """`profile`'s prefill breakdown through the run context: the last chunk of the prompt (positions 96..129 of a
    130-token prompt in chunks of 48, then the lm_head), every role timed, positive, shares adding up to 1, the row ops' bytes those
    their launches count; profiling leaves the cache as a plain prefill does; the record passes its reader."""
    from atomflow_bench.gpu.launch import Launch
    from atomflow_bench.gpu.prefill import ROLES
    from atomflow_bench.measure import plot, run_record
    from atomflow_bench.measure.context import RunContext
    from atomflow_bench.measure.decode import synthetic_prompt
    from atomflow_bench.measure.prefill_profile import role_bytes

    eng = Engine(tiny_model, weights="fp16", max_seq=256)
    eng._prefill = Prefill(eng, chunk=48)
    ctx = RunContext("tiny", tiny_model, "local", forms={"forms": eng.forms.text, "origin": "default"})
    p, tables = ctx.profile(eng, 40, 4, prompt_tokens=130)
    pre = p["prefill"]
    L = eng.cfg.num_hidden_layers
    assert (pre["start"], pre["m"], pre["chunk"], pre["prompt_tokens"], pre["layers"]) == (96, 34, 48, 130, L)
    assert [r["role"] for r in pre["rows"]] == ["embed", *ROLES, "lm_head"]
    for r in pre["rows"]:
        assert r["us"] > 0 and r["count"] == {"embed": 1, "lm_head": 2}.get(r["role"], L), r
        assert (r["tflops"] is not None) == (r["role"] in ("qkv", "attention", "o_proj", "gate_up", "down")), r
        assert (r["gbs"] is not None) != (r["tflops"] is not None) and (r["tflops"] or r["gbs"]) > 0, r
    assert abs(sum(r["share"] for r in pre["rows"]) - 1) < 1e-9
    assert pre["op_sum_us"] > 0 and pre["chunk_graph_us"]["median"] > 0 and pre["reps"] >= 3
    assert abs(pre["gap_us"] - (pre["chunk_graph_us"]["median"] - pre["op_sum_us"])) < 1e-6
    row_ops = set()
    for name, op in eng._prefill.chunk_ops(96, 34):
        role = name.rpartition(".")[2]
        if role_bytes(eng.cfg, role, 34) is not None:
            assert isinstance(op, Launch) and op.bytes_moved == role_bytes(eng.cfg, role, 34), name
            row_ops.add(role)
    assert row_ops == {"embed", "attn_norm", "rope_kv", "mlp_norm", "swiglu"}
    assert tables[-1].key == "prefill" and len(tables[-1].rows) == 2 + len(ROLES)
    # the chunk run again and again rewrites what one prefill writes
    eng.stream.synchronize()
    k0, v0 = eng.arena["k_cache"].get()[:, :130], eng.arena["v_cache"].get()[:, :130]
    eng.prefill(synthetic_prompt(eng.cfg.vocab_size, 130))  # the profiled prompt
    eng.stream.synchronize()
    for got, name in ((k0, "k_cache"), (v0, "v_cache")):
        np.testing.assert_allclose(got.astype(np.float32), eng.arena[name].get()[:, :130].astype(np.float32),
                                   rtol=2e-3, atol=1e-3, err_msg=name)
    rec = {**run_record.head("profile"), "gpu": eng.gpu, "model": "tiny", "weights": "fp16", **p}
    f = run_record.write(rec, tmp_path / "profile.json")
    [(_, got)] = plot.load_records([f])["profiles"]
    assert got["prefill"]["rows"] == pre["rows"] and got["prefill"]["chunk_graph_us"] == pre["chunk_graph_us"]


@pytest.mark.parametrize("pairing,rows,k,half", [("none", 48, 416, 0), ("halves", 64, 160, 0), ("rope", 128, 224, 32),
                                                  ("rope", 256, 384, 64)])
def test_untile_against_the_tiled_layout(lib, pairing, rows, k, half):
    """untile.cu inverts ops/gemv.py's tiled layout: fp16 bit for bit; fp8 codes (the NaN codes among them) times
    their group's scale, as e4m3_table * scale rounded to fp16 (K not a multiple of 128: a short last group)."""
    import cupy as cp

    from atomflow_bench.gpu.ops.gemv import tiled, tiled_scales
    from atomflow_bench.gpu.ops.untile import untile_launch

    w = rng().standard_normal((rows, k)).astype(np.float16)
    out = cp.full((rows, k), np.nan, dtype=cp.float16)
    untile_launch(lib, "fp16", cp.asarray(tiled(w, "fp16", pairing, half)), None, out, pairing, half)()
    np.testing.assert_array_equal(out.get(), w)
    codes = rng().integers(0, 256, (rows, k)).astype(np.uint8)
    scales = rng().uniform(1e-3, 0.1, (rows, -(-k // 128))).astype(np.float32)
    want = (e4m3_table()[codes] * np.repeat(scales, 128, axis=1)[:, :k]).astype(np.float16)
    out.fill(np.nan)
    untile_launch(lib, "fp8", cp.asarray(tiled(codes, "fp8", pairing, half)),
                  cp.asarray(tiled_scales(scales, pairing, half)), out, pairing, half)()
    np.testing.assert_array_equal(out.get(), want)


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_staged_form_as_the_copies(tiny_model, fmt):
    """The staged form (one scratch, filled from the tiled weights before each GEMM) un-tiles every weight to its
    copy bit for bit, and prefill + decode gives the copies form's K/V and tokens."""
    eng = Engine(tiny_model, weights=fmt, max_seq=64)
    assert eng.arena.prefill_form == "copies" and eng.prefills  # a tiny model: the copies fit
    copies = Prefill(eng, chunk=16, weights_form="copies")
    staged = Prefill(eng, chunk=16, weights_form="staged")
    assert (copies.weights_form, staged.weights_form) == ("copies", "staged") and not staged.w
    for name, want in copies.w.items():
        with eng.stream:
            got = staged.weight(name)
        eng.stream.synchronize()
        np.testing.assert_array_equal(got.get(), want.get(), err_msg=name)
    assert len({v.data.ptr for _, v in staged.staged.values()}) == 1  # one scratch for every weight
    prompt = [int(t) for t in rng().integers(0, eng.cfg.vocab_size, 45)]
    out = {}
    for pf in (copies, staged):
        eng._prefill = pf
        tokens = eng.generate(prompt, 6, prefill=True)
        out[pf.weights_form] = (tokens, [eng.arena[c][:, :45].get() for c in ("k_cache", "v_cache")])
    assert out["staged"][0] == out["copies"][0]
    for a, b in zip(out["staged"][1], out["copies"][1]):
        np.testing.assert_array_equal(a, b)


def test_engine_without_the_batched_prefill_walks(tiny_model):
    """batched_prefill=False: no prefill memory planned, `prefills` False, and `start` walks the prompt through the
    decode step (the same tokens as a reset and the walked steps)."""
    eng = Engine(tiny_model, weights="fp16", max_seq=64, batched_prefill=False)
    assert eng.plan.prefill == {} and eng.arena.prefill_form is None and not eng.prefills
    prompt = [int(t) for t in rng().integers(0, eng.cfg.vocab_size, 20)]
    eng.start(prompt)  # the prompt and the first new token
    assert eng.position == 20 and eng._prefill is None
    eng.run(3)
    assert eng.tokens(19, 4) == eng.generate(prompt, 4)
    with pytest.raises(AtomflowError, match="weights form 'tiled'"):
        Prefill(eng, weights_form="tiled")
