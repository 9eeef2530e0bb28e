"""The lab's persistent step (lab/persist.py, lab/kernels/decode_persist.cu) without a GPU: its shared-memory plan,
the layer table's order, which shapes have a kernel, the kernel's constants and its build (nvcc: the entries, and no
more stack than the one allowance)."""
from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from atomflow_bench.config import CATALOG, ModelConfig
from atomflow_bench.errors import AtomflowError
from atomflow_bench.gpu.device import SMEM_H100
from atomflow_bench.gpu.ops.attention import short_smem, short_static
from lab import KERNELS_DIR
from lab import persist

SMEM_SM89 = (99 * 1024, 100 * 1024, 1024)


def cfg_of(name: str) -> ModelConfig:
    return CATALOG[name].config


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "smollm2-135m"])
@pytest.mark.parametrize("fmt", ["fp16", "fp8"])
def test_plan_fits_one_block_per_sm(name, fmt):
    cfg = cfg_of(name)
    p = persist.plan(cfg, fmt, SMEM_H100)
    kmax = max(cfg.hidden_size, cfg.q_dim, cfg.intermediate_size)
    assert p["slots"] == persist.PS_RING_SLOTS
    assert p["a_bytes"] >= kmax * 2 and p["a_bytes"] >= short_smem(cfg.head_dim, p["att_cap"])
    assert p["att_cap"] % 16 == 0 and 16 <= p["att_cap"] <= 512
    assert p["shmem"] + short_static(cfg.head_dim) <= SMEM_H100[0]
    # one more position would not fit (the capacity takes what the ring leaves), unless at the kernel's chunk limit
    if p["att_cap"] < 512:
        bigger = short_smem(cfg.head_dim, p["att_cap"] + 16)
        assert max(bigger, kmax * 2) + (p["shmem"] - p["a_bytes"]) + short_static(cfg.head_dim) > SMEM_H100[0]
    assert p["shmem"] > SMEM_H100[1] // 2  # one block per SM: the waits need every block resident, and nothing beside


def test_plan_refuses_what_does_not_fit():
    cfg = cfg_of("llama-3.1-8b")
    with pytest.raises(AtomflowError, match="shared memory"):
        persist.plan(cfg, "fp8", (48 * 1024, 48 * 1024, 1024))


def test_supported_shapes():
    assert persist.supported(cfg_of("llama-3.2-3b")) is None
    odd = ModelConfig(vocab_size=100, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=1, head_dim=64)
    assert "16 q heads" in persist.supported(odd)
    kernels = set(persist.KERNELS["decode_persist.cu"])
    for fmt in ("fp16", "fp8"):
        for hd in persist.HEAD_DIMS:
            for g in persist.GROUPS:
                assert persist.kernel_name(fmt, hd, g) in kernels
    assert persist.kernel_name("fp8", 128, 3) == "decode_persist_f8_hd128_g3"


def test_op_numbering():
    cfg = cfg_of("llama-3.2-1b")
    names = persist.op_names(cfg)
    assert len(names) == persist.n_ops(cfg) == 1 + 5 * cfg.num_hidden_layers
    assert names[:7] == ["embed", "L0.wqkv", "L0.attention", "L0.wo", "L0.wgu", "L0.wd", "L1.wqkv"]


class FakeArray:
    def __init__(self, ptr):
        self.data = type("M", (), {"ptr": ptr})()

    def __getitem__(self, i):
        return FakeArray(self.data.ptr + 1000 * (i + 1))


def test_layer_table_order():
    """decode_persist.cu reads each layer's row as wqkv, its scales, attn_norm, wo, scales, wgu, scales, mlp_norm, wd,
    scales, K cache, V cache."""
    cfg = ModelConfig(vocab_size=100, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    names = [f"L{i}.{r}{s}" for i in range(2) for r in persist.LAYER_WEIGHTS for s in ("", ".scale")]
    names += [f"L{i}.{n}" for i in range(2) for n in ("attn_norm", "mlp_norm")] + ["k_cache", "v_cache"]
    ptrs = {n: 10 ** 6 * (k + 1) for k, n in enumerate(names)}
    a = {n: FakeArray(p) for n, p in ptrs.items()}
    t = persist.layer_table(a, cfg, "fp8")
    assert t.shape == (2, persist.PS_PTRS) and t.dtype == np.uint64
    row = [ptrs["L1.wqkv"], ptrs["L1.wqkv.scale"], ptrs["L1.attn_norm"], ptrs["L1.wo"], ptrs["L1.wo.scale"],
           ptrs["L1.wgu"], ptrs["L1.wgu.scale"], ptrs["L1.mlp_norm"], ptrs["L1.wd"], ptrs["L1.wd.scale"],
           ptrs["k_cache"] + 2000, ptrs["v_cache"] + 2000]
    assert [int(x) for x in t[1]] == row
    assert int(persist.layer_table(a, cfg, "fp16")[0][1]) == 0  # no scales in fp16


def test_split_units_and_their_buffer():
    """A split-K unit is one ring slot: 8 groups of 128 inputs in fp8, 4 in fp16, the last one short; the LL buffer
    holds the epoch and 16 row sums per unit of the step's largest GEMV."""
    assert [persist.parts_per_tile("fp8", k) for k in (64, 1024, 1025, 2048, 3072, 8192)] == [1, 1, 2, 2, 3, 8]
    assert [persist.parts_per_tile("fp16", k) for k in (64, 512, 576, 3072, 8192)] == [1, 1, 2, 6, 16]
    cfg = cfg_of("llama-3.2-3b")  # gate/up: 16384 rows of 3072 inputs is the largest
    assert persist.ll_words(cfg, "fp8") == 1 + 16384 // 16 * 3 * 16
    assert persist.ll_words(cfg, "fp16") == 1 + 16384 // 16 * 6 * 16
    assert persist.MODES == {"static": 0, "dyn": 1, "split": 2}


def test_constants_are_the_kernels_defines():
    text = (KERNELS_DIR / "decode_persist.cu").read_text()
    found = dict(re.findall(r"^#define (PS_\w+) (\d+)", text, re.M))
    assert {k: int(v) for k, v in found.items()} == persist.CU_DEFINES


# Ten warps per block (nine would do the same) cap a thread at 168 registers; the GEMVs and the attention together need a few more, so ptxas
# keeps a little on the stack (decode_persist.cu, the instances' comment). More than this is a regression.
STACK_ALLOWED = 32


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_the_kernel_builds_beside_the_product(tmp_path):
    """It compiles from the lab against the product's headers, its entries are kernel_name's, and no instance keeps
    more than STACK_ALLOWED bytes on the stack."""
    src = KERNELS_DIR / "decode_persist.cu"
    out = subprocess.run([shutil.which("nvcc"), "-arch=sm_90", "-std=c++17", "-Xptxas", "-v", "-c", str(src), "-o",
                          str(tmp_path / "p.o")], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    entries = re.findall(r"Compiling entry function '(\w+)'", out.stderr)
    assert sorted(entries) == sorted(persist.KERNELS["decode_persist.cu"])
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", out.stderr)
    assert len(frames) == len(entries) and max(int(v) for f in frames for v in f) <= STACK_ALLOWED
