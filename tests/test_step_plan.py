"""The persistent kernel's host-side plan (CPU): where it applies, and its shared-memory ring."""
from __future__ import annotations

import pytest

from atomflow_bench.config import CATALOG, ModelConfig
from atomflow_bench.errors import AtomflowError
from atomflow_bench.step import PK_CONSUMERS, PK_MAX_SLOTS, fused_supported, ring_plan

H100_OPTIN = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90


@pytest.mark.parametrize("name,fmt", [(n, f) for n in ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "smollm2-135m")
                                      for f in ("fp16", "fp8") if (n, f) != ("llama-3.1-8b", "fp16")])
def test_ring_fits_and_holds_every_tile(name, fmt):
    cfg = CATALOG[name].config
    r = ring_plan(cfg, fmt, H100_OPTIN)
    assert PK_CONSUMERS <= r["n_slots"] <= PK_MAX_SLOTS and r["n_slots"] % PK_CONSUMERS == 0
    assert r["shmem"] <= H100_OPTIN - 1024
    assert r["slot_bytes"] % 128 == 0 and r["union_bytes"] % 128 == 0
    bpw = 1 if fmt == "fp8" else 2
    for rows, k in ((2, cfg.hidden_size), (1, cfg.q_dim), (2, cfg.hidden_size), (1, cfg.intermediate_size)):
        weights = rows * k * bpw
        scales = rows * (-(-k // 128) * 4 + 16) if fmt == "fp8" else 0  # each row's scales + alignment slack
        assert weights + scales <= r["slot_bytes"]
    assert r["union_bytes"] >= max(cfg.hidden_size, cfg.q_dim, cfg.intermediate_size) * 2 + 128


def test_ring_refuses_fewer_slots_than_consumer_warps():
    """8B fp16: a down_proj tile is 28 KB, so 227 KB hold 6 < 8 slots: the split step runs it."""
    with pytest.raises(AtomflowError, match=f"fewer than {PK_CONSUMERS} weight tiles"):
        ring_plan(CATALOG["llama-3.1-8b"].config, "fp16", H100_OPTIN)
    assert "fewer than" in fused_supported(CATALOG["llama-3.1-8b"].config, "9.0", "fp16", H100_OPTIN)
    assert fused_supported(CATALOG["llama-3.1-8b"].config, "9.0", "fp8", H100_OPTIN) is None


def test_fused_supported_by_group_and_arch():
    cfg = CATALOG["llama-3.2-3b"].config
    assert fused_supported(cfg, "9.0") is None
    assert "compute capability 8.9" in fused_supported(cfg, "8.9")
    assert "compute capability 12.0" in fused_supported(cfg, "12.0")
    g8 = ModelConfig(vocab_size=300, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                     num_attention_heads=8, num_key_value_heads=1, head_dim=64)
    assert "8 q heads per kv head" in fused_supported(g8, "9.0")


def test_probe_views_tile_the_buffer_in_kernel_order():
    """step.probe_views must cut the persistent kernel's probe buffer exactly as decode_layers.cu writes it:
    embed, then per layer q|k|v, attn_out, h after o_proj, act, h after down_proj; no gap, no overlap."""
    import numpy as np

    from atomflow_bench.arena import probe_floats_per_layer
    from atomflow_bench.step import probe_views

    cfg = CATALOG["llama-3.2-1b"].config
    n = cfg.hidden_size + cfg.num_hidden_layers * probe_floats_per_layer(cfg)
    buf = np.arange(n, dtype=np.float64)
    views = probe_views(cfg, buf)
    order = ["embed"] + [f"layers.{i}.{k}" for i in range(cfg.num_hidden_layers)
                         for k in ("q", "k", "v", "attn_out", "attn", "act", "mlp")]
    assert list(views) == order
    np.testing.assert_array_equal(np.concatenate([views[k] for k in order]), buf)  # contiguous, in order
    sizes = {"q": cfg.q_dim, "k": cfg.kv_dim, "v": cfg.kv_dim, "attn_out": cfg.q_dim, "attn": cfg.hidden_size,
             "act": cfg.intermediate_size, "mlp": cfg.hidden_size}
    for k, size in sizes.items():
        assert views[f"layers.3.{k}"].size == size
