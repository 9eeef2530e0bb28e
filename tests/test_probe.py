"""The persistent-stream probe's host side (lab/probe.py; the kernel: tests/test_kernels_gpu.py, and its build here)."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from atomflow_bench.gpu.arena import plan_arena
from atomflow_bench.config import CATALOG
from atomflow_bench.errors import AtomflowError
from lab import KERNELS, KERNELS_DIR
from lab.probe import dynamic, expected_counters, op_groups, probe_table, probe_variants, step_ops

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("model,fmt", [("llama-3.2-3b", "fp8"), ("llama-3.2-1b", "fp16"), ("llama-3.1-8b", "fp8"),
                                       ("llama-3.1-8b", "fp16")])
def test_step_ops_are_the_streamed_bytes_in_step_order(model, fmt):
    cfg = CATALOG[model].config
    ops = step_ops(cfg, fmt)
    L = cfg.num_hidden_layers
    assert [n for n, _ in ops] == [f"L{i}.{r}" for i in range(L) for r in ("qkv", "o", "gu", "d")] + ["lm_head"]
    assert all(b > 0 and b % 16 == 0 for _, b in ops)
    streamed = plan_arena(cfg, fmt, 1).streamed_weight_bytes()
    assert streamed <= sum(b for _, b in ops) < streamed + 16 * len(ops)
    H, I = cfg.hidden_size, cfg.intermediate_size
    per = 1 if fmt == "fp8" else 2
    assert dict(ops)["L0.gu"] >= 2 * I * H * per and dict(ops)["lm_head"] == cfg.vocab_size * H * 2 + H * 2


def test_probe_table_lists_every_variant():
    vs = probe_variants(3000, 12, 16384)
    assert [v["name"] for v in vs] == ["stream", "deps", "deps+att", "deps+att-ring2"]
    assert [v["deps"] for v in vs] == ["none", "grid", "grid", "grid"]
    swept = probe_variants(3000, 12, 16384, sweep=True)
    assert swept[:4] == vs and len(swept) == 32 and all(v["att_ns"] == 0 for v in swept[4:12])
    assert [v["signal"] for v in swept] == [1] * 12 + [0] * 3 + [1] * 17 and swept[12]["name"] == "stream-fence"
    assert [v["deps"] for v in swept[26:]] == ["dyn-none"] + ["dyn"] * 5 and swept[28]["att_ns"] == 3000
    assert [v.get("grab", 1) for v in swept[26:]] == [1, 1, 1, 1, 3, 8]
    assert all(" " not in v["name"] and "," not in v["name"] for v in swept)  # gpu_check's PROBE_ARGS="--only a,b"
    assert [v["deps"] for v in swept[15:26]] == ["group=1", "group=4", "group=12", "group=33", "layer=1", "layer=12",
                                               "layer=33", "layer=12", "layer1=1", "layer1=12", "layer1=12"]
    assert swept[22]["att_ns"] == swept[25]["att_ns"] == 3000 and len({v["name"] for v in swept}) == len(swept)
    assert all(1024 + v["slots"] * v["chunk"] <= 227 * 1024 for v in swept)
    assert [v["att_ns"] for v in vs] == [0, 0, 3000, 3000] and vs[-1]["slots"] == 2
    res = {"ops": 113, "bytes": 3_695_007_744, "grid": 132, "floor_ms": 1.2537,
           "copy_bandwidth_gbs": {"median": 2947.0},
           "variants": [{**v, "ms": {"median": 1.3 + i / 100, "p10": 1.29, "p90": 1.31}, "gbs": 2800.0 - i,
                         "pct_of_copy": 95.0 - i} for i, v in enumerate(vs)]}
    res["variants"][1]["cycle_shares"] = {n: {"mean": x, "max": x} for n, x in
                                          zip(("producer_blocked", "data_wait", "dep_wait", "end_sync"),
                                              (0.12, 0.61, 0.2, 0.04))}
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(probe_table(res))
    text = console.export_text()
    for v in vs:
        assert v["name"] in text
    assert "1.3200" in text and "93.0%" in text and "floor 1.2537 ms" in text
    assert "12/61/20/4" in text  # the cycle shares of the one variant that has them


def test_probe_script_refuses_an_unknown_model():
    r = subprocess.run([sys.executable, str(ROOT / "lab/scripts/probe_stream.py"), "llama-9b", "fp8"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert "unknown model 'llama-9b'" in r.stderr


def test_op_groups_and_the_counters_they_leave():
    ops = [("L0.qkv", 16), ("L0.o", 16), ("L0.gu", 16), ("L0.d", 16), ("lm_head", 16)]
    assert op_groups(ops, "none", 10).tolist() == [0, 0, 0, 0, 0]
    assert op_groups(ops, "grid", 10).tolist() == [0, 10, 10, 10, 10]
    assert op_groups(ops, "group=4", 10).tolist() == [0, 4, 4, 4, 4]
    assert op_groups(ops, "layer=3", 10).tolist() == [0, 3, 10, 3, 10]
    assert op_groups(ops, "layer1=3", 10).tolist() == [0, 3, 3, 3, 10]
    assert op_groups(ops, "dyn", 10).tolist() == [0, 10, 10, 10, 10] and not op_groups(ops, "dyn-none", 10).any()
    assert dynamic("dyn") and dynamic("dyn-none") and not dynamic("grid")
    d = expected_counters(op_groups(ops, "dyn", 10), 10, 2, chunks=[3, 1, 7, 2, 5])  # chunks consumed, column 0
    assert d[:, 0].tolist() == [6, 2, 14, 4, 0] and not d[:, 1:].any()
    for bad in ("group=0", "group=11", "layer=x", "layer1=", "grid=2x", "dyn=3", "all"):
        with pytest.raises(AtomflowError, match="probe rule"):
            op_groups(ops, bad, 10)
    c = expected_counters(op_groups(ops, "layer=4", 10), 10, 3)  # groups of 4, 4, 2 blocks before o_proj and down
    assert c[0].tolist() == c[2].tolist() == [12, 12, 6] + [0] * 7
    assert c[1].tolist() == c[3].tolist() == [30] + [0] * 9 and not c[4].any()


def test_probe_script_refuses_an_unknown_variant():
    r = subprocess.run([sys.executable, str(ROOT / "lab/scripts/probe_stream.py"), "llama-3.2-3b", "fp8", "--only",
                        "stream,fast"], capture_output=True, text=True)
    assert r.returncode == 2 and "no probe variant 'fast'" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_the_probe_kernel_compiles_beside_the_product():
    """lab/kernels/probe_stream.cu builds against the product's kernels_cu/common.cuh from its place in the lab (the
    wheel no longer carries it, so no packaging test compiles it), and nvcc's entries are the loader's names."""
    src = KERNELS_DIR / "probe_stream.cu"
    out = subprocess.run([shutil.which("nvcc"), "-arch=sm_90", "-std=c++17", "-Xptxas", "-v", "-c", str(src), "-o",
                          "/dev/null"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    entries = re.findall(r"Compiling entry function '(\w+)'", out.stderr)
    assert entries and sorted(entries) == sorted(KERNELS[src.name]) and "probe_stream" in entries
