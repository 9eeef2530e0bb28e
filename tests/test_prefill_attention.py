"""The prefill attention kernel (kernels_cu/attention_prefill.cu) and its op module (gpu/ops/attention_prefill.py).

CPU: the grid, the shared memory (a block fits an H100 and an sm_89 GPU; two blocks per H100 SM, as the kernel's
launch bounds assume), the one-line refusals of what the kernel does not take, the launch the factory builds, the
NumPy reference against a naive loop, and the error bound on a NumPy model of the kernel's roundings.

GPU (@pytest.mark.gpu, skipped without a device): the kernel against the float64 NumPy reference (exact softmax from
the fp16 inputs, causal mask: query row r at position start + r sees positions 0 .. start + r). Fresh random inputs
every run (the seed is printed); q is the start of a fused qkv buffer whose k and v columns are NaN, the cache rows
past the chunk are NaN (neither may reach the output), out is NaN-poisoned before the launch and wider than the q
heads and longer than the chunk: every element of the chunk's rows in the q heads' columns is checked, the columns
and rows beyond must stay NaN. A replay gives the identical result.

Error bound, every element: |out - ref| <= 2e-3 * max|V| (V over the positions read). Derivation, u = 2^-11 (fp16's
unit roundoff): the scores are exact fp16 products summed in fp32 (relative error ~hd * 2^-24) and 2^x is ex2.approx
(~2^-22): both negligible. P is rounded to fp16 and the sum is taken over the rounded values, so the output is a
convex combination of V rows with weights w_t (1 + d_t) / (1 + mean d), |d_t| <= u: at most 2u / (1 - u) * max|V| =
9.8e-4 max|V| away; weights below fp16's normal range carry an absolute error <= 2^-25 each (the sum is >= 1), at most
(start + M) * 2^-25 = 6e-5 for 2064 positions; the fp16 output adds u |out| <= 4.9e-4 max|V|. Total 1.53e-3 max|V|.
The relative L2 error is also held to tests/test_kernels_gpu.py's fp16 bound (2e-3).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from atomflow_bench.errors import AtomflowError
from atomflow_bench.gpu.device import SMEM_H100, SMEM_SM89, blocks_fit
from atomflow_bench.gpu.ops.attention_prefill import (ATP_KV, ATP_ROWS, ATP_SMEM_PAD, ATP_THREADS, HEAD_DIMS,
                                                      KERNELS, SMEM_HEADROOM, attention_prefill_launch, check_prefill,
                                                      prefill_bytes, prefill_grid, prefill_kernel, prefill_smem,
                                                      wgmma_default)
from test_kernels_gpu import rng_for

# conftest.compiled_kernels compiles these before the first GPU test
KERNEL_BUILDS = [(None, (), ("attention_prefill.cu", "attention_prefill_sm90a.cu"))]
ERR_BOUND = 2e-3  # x max|V|, per element (the derivation above)
REL_TOL = 2e-3    # relative L2 error (tests/test_kernels_gpu.py FP16_TOL)


def prefill_reference(q, kc, vc, start: int, m: int, n_kv: int, group: int, hd: int, scale: float) -> np.ndarray:
    """Causal GQA attention in float64 from the fp16 inputs: q [m][>= n_q*hd] (row stride its own), caches
    [>= start+m][n_kv*hd]; returns [m][n_q*hd]."""
    n_q, L = n_kv * group, start + m
    q64 = np.asarray(q[:, :n_q * hd], np.float64).reshape(m, n_q, hd)
    k = np.asarray(kc[:L], np.float64).reshape(L, n_kv, hd)
    v = np.asarray(vc[:L], np.float64).reshape(L, n_kv, hd)
    masked = np.arange(L)[None, :] > start + np.arange(m)[:, None]
    out = np.empty((m, n_q, hd))
    for hq in range(n_q):
        s = q64[:, hq] @ k[:, hq // group].T * scale
        s[masked] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, hq] = (p @ v[:, hq // group]) / p.sum(axis=1, keepdims=True)
    return out.reshape(m, n_q * hd)


def prefill_inputs(rng, hd: int, group: int, n_kv: int, start: int, m: int, fused: bool = True, extra_rows: int = 40):
    """(qkv [m][q_stride] fp16 with the q columns random and the rest NaN, k/v caches fp16 [start+m+extra][kv_dim]
    random up to start+m and NaN past it, q_stride, max|V| over the positions read)."""
    q_dim, kv_dim = n_kv * group * hd, n_kv * hd
    q_stride = q_dim + 2 * kv_dim if fused else q_dim
    qkv = np.full((m, q_stride), np.nan, np.float16)
    qkv[:, :q_dim] = rng.standard_normal((m, q_dim), dtype=np.float32) * rng.uniform(0.5, 3)
    caches = []
    for _ in range(2):
        c = rng.standard_normal((start + m + extra_rows, kv_dim), dtype=np.float32).astype(np.float16)
        c[start + m:] = np.nan
        caches.append(c)
    kc, vc = caches
    return qkv, kc, vc, q_stride, float(np.abs(vc[:start + m].astype(np.float64)).max())


# ---- CPU ------------------------------------------------------------------------------------------------------------
def test_constants_and_kernel_names():
    assert ATP_THREADS == 4 * 32 and ATP_ROWS == 16 * (ATP_THREADS // 32)  # 4 warps x the mma's 16 rows
    assert KERNELS == {f: tuple(f"attention_prefill_{w}hd{hd}_g{g}" for hd in (64, 128) for g in (1, 2, 3, 4, 8, 16))
                       for f, w in (("attention_prefill.cu", ""), ("attention_prefill_sm90a.cu", "wgmma_"))}
    assert prefill_kernel(128, 8) == "attention_prefill_hd128_g8"


@pytest.mark.parametrize("m, n_kv, group, grid", [(1, 8, 4, (1, 8)), (16, 8, 4, (1, 8)), (17, 2, 4, (2, 2)),
                                                  (100, 2, 3, (5, 2)), (300, 8, 1, (5, 8)), (64, 1, 16, (16, 1)),
                                                  (2048, 8, 4, (128, 8))])
def test_grid(m, n_kv, group, grid):
    """A block per ATP_ROWS stacked rows (query rows x the kv head's q heads) per kv head."""
    assert prefill_grid(m, n_kv, group) == grid


@pytest.mark.parametrize("hd", HEAD_DIMS)
def test_shared_memory_fits_h100_and_sm89(hd):
    """q tile + 2 stages of K and V tiles: a block fits both GPUs; an H100 SM holds two (launch bounds: 2 blocks)."""
    need = prefill_smem(hd)
    assert need == ATP_ROWS * hd * 2 + 2 * 2 * ATP_KV * hd * 2 == {64: 40960, 128: 81920}[hd]
    for smem in (SMEM_H100, SMEM_SM89):
        assert need + SMEM_HEADROOM <= smem[0]
        check_prefill(hd, 4, 0, 1, 8, 8 * 4 * hd, 8 * 4 * hd, smem)
    assert blocks_fit(need + SMEM_HEADROOM, SMEM_H100) >= 2 and blocks_fit(need + SMEM_HEADROOM, SMEM_SM89) >= 1
    # the wgmma kernel (an H100/H200 only): 1 KB more, still two blocks an SM
    assert prefill_smem(hd, True) == need + ATP_SMEM_PAD
    assert blocks_fit(need + ATP_SMEM_PAD + SMEM_HEADROOM, SMEM_H100) >= 2


def test_bytes_moved():
    # q and out: 17 rows x 8 heads x 64 dims fp16 each; K and V: 37 + 17 rows x 2 kv heads x 64 dims fp16 each
    assert prefill_bytes(37, 17, 2, 4, 64) == 2 * 17 * 8 * 64 * 2 + 2 * 54 * 2 * 64 * 2


class _NoLib:
    """A KernelLib stand-in that fails the test if the factory asks it for a kernel (it must refuse before)."""

    def __getitem__(self, name):
        raise AssertionError(f"the factory asked for {name} before refusing")


def _arrays(hd=64, group=4, n_kv=2, start=5, m=10, q_stride=None, out_stride=None, max_seq=None):
    q_dim = n_kv * group * hd
    q = np.zeros((m, q_stride or q_dim), np.float16)
    out = np.zeros((m, out_stride or q_dim), np.float16)
    kc = np.zeros((max_seq or start + m, n_kv * hd), np.float16)
    return q, kc, kc.copy(), out


@pytest.mark.parametrize("change, match", [
    ({"hd": 96}, "head_dim 96 unsupported"),
    ({"group": 5}, "5 q heads per kv head unsupported"),
    ({"m": 0}, "m >= 1"),
    ({"start": -1}, "start >= 0"),
    ({"q_stride": 516}, "q_stride 516 must be a multiple of 8"),
    ({"out_stride": 256}, "out_stride 256 must be a multiple of 8 and at least the q heads' 512"),
    ({"max_seq": 14}, r"k_cache \(14, 128\) is not a contiguous \[max_seq >= 15\]\[128\]"),
    ({"q_dtype": np.float32}, "q must be fp16"),
    ({"q_rows": 9}, r"q \(9, 512\)"),
    ({"smem": (64 * 1024, 64 * 1024, 1024), "hd": 128}, "needs 82944 bytes of shared memory per block"),
    ({"smem": (84000, 84000, 1024), "hd": 128, "wgmma": True}, "needs 84992 bytes of shared memory per block"),
])
def test_refuses_in_one_line(change, match):
    args = {"hd": 64, "group": 4, "n_kv": 2, "start": 5, "m": 10, "q_stride": 512, "out_stride": 512}
    args.update({k: v for k, v in change.items() if k in args})
    hd, group, n_kv, start, m = args["hd"], args["group"], args["n_kv"], args["start"], args["m"]
    q_dim = n_kv * group * hd
    q_stride = args["q_stride"] if "q_stride" in change else q_dim
    out_stride = args["out_stride"] if "out_stride" in change else q_dim
    q, kc, vc, out = _arrays(hd, group, n_kv, start, m, q_dim, q_dim, change.get("max_seq"))
    if "q_dtype" in change:
        q = q.astype(change["q_dtype"])
    if "q_rows" in change:
        q = q[:change["q_rows"]]
    with pytest.raises(AtomflowError, match=match) as err:
        attention_prefill_launch(_NoLib(), q, kc, vc, start, m, out, n_kv, group, hd, q_stride, out_stride,
                                 smem=change.get("smem", SMEM_H100), wgmma=change.get("wgmma", False))
    assert "\n" not in str(err.value)


def test_refuses_a_view_whose_rows_are_not_the_stride_apart():
    """A q view of the fused buffer is taken with the buffer's row stride; a mismatched stride is refused."""
    hd, group, n_kv, m = 64, 4, 2, 10
    q_dim, kv_dim = n_kv * group * hd, n_kv * hd
    qkv = np.zeros((m, q_dim + 2 * kv_dim), np.float16)
    _, kc, vc, out = _arrays(hd, group, n_kv, 0, m)
    with pytest.raises(AtomflowError, match="does not hold 10 rows of 512 fp16 elements 512 apart"):
        attention_prefill_launch(_NoLib(), qkv[:, :q_dim], kc, vc, 0, m, out, n_kv, group, hd, q_dim, q_dim,
                                 smem=SMEM_H100, wgmma=False)


@pytest.mark.parametrize("wgmma", [False, True])
def test_launch_the_factory_builds(wgmma, monkeypatch):
    """Grid, block, shared memory, arguments (a q view of the fused buffer with its stride), bytes and label, for
    either kernel; the wgmma kernel's tensor maps cover the cache rows the launch may read, K then V."""
    asked = []
    monkeypatch.setattr("atomflow_bench.gpu.ops.attention_prefill.tensor_maps",  # the driver's encoder needs a GPU
                        lambda arrays, box: asked.append(([a.shape for a in arrays], box)) or "maps")
    hd, group, n_kv, start, m = 128, 3, 8, 37, 100
    q_dim, kv_dim = n_kv * group * hd, n_kv * hd
    qkv = np.zeros((m, q_dim + 2 * kv_dim), np.float16)
    out = np.zeros((m, q_dim + 64), np.float16)
    kc = np.zeros((start + m, kv_dim), np.float16)
    fn = SimpleNamespace(max_dynamic_shared_size_bytes=0)
    ln = attention_prefill_launch({prefill_kernel(hd, group, wgmma): fn}, qkv[:, :q_dim], kc, kc, start, m, out,
                                  n_kv, group, hd, q_dim + 2 * kv_dim, q_dim + 64, smem=SMEM_H100, wgmma=wgmma)
    smem = prefill_smem(hd) + (ATP_SMEM_PAD if wgmma else 0)
    assert ln.fn is fn and ln.grid == (5, 8) and ln.block == (ATP_THREADS,)
    assert ln.shmem == smem == prefill_smem(hd, wgmma)
    assert fn.max_dynamic_shared_size_bytes == smem  # > 48 KB: opted in
    assert [int(a) for a in ln.args[4:9]] == [start, m, n_kv, q_dim + 2 * kv_dim, q_dim + 64]
    assert ln.args[9] == np.float32(1 / np.sqrt(hd)) and ln.args[9].dtype == np.float32
    assert ln.bytes_moved == prefill_bytes(start, m, n_kv, group, hd)
    assert ln.label == f"attention prefill{' wgmma' * wgmma} hd128 g3 100 rows" and ln.name == "attention_prefill"
    assert (ln.args[10:], asked) == ((("maps",), [([(137, 1024), (137, 1024)], (64, 64))]) if wgmma else ((), []))


def test_a_graph_holds_its_launches_and_their_arguments():
    """A captured graph keeps only the launches' argument pointers: StepGraph holds the launches, so a buffer made
    for one launch alone (the wgmma kernel's tensor maps) lives as long as the graph that reads it."""
    import gc
    import weakref

    from atomflow_bench.gpu.graph import StepGraph
    from atomflow_bench.gpu.launch import Launch

    class Stream:  # stream capture as StepGraph drives it
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def begin_capture(self):
            pass

        def end_capture(self):
            return SimpleNamespace(upload=lambda stream: None)

    class Maps:  # stands for the device array of tensor maps
        pass

    launched = []
    maps = Maps()
    alive = weakref.ref(maps)
    graph = StepGraph([Launch(lambda grid, block, args, shared_mem: launched.append(args), "k", (1,), (1,),
                              (maps,))], Stream())
    assert launched == [(maps,)] and graph.n_nodes == 1
    launched.clear()
    del maps
    gc.collect()
    assert alive() is not None
    del graph
    gc.collect()
    assert alive() is None


def test_the_wgmma_kernel_runs_on_compute_capability_9_0_only():
    """sm_90a code loads on a 9.0 device only: the mma.sync kernel everywhere else (8.9, 10.0, 12.0)."""
    assert [wgmma_default(cc) for cc in (80, 89, 90, 100, 120)] == [False, False, True, False, False]
    assert prefill_kernel(64, 8, True) == "attention_prefill_wgmma_hd64_g8"
    assert set(KERNELS["attention_prefill_sm90a.cu"]) == {prefill_kernel(hd, g, True) for hd in HEAD_DIMS
                                                          for g in (1, 2, 3, 4, 8, 16)}


def test_reference_matches_a_naive_loop():
    rng = rng_for("reference")
    hd, group, n_kv, start, m = 16, 3, 2, 5, 7
    qkv, kc, vc, _, _ = prefill_inputs(rng, hd, group, n_kv, start, m)
    ref = prefill_reference(qkv, kc, vc, start, m, n_kv, group, hd, 0.25)
    for r in range(m):
        for hq in range(n_kv * group):
            kv = slice((hq // group) * hd, (hq // group + 1) * hd)
            s = np.array([float(qkv[r, hq * hd:(hq + 1) * hd].astype(np.float64) @ kc[t, kv].astype(np.float64))
                          for t in range(start + r + 1)]) * 0.25
            w = np.exp(s - s.max())
            # atol: an output near 0 is a sum that cancels, so its relative error is the rounding over its size
            # (BLAS may add in another order from run to run)
            np.testing.assert_allclose(ref[r, hq * hd:(hq + 1) * hd], (w / w.sum()) @ vc[:start + r + 1, kv],
                                       rtol=1e-12, atol=1e-14)
    ref0 = prefill_reference(qkv[:1], kc, vc, 0, 1, n_kv, group, hd, 0.25)  # position 0 sees only itself
    np.testing.assert_allclose(ref0[0], np.repeat(vc[0].astype(np.float64).reshape(n_kv, hd), group, axis=0).ravel())


def kernel_model(q, kc, vc, start: int, m: int, n_kv: int, group: int, hd: int, scale: float) -> np.ndarray:
    """The kernel's arithmetic in NumPy (not its code): fp32 scores of the fp16 inputs, the walk over 64-position
    tiles with the online softmax in fp32 (log2 units), P rounded to fp16 with the sum over the rounded values,
    fp32 O, fp16 out."""
    n_q, L = n_kv * group, start + m
    q32 = q[:, :n_q * hd].astype(np.float32).reshape(m, n_q, hd)
    k32 = kc[:L].astype(np.float32).reshape(L, n_kv, hd)
    v32 = vc[:L].astype(np.float32).reshape(L, n_kv, hd)
    lim = start + np.arange(m)[:, None]
    out = np.empty((m, n_q, hd), np.float16)
    sl2 = np.float32(scale * 1.4426950408889634)
    for hq in range(n_q):
        mx, l, o = np.full((m, 1), -np.inf, np.float32), np.zeros((m, 1), np.float32), np.zeros((m, hd), np.float32)
        for p0 in range(0, L, ATP_KV):
            pos = np.arange(p0, min(p0 + ATP_KV, L))[None, :]
            s = np.where(pos > lim, -np.inf, (q32[:, hq] @ k32[p0:p0 + ATP_KV, hq // group].T) * sl2).astype(np.float32)
            m_new = np.maximum(mx, s.max(axis=1, keepdims=True))
            alpha = np.exp2(mx - m_new)
            p = np.exp2(s - m_new).astype(np.float16).astype(np.float32)
            l = l * alpha + p.sum(axis=1, keepdims=True)
            o = o * alpha + p @ v32[p0:p0 + ATP_KV, hq // group]
            mx = m_new
        out[:, hq] = (o / l).astype(np.float16)
    return out.reshape(m, n_q * hd)


@pytest.mark.parametrize("hd, group, start, m", [(64, 4, 0, 100), (128, 3, 2000, 64)])
def test_error_bound_holds_for_the_kernels_roundings(hd, group, start, m):
    """The stated bound has room for what the kernel's roundings do (on a model of them, every element)."""
    rng = rng_for("model", hd, group, start, m)
    qkv, kc, vc, _, vmax = prefill_inputs(rng, hd, group, 1, start, m)
    scale = 1 / np.sqrt(hd)
    got = kernel_model(qkv, kc, vc, start, m, 1, group, hd, scale).astype(np.float64)
    err = np.abs(got - prefill_reference(qkv, kc, vc, start, m, 1, group, hd, scale)).max()
    assert err <= ERR_BOUND * vmax, (err, vmax)


# ---- GPU ------------------------------------------------------------------------------------------------------------
def check_prefill_kernel(kernel_lib, hd: int, group: int, n_kv: int, start: int, m: int, fused: bool = True,
                         out_pad: int = 16, scale: float | None = None, factory=attention_prefill_launch,
                         rows: int | None = None, wgmma: bool | None = None) -> None:
    """One launch against the reference (the module docstring's checks), then a replay into a re-poisoned out.
    `factory`: attention_prefill_launch's arguments -> the Launch (the lab's versions bring their own, with `rows`
    stacked query rows a block where theirs differ from the product's)."""
    import cupy as cp

    rng = rng_for("prefill", hd, group, n_kv, start, m, fused)
    qkv, kc, vc, q_stride, vmax = prefill_inputs(rng, hd, group, n_kv, start, m, fused)
    q_dim = n_kv * group * hd
    out_stride = q_dim + out_pad
    scale_used = 1 / np.sqrt(hd) if scale is None else scale
    ref = prefill_reference(qkv, kc, vc, start, m, n_kv, group, hd, scale_used)
    qkv_d = cp.asarray(qkv)
    out = cp.full((m + 2, out_stride), np.nan, dtype=cp.float16)  # 2 rows past the chunk: must stay NaN too
    kw = {} if wgmma is None else {"wgmma": wgmma}
    launch = factory(kernel_lib, qkv_d[:, :q_dim] if fused else qkv_d, cp.asarray(kc), cp.asarray(vc), start, m, out,
                     n_kv, group, hd, q_stride, out_stride, scale, **kw)
    assert launch.grid == (prefill_grid(m, n_kv, group) if rows is None else (-(-m * group // rows), n_kv))
    launch()
    first = out.get()
    assert np.isnan(first[:, q_dim:]).all(), "written past the q heads' columns"
    assert np.isnan(first[m:]).all(), "written past the chunk's rows"
    got = first[:m, :q_dim].astype(np.float64)
    assert np.isfinite(got).all(), f"{np.count_nonzero(~np.isfinite(got))} elements unwritten or not finite"
    err = np.abs(got - ref)
    worst = np.unravel_index(err.argmax(), err.shape)
    assert err.max() <= ERR_BOUND * vmax, (f"max |err| {err.max():.3g} > {ERR_BOUND} x max|V| {vmax:.3g} at row "
                                           f"{worst[0]}, q head {worst[1] // hd}, dim {worst[1] % hd}")
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= REL_TOL
    out.fill(np.nan)
    launch()  # a replay gives the identical result
    np.testing.assert_array_equal(out.get(), first)


# (start, m): a first chunk and chunks after earlier cache; m of 1, below, at and past the 64-row / 64-position tiles;
# a long cache before a short chunk
CHUNKS = [(0, 1), (0, 17), (0, 64), (0, 100), (0, 300), (37, 1), (129, 17), (100, 100), (250, 300), (2000, 64)]


@pytest.fixture(params=[False, True], ids=["mma", "wgmma"])
def wgmma(request):
    """Each kernel where this GPU runs it: mma.sync everywhere, wgmma on compute capability 9.0."""
    if request.param and not wgmma_default():
        pytest.skip("the wgmma kernel runs on compute capability 9.0 only")
    return request.param


@pytest.mark.gpu
@pytest.mark.parametrize("hd", HEAD_DIMS)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("start, m", CHUNKS)
def test_prefill_attention(kernel_lib, wgmma, hd, group, start, m):
    """Two kv heads (the second's K/V columns and q heads are where a head-index slip shows), q read through a view
    of the fused qkv buffer."""
    check_prefill_kernel(kernel_lib, hd, group, 2, start, m, wgmma=wgmma)


@pytest.mark.gpu
@pytest.mark.parametrize("hd", HEAD_DIMS)
@pytest.mark.parametrize("group", [2, 16])
@pytest.mark.parametrize("start, m", [(0, 33), (70, 130)])
def test_prefill_attention_other_groups(kernel_lib, wgmma, hd, group, start, m):
    """The remaining instances: 16 q heads per kv head fill a block's 64 rows with 4 query rows."""
    check_prefill_kernel(kernel_lib, hd, group, 2, start, m, wgmma=wgmma)


@pytest.mark.gpu
@pytest.mark.parametrize("n_kv, group, hd", [(8, 4, 64), (8, 3, 128), (3, 3, 64), (8, 4, 128)],
                         ids=["llama-3.2-1b", "llama-3.2-3b", "smollm2-135m", "llama-3.1-8b"])
@pytest.mark.parametrize("start, m", [(0, 512), (512, 256)])
def test_prefill_attention_model_shapes(kernel_lib, wgmma, n_kv, group, hd, start, m):
    """The catalog's shapes at prefill sizes, q and out contiguous (strides = the q heads' width)."""
    check_prefill_kernel(kernel_lib, hd, group, n_kv, start, m, fused=False, out_pad=0, wgmma=wgmma)


@pytest.mark.gpu
def test_prefill_attention_scale_argument(kernel_lib):
    """The scale is the kernel's argument, not 1/sqrt(hd) built in."""
    check_prefill_kernel(kernel_lib, 128, 4, 2, 50, 70, scale=0.03)
