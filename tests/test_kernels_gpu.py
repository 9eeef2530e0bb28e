"""Every kernel in kernels_cu/ against a NumPy reference, on the GPU.

Rules (llm.c dev/cuda style): fresh random inputs every run (never zeros), outputs poisoned with NaN (or a
sentinel) before the launch so an unwritten element fails, references in float64 (or exact emulation of
the fp16 roundings the kernel is specified to do). The costly inputs are drawn once per shape and shared by the cases
that launch them in other forms (ring depths, slot counts, builds, ranks, lengths): a GEMV's weight matrix with its fp8
quantisation and float64 copy (gemv_weights), an attention shape's K/V caches (kv_caches); the vectors (x, h, q, the
residual) are drawn per case. Drawing, quantising and widening a 117M-element matrix in NumPy takes seconds, the
launch microseconds. Error bounds, as relative L2 error ||out-ref||/||ref||:
  fp16 outputs (QKV, SwiGLU, RoPE, attention, RMSNorm)   <= 2e-3   (fp16 rounding is 2^-11 ~ 4.9e-4 per element)
  fp32 outputs (logits, residual updates)                <= 1e-4   (fp32 accumulation over K <= 14336 terms)
  the lm_head's RMSNorm prologue (xnorm): per element <= 2e-3 relative (2 fp16 ulps) and at most 2% of the elements
  different from the NumPy norm at all (assert_norm_matches)
  fp8 GEMV is compared against the *dequantised* weights with the same bounds (its quantisation error is
  the quantiser's, tested in test_quant.py); the GPU quantiser must be bit-exact with quant.py.
Layer GEMVs take their weights in the tiled layout (gpu.ops.gemv.tiled, as the loader writes them); the references
use the row-major matrices, so a layout bug fails here. A launch's form (warp-specialised or ring, slots before the
wait, the L2 tail) is a launch argument now (gpu.forms): each form is launched here by name.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from atomflow_bench.config import CATALOG
from atomflow_bench.errors import AtomflowError
from atomflow_bench.gpu.device import compute_capability, smem_limits
from atomflow_bench.gpu.forms import GemvForm, default_forms
from atomflow_bench.gpu.ops.attention import (ATT_CHUNK, attention_launch, attention_short_launch, attention_splits,
                                              blocks_per_kv, short_capacity)
from atomflow_bench.gpu.ops.gemv import (VARIANT_PAIRING, gemv_launch, head_l2, linear_regions, next_l2, tiled,
                                         tiled_scales)
from atomflow_bench.gpu.ops.lm_head import lm_head_launch, rows_launch
from atomflow_bench.gpu.ops.small import embed_launch, quantize_launch, spin_launch
from atomflow_bench.gpu.nvrtc import KernelLib
from atomflow_bench.gpu.step import hold_position
from atomflow_bench.quant import dequantize_fp8, quantize_fp8
from lab import KERNELS as LAB_KERNELS, KERNELS_DIR as LAB_KERNELS_DIR

pytestmark = pytest.mark.gpu

# The kernel builds these tests compile (conftest.compiled_kernels compiles them in parallel before the first test):
# every file of the default build, attention.cu's portable staging (ATT_TMA=0), the GEMVs without bulk copies
# (GEMV_BULK=0) and the lab's probe kernels.
KERNEL_BUILDS = [(None, (), None), (None, ("ATT_TMA=0",), ("attention.cu",)),
                 (None, ("GEMV_BULK=0",), ("gemv_fp16.cu", "gemv_fp8.cu")), (LAB_KERNELS_DIR, (), None)]

FP16_TOL, FP32_TOL = 2e-3, 1e-4
SHAPE_MODELS = ("llama-3.2-1b", "llama-3.2-3b", "smollm2-135m")
WS_THREADS, RING_THREADS = 288, 256  # block sizes of the warp-specialised (8 consumer warps + producer) and ring forms


def default_gemv_form(fmt: str) -> GemvForm:
    """The layer GEMVs' form when nothing was tuned (forms.default_forms): on sm_90+ fp16 warp-specialised and fp8 the
    ring, each with the L2 tail; before sm_90 the ring. (What gemv_launch's old ws=None picked, plus the L2 tail.)"""
    return default_forms(fmt, compute_capability(), 0).gemv_split


def skip_unless_sm90(why: str = "warp-specialised GEMVs need sm_90+ (bulk copies)") -> None:
    if compute_capability() < 90:
        pytest.skip(why)


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), "non-finite output (unwritten element or overflow)"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def rng_for(*key) -> np.random.Generator:
    """Fresh random inputs every run; the seed is printed so a failure can be replayed."""
    seed = np.random.SeedSequence().entropy
    print(f"rng seed for {key}: {seed}")
    return np.random.default_rng(seed)


WEIGHTS_HOST_BYTES = 8 << 30  # the float64 copies gemv_weights keeps (least recently used dropped first)
_weights: OrderedDict = OrderedDict()


def gemv_weights(fmt: str, rows: int, k: int, pairing: str = "none", half: int = 0):
    """(device weights in the tiled layout, device scales (fp8) or None, float64 weights the reference multiplies) of
    a random [rows, k] fp16 matrix (std 0.02; fp8: quantised, the reference on the dequantised values), drawn once per
    (format, shape, tile pairing) and shared by the cases that launch it; kernels only read their weights."""
    import cupy as cp

    key = (fmt, rows, k, pairing, half)
    if key in _weights:
        _weights.move_to_end(key)
        seed, entry = _weights[key]
        print(f"weights {key}: rng seed {seed}")
        return entry
    seed = np.random.SeedSequence().entropy
    print(f"weights {key}: rng seed {seed}")
    rng = np.random.default_rng(seed)
    w16 = (rng.standard_normal((rows, k), dtype=np.float32) * 0.02).astype(np.float16)
    if fmt == "fp8":
        q, s = quantize_fp8(w16)
        entry = (cp.asarray(tiled(q, fmt, pairing, half)), cp.asarray(tiled_scales(s, pairing, half)),
                 dequantize_fp8(q, s).astype(np.float64))
    else:
        entry = (cp.asarray(tiled(w16, fmt, pairing, half)), None, w16.astype(np.float64))
    _weights[key] = (seed, entry)
    while len(_weights) > 1 and sum(e[2].nbytes for _, e in _weights.values()) > WEIGHTS_HOST_BYTES:
        _weights.popitem(last=False)
    return entry


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
    w_dev, s_dev, w_eff = gemv_weights(fmt, rows, k, VARIANT_PAIRING[variant])
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
    elif variant == "partial":  # fp32 store (a tensor-parallel rank's share of o_proj / down)
        y_dev = cp.full(n_out, np.nan, dtype=np.float32)
    else:
        y_dev = cp.full(n_out, np.nan, dtype=np.float16)
    ln = gemv_launch(kernel_lib, fmt, variant, w_dev, s_dev, x_dev, y_dev, n_out, k, n_sm, norm_w=nw_dev, eps=eps,
                     **launch_kw)
    ln()
    out = y_dev.get()
    if variant == "resid":
        assert rel_err(out.astype(np.float64) - h0, y_ref) < FP32_TOL
    elif variant == "partial":
        assert out.dtype == np.float32 and not np.isnan(out).any() and rel_err(out, y_ref) < FP32_TOL
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
    """Every layer shape (and the odd ones) in the format's default form (default_gemv_form)."""
    form = default_gemv_form(fmt)
    ln = check_gemv(kernel_lib, n_sm, rng_for("gemv", fmt, model, region), fmt, variant_of(region), rows, k,
                    ws=form.ws, ws_pre=form.ws_pre)
    assert ln.block[0] == (WS_THREADS if form.ws else RING_THREADS)


RING_CASES = [("resid", 3072, 8192), ("store", 5120, 3072), ("norm_swiglu", 4608, 576)]
# tensor parallel: o_proj and down per rank (gpu/tp/plan.py local_config): 70B over 2 (o_proj; down, the only K above 11k,
# where the fp8 ring is 4 deep) and 8B over 2 (o_proj). (70B's down over 4 and 8B's down over 2, K 7168, run the plans
# of the first shape.)
PARTIAL_CASES = [(8192, 4096), (8192, 14336), (4096, 2048)]


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("ws", [False, True], ids=["ring", "ws"])
@pytest.mark.parametrize("rows,k", PARTIAL_CASES)
def test_gemv_partial(kernel_lib, n_sm, fmt, ws, rows, k):
    """The "partial" variant (fp32 y = W.x, output poisoned with NaN) in both forms at the per-rank shapes."""
    if ws:
        skip_unless_sm90()
    ln = check_gemv(kernel_lib, n_sm, rng_for("partial", fmt, ws, rows, k), fmt, "partial", rows, k, ws=ws)
    assert ln.name == f"gemv_{fmt}_partial"


def ll_words(values: np.ndarray, epoch: int) -> np.ndarray:
    """LL slots (tp_ll.cuh): fp32 bits low, epoch high."""
    return values.astype(np.float32).view(np.uint32).astype(np.uint64) | np.uint64(epoch << 32)


def fake_peers(rng, n_ranks: int, rank: int, n: int, epoch: int, bufs):
    """This rank's LL buffer `bufs[rank]` with the other ranks' rows already arrived (random values at `epoch`), as
    their GPUs would have pushed them; returns those values [n_ranks, n] (this rank's row: NaN, unknown yet)."""
    import cupy as cp

    vals = np.full((n_ranks, n), np.nan, np.float32)
    for s in range(n_ranks):
        if s != rank:
            vals[s] = rng.standard_normal(n, dtype=np.float32) * np.float32(0.5)
            bufs[rank][s] = cp.asarray(ll_words(vals[s], epoch))
    return vals


def check_rank_sum(bufs, vals, rank: int, epoch: int, h0: np.ndarray, h_out: np.ndarray) -> np.ndarray:
    """After a launch as rank `rank`: its row went to every buffer (epoch included, the same words everywhere), and
    h = h0 + (v_0 + v_1 + ...) in rank order, bit for bit in fp32; returns this rank's values."""
    mine = bufs[rank][rank].get()
    assert (mine >> np.uint64(32) == epoch).all(), "this rank's row did not arrive at the epoch"
    for s, b in enumerate(bufs):
        assert np.array_equal(b[rank].get(), mine), f"rank {s}'s buffer holds another row {rank}"
    own = (mine & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.float32)
    acc = own.copy() if rank == 0 else vals[0].copy()
    for s in range(1, len(bufs)):
        acc = acc + (own if s == rank else vals[s])
    assert np.array_equal(h_out, h0 + acc), "h != h0 + the rows summed in rank order"
    return own


# (ranks, this rank): the rank's row first, last, in the middle; one rank alone
TP_SUM_CASES = [(2, 0), (2, 1), (4, 2), (1, 0)]


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("ws", [False, True], ids=["ring", "ws"])
@pytest.mark.parametrize("rows,k", [(8192, 4096), (4096, 2048), (48, 96)])
@pytest.mark.parametrize("n_ranks,rank", TP_SUM_CASES)
def test_gemv_resid_tp(kernel_lib, n_sm, fmt, ws, rows, k, n_ranks, rank):
    """resid_tp (EPI_TPSUM) as rank `rank` of `n_ranks` on one GPU: the other ranks' rows are already in this rank's
    LL buffer (their GPUs would have pushed them; the 'peer' buffers are local arrays here): the kernel pushes W.x
    (checked against float64) into every buffer and sums all rows into h in rank order, bit for bit; two rounds (the
    epochs advance, seq per block), the second asking a next GEMV's head into L2 while it waits (head_l2: here its
    own weights; a hint, so the values must not change, and a wrong address would fault)."""
    import cupy as cp

    if ws:
        skip_unless_sm90()
    rng = rng_for("resid_tp", fmt, ws, rows, k, n_ranks, rank)
    w_dev, s_dev, w_eff = gemv_weights(fmt, rows, k)
    bufs = [cp.zeros((n_ranks, rows), dtype=cp.uint64) for _ in range(n_ranks)]
    slots = cp.asarray(np.array([b.data.ptr for b in bufs], dtype=np.uint64))
    seq = cp.zeros(1024, dtype=cp.uint32)
    for epoch in (1, 2):
        x16 = rng.standard_normal(k, dtype=np.float32).astype(np.float16)
        h0 = rng.standard_normal(rows, dtype=np.float32)
        vals = fake_peers(rng, n_ranks, rank, rows, epoch, bufs)
        h = cp.asarray(h0)
        ln = gemv_launch(kernel_lib, fmt, "resid_tp", w_dev, s_dev, cp.asarray(x16), h, rows, k, n_sm, ws=ws,
                         tp=(slots, seq, rank, n_ranks),
                         head=head_l2(fmt, "resid", w_dev, s_dev, n_sm, ws, 2) if epoch == 2 else None)
        ln()
        own = check_rank_sum(bufs, vals, rank, epoch, h0, h.get())
        assert rel_err(own, w_eff @ x16.astype(np.float64)) < FP32_TOL
        g = ln.grid[0]
        assert (seq.get()[:g] == epoch).all() and (seq.get()[g:] == 0).all()
    assert ln.name == f"gemv_{fmt}_resid_tp"


def test_gemv_resid_tp_refuses(kernel_lib, n_sm):
    import cupy as cp

    w = cp.zeros((16, 32), cp.float16)
    with pytest.raises(AtomflowError, match="cross-rank arguments"):
        gemv_launch(kernel_lib, "fp16", "resid_tp", w, None, cp.zeros(32, cp.float16), cp.zeros(16, cp.float32), 16,
                    32, n_sm)


@pytest.mark.parametrize("n", [4096, 8192, 576])
@pytest.mark.parametrize("n_ranks,rank", TP_SUM_CASES)
def test_tp_allreduce_add_alone(kernel_lib, n, n_ranks, rank):
    """The standalone sum (tp_comm.cu tp_allreduce_add) as rank `rank` on one GPU, the other ranks' rows already
    arrived: this rank's x goes to every buffer, h = h0 + the rows in rank order bit for bit; three rounds over the
    same buffer (epochs per block)."""
    import cupy as cp

    from atomflow_bench.gpu.tp.sums import TP_SUM_BLOCKS, allreduce_launch, sum_blocks

    rng = rng_for("tp_sum", n, n_ranks, rank)
    bufs = [cp.zeros((n_ranks, n), dtype=cp.uint64) for _ in range(n_ranks)]
    slots = cp.asarray(np.array([b.data.ptr for b in bufs], dtype=np.uint64))
    seq = cp.zeros(TP_SUM_BLOCKS, dtype=cp.uint32)
    for epoch in (1, 2, 3):
        vals = fake_peers(rng, n_ranks, rank, n, epoch, bufs)
        x = rng.standard_normal(n, dtype=np.float32)
        h0 = rng.standard_normal(n, dtype=np.float32)
        h = cp.asarray(h0)
        allreduce_launch(kernel_lib, h, cp.asarray(x), slots, seq, rank, n_ranks)()
        own = check_rank_sum(bufs, vals, rank, epoch, h0, h.get())
        assert np.array_equal(own, x)
        g = sum_blocks(n)
        assert (seq.get()[:g] == epoch).all() and (seq.get()[g:] == 0).all()


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("region,rows,k", [(r, *rk) for r, rk in linear_regions(CATALOG["llama-3.2-3b"].config).items()])
def test_gemv_ws_plans(kernel_lib, n_sm, fmt, region, rows, k):
    """Both formats warp-specialised (ws=True) at their launch plans (ops.gemv.gemv_ws_plan) on the 3B shapes."""
    skip_unless_sm90()
    ln = check_gemv(kernel_lib, n_sm, rng_for("ws", fmt, region), fmt, variant_of(region), rows, k, ws=True)
    assert ln.block[0] == WS_THREADS


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("depth", [1, 2, 3, 5])
@pytest.mark.parametrize("variant,rows,k", RING_CASES)
def test_gemv_ws_every_ring_depth(kernel_lib, n_sm, fmt, depth, variant, rows, k):
    """The warp-specialised GEMV (producer warp + bulk copies, sm_90+) with rings of 1-5 slots at 1 block per SM:
    every block walks several tiles through one ring, whose slots wrap many times."""
    skip_unless_sm90()
    ln = check_gemv(kernel_lib, n_sm, rng_for("ws ring", fmt, depth, variant, rows, k), fmt, variant, rows, k,
                    ws=True, ring_depth=depth)
    assert ln.grid[0] == n_sm < rows // 16 and ln.block[0] == WS_THREADS


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("pre", [0, 1, 2, 3, 5, 16])
@pytest.mark.parametrize("variant,rows,k", RING_CASES[:2])
def test_gemv_ws_slots_before_the_wait(kernel_lib, n_sm, fmt, pre, variant, rows, k):
    """The warp-specialised GEMV with 0 (the whole ring), 1-5 or more slots than the ring has filled before the
    PDL wait (the launch argument ws_pre that the tuned forms vary: forms.WS_PRE_TRY, GemvForm.ws_pre), at 1 block
    per SM with a ring of 4 slots: the producer's `go` barrier is crossed at every count and never deadlocks."""
    skip_unless_sm90()
    ln = check_gemv(kernel_lib, n_sm, rng_for("ws pre", fmt, pre, variant), fmt, variant, rows, k,
                    ws=True, ring_depth=4, ws_pre=pre)
    assert ln.block[0] == WS_THREADS and int(ln.args[-1]) == pre


# The ring form (ws=False): fp16 through registers, fp8 through a per-warp ring filled by bulk copies (sm_90+) or,
# with the kernel define GEMV_BULK=0 (sm_89's path), lane by lane with cp.async. The test ids keep the names of the
# builds these cases ran on before the GEMV_WS knob became the launch argument `ws` ("GEMV_WS=0": the default build).
@pytest.fixture(scope="module", params=[(), ("GEMV_BULK=0",)], ids=["GEMV_WS=0", "GEMV_WS=0 GEMV_BULK=0"])
def kernel_lib_ring(request, kernel_lib_of):
    return kernel_lib_of(request.param)


@pytest.mark.parametrize("depth", [2, 3, 4, 5])
@pytest.mark.parametrize("variant,rows,k", RING_CASES)
def test_gemv_legacy_every_ring_depth(kernel_lib_ring, n_sm, depth, variant, rows, k):
    """fp8's per-warp ring at each depth that has a kernel (gemv_f8_<variant>_r<depth>), at 1 block per SM."""
    ln = check_gemv(kernel_lib_ring, n_sm, rng_for("ring", depth, variant, rows, k), "fp8", variant, rows, k,
                    ws=False, ring_depth=depth)
    assert ln.grid[0] == n_sm < rows // 16 and ln.block[0] == RING_THREADS
    assert ln.fn is kernel_lib_ring[f"gemv_f8_{variant}_r{depth}"]


@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("region,rows,k", [(r, *rk) for r, rk in linear_regions(CATALOG["llama-3.2-3b"].config).items()])
def test_gemv_legacy_plans(kernel_lib_ring, n_sm, fmt, region, rows, k):
    """The ring form (ws=False) at its own launch plans (ops.gemv.gemv_plan), on the 3B shapes."""
    ln = check_gemv(kernel_lib_ring, n_sm, rng_for("legacy", fmt, region), fmt, variant_of(region), rows, k,
                    ws=False)
    assert ln.block[0] == RING_THREADS


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
    """The plain ROWS GEMV (ops.lm_head.rows_launch without norm or argmax: gemv_f16_f32, the `gemv` benchmark's)."""
    import cupy as cp

    rng = rng_for("lm_head", rows, k)
    w = (rng.standard_normal((rows, k), dtype=np.float32) * 0.02).astype(np.float16)
    x = rng.standard_normal(k, dtype=np.float32).astype(np.float16)
    y = cp.full(rows, np.nan, dtype=np.float32)
    ln = rows_launch(kernel_lib, cp.asarray(w), cp.asarray(x), y, rows, k, n_sm)
    assert ln.name == "gemv_fp16_f32"
    ln()
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
    """spin.cu lasts at least what it is asked for; measure.timing.queued_event_us keeps the host's time out of the
    event pairs: a 3 ms host sleep before each launch of a short kernel is not in its figure, the spin is not either;
    1500 calls (more than a stream queues before the host blocks) are taken in batches."""
    import time

    import cupy as cp

    from atomflow_bench.measure.timing import queued_event_us

    s = cp.cuda.Stream(non_blocking=True)
    a, b = cp.cuda.Event(), cp.cuda.Event()
    spin = spin_launch(kernel_lib, 500_000)  # compiled here (first use), not between the events
    with s:
        a.record(s)
        spin()
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


@pytest.mark.parametrize("form", ["default", "other"])
@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
@pytest.mark.parametrize("model", ["llama-3.2-3b", "llama-3.2-1b", "smollm2-135m"])
@pytest.mark.parametrize("pos", [0, 1, 77, 5000])
def test_qkv_rope_kv_append(kernel_lib, n_sm, form, fmt, model, pos):
    """QKV GEMV with RMSNorm prologue and the RoPE + KV-append epilogue against NumPy, in the format's default form
    (default_gemv_form: on sm_90+ with the L2 tail, i.e. gate/up's last MB asked into L2 after the epilogue, and
    o_proj's head before it as under tensor parallel: hints, whose contents are never read) and in the other form the
    tuner may pick (ws flipped, no L2 tail, no head)."""
    import cupy as cp

    base = default_gemv_form(fmt)
    gf = base if form == "default" else GemvForm(ws=not base.ws)
    if gf.ws:
        skip_unless_sm90()

    cfg = CATALOG[model].config
    nh, nkv, hd, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    rng = rng_for("qkv_rope", fmt, model, pos)
    w_dev, s_dev, w_eff = gemv_weights(fmt, cfg.qkv_dim, H, "rope", hd // 2)
    h = rng.standard_normal(H, dtype=np.float32) * 3
    nw = (1 + 0.1 * rng.standard_normal(H)).astype(np.float16)
    proj = (w_eff @ norm_ref(h, nw, 1e-5).astype(np.float64)).astype(np.float16).astype(np.float64)
    max_seq = pos + 3
    cs = cfg.rope_cos_sin(max_seq)
    kc = cp.full((max_seq, cfg.kv_dim), np.nan, dtype=cp.float16)
    vc = cp.full((max_seq, cfg.kv_dim), np.nan, dtype=cp.float16)
    y = cp.full(cfg.qkv_dim, np.nan, dtype=cp.float16)
    # the layer's gate/up weights, whose last l2_tail_mb MB the kernel asks into L2 (contents never read)
    wgu = cp.empty((2 * cfg.intermediate_size, H), dtype=cp.uint8 if fmt == "fp8" else cp.float16)
    nxt = next_l2(wgu, gf.l2_tail_mb)
    assert (nxt is None) == (gf.l2_tail_mb == 0)
    wo = cp.empty((H, cfg.q_dim), dtype=cp.uint8 if fmt == "fp8" else cp.float16)
    wo_s = cp.empty((H, -(-cfg.q_dim // 128)), dtype=cp.float32) if fmt == "fp8" else None
    head = head_l2(fmt, "resid", wo, wo_s, n_sm, gf.ws, 1) if form == "default" else None
    ln = gemv_launch(kernel_lib, fmt, "qkv_rope", w_dev, s_dev, cp.asarray(h), y, cfg.qkv_dim // 2, H, n_sm,
                     norm_w=cp.asarray(nw),
                     rope=(cp.asarray(cs), cp.asarray([pos], dtype=cp.int32), kc, vc, nh, nkv, hd, nxt),
                     ws=gf.ws, ws_pre=gf.ws_pre, head=head)
    assert ln.block[0] == (WS_THREADS if gf.ws else RING_THREADS)
    ln()
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
              "llama-3.1-8b": (8, 4, 128),
              # 16 q heads per kv head (two blocks per kv head): Llama-3.1-405B on 8 GPUs (one kv head each) and 4
              "405b-tp8": (1, 16, 128), "405b-tp4": (2, 16, 128), "g16-hd64": (2, 16, 64)}


_kv_caches: dict = {}


def kv_caches(model, max_seq):
    """Random K and V caches (fp16 [max_seq, n_kv * hd]) and their float64 copies, drawn once per (shape, max_seq)
    and shared by the lengths, split counts and builds that read them."""
    key = (model, max_seq)
    if key not in _kv_caches:
        n_kv, G, hd = ATT_SHAPES[model]
        rng = rng_for("kv", model, max_seq)
        kc = rng.standard_normal((max_seq, n_kv * hd), dtype=np.float32).astype(np.float16)
        vc = rng.standard_normal((max_seq, n_kv * hd), dtype=np.float32).astype(np.float16)
        _kv_caches[key] = kc, vc, kc.astype(np.float64), vc.astype(np.float64)
    return _kv_caches[key]


def attention_case(model, length, max_seq):
    """Random q (per case), the shape's K/V caches (fp16, NaN past `length`) and the float64 reference output of GQA
    attention over `length` rows."""
    n_kv, G, hd = ATT_SHAPES[model]
    nh = n_kv * G
    rng = rng_for("att", model, length)
    q = (rng.standard_normal(nh * hd, dtype=np.float32) * rng.uniform(0.5, 3)).astype(np.float16)
    kc, vc, k64, v64 = kv_caches(model, max_seq)
    kq = k64[:length].reshape(length, n_kv, hd)
    vq = v64[:length].reshape(length, n_kv, hd)
    kc, vc = kc.copy(), vc.copy()
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
    shared memory holds — "max" = the engine's largest bucket (ops.attention.short_capacity on this GPU: 416 at
    hd 128, 512 at hd 64 on an H100), 128 = a smaller bucket; lengths beyond it (and cap 7) walk several chunks
    with the online-softmax rescale."""
    import cupy as cp

    n_kv, G, hd = ATT_SHAPES[model]
    cap = short_capacity(hd, smem_limits()) if cap == "max" else cap
    q, kc, vc, ref = attention_case(model, length, max_seq=1024)
    out = cp.full(q.size, np.nan, dtype=cp.float16)
    launch = attention_short_launch(kernel_lib, cp.asarray(q), cp.asarray(kc), cp.asarray(vc),
                                    cp.asarray([length - 1], dtype=cp.int32), out, n_kv, G, hd, cap)
    assert launch.grid == (n_kv * blocks_per_kv(G),)
    launch()
    first = out.get()
    assert rel_err(first, ref) < FP16_TOL
    out.fill(np.nan)
    launch()  # a replay gives the identical result
    np.testing.assert_array_equal(out.get(), first)


def test_attention_short_refuses_what_does_not_fit(kernel_lib):
    import cupy as cp

    n_kv, G, hd = ATT_SHAPES["llama-3.2-3b"]
    too_many = short_capacity(hd, smem_limits()) + 32
    z = cp.zeros(16, dtype=cp.float16)
    with pytest.raises(AtomflowError, match="shared memory"):
        attention_short_launch(kernel_lib, z, z, z, cp.zeros(1, dtype=cp.int32), z, n_kv, G, hd, too_many)


@pytest.fixture(scope="module", params=["ATT_TMA=1", "ATT_TMA=0"])
def kernel_lib_att(request, kernel_lib_of):
    """attention.cu's staging forms: ATT_TMA = 1: K/V groups staged by 2D tensor copies (sm_90+; the default there,
    nvrtc.arch_defines); ATT_TMA = 0: by cp.async (the default before sm_90, the portable form)."""
    return kernel_lib_of((request.param,))


@pytest.mark.parametrize("model", list(ATT_SHAPES))
@pytest.mark.parametrize("length", [1, 2, 63, 64, 65, 200, 1000, 4097])
@pytest.mark.parametrize("cap", [None, "plan", 7, 1])
def test_attention(kernel_lib, model, length, cap, n_sm):
    """cap: the split count (grid.y). None = one split per 32-position sub-chunk of max_seq; "plan" = the engine's
    (ops.attention.attention_splits: ~2 blocks per SM); 7 and 1 force splits that walk many 16-position groups per
    warp (the ring wraps; row L-1 is staged after the wait; online softmax, uneven shares)."""
    check_attention(kernel_lib, n_sm, model, length, cap)


@pytest.mark.parametrize("model", list(ATT_SHAPES))
@pytest.mark.parametrize("length", [1, 2, 33, 200, 1000, 4097])
@pytest.mark.parametrize("cap", [None, "plan", 2])
def test_attention_variants(kernel_lib_att, model, length, cap, n_sm):
    """ATT_TMA = 1 and 0 explicitly: cap 2 walks many groups per warp (the ring's slots wrap), lengths 1, 2, 33
    groups with row L-1 alone or rows past the split; with tensor copies row L-1 is patched once its group's boxes
    have landed and rows past the length (NaN in the cache) are zeroed in shared memory."""
    if "ATT_TMA=1" in kernel_lib_att.defines:
        skip_unless_sm90("tensor copies (ATT_TMA=1) need sm_90+")
    check_attention(kernel_lib_att, n_sm, model, length, cap)


def check_attention(lib, n_sm, model, length, cap):
    import cupy as cp

    n_kv, G, hd = ATT_SHAPES[model]
    nh, max_seq = n_kv * G, 4160
    splits = attention_splits(max_seq, n_kv, n_sm, group=G) if cap == "plan" else cap or -(-max_seq // ATT_CHUNK)
    q, kc, vc, ref = attention_case(model, length, max_seq)
    out = cp.full(nh * hd, np.nan, dtype=cp.float16)
    counters = cp.zeros(n_kv * blocks_per_kv(G), dtype=cp.uint32)
    launch = attention_launch(lib, cp.asarray(q), cp.asarray(kc), cp.asarray(vc),
                              cp.asarray([length - 1], dtype=cp.int32),
                              cp.full((nh, splits, 2), np.nan, dtype=cp.float32),
                              cp.full((nh, splits, hd), np.nan, dtype=cp.float32), counters, out, n_kv, G, hd)
    assert launch.grid == (n_kv * blocks_per_kv(G), splits)
    launch()
    first = out.get()
    assert rel_err(first, ref) < FP16_TOL
    assert (counters.get() == 0).all(), "split-combine ticket not reset"
    out.fill(np.nan)
    launch()  # a replay must give the identical result (tickets reset, no stale partials)
    np.testing.assert_array_equal(out.get(), first)


def assert_norm_matches(x, h, nw, eps):
    """The kernels' RMSNorm (common.cuh rms_inv / rmsnorm_elem: fp32 sum of squares in the block's order, rsqrtf,
    h * inv rounded to fp16, times the fp16 weight rounded to fp16: HF's order) against norm_ref, which does the same
    roundings with inv from a float64 mean. The two inv differ by ~1e-6 relative (summation order, rsqrtf's 2 ulp),
    so an element can differ only where h * inv lies that close to an fp16 rounding boundary, and then by at most 2
    fp16 ulps: bound 2e-3 relative per element (2 ulps = 2^-9 ~ 1.95e-3 at a binade's bottom; the products' own
    rounding keeps it under 2e-3) plus 2^-22 absolute (fp16 subnormals, spacing 2^-24). A NumPy emulation of the
    kernel's order with inv moved 2 ulps either way differs in <= 0.4% of the elements (K 576-4096); a norm that
    skips the fp16 rounding of h * inv (one rounding at the end) differs in ~20%. So: at most 2% may differ at all."""
    ref = norm_ref(h, nw, eps)
    assert rel_err(x, ref) < FP16_TOL
    np.testing.assert_allclose(x.astype(np.float64), ref.astype(np.float64), rtol=2e-3, atol=2.0 ** -22)
    assert np.count_nonzero(x != ref) <= 0.02 * x.size, f"{np.count_nonzero(x != ref)} of {x.size} differ"


@pytest.fixture(scope="module", params=[""])
def kernel_lib_lmhead(request, kernel_lib):
    """The default build. (The LMHEAD_L2_KEEP builds this was parametrised over are gone; the one parameter left
    keeps the cases' ids, test_lm_head_argmax[-ROWS-K].)"""
    return kernel_lib


@pytest.mark.parametrize("rows,k", [(128256, 3072), (49152, 576), (1000, 2048), (2000, 4096)])
def test_lm_head_argmax(kernel_lib_lmhead, n_sm, rows, k):
    """The step's lm_head launch (ops.lm_head.lm_head_launch: gemv_f16_f32_argmax with the final RMSNorm as its
    prologue and the argmax in its epilogue): xnorm within assert_norm_matches' bounds of the NumPy norm and the same
    bits at every launch, the logits of that xnorm within the plain GEMV's bound, the token = the first maximum of
    those very logits (NaN never wins, ties -> the smaller index), the step state (out_tokens[pos], cur_token = the
    prompt's next id or the token, pos + 1), the ticket reset; with advance = 0 (step.hold_position) the same search
    but the state left alone. Partials, xnorm, logits and tokens poisoned before every launch."""
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
    launch = lm_head_launch(kernel_lib_lmhead, a, cfg, n_sm)
    assert launch.name == "gemv_fp16_f32_argmax" and launch.grid[0] <= n_part
    assert set(launch.taps) == {"final_norm", "logits"}
    (held,) = hold_position([launch])
    assert int(launch.args[-1]) == 1 and int(held.args[-1]) == 0
    prompt = a["prompt"].get()

    def poison(pos):
        for name, v in (("logits", np.nan), ("xnorm", np.nan), ("am_val", np.nan), ("am_idx", -1),
                        ("out_tokens", -1)):
            a[name].fill(v)
        a["pos"].fill(pos)
        a["cur_token"].fill(-7)

    poison(2)
    held()
    x = a["xnorm"].get()
    assert_norm_matches(x, h, nw, 1e-5)  # the norm prologue against NumPy (the separate rmsnorm kernel is gone)
    x64 = x.astype(np.float64)
    ref = np.concatenate([w[r:r + 8192].astype(np.float64) @ x64 for r in range(0, rows, 8192)])  # no 3 GB temporary

    def run(ln, pos):
        poison(pos)
        ln()
        np.testing.assert_array_equal(a["xnorm"].get(), x)  # the norm prologue: the same bits at every launch
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
    ref[[best, best + 7]] = w[[best, best + 7]].astype(np.float64) @ x64  # only these rows changed
    assert run(launch, 4) == best
    assert int(a["out_tokens"].get()[4]) == best
    assert int(a["pos"].get()[0]) == 5 and int(a["cur_token"].get()[0]) == best  # the first generated token
    assert int(a["am_idx"].get()[0]) == best  # the best is left in partials[0] (tensor parallel combines them)
    assert a["am_val"].get()[0] == np.float32(a["logits"].get()[best])
    assert run(held, 4) == best  # advance = 0: the same search, the state untouched
    assert int(a["pos"].get()[0]) == 4 and int(a["cur_token"].get()[0]) == -7
    assert (a["out_tokens"].get() == -1).all()
    assert int(a["am_idx"].get()[0]) == best


@pytest.fixture(scope="module")
def lab_lib():
    """The lab kernels (lab/kernels/probe_stream.cu), as lab/scripts/probe_stream.py builds them."""
    return KernelLib(LAB_KERNELS, LAB_KERNELS_DIR)


def test_probe_stream(lab_lib, n_sm):
    """lab/kernels/probe_stream.cu (the persistent-stream probe, lab/probe.py): on fresh random
    bytes every chunk is read exactly once (stream_probe checks each launch's checksum and the op counters against
    what the rule gives, raising otherwise) for ops smaller than the grid, not multiples of the chunk, rings of 1, 2
    and 12 chunks, each dependency rule (none, the grid, groups of 4, the layer rule, static or dynamic chunks;
    spinning or sleeping polls, both signals); the modelled latency is waited for only where the op waits."""
    from lab.probe import stream_probe

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
    res = stream_probe(lab_lib, ops, n_sm, variants, reps=3, warmup=1, copy=copy)
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
        stream_probe(lab_lib, [("x", 24)], n_sm, variants, copy=copy)
