"""One decode step as a fixed list of kernel launches.

The step reads the current token and position from device memory and leaves the next ones there, so the same list
runs eagerly (`run_eager`, optionally copying probes out after each launch) or is captured once into a CUDA Graph
(graph.py). Per layer 5 launches:

    gemv  QKV      RMSNorm prologue (input_layernorm), q|k|v rows stacked; epilogue: RoPE on q and k,
                   k and v appended to the cache at pos                        -> qkv (fp16)
    attention      GQA over cache[0..pos] -> attn_out (fp16): the short kernel (whole K/V range in shared memory)
                   in the short bucket, the split kernel beyond it
    gemv  o_proj   residual epilogue                                           h += Wo . attn_out
                   (tensor parallel: + the sum across ranks, gpu/tp/sums.py; while the ranks meet, the next
                   GEMV's head is asked into L2, as QKV asks o_proj's: ops/gemv.py head_l2)
    gemv  gate/up  RMSNorm prologue (post_attention_layernorm), SwiGLU epilogue -> act (fp16)
    gemv  down     residual epilogue                                           h += Wd . act

plus the embedding lookup before the layers and the lm_head after them (the final RMSNorm in its prologue, the
greedy argmax and the step's bookkeeping in its epilogue). Each op's launch factory lives in ops/; the form each op
runs comes in as a value (forms.GemvForm, the attention bucket), never from the environment.
"""
from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from ..errors import AtomflowError
from .arena import Arena
from .forms import GemvForm
from .launch import Launch, i32, with_last_arg
from .nvrtc import KernelLib
from .ops import lm_head
from .ops.attention import attention_launch, attention_short_launch
from .ops.gemv import ROLE_VARIANT, gemv_launch, head_l2, linear_regions, next_l2
from .ops.small import embed_launch


def build_step(cfg: ModelConfig, fmt: str, a: Arena, lib: KernelLib, n_sm: int, att_cap: int | None,
               form: GemvForm, tp=None, vocab_rows: tuple[int, int] | None = None,
               tp_path: str | None = None) -> list[Launch]:
    """The step's launches, each with its probes as taps (validation copies them after each launch). `att_cap`: the
    short attention kernel holding that many positions (lengths up to it), else (None) the split kernel. `form`: the
    layer GEMVs' form.

    Tensor parallel (`tp`: gpu/tp/sums.py TpComm; `cfg` is then the rank's local_config and `vocab_rows` its lm_head
    rows): o_proj and down run the variant tp.gemv_target says (peer: resid_tp, which sums across ranks itself),
    followed by tp.sum_launches (nccl: the all-reduce; the last launch carries the h probe); the lm_head finds the
    rank's best over its rows and tp's combine picks the token and advances the position. `tp_path` overrides the
    run's path (gpu/tp/sums.py; "local": no exchange, for timing)."""
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_dim, kv_dim, eps = cfg.q_dim, cfg.kv_dim, cfg.rms_norm_eps
    h, qkv, attn_out, act = (a[n] for n in ("h", "qkv", "attn_out", "act"))
    rows = linear_regions(cfg)

    def gemv(i, role, x, y, n_out, k, variant=None, **kw):
        w = f"L{i}.{role}"
        return gemv_launch(lib, fmt, variant or ROLE_VARIANT[role], a[w], a[w + ".scale"] if fmt == "fp8" else None,
                           x, y, n_out, k, n_sm, eps=eps, role=role, ws=form.ws,
                           ws_pre=form.slots_before_wait(role), **kw)

    def head(i, role, slots):
        """What layer i's `role` GEMV reads first (ops/gemv.py head_l2), asked into L2 by an earlier kernel."""
        if i >= cfg.num_hidden_layers:
            return None
        w = f"L{i}.{role}"
        return head_l2(fmt, ROLE_VARIANT[role], a[w], a[w + ".scale"] if fmt == "fp8" else None, n_sm, form.ws, slots)

    def resid(i, role, x, k, probe):
        """o_proj / down: h += W.x, or across ranks a partial product and the sum."""
        if tp is None:
            return [gemv(i, role, x, h, H, k, taps={probe: h})]
        variant, y, tp_args = tp.gemv_target(role, h, tp_path)
        slots = tp.WAIT_HEAD_SLOTS  # while it waits for the other ranks: the next GEMV's head
        nxt = None if tp_args is None else head(i, "wgu", slots) if role == "wo" else head(i + 1, "wqkv", slots)
        out = [gemv(i, role, x, y, H, k, variant=variant, tp=tp_args, head=nxt)] + tp.sum_launches(role, h, tp_path)
        out[-1].taps = {probe: h}
        return out

    steps = [embed_launch(lib, a["cur_token"], a["embed"], h, taps={"embed": h})]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        steps += [
            gemv(i, "wqkv", h, qkv, rows["wqkv"][0] // 2, H, norm_w=a[f"L{i}.attn_norm"],
                 rope=(a["rope_cs"], a["pos"], a["k_cache"][i], a["v_cache"][i], cfg.num_attention_heads,
                       cfg.num_key_value_heads, hd, next_l2(a[f"L{i}.wgu"], form.l2_tail_mb)),
                 head=None if tp is None else head(i, "wo", tp.QKV_HEAD_SLOTS),
                 taps={p + "q": qkv[:q_dim], p + "k": qkv[q_dim:q_dim + kv_dim], p + "v": qkv[q_dim + kv_dim:]}),
            attention_short_launch(lib, qkv, a["k_cache"][i], a["v_cache"][i], a["pos"], attn_out,
                                   cfg.num_key_value_heads, cfg.group_size, hd, att_cap, taps={p + "attn_out": attn_out})
            if att_cap else
            attention_launch(lib, qkv, a["k_cache"][i], a["v_cache"][i], a["pos"], a["att_ml"], a["att_o"],
                             a["att_counters"][i], attn_out, cfg.num_key_value_heads, cfg.group_size, hd,
                             taps={p + "attn_out": attn_out}),
            *resid(i, "wo", attn_out, q_dim, p + "attn"),
            gemv(i, "wgu", h, act, I, H, norm_w=a[f"L{i}.mlp_norm"], taps={p + "act": act}),
            *resid(i, "wd", act, I, p + "mlp"),
        ]
    if tp is None:
        steps.append(lm_head.lm_head_launch(lib, a, cfg, n_sm))
    else:
        steps.append(lm_head.lm_head_launch(lib, a, cfg, n_sm, shard=vocab_rows, partials=tp.argmax_arrays()))
        steps += tp.argmax_launches((a["pos"], a["cur_token"], a["prompt"], a["prompt_len"], a["out_tokens"]),
                                    tp_path)
    check_residual_order([ln.name for ln in steps])
    return steps


def hold_position(launches: list[Launch]) -> list[Launch]:
    """The step without advancing the position, for timing runs that replay it many times at one length: the
    lm_head launched with advance = 0 (it still finds the token, so the time includes the argmax)."""
    return [with_last_arg(ln, i32(0)) if ln.name == TP_COMBINE else lm_head.hold_position(ln) for ln in launches]


TP_COMBINE = "tp_argmax_combine"  # tensor parallel: the combine advances the position (its last argument), not the lm_head


def check_residual_order(names: list[str]) -> None:
    """A residual GEMV reads h[o] before its PDL wait (gemv_epilogue.cuh epilogue_operand): that is safe only when
    the last writer of h is not its direct predecessor (a kernel starts once its predecessor passed its own wait,
    so everything before the predecessor is complete). Writers of h: the embedding and the residual GEMVs. The
    residual GEMVs themselves trigger their successor before their wait (gemv_epilogue.cuh gemv_arrive_wait), so
    that guarantee holds for kernels after any other kernel — which is why a residual GEMV must not follow one."""
    for prev, name in zip(names, names[1:]):
        if "_resid" in name and (prev == "embed_lookup" or "_resid" in prev):
            raise AtomflowError(f"step order: {name} right after {prev}, which writes h (read before the wait)")


def run_eager(launches: list[Launch], taps: dict | None = None) -> None:
    """Run one step launch by launch on the current stream; with `taps`, copy every probe to the host."""
    for ln in launches:
        ln()
        if taps is not None:
            for name, view in ln.taps.items():
                taps[name] = view.get().astype(np.float32)
