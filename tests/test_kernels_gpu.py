"""Every kernel in kernels_cu/ against a NumPy reference, on the GPU.

Rules (llm.c dev/cuda style): fresh random inputs per case (never zeros), outputs poisoned with NaN (or a
sentinel) before the launch so an unwritten element fails, references in float64 (or exact emulation of
the fp16 roundings the kernel is specified to do). Error bounds, as relative L2 error ||out-ref||/||ref||:
  fp16 outputs (QKV, SwiGLU, RoPE, attention, RMSNorm)   <= 2e-3   (fp16 rounding is 2^-11 ~ 4.9e-4 per element)
  fp32 outputs (logits, residual updates)                <= 1e-4   (fp32 accumulation over K <= 14336 terms)
  fp8 GEMV is compared against the *dequantised* weights with the same bounds (its quantisation error is
  the quantiser's, tested in test_quant.py); the GPU quantiser must be bit-exact with quant.py.
Layer GEMVs take their weights in the tiled layout (weights.tiled, as the loader writes them); the references
use the row-major matrices, so a layout bug fails here.
"""
from __future__ import annotations

import numpy as np
import pytest

from atomflow_bench.arena import ATT_CHUNK, dyn_part_floats, linear_regions
from atomflow_bench.config import CATALOG
from atomflow_bench.errors import AtomflowError
from atomflow_bench.kernels import compute_capability
from atomflow_bench.quant import dequantize_fp8, quantize_fp8
from atomflow_bench.step import (VARIANT_PAIRING, argmax_launch, attention_launch, attention_short_cap,
                                 attention_short_launch, embed_launch, GEMV_DYN_THREADS, gemv_dyn_clear, gemv_launch, gemv_ws,
                                 hold_position, lm_head_launches, quantize_launch, rmsnorm_launch)
from atomflow_bench.weights import tiled, tiled_scales

pytestmark = pytest.mark.gpu

FP16_TOL, FP32_TOL = 2e-3, 1e-4
SHAPE_MODELS = ("llama-3.2-1b", "llama-3.2-3b", "smollm2-135m")


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), "non-finite output (unwritten element or overflow)"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def rng_for(*key) -> np.random.Generator:
    """Fresh random inputs every run; the seed is printed so a failure can be replayed."""
    seed = np.random.SeedSequence().entropy
    print(f"rng seed for {key}: {seed}")
    return np.random.default_rng(seed)


def norm_ref(h: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """HF LlamaRMSNorm for fp16 models: normalise in fp32, round to fp16, times the fp16 weight."""
    h = h.astype(np.float32)
    inv = np.float32(1.0) / np.sqrt(np.mean(h.astype(np.float64) ** 2) + eps).astype(np.float32)
    return (h * inv).astype(np.float16) * w.astype(np.float16)


def gemv_cases():
    cases = []
    for m in SHAPE_MODELS:
        for region, (rows, k) in linear_regions(CATALOG[m].config).items():
            cases.append((m, region, rows, k))
    # odd sizes: K not a multiple of 128 (short last group), few tiles, K = 32 (one unit for fp8)
    cases += [("odd", "wo", 48, 96), ("odd", "wqkv", 32, 1056), ("odd", "wgu", 2 * 24, 160), ("odd", "wd", 16, 32)]
    return cases


def variant_of(region: str) -> str:
    """The step's epilogue per projection; QKV's RoPE epilogue has its own test, here it runs the plain store."""
    return {"wqkv": "store", "wo": "resid", "wgu": "norm_swiglu", "wd": "resid"}[region]


def check_gemv(kernel_lib, n_sm, rng, fmt: str, variant: str, rows: int, k: int, **launch_kw):
    """One tiled GEMV launch (weights in the tiled layout, output poisoned / residual random) against the float64
    reference on the row-major (fp8: dequantised) weights; returns the launch."""
    import cupy as cp

    n_out = rows // 2 if variant == "norm_swiglu" else rows
    w16 = (rng.standard_normal((rows, k), dtype=np.float32) * 0.02).astype(np.float16)
    pairing = VARIANT_PAIRING[variant]
    if fmt == "fp8":
        q, s = quantize_fp8(w16)
        w_eff = dequantize_fp8(q, s).astype(np.float64)
        w_dev, s_dev = cp.asarray(tiled(q, fmt, pairing)), cp.asarray(tiled_scales(s, pairing))
    else:
        w_eff = w16.astype(np.float64)
        w_dev, s_dev = cp.asarray(tiled(w16, fmt, pairing)), None
    eps = 1e-5
    if variant.startswith("norm"):
        h = rng.standard_normal(k, dtype=np.float32) * 3
        nw = (1 + 0.1 * rng.standard_normal(k)).astype(np.float16)
        x_dev, nw_dev = cp.asarray(h), cp.asarray(nw)
        x_eff = norm_ref(h, nw, eps).astype(np.float64)
    else:
        x16 = rng.standard_normal(k, dtype=np.float32).astype(np.float16)
        x_dev, nw_dev, x_eff = cp.asarray(x16), None, x16.astype(np.float64)
    y_ref = w_eff @ x_eff
    if variant == "resid":
        h0 = rng.standard_normal(n_out, dtype=np.float32)
        y_dev = cp.asarray(h0)
    else:
        y_dev = cp.full(n_out, np.nan, dtype=np.float16)
    ln = gemv_launch(kernel_lib, fmt, variant, w_dev, s_dev, x_dev, y_dev, n_out, k, n_sm, norm_w=nw_dev, eps=eps,
                     **launch_kw)
    ln()
    out = y_dev.get()
    if variant == "resid":
        assert rel_err(out.astype(np.float64) - h0, y_ref) < FP32_TOL
    elif variant == "norm_swiglu":
        g = y_ref[:n_out].astype(np.float16).astype(np.float64)
        u = y_ref[n_out:].astype(np.float16).astype(np.float64)
        ref = (g / (1 + np.exp(-g))).astype(np.float16).astype(np.float64) * u
        assert rel_err(out, ref) < FP16_TOL
    else:
        assert rel_err(out, y_ref) < FP16_TOL
    return ln


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("model,region,rows,k", gemv_cases(), ids=lambda v: str(v))
def test_gemv(kernel_lib, n_sm, fmt, model, region, rows, k):
    check_gemv(kernel_lib, n_sm, rng_for("gemv", fmt, model, region), fmt, variant_of(region), rows, k)


RING_CASES = [("resid", 3072, 8192), ("store", 5120, 3072), ("norm_swiglu", 4608, 576)]


@pytest.fixture(scope="module")
def kernel_lib_ws():
    """The kernels with GEMV_WS=2: fp8 warp-specialised too (fp16 is by default on sm_90+)."""
    from atomflow_bench.kernels import KernelLib

    return KernelLib(extra_defines=("GEMV_WS=2",))


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("region,rows,k", [(r, *rk) for r, rk in linear_regions(CATALOG["llama-3.2-3b"].config).items()])
def test_gemv_ws_plans(kernel_lib_ws, n_sm, fmt, region, rows, k):
    """Both formats warp-specialised at their launch plans (step.gemv_ws_plan) on the 3B shapes."""
    if not gemv_ws(fmt, kernel_lib_ws.defines):
        pytest.skip("warp-specialised GEMVs need sm_90+")
    ln = check_gemv(kernel_lib_ws, n_sm, rng_for("ws", fmt, region), fmt, variant_of(region), rows, k)
    assert ln.block[0] == 288


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("depth", [1, 2, 3, 5])
@pytest.mark.parametrize("variant,rows,k", RING_CASES)
def test_gemv_ws_every_ring_depth(kernel_lib_ws, n_sm, fmt, depth, variant, rows, k):
    """The warp-specialised GEMV (producer warp + bulk copies, sm_90+) with rings of 1-5 slots at 1 block per SM:
    every block walks several tiles through one ring, whose slots wrap many times."""
    if not gemv_ws(fmt, kernel_lib_ws.defines):
        pytest.skip("warp-specialised GEMVs need sm_90+")
    ln = check_gemv(kernel_lib_ws, n_sm, rng_for("ws ring", fmt, depth, variant, rows, k), fmt, variant, rows, k,
                    ring_depth=depth)
    assert ln.grid[0] == n_sm < rows // 16 and ln.block[0] == 288


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("pre", [0, 1, 2, 3, 5, 16])
@pytest.mark.parametrize("variant,rows,k", RING_CASES[:2])
def test_gemv_ws_slots_before_the_wait(kernel_lib_ws, n_sm, fmt, pre, variant, rows, k):
    """The warp-specialised GEMV with 0 (the whole ring), 1-5 or more slots than the ring has filled before the
    PDL wait (the kernel argument the engine's choice varies: step.GEMV_WS_PRE_TRY), at 1 block per SM with a ring
    of 4 slots: the producer's `go` barrier is crossed at every count and never deadlocks."""
    if not gemv_ws(fmt, kernel_lib_ws.defines):
        pytest.skip("warp-specialised GEMVs need sm_90+")
    ln = check_gemv(kernel_lib_ws, n_sm, rng_for("ws pre", fmt, pre, variant), fmt, variant, rows, k,
                    ring_depth=4, ws_pre=pre)
    assert ln.block[0] == 288 and int(ln.args[-1]) == pre


def dyn_state(fmt: str, rows_k):
    """A DYN launch's counter pair and partial-sum scratch (step.gemv_dyn_clear's state) for GEMVs of `rows_k`."""
    import cupy as cp

    ctr, part = cp.empty(2, cp.uint32), cp.empty(dyn_part_floats(fmt, rows_k), cp.float32)
    gemv_dyn_clear(ctr, part)
    return ctr, part


def assert_dyn_clear(ctr, part):
    """What every DYN launch must leave behind for the next: counters 0, every partial sum SENTINEL again."""
    assert ctr.get().tolist() == [0, 0]
    assert (part.view(np.uint32).get() == 0xFFFFFFFF).all()


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("model,region,rows,k", gemv_cases(), ids=lambda v: str(v))
def test_gemv_dyn(kernel_lib, n_sm, fmt, model, region, rows, k):
    """The DYN GEMVs (dynamic split-K units from a counter, partial sums published and summed by the tile's last
    unit; gemv_common.cuh) on every layer shape and the odd ones (one unit per tile, a short last group): twice on
    the same state with fresh data — the first launch must leave the counters at 0 and the scratch SENTINEL, or the
    second one computes garbage — and deterministically (the same inputs give the same bits)."""
    import cupy as cp

    if compute_capability() < 90:
        pytest.skip("the DYN GEMVs are sm_90+ (bulk copies)")
    ctr, part = dyn_state(fmt, [(rows, k)])
    variant = variant_of(region)
    for rep in range(2):
        ln = check_gemv(kernel_lib, n_sm, rng_for("dyn", fmt, model, region, rep), fmt, variant, rows, k,
                        dyn=(ctr, part))
        assert ln.block[0] == GEMV_DYN_THREADS and ln.fn is kernel_lib[f"gemv_{'f8' if fmt == 'fp8' else 'f16'}_{variant}_dyn"]
        assert_dyn_clear(ctr, part)
    if variant != "resid":  # same inputs, same bits (the output is overwritten, not accumulated)
        y = ln.args[5]
        first = y.get()
        y.fill(np.nan)
        ln()
        np.testing.assert_array_equal(y.get(), first)
        assert_dyn_clear(ctr, part)


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("pre", [0, 1, 3])
@pytest.mark.parametrize("variant,rows,k", RING_CASES)
def test_gemv_dyn_slots_before_the_wait(kernel_lib, n_sm, fmt, pre, variant, rows, k):
    """DYN with 0 (the whole ring), 1 or 3 units taken and requested before the PDL wait (the `go` barrier)."""
    if compute_capability() < 90:
        pytest.skip("the DYN GEMVs are sm_90+ (bulk copies)")
    ctr, part = dyn_state(fmt, [(rows, k)])
    ln = check_gemv(kernel_lib, n_sm, rng_for("dyn pre", fmt, pre, variant, rows, k), fmt, variant, rows, k,
                    dyn=(ctr, part), ws_pre=pre)
    assert int(ln.args[-3]) == pre
    assert_dyn_clear(ctr, part)


def test_gemv_dyn_refuses_small_state(kernel_lib, n_sm):
    """A DYN launch checks its counter and scratch before it is built: too small a scratch could be overrun."""
    import cupy as cp

    if compute_capability() < 90:
        pytest.skip("the DYN GEMVs are sm_90+ (bulk copies)")
    rows, k = 512, 2048
    w, s = cp.zeros((rows, k), cp.uint8), cp.zeros((rows, 16), cp.float32)
    x, y = cp.zeros(k, cp.float16), cp.zeros(rows, cp.float16)
    ctr, part = dyn_state("fp8", [(rows, k)])
    with pytest.raises(AtomflowError, match="needs 2 uint32 counters and 1024 float32 partials"):
        gemv_launch(kernel_lib, "fp8", "store", w, s, x, y, rows, k, n_sm, dyn=(ctr, part[:1000]))
    with pytest.raises(AtomflowError, match="needs 2 uint32 counters"):
        gemv_launch(kernel_lib, "fp8", "store", w, s, x, y, rows, k, n_sm, dyn=(ctr[:1], part))


@pytest.fixture(scope="module", params=["GEMV_WS=0", "GEMV_WS=0 GEMV_BULK=0"])
def kernel_lib_legacy(request):
    """The kernels as launched on sm_89 or with GEMV_WS=0: fp16 through registers, fp8 through a per-warp ring filled
    by bulk copies (sm_90+) or, with GEMV_BULK=0 (sm_89's path), lane by lane with cp.async."""
    from atomflow_bench.kernels import KernelLib

    return KernelLib(extra_defines=tuple(request.param.split()))


@pytest.mark.parametrize("depth", [2, 3, 4, 5])
@pytest.mark.parametrize("variant,rows,k", RING_CASES)
def test_gemv_legacy_every_ring_depth(kernel_lib_legacy, n_sm, depth, variant, rows, k):
    """fp8's per-warp ring at each depth that has a kernel (gemv_f8_<variant>_r<depth>), at 1 block per SM."""
    ln = check_gemv(kernel_lib_legacy, n_sm, rng_for("ring", depth, variant, rows, k), "fp8", variant, rows, k,
                    ring_depth=depth)
    assert ln.grid[0] == n_sm < rows // 16 and ln.block[0] == 256


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("region,rows,k", [(r, *rk) for r, rk in linear_regions(CATALOG["llama-3.2-3b"].config).items()])
def test_gemv_legacy_plans(kernel_lib_legacy, n_sm, fmt, region, rows, k):
    """The forms before the warp-specialised one, at their own launch plans (step.gemv_plan), on the 3B shapes."""
    ln = check_gemv(kernel_lib_legacy, n_sm, rng_for("legacy", fmt, region), fmt, variant_of(region), rows, k)
    assert ln.block[0] == 256


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("rows,k", [(40, 96), (32, 80)])
def test_gemv_refuses_untileable_shapes(kernel_lib, n_sm, fmt, rows, k):
    """rows % 16 != 0 or K % 32 != 0 cannot take the tiled layout: refused in one line before any launch."""
    import cupy as cp

    w = cp.zeros((rows, k), dtype=cp.uint8 if fmt == "fp8" else cp.float16)
    s = cp.zeros((rows, -(-k // 128)), dtype=cp.float32) if fmt == "fp8" else None
    with pytest.raises(AtomflowError, match="rows % 16 == 0 and K % 32 == 0"):
        gemv_launch(kernel_lib, fmt, "store", w, s, cp.zeros(k, cp.float16), cp.zeros(rows, cp.float16), rows, k, n_sm)


@pytest.mark.parametrize("rows,k", [(3072, 3072), (128256 // 16, 3072), (1000, 576)])
def test_gemv_f32_logits(kernel_lib, n_sm, rows, k):
    import cupy as cp

    rng = rng_for("lm_head", rows, k)
    w = (rng.standard_normal((rows, k), dtype=np.float32) * 0.02).astype(np.float16)
    x = rng.standard_normal(k, dtype=np.float32).astype(np.float16)
    y = cp.full(rows, np.nan, dtype=np.float32)
    gemv_launch(kernel_lib, "fp16", "f32", cp.asarray(w), None, cp.asarray(x), y, rows, k, n_sm)()
    assert rel_err(y.get(), w.astype(np.float64) @ x.astype(np.float64)) < FP32_TOL


@pytest.mark.parametrize("rows,k", [(5120, 3072), (960, 576), (33, 1000), (8, 128)])
def test_quantize_fp8_bit_exact(kernel_lib, rows, k):
    import cupy as cp

    rng = rng_for("quant", rows, k)
    w = (rng.standard_normal((rows, k), dtype=np.float32) * rng.uniform(1e-3, 3, (rows, 1))).astype(np.float16)
    w[0, :] = 0  # an all-zero row: scale 1, codes 0
    w[-1, 5] = 60000  # a huge outlier in one group
    q_ref, s_ref = quantize_fp8(w)
    q = cp.full((rows, k), 0x7F, dtype=cp.uint8)  # 0x7F is E4M3 NaN: any code left unwritten fails
    s = cp.full(s_ref.shape, np.nan, dtype=cp.float32)
    quantize_launch(kernel_lib, cp.asarray(w), q, s)()
    np.testing.assert_array_equal(s.get(), s_ref)
    np.testing.assert_array_equal(q.get(), q_ref)


def test_embedding(kernel_lib):
    import cupy as cp

    rng = rng_for("embed")
    emb = rng.standard_normal((1000, 576), dtype=np.float32).astype(np.float16)
    tok = int(rng.integers(0, 1000))
    h = cp.full(576, np.nan, dtype=cp.float32)
    embed_launch(kernel_lib, cp.asarray([tok], dtype=cp.int32), cp.asarray(emb), h)()
    np.testing.assert_array_equal(h.get(), emb[tok].astype(np.float32))


def test_spin_and_queued_timing(kernel_lib):
    """spin.cu lasts at least what it is asked for; profile.queued_event_us keeps the host's time out of the event
    pairs: a 3 ms host sleep before each launch of a short kernel is not in its figure, the spin is not either;
    1500 calls (more than a stream queues before the host blocks) are taken in batches."""
    import time

    import cupy as cp

    from atomflow_bench.profile import queued_event_us

    s = cp.cuda.Stream(non_blocking=True)
    a, b = cp.cuda.Event(), cp.cuda.Event()
    with s:
        a.record(s)
        kernel_lib["spin_ns"]((1,), (1,), (np.uint64(500_000),))
        b.record(s)
    b.synchronize()
    assert 500 <= cp.cuda.get_elapsed_time(a, b) * 1e3 < 5000
    h = cp.zeros(576, dtype=cp.float32)
    emb = cp.ones((4, 576), dtype=cp.float16)
    ln = embed_launch(kernel_lib, cp.asarray([1], dtype=cp.int32), emb, h)

    def slow_host_launch():
        time.sleep(0.003)
        ln()

    us = queued_event_us(kernel_lib, [slow_host_launch] * 3, s, per_call_ns=10_000_000)
    assert len(us) == 3 and all(0 < u < 500 for u in us), us
    many = queued_event_us(kernel_lib, [ln] * 1500, s)  # past a stream's queue depth: taken in batches
    assert len(many) == 1500 and all(0 < u < 500 for u in many)
    np.testing.assert_array_equal(h.get(), np.ones(576, np.float32))
    with pytest.raises(AtomflowError, match="longer than"):  # a spin too short for the host: refused, not used
        queued_event_us(kernel_lib, [slow_host_launch] * 3, s, per_call_ns=1_000)


@pytest.mark.parametrize("K", [576, 2048, 3072, 4096])
def test_rmsnorm(kernel_lib, K):
    import cupy as cp

    rng = rng_for("rmsnorm", K)
    h = rng.standard_normal(K, dtype=np.float32) * 5
    w = (1 + 0.2 * rng.standard_normal(K)).astype(np.float16)
    out = cp.full(K, np.nan, dtype=cp.float16)
    rmsnorm_launch(kernel_lib, cp.asarray(h), cp.asarray(w), 1e-5, out)()
    assert rel_err(out.get(), norm_ref(h, w, 1e-5)) < FP16_TOL


@pytest.mark.parametrize("form", ["default", "dyn"])
@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("model", ["llama-3.2-3b", "llama-3.2-1b", "smollm2-135m"])
@pytest.mark.parametrize("pos", [0, 1, 77, 5000])
def test_qkv_rope_kv_append(kernel_lib, n_sm, form, fmt, model, pos):
    """QKV GEMV with RMSNorm prologue and the RoPE + KV-append epilogue against NumPy (the launch's default form,
    and the DYN kernel: its reducer warp runs this epilogue)."""
    import cupy as cp

    if form == "dyn" and compute_capability() < 90:
        pytest.skip("the DYN GEMVs are sm_90+ (bulk copies)")

    cfg = CATALOG[model].config
    nh, nkv, hd, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    rng = rng_for("qkv_rope", fmt, model, pos)
    w16 = (rng.standard_normal((cfg.qkv_dim, H), dtype=np.float32) * 0.02).astype(np.float16)
    if fmt == "fp8":
        q8, s8 = quantize_fp8(w16)
        w_eff = dequantize_fp8(q8, s8).astype(np.float64)
        w_dev, s_dev = cp.asarray(tiled(q8, fmt, "rope", hd // 2)), cp.asarray(tiled_scales(s8, "rope", hd // 2))
    else:
        w_eff, w_dev, s_dev = w16.astype(np.float64), cp.asarray(tiled(w16, fmt, "rope", hd // 2)), None
    h = rng.standard_normal(H, dtype=np.float32) * 3
    nw = (1 + 0.1 * rng.standard_normal(H)).astype(np.float16)
    proj = (w_eff @ norm_ref(h, nw, 1e-5).astype(np.float64)).astype(np.float16).astype(np.float64)
    max_seq = pos + 3
    cs = cfg.rope_cos_sin(max_seq)
    kc = cp.full((max_seq, cfg.kv_dim), np.nan, dtype=cp.float16)
    vc = cp.full((max_seq, cfg.kv_dim), np.nan, dtype=cp.float16)
    y = cp.full(cfg.qkv_dim, np.nan, dtype=cp.float16)
    dyn = dyn_state(fmt, [(cfg.qkv_dim, H)]) if form == "dyn" else None
    gemv_launch(kernel_lib, fmt, "qkv_rope", w_dev, s_dev, cp.asarray(h), y, cfg.qkv_dim // 2, H, n_sm,
                norm_w=cp.asarray(nw), rope=(cp.asarray(cs), cp.asarray([pos], dtype=cp.int32), kc, vc, nh, nkv, hd),
                dyn=dyn)()
    if dyn:
        assert_dyn_clear(*dyn)
    ang = (np.float32(pos) * cfg.rope_inv_freq()).astype(np.float64)
    c, s = np.cos(ang), np.sin(ang)
    x = proj[: (nh + nkv) * hd].reshape(nh + nkv, hd)
    x0, x1 = x[:, : hd // 2], x[:, hd // 2:]
    rot = np.concatenate([x0 * c - x1 * s, x1 * c + x0 * s], axis=1).reshape(-1)
    got = y.get()
    assert rel_err(got[: rot.size], rot) < FP16_TOL
    assert rel_err(got[rot.size:], proj[rot.size:]) < FP16_TOL  # v: projected, not rotated
    kc_h, vc_h = kc.get(), vc.get()
    np.testing.assert_array_equal(kc_h[pos], got[nh * hd: (nh + nkv) * hd])
    np.testing.assert_array_equal(vc_h[pos], got[(nh + nkv) * hd:])
    others = np.delete(np.arange(max_seq), pos)
    assert np.isnan(kc_h[others]).all() and np.isnan(vc_h[others]).all(), "wrote outside row pos"


ATT_SHAPES = {"llama-3.2-3b": (8, 3, 128), "llama-3.2-1b": (8, 4, 64), "smollm2-135m": (3, 3, 64),
              "llama-3.1-8b": (8, 4, 128)}


def attention_case(model, length, max_seq):
    """Random q and K/V caches (fp16) and the float64 reference output of GQA attention over `length` rows."""
    n_kv, G, hd = ATT_SHAPES[model]
    nh = n_kv * G
    rng = rng_for("att", model, length)
    q = (rng.standard_normal(nh * hd, dtype=np.float32) * rng.uniform(0.5, 3)).astype(np.float16)
    kc = rng.standard_normal((max_seq, n_kv * hd), dtype=np.float32).astype(np.float16)
    vc = rng.standard_normal((max_seq, n_kv * hd), dtype=np.float32).astype(np.float16)
    kq = kc[:length].astype(np.float64).reshape(length, n_kv, hd)
    vq = vc[:length].astype(np.float64).reshape(length, n_kv, hd)
    kc[length:] = np.nan  # rows past the length must never reach the output (a masked score still multiplies V)
    vc[length:] = np.nan
    ref = np.empty((nh, hd))
    for hq in range(nh):
        sc = kq[:, hq // G] @ q[hq * hd:(hq + 1) * hd].astype(np.float64) / np.sqrt(hd)
        p = np.exp(sc - sc.max())
        ref[hq] = (p / p.sum()) @ vq[:, hq // G]
    return q, kc, vc, ref.reshape(-1)


@pytest.mark.parametrize("model", list(ATT_SHAPES))
@pytest.mark.parametrize("length", [1, 2, 63, 64, 65, 200, 416, 417, 833, 1000])
@pytest.mark.parametrize("cap", ["max", 128, 7])
def test_attention_short(kernel_lib, model, length, cap):
    """The short-context kernel (one block per kv head, K/V staged in shared memory). cap: the positions its
    shared memory holds — "max" = the engine's largest bucket (416 at hd 128, 832 at hd 64), 128 = a smaller
    bucket; lengths beyond it (and cap 7) walk several chunks with the online-softmax rescale."""
    import cupy as cp

    n_kv, G, hd = ATT_SHAPES[model]
    cap = attention_short_cap(hd) if cap == "max" else cap
    q, kc, vc, ref = attention_case(model, length, max_seq=1024)
    out = cp.full(q.size, np.nan, dtype=cp.float16)
    launch = attention_short_launch(kernel_lib, cp.asarray(q), cp.asarray(kc), cp.asarray(vc),
                                    cp.asarray([length - 1], dtype=cp.int32), out, n_kv, G, hd, cap)
    assert launch.grid == (n_kv,)
    launch()
    first = out.get()
    assert rel_err(first, ref) < FP16_TOL
    out.fill(np.nan)
    launch()  # a replay gives the identical result
    np.testing.assert_array_equal(out.get(), first)


def test_attention_short_refuses_what_does_not_fit(kernel_lib):
    import cupy as cp

    n_kv, G, hd = ATT_SHAPES["llama-3.2-3b"]
    too_many = attention_short_cap(hd) + 32
    z = cp.zeros(16, dtype=cp.float16)
    with pytest.raises(AtomflowError, match="shared memory"):
        attention_short_launch(kernel_lib, z, z, z, cp.zeros(1, dtype=cp.int32), z, n_kv, G, hd, too_many)


@pytest.fixture(scope="module", params=["ATT_CLUSTER=8", "ATT_CLUSTER=16", "ATT_COMBINE_SLICES=8",
                                        "ATT_COMBINE_SLICES=3", "ATT_BULK=1", "ATT_TMA=1", "ATT_TMA=0"])
def kernel_lib_att(request):
    """attention.cu's A/B forms: ATT_CLUSTER = 8 (portable) and 16 (non-portable) splits of a kv head per thread
    block cluster; ATT_COMBINE_SLICES = 8 and 3 (uneven slices) of the head's last blocks sharing the combine
    (with the GPU's default staging); ATT_BULK = 1: K/V rows staged by bulk copies on per-slot mbarriers (sm_90+);
    ATT_TMA = 1: K/V groups staged by 2D tensor copies (sm_90+; the default there, kernels.arch_defines);
    ATT_TMA = 0: by cp.async (the default before sm_90)."""
    from atomflow_bench.kernels import KernelLib

    return KernelLib(extra_defines=(request.param,))


@pytest.mark.parametrize("model", list(ATT_SHAPES))
@pytest.mark.parametrize("length", [1, 2, 63, 64, 65, 200, 1000, 4097])
@pytest.mark.parametrize("cap", [None, "plan", 7, 1])
def test_attention(kernel_lib, model, length, cap, n_sm):
    """cap: the split count (grid.y). None = one split per 32-position sub-chunk of max_seq; "plan" = the engine's
    (arena.attention_splits: ~2 blocks per SM); 7 and 1 force splits that walk many 16-position groups per warp
    (the ring wraps; row L-1 is staged after the wait; online softmax, uneven shares)."""
    check_attention(kernel_lib, n_sm, model, length, cap)


@pytest.mark.parametrize("model", list(ATT_SHAPES))
@pytest.mark.parametrize("length", [1, 2, 33, 200, 1000, 4097])
@pytest.mark.parametrize("cap", [None, "plan", 2])
def test_attention_variants(kernel_lib_att, model, length, cap, n_sm):
    """ATT_CLUSTER = C: splits in clusters of C (the cap rounded to whole clusters: None = 136 or 144 splits, up to
    17 clusters per head combined per slice through the tickets; 2 -> one cluster per head, which writes out
    directly); lengths 1, 2, 33, 200 leave blocks of a live cluster with empty splits, whole clusters past the
    length leave at once. ATT_COMBINE_SLICES = C: the head's last min(C, splits) blocks combine a slice each (2
    splits at length 33 or cap 2: fewer slice blocks than C; 130 splits: batches of partials per slice). ATT_BULK:
    cap 2 walks many groups per warp (the slots' mbarrier phases wrap), lengths 1, 2, 33 groups with row L-1 alone
    or rows past the split (V zero-filled). ATT_TMA: the same, row L-1 patched once its group's boxes have landed,
    rows past the length (NaN in the cache) zeroed in shared memory."""
    from atomflow_bench.step import compute_capability

    if {"ATT_BULK=1", "ATT_TMA=1"} & set(kernel_lib_att.defines) and compute_capability() < 90:
        pytest.skip("bulk and tensor copies need sm_90+")
    check_attention(kernel_lib_att, n_sm, model, length, cap)


def check_attention(lib, n_sm, model, length, cap):
    import cupy as cp

    from atomflow_bench.arena import att_cluster, attention_splits

    n_kv, G, hd = ATT_SHAPES[model]
    nh, max_seq, c = n_kv * G, 4160, att_cluster(lib.defines)
    splits = attention_splits(max_seq, n_kv, n_sm, defines=lib.defines) if cap == "plan" else cap or -(-max_seq // ATT_CHUNK)
    splits = -(-splits // c) * c
    q, kc, vc, ref = attention_case(model, length, max_seq)
    out = cp.full(nh * hd, np.nan, dtype=cp.float16)
    counters = cp.zeros(n_kv * c, dtype=cp.uint32)
    launch = attention_launch(lib, cp.asarray(q), cp.asarray(kc), cp.asarray(vc),
                              cp.asarray([length - 1], dtype=cp.int32),
                              cp.full((nh, splits, 2), np.nan, dtype=cp.float32),
                              cp.full((nh, splits, hd), np.nan, dtype=cp.float32), counters, out, n_kv, G, hd)
    launch()
    first = out.get()
    assert rel_err(first, ref) < FP16_TOL
    assert (counters.get() == 0).all(), "split-combine ticket not reset"
    out.fill(np.nan)
    launch()  # a replay must give the identical result (tickets reset, no stale partials)
    np.testing.assert_array_equal(out.get(), first)


@pytest.fixture(scope="module", params=["", "LMHEAD_L2_KEEP=1", "LMHEAD_L2_KEEP=64"])
def kernel_lib_lmhead(request, kernel_lib):
    """The default build, and the lm_head's last 1 MB (part of every shape's rows) or 64 MB (all rows of the smaller
    shapes) loaded under the L2 evict-last policy (LMHEAD_L2_KEEP, PERF_NOTES v35): a cache hint, no other change."""
    from atomflow_bench.kernels import KernelLib

    if not request.param:
        return kernel_lib
    return KernelLib(extra_defines=(request.param,))  # compiles only the sources the test launches, on first use


@pytest.mark.parametrize("rows,k", [(128256, 3072), (49152, 576), (1000, 2048), (2000, 4096)])
def test_lm_head_argmax(kernel_lib_lmhead, n_sm, rows, k):
    """The step's lm_head launch (step.lm_head_launches: gemv_f16_f32_argmax with the final RMSNorm as its
    prologue and the argmax in its epilogue): xnorm as rmsnorm_f32_f16 writes it (bit for bit) and within the fp16
    bound of the NumPy norm, the logits of that xnorm within the plain GEMV's bound, the token = the first maximum
    of those very logits (NaN never wins, ties -> the smaller index), the step state as argmax_advance writes it,
    the ticket reset; with advance = 0 (step.hold_position) the same search but the state left alone. Partials,
    xnorm, logits and tokens poisoned before every launch."""
    import types

    import cupy as cp

    rng = rng_for("lm_head_argmax", rows, k)
    w = (rng.standard_normal((rows, k), dtype=np.float32) * 0.02).astype(np.float16)
    h = rng.standard_normal(k, dtype=np.float32) * 5
    nw = (1 + 0.2 * rng.standard_normal(k)).astype(np.float16)
    w[rows // 3, 5] = np.nan  # a NaN logit never wins
    cfg = types.SimpleNamespace(tie_word_embeddings=False, vocab_size=rows, hidden_size=k, rms_norm_eps=1e-5)
    n_part = min(-(-rows // 8), 4 * n_sm)
    a = {"lm_head": cp.asarray(w), "h": cp.asarray(h), "final_norm": cp.asarray(nw),
         "xnorm": cp.empty(k, cp.float16), "logits": cp.empty(rows, cp.float32),
         "am_val": cp.empty(n_part, cp.float32), "am_idx": cp.empty(n_part, cp.int32),
         "am_counter": cp.zeros(1, cp.uint32), "pos": cp.zeros(1, cp.int32), "cur_token": cp.zeros(1, cp.int32),
         "prompt": cp.asarray(rng.integers(0, rows, 8).astype(np.int32)), "prompt_len": cp.full(1, 5, cp.int32),
         "out_tokens": cp.empty(16, cp.int32)}
    (launch,) = lm_head_launches(kernel_lib_lmhead, a, cfg, n_sm)
    assert launch.name == "gemv_fp16_f32_argmax" and launch.grid[0] <= n_part
    assert set(launch.taps) == {"final_norm", "logits"}
    (held,) = hold_position([launch])
    x_sep = cp.full(k, np.nan, dtype=cp.float16)
    rmsnorm_launch(kernel_lib_lmhead, a["h"], a["final_norm"], 1e-5, x_sep)()
    x = x_sep.get()
    assert rel_err(x, norm_ref(h, nw, 1e-5)) < FP16_TOL
    ref = w.astype(np.float64) @ x.astype(np.float64)
    prompt = a["prompt"].get()

    def run(ln, pos):
        for name, v in (("logits", np.nan), ("xnorm", np.nan), ("am_val", np.nan), ("am_idx", -1),
                        ("out_tokens", -1)):
            a[name].fill(v)
        a["pos"].fill(pos)
        a["cur_token"].fill(-7)
        ln()
        np.testing.assert_array_equal(a["xnorm"].get(), x)  # the norm prologue = rmsnorm_f32_f16, bit for bit
        got = a["logits"].get()
        assert np.isnan(got[rows // 3]) and rel_err(np.nan_to_num(got), np.nan_to_num(ref)) < FP32_TOL
        assert int(a["am_counter"].get()[0]) == 0
        finite = np.where(np.isnan(got), -np.inf, got)
        return int(np.flatnonzero(finite == finite.max())[0])

    want = run(launch, 2)  # no plant: the reduction over every block's rows must find the first maximum
    assert int(a["out_tokens"].get()[2]) == want
    assert int(a["pos"].get()[0]) == 3 and int(a["cur_token"].get()[0]) == prompt[3]  # still inside the prompt
    best = int(rng.integers(rows // 2, rows - 8))  # a planted maximum and its exact tie 7 rows later
    w[best] = w[best + 7] = (np.sign(x.astype(np.float32)) * 0.05).astype(np.float16)
    a["lm_head"].set(w)
    ref = w.astype(np.float64) @ x.astype(np.float64)
    assert run(launch, 4) == best
    assert int(a["out_tokens"].get()[4]) == best
    assert int(a["pos"].get()[0]) == 5 and int(a["cur_token"].get()[0]) == best  # the first generated token
    assert run(held, 4) == best  # advance = 0: the same search, the state untouched
    assert int(a["pos"].get()[0]) == 4 and int(a["cur_token"].get()[0]) == -7
    assert (a["out_tokens"].get() == -1).all()


def test_argmax_advance(kernel_lib, n_sm):
    import cupy as cp

    V = 128256
    rng = rng_for("argmax")
    logits = rng.standard_normal(V, dtype=np.float32)
    best = int(rng.integers(V // 2, V))
    logits[best] = 50.0
    logits[best + 7 if best + 7 < V else best - 7] = 50.0  # a tie: the smaller index must win
    logits[3] = np.nan  # NaN never wins
    want = min(best, best + 7 if best + 7 < V else best - 7)
    blocks = min(-(-V // 1024), n_sm)
    prompt = rng.integers(0, V, 8).astype(np.int32)
    st = {n: cp.zeros(1, dtype=cp.int32) for n in ("pos", "cur", "plen")}
    st["plen"].fill(5)
    out_tokens = cp.full(16, -1, dtype=cp.int32)
    counter = cp.zeros(1, dtype=cp.uint32)
    launch = argmax_launch(kernel_lib, cp.asarray(logits), cp.full(blocks, np.nan, dtype=cp.float32),
                           cp.full(blocks, -1, dtype=cp.int32), counter, st["pos"], st["cur"],
                           cp.asarray(prompt), st["plen"], out_tokens)
    st["pos"].fill(2)
    launch()
    assert int(st["pos"].get()[0]) == 3 and int(st["cur"].get()[0]) == prompt[3]  # still inside the prompt
    assert int(out_tokens.get()[2]) == want and int(counter.get()[0]) == 0
    st["pos"].fill(4)
    launch()
    assert int(st["pos"].get()[0]) == 5 and int(st["cur"].get()[0]) == want  # first generated token
    assert int(out_tokens.get()[4]) == want


def test_probe_stream(kernel_lib, n_sm):
    """probe_stream.cu (the persistent-stream probe, atomflow_bench/probe.py): on fresh random bytes every chunk is read
    exactly once (stream_probe checks each launch's checksum and the op counters against what the rule gives,
    raising otherwise) for ops smaller than the grid, not multiples of the chunk, rings of 1, 2 and 12 chunks, each
    dependency rule (none, the grid, groups of 4, the layer rule, static or dynamic chunks; spinning or sleeping
    polls, both signals); the modelled latency is waited for only where the op waits."""
    from atomflow_bench.probe import stream_probe

    ops = [("L0.qkv", 16 * 5), ("L0.o", 16 * 1001), ("L0.gu", 16 * 70001), ("L0.d", 4096 * n_sm + 48),
           ("L1.qkv", 16 * 3), ("L1.o", 16 * 20011), ("lm_head", 16 * 123457)]
    copy = {"median": 1000.0}  # GB/s: only scales the reported percentages
    rings = ((1, 16), (2, 4096), (12, 16384))
    variants = [{"name": f"{d} p{p} s{s} c{c}", "deps": d, "poll_ns": p, "att_ns": 50_000, "slots": s, "chunk": c,
                 "signal": s % 2}  # the release reduction (odd rings) or the fence + atomicAdd (even)
                for d, p in (("none", 0), ("grid", 0), ("grid", 200), ("group=4", 0), ("layer=4", 0), ("dyn-none", 0),
                             ("dyn", 0))
                for s, c in rings]
    variants += [{**v, "name": v["name"] + " grab3", "grab": 3} for v in variants if v["deps"] == "dyn"]
    res = stream_probe(kernel_lib, ops, n_sm, variants, reps=3, warmup=1, copy=copy)
    assert res["bytes"] == sum(b for _, b in ops) and res["grid"] == n_sm
    ms = {v["name"]: v["ms"]["median"] for v in res["variants"]}
    for v in variants:  # two o_proj ops wait 50 µs each after their dependency, where ops wait
        if v["deps"] not in ("none", "dyn-none"):
            assert ms[v["name"]] >= 0.1, ms
    assert ms["none p0 s12 c16384"] < 0.1 and ms["dyn-none p0 s12 c16384"] < 0.1, ms
    for v in res["variants"]:  # cycle shares of the run: the delays show up as dependency waits only
        sh = {n: x["mean"] for n, x in v["cycle_shares"].items()}
        assert all(0 <= x <= 1 for x in sh.values()) and sum(sh.values()) - sh["producer_blocked"] <= 1.0, v
        waits = v["deps"] not in ("none", "dyn-none")
        assert (sh["dep_wait"] > 0) if waits else (sh["dep_wait"] == 0), v
        if waits and v["slots"] == 12:  # fast streaming: the 100 µs of delays dominate
            assert sh["dep_wait"] > 0.3, v
    with pytest.raises(AtomflowError, match="multiples of 16"):
        stream_probe(kernel_lib, [("x", 24)], n_sm, variants, copy=copy)
