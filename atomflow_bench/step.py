"""Stage 5 of the decode path: one decode step as a fixed list of kernel launches.

The step reads the current token and position from device memory and leaves the next ones there, so the
same list runs eagerly (`run_eager`, optionally copying probes out after each launch) or is captured once
into a CUDA Graph (graph.py). Two forms of the same math (`STEP_MODES`):

"split" (the default: measured faster, results/PERF_NOTES.md): the per-op kernels, per layer 5 launches:

    gemv  QKV      RMSNorm prologue (input_layernorm), q|k|v rows stacked; epilogue: RoPE on q and k,
                   k and v appended to the cache at pos                        -> qkv (fp16)
    attention      GQA over cache[0..pos], split over the sequence, combine fused -> attn_out (fp16)
    gemv  o_proj   residual epilogue                                           h += Wo . attn_out
    gemv  gate/up  RMSNorm prologue (post_attention_layernorm), SwiGLU epilogue -> act (fp16)
    gemv  down     residual epilogue                                           h += Wd . act

plus the embedding lookup before the layers and final RMSNorm, lm_head (fp16, fp32 logits) and argmax
after.

"fused" (opt-in, sm_90..sm_10x): 3 launches per step. decode_layers.cu runs the embedding and every layer in
ONE persistent cooperative kernel: a producer warp streams all weight rows through a shared-memory ring
(TMA) while consumer warps compute the five phases above, separated by grid barriers; then lm_head, argmax.

Each op has one launch factory below (`*_launch`), shared by the step, the kernel tests and the
microbenchmarks: grid/block/shared-memory rules live in exactly one place.
"""
from __future__ import annotations

import math

import numpy as np

from .arena import ARGMAX_THREADS, ATT_CHUNK, LAYER_TABLE_FIELDS, Arena, linear_regions, probe_floats_per_layer
from .config import ModelConfig
from .errors import AtomflowError
from .kernels import KernelLib, Launch, allow_dynamic_smem, resident_blocks_per_sm

GEMV_THREADS = 256
GEMV_BLOCKS_PER_SM = 4  # = GEMV_MIN_BLOCKS in gemv_common.cuh: the grid never exceeds one resident wave
ATT_THREADS = 128
PK_CONSUMERS = 8                 # decode_layers.cu consumer warps (+ 1 producer warp); -DPK_CONSUMERS=N overrides
PK_ATT_THREADS = 256             # decode_layers.cu PK_ATT_WARPS * 32: the threads of an attention item
PK_GROUPS = (1, 2, 3, 4)         # q heads per kv head with a persistent instance (G = 8: the split step)
PK_MAX_SLOTS = 64                # ring slots at most (mbarrier pairs)
PK_PRODUCER_LANES = 8            # decode_layers.cu PK_PRODUCER_LANES
STEP_MODES = ("fused", "split")
# decode_layers.cu struct LayerW, in order (scales are 0 for fp16 weights)
LAYER_FIELDS = ("wqkv", "wqkv.scale", "attn_norm", "wo", "wo.scale", "wgu", "wgu.scale", "mlp_norm", "wd", "wd.scale",
                "k_cache", "v_cache", "att_counters")
SMEM_PER_SM = 227 * 1024  # usable shared memory per SM on sm_90 (sm_89: 99 KB; only limits residency)
NULL = np.uint64(0)


def i32(v) -> np.int32:
    return np.int32(v)


# ---- launch factories, one per op ----------------------------------------------------------------------

def gemv_launch(lib: KernelLib, fmt: str, variant: str, w, scales, x, y, n_out: int, k: int, n_sm: int,
                norm_w=None, eps: float = 1e-5, taps=None, role: str = "", rope: tuple = ()) -> Launch:
    """y = W.x in `fmt` (fp16 | fp8) with `variant` in qkv_rope | norm_swiglu | resid | f32 | store.

    qkv_rope: n_out = qkv_dim / 2 (one output per rotation pair); `rope` = (cos_sin, pos, k_cache, v_cache,
    n_q_heads, n_kv_heads, head_dim) for this layer.
    """
    fp8 = fmt == "fp8"
    if k % (16 if fp8 else 8):
        raise AtomflowError(f"GEMV K={k} unsupported: {fmt} rows must be a multiple of 16 bytes "
                            f"(K % {16 if fp8 else 8} == 0)")
    rows = 2 * n_out if variant in ("norm_swiglu", "qkv_rope") else n_out
    if tuple(w.shape) != (rows, k):
        raise AtomflowError(f"GEMV weight shape {tuple(w.shape)} != ({rows}, {k})")
    shmem = k * 2 + 128  # x staged in fp16 + reduction scratch
    fn = lib[f"gemv_{'f8' if fp8 else 'f16'}_{variant}"]
    allow_dynamic_smem(fn, shmem)
    per_sm = min(GEMV_BLOCKS_PER_SM, SMEM_PER_SM // shmem)
    grid = (min(-(-n_out // (GEMV_THREADS // 32)), n_sm * per_sm),)
    moved = w.nbytes + (scales.nbytes if fp8 else 0) + x.nbytes + y.nbytes
    extra = ()
    if variant == "qkv_rope":
        cos_sin, pos, k_cache, v_cache, n_q, n_kv, hd = rope
        extra = (cos_sin, pos, k_cache, v_cache, i32(n_q), i32(n_kv), i32(hd))
        moved += 2 * n_kv * hd * 2  # the K and V rows appended to the cache
    return Launch(fn, f"gemv_{fmt}_{variant}", grid, (GEMV_THREADS,),
                  (w, scales if fp8 else NULL, x, NULL if norm_w is None else norm_w, np.float32(eps), y,
                   i32(n_out), i32(k)) + extra, shmem, taps or {}, moved,
                  f"gemv {fmt} {role or variant} {rows}x{k}")


def quantize_launch(lib: KernelLib, w16, q, s) -> Launch:
    rows, k = w16.shape
    groups = s.shape[1]
    return Launch(lib["quantize_fp8"], "quantize_fp8", (-(-rows * groups // 8),), (256,),
                  (w16, q, s, i32(rows), i32(k)), 0, {}, w16.nbytes + q.nbytes + s.nbytes)


def embed_launch(lib: KernelLib, token, emb, h, taps=None) -> Launch:
    H = emb.shape[1]
    return Launch(lib["embed_lookup"], "embed_lookup", (-(-H // 256),), (256,), (token, emb, h, i32(H)), 0,
                  taps or {}, H * 2 + H * 4)


def attention_smem(group: int, hd: int, splits: int) -> int:
    """Scores [G][chunk] + P.V partials [threads/(hd/8)][G][hd] (reused for the [G][splits] combine weights)."""
    pv = (ATT_THREADS // (hd // 8)) * group * hd
    if splits > pv // group:
        raise AtomflowError(f"{splits} attention splits exceed the kernel's shared-memory plan (max_seq too large)")
    return 4 * (group * ATT_CHUNK + pv)


def attention_launch(lib: KernelLib, q, k_cache, v_cache, pos, part_ml, part_o, counters, out, n_kv: int,
                     group: int, hd: int, taps=None) -> Launch:
    """k_cache/v_cache: one layer's [max_seq, kv_dim] slab; part_*: [n_heads, splits, ...] scratch."""
    splits = part_ml.shape[1]
    if splits * ATT_CHUNK < k_cache.shape[0]:
        raise AtomflowError("attention partials too small for max_seq")
    return Launch(lib[f"attention_decode_hd{hd}_g{group}"], "attention_decode", (n_kv, splits), (ATT_THREADS,),
                  (q, k_cache, v_cache, pos, part_ml, part_o, counters, out, i32(n_kv), i32(splits),
                   np.float32(1.0 / math.sqrt(hd))), attention_smem(group, hd, splits), taps or {}, 0)


def rmsnorm_launch(lib: KernelLib, h, w, eps: float, out, taps=None) -> Launch:
    K = h.shape[0]
    return Launch(lib["rmsnorm_f32_f16"], "rmsnorm_f32_f16", (1,), (1024,), (h, w, np.float32(eps), out, i32(K)),
                  0, taps or {}, K * 8)


def argmax_launch(lib: KernelLib, logits, part_val, part_idx, counter, pos, cur_token, prompt, prompt_len,
                  out_tokens) -> Launch:
    V = logits.shape[0]
    return Launch(lib["argmax_advance"], "argmax_advance", (part_val.shape[0],), (ARGMAX_THREADS,),
                  (logits, i32(V), part_val, part_idx, counter, pos, cur_token, prompt, prompt_len, out_tokens),
                  0, {}, logits.nbytes)


def fused_supported(cfg: ModelConfig, cc: str | float = "9.0", fmt: str = "fp16",
                    smem_optin: int = 232448, consumers: int = PK_CONSUMERS) -> str | None:
    """None when the persistent kernel runs this shape/format on this GPU, else why not."""
    if cfg.group_size not in PK_GROUPS:
        return f"{cfg.group_size} q heads per kv head (decode_layers.cu instances: {PK_GROUPS})"
    if not 9.0 <= float(cc) < 12.0:
        return f"compute capability {cc} (decode_layers.cu needs TMA and ~200 KB shared memory: sm_90..sm_10x)"
    try:
        ring_plan(cfg, fmt, smem_optin, consumers)
    except AtomflowError as e:
        return str(e).removeprefix("decode_layers: ")
    return None


def pk_consumers(defines=()) -> int:
    """Consumer warps of the compiled decode_layers kernel (an A/B override in ATOMFLOW_KERNEL_DEFINES)."""
    for d in defines:
        if d.startswith("PK_CONSUMERS="):
            return int(d.split("=", 1)[1])
    return PK_CONSUMERS


def ring_plan(cfg: ModelConfig, fmt: str, smem_optin: int, consumers: int = PK_CONSUMERS) -> dict:
    """Shared memory of the persistent kernel: the union (x staging | attention scratch), then the ring of
    weight-tile slots (one slot = the largest tile: R rows + their fp8 scale windows), then the mbarriers."""
    H, I, hd, G = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.group_size
    bpw = 1 if fmt == "fp8" else 2
    union = max(max(H, cfg.q_dim, I) * 2 + 128, 4 * (G * ATT_CHUNK + (PK_ATT_THREADS // (hd // 8)) * G * hd))
    union = -(-union // 128) * 128

    def tile(rows: int, k: int) -> int:  # R weight rows + (fp8) one 16-byte aligned scale window per row
        groups = -(-k // 128)
        seg = (-(-groups * 4 // 16) * 16 + 16) if fmt == "fp8" else 0  # = scale_seg() in decode_layers.cu
        return rows * (k * bpw + seg)

    slot = max(tile(2, H), tile(1, cfg.q_dim), tile(1, I))
    slot = -(-slot // 128) * 128
    budget = smem_optin - union - 1024  # static shared memory (reductions, attention statistics) + margin
    # a multiple of the consumer warps: each slot always belongs to one warp (decode_layers.cu consume_phase)
    # a multiple of the consumer warps and of the producer lanes (decode_layers.cu PK_PRODUCER_LANES = 8):
    # each slot is always filled by one lane and consumed by one warp, in order
    unit = math.lcm(consumers, PK_PRODUCER_LANES)
    n_slots = min(PK_MAX_SLOTS, budget // (slot + 16)) // unit * unit
    if n_slots < consumers:
        raise AtomflowError(f"decode_layers: {smem_optin} bytes of shared memory hold fewer than {consumers} "
                            f"weight tiles of {slot} bytes (+ {union} staging); use the split step")
    return {"union_bytes": union, "slot_bytes": slot, "n_slots": int(n_slots),
            "shmem": union + n_slots * slot + 16 * n_slots}


def layer_table(cfg: ModelConfig, fmt: str, a: Arena) -> np.ndarray:
    """The device pointers of every layer's weights / caches, in decode_layers.cu LayerW order."""
    t = np.zeros((cfg.num_hidden_layers, LAYER_TABLE_FIELDS), np.uint64)
    for i in range(cfg.num_hidden_layers):
        for j, f in enumerate(LAYER_FIELDS):
            if f.endswith(".scale") and fmt != "fp8":
                continue
            view = {"k_cache": a["k_cache"][i], "v_cache": a["v_cache"][i],
                    "att_counters": a["att_counters"][i]}.get(f)
            t[i, j] = (view if view is not None else a[f"L{i}.{f}"]).data.ptr
    return t


def probe_views(cfg: ModelConfig, probes) -> dict:
    """Named views of the persistent kernel's probe buffer (layout: decode_layers.cu header)."""
    H, q, kv, I = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.intermediate_size
    P = probe_floats_per_layer(cfg)
    taps = {"embed": probes[:H]}
    for i in range(cfg.num_hidden_layers):
        b, p = H + i * P, f"layers.{i}."
        taps.update({p + "q": probes[b:b + q], p + "k": probes[b + q:b + q + kv],
                     p + "v": probes[b + q + kv:b + q + 2 * kv], p + "attn_out": probes[b + q + 2 * kv:b + 2 * q + 2 * kv]})
        b += 2 * q + 2 * kv
        taps.update({p + "attn": probes[b:b + H], p + "act": probes[b + H:b + H + I],
                     p + "mlp": probes[b + H + I:b + 2 * H + I]})
    return taps


def fused_launch(lib: KernelLib, cfg: ModelConfig, fmt: str, a: Arena, n_sm: int, probes: bool = False,
                 smem_optin: int = 232448) -> Launch:
    """The persistent decode_layers kernel over the whole model: cooperative, one block per SM. The caller has
    checked fused_supported() for this GPU (engine.py)."""
    consumers = pk_consumers(lib.defines)
    threads = (consumers + 1) * 32
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    fn = lib[f"decode_layers_{'f8' if fmt == 'fp8' else 'f16'}_hd{hd}_g{cfg.group_size}"]
    splits = a["att_ml"].shape[1]
    if splits > (PK_ATT_THREADS // (hd // 8)) * hd:
        raise AtomflowError(f"{splits} attention splits exceed the persistent kernel's shared-memory plan")
    ring = ring_plan(cfg, fmt, smem_optin, consumers)
    if resident_blocks_per_sm(fn, threads, ring["shmem"]) < 1:
        raise AtomflowError(f"decode_layers kernel does not fit on an SM ({ring['shmem']} bytes of shared memory)")
    P = a["probes"]
    moved = sum(a[f"L{i}.{f}"].nbytes for i in range(cfg.num_hidden_layers)
                for f in ("wqkv", "wo", "wgu", "wd", "attn_norm", "mlp_norm")
                + (("wqkv.scale", "wo.scale", "wgu.scale", "wd.scale") if fmt == "fp8" else ()))
    taps = dict(probe_views(cfg, P)) if probes else {}
    if probes:
        taps["final_norm"] = a["xnorm"]
    return Launch(fn, "decode_layers", (n_sm,), (threads,),
                  (a["layer_table"], i32(cfg.num_hidden_layers), a["cur_token"], a["embed"], a["rope_cs"], a["pos"],
                   a["h"], a["qkv"], a["attn_out"], a["act"], a["xnorm"], a["final_norm"], a["att_ml"], a["att_o"],
                   i32(splits), a["step_sync"], P if probes else NULL, i32(H), i32(I), i32(cfg.num_attention_heads),
                   i32(cfg.num_key_value_heads), np.float32(cfg.rms_norm_eps), np.float32(1.0 / math.sqrt(hd)),
                   i32(ring["n_slots"]), i32(ring["slot_bytes"]), i32(ring["union_bytes"])),
                  ring["shmem"], taps, moved,
                  f"decode_layers {fmt} x{cfg.num_hidden_layers} (persistent, ring {ring['n_slots']}x{ring['slot_bytes']} B)",
                  cooperative=True)


# ---- the step --------------------------------------------------------------------------------------------

def build_step(cfg: ModelConfig, fmt: str, a: Arena, lib: KernelLib, n_sm: int, mode: str = "split",
               probes: bool = False, smem_optin: int = 232448) -> list[Launch]:
    """The step's launches; mode "fused" (persistent layers kernel) or "split" (per-op kernels). probes:
    fused mode writes every layer's probes (validation; the split step always exposes them as taps)."""
    if mode not in STEP_MODES:
        raise AtomflowError(f"unknown step mode {mode!r} (expected one of {', '.join(STEP_MODES)})")
    head = a["embed" if cfg.tie_word_embeddings else "lm_head"]
    tail = [gemv_launch(lib, "fp16", "f32", head, None, a["xnorm"], a["logits"], cfg.vocab_size, cfg.hidden_size,
                        n_sm, taps={"logits": a["logits"]}, role="lm_head"),
            argmax_launch(lib, a["logits"], a["am_val"], a["am_idx"], a["am_counter"], a["pos"], a["cur_token"],
                          a["prompt"], a["prompt_len"], a["out_tokens"])]
    if mode == "fused":
        return [fused_launch(lib, cfg, fmt, a, n_sm, probes, smem_optin)] + tail
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_dim, kv_dim, eps = cfg.q_dim, cfg.kv_dim, cfg.rms_norm_eps
    h, qkv, attn_out, act, xnorm = (a[n] for n in ("h", "qkv", "attn_out", "act", "xnorm"))
    rows = linear_regions(cfg)

    def gemv(weight, variant, x, y, n_out, k, **kw):
        scales = a[weight + ".scale"] if fmt == "fp8" else None
        return gemv_launch(lib, fmt, variant, a[weight], scales, x, y, n_out, k, n_sm, eps=eps,
                           role=weight.split(".", 1)[1], **kw)

    steps = [embed_launch(lib, a["cur_token"], a["embed"], h, taps={"embed": h})]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        steps += [
            gemv(f"L{i}.wqkv", "qkv_rope", h, qkv, rows["wqkv"][0] // 2, H, norm_w=a[f"L{i}.attn_norm"],
                 rope=(a["rope_cs"], a["pos"], a["k_cache"][i], a["v_cache"][i], cfg.num_attention_heads,
                       cfg.num_key_value_heads, hd),
                 taps={p + "q": qkv[:q_dim], p + "k": qkv[q_dim:q_dim + kv_dim], p + "v": qkv[q_dim + kv_dim:]}),
            attention_launch(lib, qkv, a["k_cache"][i], a["v_cache"][i], a["pos"], a["att_ml"], a["att_o"],
                             a["att_counters"][i], attn_out, cfg.num_key_value_heads, cfg.group_size, hd,
                             taps={p + "attn_out": attn_out}),
            gemv(f"L{i}.wo", "resid", attn_out, h, H, q_dim, taps={p + "attn": h}),
            gemv(f"L{i}.wgu", "norm_swiglu", h, act, I, H, norm_w=a[f"L{i}.mlp_norm"], taps={p + "act": act}),
            gemv(f"L{i}.wd", "resid", act, h, H, I, taps={p + "mlp": h}),
        ]
    steps.append(rmsnorm_launch(lib, h, a["final_norm"], eps, xnorm, taps={"final_norm": xnorm}))
    return steps + tail


def run_eager(launches: list[Launch], taps: dict | None = None) -> None:
    """Run one step launch by launch on the current stream; with `taps`, copy every probe to the host."""
    for ln in launches:
        ln()
        if taps is not None:
            for name, view in ln.taps.items():
                taps[name] = view.get().astype(np.float32)
