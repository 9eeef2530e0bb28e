#!/usr/bin/env python3
"""The prefill attention's variants against the product's kernel: checked against NumPy, then timed interleaved on one
GPU.

    lab/scripts/prefill_att_ab.py [--rounds 3] [--variants product,v2-s3,...] [--json FILE]

A variant is a kernel file standing in for kernels_cu/attention_prefill.cu (the product's own, or a lab version in
lab/kernels/ with the same kernel names and arguments) with some of its ATP_* #defines replaced. It is compiled from a
copy of kernels_cu/ (the product's other code unchanged) and launched with its own grid and shared memory: the
launch factory's arithmetic over the #defines the variant's source ends up with (`variant_defines`). Every version's
dynamic shared memory is the q tile and ATP_STAGES K and V tiles (the lab versions' headers say how they lay them
out), so one formula (`variant_smem`) serves all. Correctness: chunks at start 0 of 130 rows (row tiles of 1-3 K/V
tiles: the pipelines' short walks) and at start 300 of 200 rows against float64 NumPy (the product test's bound,
2e-3 max|V|) for 3B's and 1B's shapes; tests/test_lab_prefill_att_gpu.py holds the lab versions to the product's
whole GPU test. Timing: CUDA events around each launch, 20 after 3 warm-ups, median; the variants interleaved round
by round. TFLOPS of the causal work (row at position p: 4 hd (p+1) per q head)."""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

V2, V3 = "lab/kernels/attention_prefill_v2.cu", "lab/kernels/attention_prefill_v3.cu"
V4, V5 = "lab/kernels/attention_prefill_v4.cu", "lab/kernels/attention_prefill_v5.cu"
V6, V7 = "lab/kernels/attention_prefill_v6.cu", "lab/kernels/attention_prefill_v7.cu"
V8, V9 = "lab/kernels/attention_prefill_v8.cu", "lab/kernels/attention_prefill_v9.cu"
V10, V11 = "lab/kernels/attention_prefill_v10.cu", "lab/kernels/attention_prefill_v11.cu"
V12, V13 = "lab/kernels/attention_prefill_v12.cu", "lab/kernels/attention_prefill_v13.cu"
VARIANTS = {  # name: file (None: the product's), #define overrides (ATP_ROWS, ATP_THREADS, ATP_KV, ATP_STAGES, ...)
    "product": dict(file=None, defines={}),
    # 8 warps over 128 stacked rows, one block an SM: each K/V tile staged in shared memory serves twice the rows
    # (128-position tiles break hd 64's batching)
    "rows128": dict(file=None, defines=dict(ATP_ROWS=128, ATP_THREADS=256, ATP_KV=64, ATP_STAGES=2, ATP_MIN_BLOCKS=1,
                                            ATP_BATCH=4)),
    # prefetch distance ATP_STAGES - 1, one barrier a tile: at 2 stages the product's distance without its second
    # barrier, at 3 tiles k + 1 and k + 2 in flight while tile k is computed (112 KB at hd 128, two blocks an SM)
    "v2-s2": dict(file=V2, defines=dict(ATP_STAGES=2)),
    "v2-s3": dict(file=V2, defines=dict(ATP_STAGES=3)),
    # v2-s3's distance, and each warp computes tile k + 1's scores beside tile k's softmax and P.V
    "v3-s3": dict(file=V3, defines=dict(ATP_STAGES=3)),
    # the product's pipeline, fewer FP32 instructions between the mma phases (P's row sums by an mma with ones, the
    # scale folded into the exponent's FFMA, the mask only on diagonal tiles)
    "v4": dict(file=V4, defines={}),
    # v4 with two m-tiles a warp (32 rows, 128 a block): each K/V fragment feeds two mmas; at hd 128 O (128
    # registers) and the scores (64) leave too few, and it spills 12-132 bytes (by arch): a layout question, not a
    # product candidate as it stands
    "v5": dict(file=V5, defines={}, spills_at_hd=128),
    # v5 over K/V tiles of 32 positions: the scores take 32 registers instead of 64 (no spills), the staging and the
    # fragment reuse as v5's, twice the tiles (barriers, rescales of O) per position
    "v5-kv32": dict(file=V5, defines=dict(ATP_KV=32, ATP_BATCH=2), spills_at_hd=128),  # sm_120 g1: 8 bytes
    # v4 with S = Q K^T on Hopper's wgmma (q and K from shared memory): built for sm_90a only
    "v6": dict(file=V6, defines={}, arch="sm_90a"),
    # v6 with P.V on wgmma too (P from registers, V from shared memory as an N-major operand): built for sm_90a only
    "v7": dict(file=V7, defines={}, arch="sm_90a"),
    # v7 with tile k + 1's scores on the tensor cores beside tile k's softmax (K and V rings, K a tile ahead)
    "v8": dict(file=V8, defines={}, arch="sm_90a"),
    # v7 with each K/V tile brought by the copy engine (TMA, one thread) instead of every thread's cp.async: one more
    # argument, the tensor maps of the cache rows the launch may read (`tma`)
    "v9": dict(file=V9, defines={}, arch="sm_90a", tma=True),
    # v9 with the grid dispatched longest causal prefix first over all kv heads, not head by head
    "v9-lpt": dict(file=V9, defines=dict(ATP_HEADS_FIRST=1), arch="sm_90a", tma=True),
    # v9 with blocks of 128 rows, two warpgroups sharing each K/V tile (half the tiles' L2 traffic), one block an SM
    "v10": dict(file=V10, defines={}, arch="sm_90a", tma=True),
    # FlashAttention-3's shape: a producer warpgroup streaming K/V by TMA, two consumer warpgroups of 64 rows with
    # their register budgets moved by setmaxnreg, 128-position tiles, each consumer's P.V and next scores one burst,
    # the consumers' bursts in turns (ping-pong)
    "v11": dict(file=V11, defines={}, arch="sm_90a", tma=True),
    # v11 with 64-position tiles: what the tile length alone gives
    "v11-kv64": dict(file=V11, defines=dict(ATP_KV=64), arch="sm_90a", tma=True),
    # v11 without the turns: what the ping-pong alone gives
    "v11-free": dict(file=V11, defines=dict(ATP_PINGPONG=0), arch="sm_90a", tma=True),
    # v11 with each consumer's softmax of tile k + 1 beside its own P.V of tile k (FlashAttention-3's intra-warpgroup
    # overlap: two wgmma groups a burst, P double-buffered)
    "v11-ia": dict(file=V11, defines=dict(ATP_INTRA=1), arch="sm_90a", tma=True),
    # the product's sm_90a kernel with the scores taking q from registers (wgmma's register-A form): a third less
    # shared memory read a tile
    "v12": dict(file=V12, defines={}, arch="sm_90a", tma=True),
    # v12's source with q read from shared memory, as the product's kernel does: the control from the same file
    "v12-smem": dict(file=V12, defines=dict(ATP_QREG=0), arch="sm_90a", tma=True),
    # the product's sm_90a kernel with one K and one V buffer (own mbarriers, each refilled once read): 50 KB a
    # block at hd 128, three blocks an SM
    "v13": dict(file=V13, defines={}, arch="sm_90a", tma=True),
    # v13 held to 128 registers, four blocks an SM (spills ~100 bytes at hd 128)
    "v13-b4": dict(file=V13, defines=dict(ATP_MIN_BLOCKS=4), arch="sm_90a", tma=True, spills_at_hd=128),
}
LAB_INCLUDE = '#include "../../kernels_cu/common.cuh"'  # a lab version's include, as its copy in kernels_cu/ reads it
LAB_INCLUDES = re.compile(r'^#include "\.\./\.\./kernels_cu/(\w+\.cuh)"$', re.M)  # any product header a lab file takes
SHAPES = {"3b": (24, 8, 128), "8b": (32, 8, 128), "1b": (32, 8, 64)}  # q heads, kv heads, head_dim
TIMED = [("3b", 0, 2048), ("3b", 4096, 4096), ("8b", 0, 2048), ("1b", 0, 2048), ("3b", 0, 512)]  # shape, start, m


def builds_for(name: str, arch: str) -> bool:
    """Whether variant `name` is built for `arch` ("sm_90"): every arch, or the one it names (wgmma's sm_90a is an
    sm_90 build)."""
    only = VARIANTS[name].get("arch")
    return only is None or only.rstrip("a") == arch


def variant_source(name: str) -> str:
    """The attention_prefill.cu of variant `name`: its file (the product's when None) with a lab version's includes
    of the product's headers pointed at the copy's and its #define overrides applied (each must replace exactly one #define)."""
    from atomflow_bench.gpu.nvrtc import KERNELS_DIR

    v = VARIANTS[name]
    src = (ROOT / v["file"] if v["file"] else KERNELS_DIR / "attention_prefill.cu").read_text()
    if v["file"]:
        assert src.count(LAB_INCLUDE) == 1, f"{v['file']}: no {LAB_INCLUDE}"
        src = LAB_INCLUDES.sub(r'#include "\1"', src)
    for k, val in v["defines"].items():
        src, n = re.subn(rf"^#define {k} \d+", f"#define {k} {val}", src, flags=re.M)
        assert n == 1, f"{name}: #define {k} found {n} times"
    return src


def variant_defines(src: str) -> dict[str, int]:
    """The ATP_* #defines of a kernel source: what its grid, block and shared memory follow."""
    return {k: int(v) for k, v in re.findall(r"^#define (ATP_\w+) (\d+)", src, flags=re.M)}


def variant_smem(d: dict[str, int], hd: int) -> int:
    """Dynamic shared memory bytes under #defines `d`: the q tile [ATP_ROWS][hd] and ATP_STAGES K and V tiles
    [ATP_KV][hd], fp16 (ops/attention_prefill.py prefill_smem's formula), and ATP_SMEM_PAD where a version aligns
    its base."""
    return d["ATP_ROWS"] * hd * 2 + d["ATP_STAGES"] * 2 * d["ATP_KV"] * hd * 2 + d.get("ATP_SMEM_PAD", 0)


def variant_lib(name: str, tmp: Path):
    """The KernelLib of variant `name`: the product's own for the product, else a copy of kernels_cu/ under `tmp`
    whose attention_prefill.cu is the variant's source."""
    from atomflow_bench.gpu.nvrtc import KERNELS_DIR, KernelLib
    from atomflow_bench.gpu.ops import declared_kernels, kernel_lib

    if VARIANTS[name] == VARIANTS["product"]:
        return kernel_lib()
    d = tmp / name
    shutil.copytree(KERNELS_DIR, d)
    (d / "attention_prefill.cu").write_text(variant_source(name))
    arch = VARIANTS[name].get("arch")
    if arch is None:
        return KernelLib(declared_kernels(), d)

    class ArchLib(KernelLib):
        """A KernelLib building its sources for `arch` through the product's arch-specific path
        (nvrtc.compile_for_arch, which KernelLib itself takes only for a file named `*_sm90a.cu`): loaded by
        RawModule(path=...), so its kernels are RawKernels as the launch factories expect."""

        def module(self, path):
            import cupy

            from atomflow_bench.gpu.nvrtc import compile_for_arch, expand_source

            if path not in self._modules:
                cubin = compile_for_arch(expand_source(path), path.name, self.options, arch)
                self._modules[path] = cupy.RawModule(path=str(cubin))
            return super().module(path)

    return ArchLib(declared_kernels(), d)


def variant_launch(name: str):
    """A launch factory for variant `name` with attention_prefill_launch's arguments (lib, q, k_cache, v_cache, start,
    m, out, n_kv, group, hd, q_stride, out_stride, scale=None): the grid, block and shared memory of its #defines."""
    import numpy as np

    from atomflow_bench.gpu.launch import Launch, allow_dynamic_smem, i32
    from atomflow_bench.gpu.ops import attention_prefill as ap

    from atomflow_bench.gpu.launch import tensor_maps

    d = variant_defines(variant_source(name))
    tma = VARIANTS[name].get("tma", False)

    def factory(lib, q, k_cache, v_cache, start, m, out, n_kv, group, hd, q_stride, out_stride, scale=None):
        smem = variant_smem(d, hd)
        fn = lib[ap.prefill_kernel(hd, group)]
        allow_dynamic_smem(fn, smem)
        # a TMA version's tensor maps cover the rows the launch may read: past them the copies land zeros
        maps = (tensor_maps((k_cache[:start + m], v_cache[:start + m]), (64, 64)),) if tma else ()
        return Launch(fn, "attention_prefill", (-(-m * group // d["ATP_ROWS"]), n_kv), (d["ATP_THREADS"],),
                      (q, k_cache, v_cache, out, i32(start), i32(m), i32(n_kv), i32(q_stride), i32(out_stride),
                       np.float32(1.0 / math.sqrt(hd) if scale is None else scale), *maps), smem, {}, 0, name)

    return factory


def launch(lib, name, q, k, v, out, start, m, n_kv, g, hd):
    """Variant `name`'s launch over contiguous q and out."""
    stride = n_kv * g * hd
    return variant_launch(name)(lib, q, k, v, start, m, out, n_kv, g, hd, stride, stride)


def inputs(shape, start, m, seed=0):
    import cupy as cp

    n_q, n_kv, hd = SHAPES[shape]
    rs = cp.random.RandomState(seed)
    q = (rs.standard_normal((m, n_q * hd), dtype=cp.float32) * 0.5).astype(cp.float16)
    k = (rs.standard_normal((start + m, n_kv * hd), dtype=cp.float32) * 0.5).astype(cp.float16)
    v = rs.standard_normal((start + m, n_kv * hd), dtype=cp.float32).astype(cp.float16)
    return q, k, v, cp.full((m, n_q * hd), float("nan"), dtype=cp.float16)


def reference(q, k, v, start, m, n_q, n_kv, hd):
    import numpy as np

    g = n_q // n_kv
    Q = q.get().astype(np.float64).reshape(m, n_q, hd)
    K = k.get().astype(np.float64).reshape(-1, n_kv, hd)
    V = v.get().astype(np.float64).reshape(-1, n_kv, hd)
    out = np.empty((m, n_q, hd))
    for h in range(n_q):
        s = Q[:, h] @ K[:, h // g].T / math.sqrt(hd)
        s[np.arange(start + m)[None, :] > (start + np.arange(m))[:, None]] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h] = (p / p.sum(axis=1, keepdims=True)) @ V[:, h // g]
    return out.reshape(m, -1), np.abs(V).max()


def torch_sdpa_ms(shape, m, rounds=20):
    """torch's scaled_dot_product_attention on the flash backend (FlashAttention-2), causal from position 0 (its mask
    is top-left aligned, so only chunks at start 0 compare), K/V repeated to the q heads outside the timing: the
    median of `rounds` CUDA-event timings after 3 warm-ups, or None where torch or the backend is missing."""
    try:
        import torch  # the peer, only where --torch asks
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    n_q, n_kv, hd = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, n_q, m, hd, device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(1, n_kv, m, hd, device="cuda", dtype=torch.float16, generator=g).repeat_interleave(n_q // n_kv, 1)
    v = torch.randn(1, n_kv, m, hd, device="cuda", dtype=torch.float16, generator=g).repeat_interleave(n_q // n_kv, 1)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
            for _ in range(3):
                f()
            ts = []
            for _ in range(rounds):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                f()
                e1.record()
                e1.synchronize()
                ts.append(e0.elapsed_time(e1))
    except RuntimeError as e:
        print(f"torch sdpa {shape} m {m}: {str(e).splitlines()[0][:160]}", flush=True)
        return None
    return sorted(ts)[len(ts) // 2]


def main(argv=None) -> int:
    ap_ = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap_.add_argument("--rounds", type=int, default=3)
    ap_.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    ap_.add_argument("--json")
    ap_.add_argument("--torch", action="store_true", help="time torch's flash SDPA on the chunks at start 0 too")
    ap_.add_argument("--once", metavar="SHAPE,START,M",
                     help="no checks or timing: each variant's launch on this chunk twice (a warm-up, then the one "
                          "a profiler such as ncu takes: `-k regex:attention_prefill`, every second launch)")
    a = ap_.parse_args(argv)
    names = a.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"prefill_att_ab: unknown variants {unknown} (known: {', '.join(VARIANTS)})", file=sys.stderr)
        return 2
    import cupy as cp
    import numpy as np

    from atomflow_bench.store.store import write_text_atomic

    tmp = Path(tempfile.mkdtemp())
    if a.once:
        shape, start, m = a.once.split(",")
        start, m = int(start), int(m)
        n_q, n_kv, hd = SHAPES[shape]
        data = inputs(shape, start, m)
        for name in names:
            ln = launch(variant_lib(name, tmp), name, *data, start, m, n_kv, n_q // n_kv, hd)
            ln()
            ln()
            cp.cuda.Device().synchronize()
            print(f"{name}: {shape} start {start} m {m} launched twice", flush=True)
        return 0
    libs, ok = {}, {}
    for name in names:
        try:
            libs[name] = variant_lib(name, tmp)
            errs = []
            for shape, start, m in (("3b", 0, 130), ("3b", 300, 200), ("1b", 0, 130), ("1b", 300, 200)):
                n_q, n_kv, hd = SHAPES[shape]
                q, k, v, out = inputs(shape, start, m, seed=1)
                launch(libs[name], name, q, k, v, out, start, m, n_kv, n_q // n_kv, hd)()
                want, vmax = reference(q, k, v, start, m, n_q, n_kv, hd)
                got = out.get().astype(np.float64)
                errs.append(float(np.abs(got - want).max() / vmax) if not np.isnan(got).any() else float("nan"))
            ok[name] = all(e <= 2e-3 for e in errs)
            print(f"{name}: max error / max|V| {errs} -> {'ok' if ok[name] else 'WRONG'}", flush=True)
        except Exception as e:  # noqa: BLE001 - a variant that does not build or launch is reported, not fatal
            ok[name] = False
            print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
    runs = []
    data = {t: inputs(t[0], t[1], t[2]) for t in TIMED}
    for r in range(a.rounds):
        for t in TIMED:
            shape, start, m = t
            n_q, n_kv, hd = SHAPES[shape]
            flops = 4.0 * hd * n_q * (m * start + m * (m + 1) / 2)
            for name in names:
                if not ok[name]:
                    continue
                ln = launch(libs[name], name, *data[t], start, m, n_kv, n_q // n_kv, hd)
                for _ in range(3):
                    ln()
                ts = []
                for _ in range(20):
                    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                    e0.record()
                    ln()
                    e1.record()
                    e1.synchronize()
                    ts.append(cp.cuda.get_elapsed_time(e0, e1))
                ms = float(np.median(ts))
                runs.append({"round": r, "variant": name, "shape": shape, "start": start, "m": m, "ms": ms,
                             "tflops": flops / (ms * 1e-3) / 1e12})
    if a.torch:
        for r in range(a.rounds):
            for shape, start, m in [t for t in TIMED if t[1] == 0]:
                ms = torch_sdpa_ms(shape, m)
                if ms is not None:
                    n_q, n_kv, hd = SHAPES[shape]
                    runs.append({"round": r, "variant": "torch-sdpa", "shape": shape, "start": 0, "m": m, "ms": ms,
                                 "tflops": 4.0 * hd * n_q * m * (m + 1) / 2 / (ms * 1e-3) / 1e12})
        names = [*names, "torch-sdpa"]
    for t in TIMED:
        line = []
        for name in names:
            x = [q["ms"] for q in runs if q["variant"] == name and (q["shape"], q["start"], q["m"]) == t]
            if x:
                tf = [q["tflops"] for q in runs if q["variant"] == name and (q["shape"], q["start"], q["m"]) == t]
                line.append(f"{name} {min(x):.4f} ms {max(tf):.0f} TF")
        print(f"{t[0]} start {t[1]} m {t[2]}: " + " | ".join(line), flush=True)
    if a.json:
        variants = {n: VARIANTS[n] for n in names if n in VARIANTS}
        write_text_atomic(Path(a.json), json.dumps({"ok": ok, "variants": variants, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
