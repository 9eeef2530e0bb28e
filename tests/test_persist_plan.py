"""The persistent step's host side without a GPU: its form's text, where it may run, its shared-memory plan, the
layer table's order, which shapes have a kernel, and what `tune` offers."""
from __future__ import annotations

import numpy as np
import pytest

from atomflow_bench.config import CATALOG, ModelConfig
from atomflow_bench.errors import AtomflowError
from atomflow_bench.gpu.device import SMEM_H100
from atomflow_bench.gpu.forms import Forms, GemvForm, candidates
from atomflow_bench.gpu.ops import persist
from atomflow_bench.gpu.ops.attention import short_smem, short_static

SMEM_SM89 = (99 * 1024, 100 * 1024, 1024)


def cfg_of(name: str) -> ModelConfig:
    return CATALOG[name].config


def test_persist_form_text_and_refusals():
    f = Forms.parse("short:persist;split:ring/l2=8")
    assert f.gemv == GemvForm(persist=True) and f.gemv_split == GemvForm(False, None, 8)
    assert f.text == "short:persist;split:ring/l2=8"
    assert Forms.parse(f.text) == f
    for bad in ("split:persist", "short:persist", "short:ring;split:persist"):
        with pytest.raises(AtomflowError, match="short bucket"):
            Forms.parse(bad)
    with pytest.raises(AtomflowError, match="no other GEMV field"):
        GemvForm(ws=True, persist=True)
    with pytest.raises(AtomflowError):
        GemvForm.parse("persist/l2=8")
    with pytest.raises(AtomflowError, match="sm_90"):
        f.check(89)
    assert f.check(90) is f
    with pytest.raises(AtomflowError, match="short bucket"):
        Forms(False, GemvForm(persist=True), GemvForm()).check(90)


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


def test_tune_offers_persist_only_where_it_can_run():
    forms, shorts = candidates("fp8", 90, 416, persist=True)
    assert forms.count(GemvForm(persist=True)) == 1 and shorts == [True, False]
    assert GemvForm(persist=True) not in candidates("fp8", 90, 416)[0]
    assert GemvForm(persist=True) not in candidates("fp8", 90, 0, persist=True)[0]  # no short bucket
    assert GemvForm(persist=True) not in candidates("fp8", 89, 416, persist=True)[0]
