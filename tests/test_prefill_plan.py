"""The batched prefill's memory, planned before anything is allocated (CPU): gpu/prefill.py form_bytes (what each
weights form holds), gpu/arena.py fit (the model first, then the first prefill form that fits beside it, or one
refusal line) and the ranks' agreement on one form (gpu/tp/group.py Group.agree)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from atomflow_bench.config import CATALOG, GROUP
from atomflow_bench.errors import AtomflowError
from atomflow_bench.gpu import tp
from atomflow_bench.gpu.arena import RESERVE, fit, plan_arena
from atomflow_bench.gpu.prefill import FORMS, buffer_shapes, form_bytes
from atomflow_bench.gpu.tp.group import Group

GiB = 2 ** 30
CFG_3B, CFG_8B, CFG_70B = (CATALOG[n].config for n in ("llama-3.2-3b", "llama-3.1-8b", "llama-3.1-70b"))


def buffers(cfg, c: int) -> int:
    """The chunk buffers counted by hand: tokens int32, h fp32 [c, H], x fp16 [c, H], qkv, attention out, gate|up and
    act fp16."""
    H, inter = cfg.hidden_size, cfg.intermediate_size
    return c * (4 + 4 * H + 2 * H + 2 * cfg.qkv_dim + 2 * cfg.q_dim + 2 * 2 * inter + 2 * inter)


def test_buffer_shapes_are_the_chunks():
    assert sum(math.prod(s) * np.dtype(d).itemsize for s, d in buffer_shapes(CFG_3B, 512).values()) == \
        buffers(CFG_3B, 512)


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "llama-3.1-70b"])
def test_copies_are_the_fp16_models_layer_bytes(name):
    cfg = CATALOG[name].config
    f = form_bytes(cfg, "fp16", 512)
    assert list(f) == list(FORMS) == ["copies", "staged"]
    assert f["copies"] == 2 * cfg.layer_linear_params() + buffers(cfg, 512)
    # staged: one scratch of the largest weight, the stacked gate|up [2I, H]
    assert f["staged"] == 2 * 2 * cfg.intermediate_size * cfg.hidden_size + buffers(cfg, 512)
    assert f["staged"] < f["copies"]
    # fp8 copies take, while being made, the largest weight's codes, scales and one group of fp32 products
    rows, k = 2 * cfg.intermediate_size, cfg.hidden_size
    making = rows * k + 4 * rows * -(-k // GROUP) + 10 * rows * GROUP + 4 * 256
    assert form_bytes(cfg, "fp8", 512) == {"copies": f["copies"] + making, "staged": f["staged"]}
    assert form_bytes(cfg, "fp16", 16)["copies"] == f["copies"] - buffers(cfg, 512) + buffers(cfg, 16)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_a_ranks_copies_are_its_shards(n):
    """Tensor parallel: the copies are the rank's shard in fp16 (1/n of every layer weight of the 70B), the buffers
    the rank's heads and MLP share with h and x whole."""
    shard = tp.plan(CFG_70B, n)[0]
    loc = shard.config
    f = form_bytes(loc, "fp16", 512)
    held = 2 * CFG_70B.num_hidden_layers * sum(r * k for r, k in shard.shapes.values())
    assert held * n == 2 * CFG_70B.layer_linear_params()
    assert f["copies"] == held + buffers(loc, 512)
    assert buffers(loc, 512) < buffers(CFG_70B, 512)


def plan(cfg, fmt="fp16", ctx=4096, chunk=512, n=1):
    if n == 1:
        return plan_arena(cfg, fmt, ctx, prefill_chunk=chunk)
    shard = tp.plan(cfg, n)[0]
    return plan_arena(shard.config, fmt, ctx, lm_head_rows=shard.vocab_rows[1] - shard.vocab_rows[0],
                      prefill_chunk=chunk)


def test_fit_takes_the_first_form_that_fits_at_its_edge():
    p = plan(CFG_3B)
    model = p.total() + RESERVE
    copies, staged = p.prefill["copies"], p.prefill["staged"]
    assert p.staging_bytes < staged < copies
    assert fit(p, model + copies, 80 * GiB) == "copies"
    assert fit(p, model + copies - 1, 80 * GiB) == "staged"
    assert fit(p, model + staged, 80 * GiB) == "staged"
    with pytest.raises(AtomflowError) as e:
        fit(p, model + staged - 1, 80 * GiB)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("the batched prefill does not fit beside the model")
    assert "smallest form (staged" in msg and "--tp" in msg and "--ctx" in msg
    with pytest.raises(AtomflowError, match="^model does not fit"):  # the model itself first
        fit(p, model + p.staging_bytes - 1, 80 * GiB)


def test_fit_counts_the_load_staging_once():
    """The load staging is freed before the prefill is made: the prefill needs room beyond the model only where it
    is larger than the staging."""
    p = plan(CFG_3B)
    model = p.total() + RESERVE
    p.staging_bytes = p.prefill["staged"] + 10 ** 6  # more than the staged form, less than the copies
    assert fit(p, model + p.staging_bytes, 80 * GiB) == "staged"
    assert fit(p, model + p.prefill["copies"], 80 * GiB) == "copies"


def test_fit_without_a_prefill():
    p = plan_arena(CFG_3B, "fp16", 4096)
    assert p.prefill == {}
    assert fit(p, p.total() + p.staging_bytes + RESERVE, 80 * GiB) is None


@pytest.mark.parametrize("cfg,fmt,n,free_gib,form", [
    (CFG_70B, "fp8", 2, 79, "staged"),    # H100: 35 GB of fp8 weights per rank + 70 GB of fp16 copies do not fit
    (CFG_70B, "fp8", 2, 139, "copies"),   # H200: they do
    (CFG_70B, "fp8", 1, 139, "staged"),   # 70B W8A16 on one H200: ~70 GB + 140 GB of copies
    (CFG_8B, "fp16", 1, 79, "copies"),    # 8B fp16 on an H100: 16 GB + 16 GB
    (CFG_8B, "fp8", 1, 20, "staged"),     # 8B W8A16 on a 24 GB GPU: ~9 GB + 16 GB of copies
])
def test_the_forms_real_models_get(cfg, fmt, n, free_gib, form):
    assert fit(plan(cfg, fmt, n=n), free_gib * GiB, 80 * GiB) == form


def test_a_model_with_no_room_for_even_the_staged_form_is_refused():
    """fp16: the staged scratch is the load staging's size plus the chunk buffers, so a model that only just fits has
    no room for it; fp8: the load staging (codes, fp16 rows and scales of the largest weight) is larger, so the
    staged form fits wherever the model does."""
    p = plan(CFG_70B, "fp16", n=2)
    room = p.total() + p.staging_bytes + RESERVE  # the model fits exactly
    assert p.prefill["staged"] == p.staging_bytes + buffers(tp.plan(CFG_70B, 2)[0].config, 512)
    with pytest.raises(AtomflowError, match="batched prefill does not fit"):
        fit(p, room, 80 * GiB)
    assert fit(p, room + p.prefill["staged"] - p.staging_bytes, 80 * GiB) == "staged"
    p8 = plan(CFG_70B, "fp8", n=2)
    assert p8.prefill["staged"] < p8.staging_bytes
    assert fit(p8, p8.total() + p8.staging_bytes + RESERVE, 80 * GiB) == "staged"


class Picks:
    """What Group.agree reads of a group: every rank's pick, stacked (allgather_host)."""

    def __init__(self, picks):
        self.picks = picks

    def allgather_host(self, mine):
        return np.array([[FORMS.index(p)] for p in self.picks], np.int32)


@pytest.mark.parametrize("picks,agreed", [(["copies", "copies"], "copies"), (["copies", "staged"], "staged"),
                                          (["staged", "copies", "copies", "copies"], "staged"),
                                          (["staged", "staged"], "staged")])
def test_the_ranks_agree_on_the_most_cautious_form(picks, agreed):
    assert Group.agree(Picks(picks), picks[0], FORMS) == agreed
