"""Tensor parallelism over N ranks: the sharding plan.

No GPU code, no NCCL here: which rows and columns of every weight each rank holds, the per-rank shapes (which must
still take the tiled GEMV layout, ops/gemv.py check_tiled), the bytes each rank streams per token, the bytes the
ranks exchange per token, the slicing of HF tensors at load time and the distributed greedy argmax's combine.

The rules (Megatron-style; rank r of N):
  QKV     split by output rows, whole heads: rank r holds kv heads [r*kv/N, (r+1)*kv/N) and their query heads
          (q heads [r*nq/N, (r+1)*nq/N): query head j uses kv head j // group, so these are exactly the q heads of
          its kv heads). Its fused wqkv is [q_r; k_r; v_r] stacked like the single-GPU q|k|v, so the qkv_rope
          epilogue (RoPE on whole heads, the K/V append) runs unchanged on the rank's heads. kv heads not divisible
          by N is refused.
  KV      the cache is sharded with the kv heads: rank r holds [layers][max_seq][kv_dim/N] of K and of V.
  o_proj  split by input columns (the rank's q heads' columns): each rank computes a partial fp32 sum [hidden]
          from its own attention output; the partials are summed across ranks (all-reduce) and added to h.
  gate/up split by output rows: rank r holds gate rows [r*I/N, (r+1)*I/N) and the same rows of up, stacked
          [gate_r; up_r] like the single-GPU [gate; up], so the SwiGLU epilogue stays local.
  down    split by input columns (the same I/N slice): partial sums, all-reduced, added to h.
  norms   replicated (every rank runs the RMSNorm prologues over the whole, replicated, fp32 residual h).
  lm_head split by vocabulary rows: rank r holds rows [r*c, min(V, (r+1)*c)), c = ceil(V/N); no padding (the
          lm_head GEMV is a warp per row with no row-multiple rule; the last rank simply holds fewer rows, and a
          plan where a rank would hold none is refused). Each rank's greedy argmax yields (value, global index);
          the N pairs are combined (combine_argmax): larger value wins, ties go to the smaller global index, NaN
          never wins (argmax_common.cuh `better`; numpy.argmax's first-occurrence tie rule).
  embed   REPLICATED. Decode reads one row per token (hidden*2 bytes), so replicating costs memory, not bandwidth:
          vocab*hidden*2 bytes per rank (Llama-3 70B: 128256*8192*2 = 2.10 GB; 405B: 4.20 GB), against a vocab-split
          embedding's extra collective per token (the looked-up row broadcast from its owner) on a path whose
          latency is counted in collectives. Tied models: the lm_head shard is a view of rows of the replicated
          embedding, so it costs no memory beyond the replicated table.
  comm    per token: two all-reduces of hidden fp32 per layer (the residual stream h is fp32 in the arena), plus an
          all-gather of N (fp32 value, int32 index) pairs for the argmax.

Per-rank shapes: every rank runs the single-GPU kernels on `local_config(cfg, n)` (heads, kv heads and intermediate
divided by N; hidden and head_dim unchanged): wqkv [(nq+2kv)/N*hd, H] (RoPE pairing: whole heads), wo [H, nq/N*hd],
wgu [2I/N, H] (halves pairing), wd [H, I/N]; all need rows % 16 and K % 32, which is refused in one line where a
split breaks it (e.g. I/N not a multiple of 32: down's K).
FP8 group scales: a rank quantises its own slice, one fp32 scale per 128 of ITS inputs; where a split's K is a
multiple of 128 (every shape in the tests) the groups are the single-GPU groups and the codes are identical.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np

from ...config import GROUP, ModelConfig
from ...errors import AtomflowError
from ..ops import attention
from ..ops.gemv import ROLE_PAIRING, check_tiled, linear_regions

NO_INDEX = 0x7FFFFFFF  # argmax_common.cuh: the index of a reduction that saw no (non-NaN) value


@dataclass(frozen=True)
class RankShard:
    """What rank `rank` of `n` holds. Ranges are half-open (start, stop) in the FULL model's coordinates."""
    rank: int
    n: int
    head_dim: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    q_rows: tuple[int, int]        # rows of the stacked q|k|v (= rows of q_proj)
    k_rows: tuple[int, int]        # rows of the stacked q|k|v (q_dim + rows of k_proj)
    v_rows: tuple[int, int]        # rows of the stacked q|k|v (q_dim + kv_dim + rows of v_proj)
    gate_rows: tuple[int, int]     # rows of the stacked gate|up (= rows of gate_proj)
    up_rows: tuple[int, int]       # rows of the stacked gate|up (I + the same rows of up_proj)
    wo_cols: tuple[int, int]       # input columns of o_proj (the rank's q heads' outputs)
    wd_cols: tuple[int, int]       # input columns of down_proj (the rank's intermediate slice)
    vocab_rows: tuple[int, int]    # rows of lm_head (of the embedding when tied)
    shapes: dict                   # per-rank fused projections role -> (rows, K), ops/gemv.py linear_regions roles
    config: ModelConfig            # the shape the rank's layer kernels see (local_config)

    @property
    def inter(self) -> tuple[int, int]:
        """The rank's slice of intermediate_size (rows of gate_proj and up_proj, columns of down_proj)."""
        return self.wd_cols

    def rows(self, role: str) -> list[tuple[int, int]]:
        """Row ranges of the full fused projection `role` this rank holds, in its stacking order."""
        if role == "wqkv":
            return [self.q_rows, self.k_rows, self.v_rows]
        if role == "wgu":
            return [self.gate_rows, self.up_rows]
        if role in ("wo", "wd"):
            return [(0, self.shapes[role][0])]
        raise AtomflowError(f"unknown projection role {role!r} (wqkv, wo, wgu, wd)")

    def cols(self, role: str) -> tuple[int, int]:
        """Input-column range of the full fused projection `role` this rank holds."""
        if role == "wo":
            return self.wo_cols
        if role == "wd":
            return self.wd_cols
        if role in ("wqkv", "wgu"):
            return (0, self.shapes[role][1])
        raise AtomflowError(f"unknown projection role {role!r} (wqkv, wo, wgu, wd)")

    def take(self, role: str, w: np.ndarray) -> np.ndarray:
        """The rank's [rows, K] of a full fused projection (row-major, before tiling)."""
        c0, c1 = self.cols(role)
        return np.ascontiguousarray(np.concatenate([w[a:b, c0:c1] for a, b in self.rows(role)], axis=0))

    # the loaders' seam (gpu/upload.py, gpu/synthetic.py): they slice through the shard they are given
    def slice_index(self, name: str) -> tuple[slice, slice]:
        return slice_index(name, self)

    def slice_shape(self, name: str, full_shape: tuple) -> tuple:
        return slice_shape(name, full_shape, self)

    def slice_weight(self, name: str, w: np.ndarray) -> np.ndarray:
        return slice_weight(name, w, self)

    def streamed_bytes(self, cfg: ModelConfig, fmt: str) -> int:
        """The weight bytes this rank streams per token (shard_bytes)."""
        return _bytes_of(cfg, self, fmt, held=False)


def _split(total: int, n: int, r: int) -> tuple[int, int]:
    return (r * total // n, (r + 1) * total // n)


def check(cfg: ModelConfig, n: int) -> None:
    """Raise a one-line AtomflowError if `cfg` cannot be split over `n` ranks."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise AtomflowError(f"tensor parallel needs a positive number of ranks, got {n!r}")
    kv, nq, I, V = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.intermediate_size, cfg.vocab_size
    if kv % n:
        raise AtomflowError(f"tensor parallel over {n} ranks needs num_key_value_heads = {kv} divisible by {n} "
                            f"(each rank holds whole kv heads)")
    if nq % kv:
        raise AtomflowError(f"num_attention_heads = {nq} is not a multiple of num_key_value_heads = {kv}")
    if I % n or (I // n) % 32:
        raise AtomflowError(f"tensor parallel over {n} ranks: intermediate_size = {I} / {n} = {I / n:g} per rank "
                            f"is not a multiple of 32 (down_proj's K; the tiled GEMV needs K % 32 == 0)")
    c = -(-V // n)
    if c * (n - 1) >= V:
        raise AtomflowError(f"tensor parallel over {n} ranks: vocab_size = {V} in rows of {c} leaves rank {n - 1} "
                            f"no lm_head rows")


def local_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """The shape each rank's layer kernels see: heads, kv heads and intermediate_size divided by `n` (hidden,
    head_dim, vocab unchanged: the embedding is replicated; the lm_head shard is planned separately)."""
    check(cfg, n)
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // n,
                               num_key_value_heads=cfg.num_key_value_heads // n,
                               intermediate_size=cfg.intermediate_size // n)


def check_kernels(cfg: ModelConfig, n: int) -> None:
    """Raise a one-line AtomflowError if a rank's attention (q heads per kv head, head_dim: unchanged by the split)
    is not one attention.cu runs. Kept out of plan(): the sharding and the byte figures hold whatever the attention
    kernel supports."""
    loc = local_config(cfg, n)
    attention.check_shape(loc.head_dim, loc.group_size)


def check_model(cfg: ModelConfig, n: int) -> None:
    """Every rule a split of `cfg` over `n` ranks must meet (the kv heads, the tiled shapes, the attention kernel),
    from the config alone: the commands ask it before they look for a GPU."""
    plan(cfg, n)
    check_kernels(cfg, n)


def plan(cfg: ModelConfig, n: int) -> list[RankShard]:
    """The shards of `cfg` over `n` ranks (see the module docstring for the rules); refused in one line where a
    split is impossible or a rank's shapes would not take the tiled GEMV layout. (The attention kernel's own limits
    are check_kernels'.)"""
    check(cfg, n)
    loc = local_config(cfg, n)
    hd, I, V = cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    shapes = linear_regions(loc)
    for role, (rows, k) in shapes.items():
        try:
            check_tiled(rows, k, ROLE_PAIRING[role], hd // 2)
        except AtomflowError as e:
            raise AtomflowError(f"tensor parallel over {n} ranks: the per-rank {role} {e}") from None
    c = -(-V // n)
    out = []
    for r in range(n):
        kv0, kv1 = _split(cfg.num_key_value_heads, n, r)
        q0, q1 = _split(cfg.num_attention_heads, n, r)
        i0, i1 = _split(I, n, r)
        qd, kvd = cfg.q_dim, cfg.kv_dim
        out.append(RankShard(
            rank=r, n=n, head_dim=hd, q_heads=(q0, q1), kv_heads=(kv0, kv1),
            q_rows=(q0 * hd, q1 * hd), k_rows=(qd + kv0 * hd, qd + kv1 * hd),
            v_rows=(qd + kvd + kv0 * hd, qd + kvd + kv1 * hd),
            gate_rows=(i0, i1), up_rows=(I + i0, I + i1), wo_cols=(q0 * hd, q1 * hd), wd_cols=(i0, i1),
            vocab_rows=(r * c, min(V, (r + 1) * c)), shapes=dict(shapes), config=loc))
    return out


# ---- bytes ------------------------------------------------------------------------------------------------------

def _proj_bytes(rows: int, k: int, fmt: str) -> int:
    if fmt == "fp16":
        return 2 * rows * k
    if fmt == "fp8":
        return rows * k + 4 * rows * -(-k // GROUP)
    raise AtomflowError(f"unknown weight format {fmt!r} (expected fp16 or fp8)")


def norm_bytes(cfg: ModelConfig) -> int:
    """The RMSNorm weights (fp16 in both formats), which every rank holds whole and streams."""
    return 2 * cfg.hidden_size * (2 * cfg.num_hidden_layers + 1)


def embed_bytes(cfg: ModelConfig) -> int:
    """The embedding table (fp16), replicated on every rank: the memory replication costs per rank."""
    return 2 * cfg.vocab_size * cfg.hidden_size


def shard_bytes(cfg: ModelConfig, fmt: str, n: int, held: bool = False) -> list[int]:
    """Per-rank weight bytes, counted as ModelConfig.weight_bytes counts them (fp8: layer projections 1 byte per
    weight + one fp32 scale per 128 of the rank's inputs; embedding, norms and lm_head fp16).

    Default: the bytes a rank STREAMS per token — its layer projections, all norms, its lm_head rows (tied: those
    rows of the embedding); the embedding of an untied model is not streamed (one row per token, like
    arena.plan_arena). `held=True`: the bytes a rank holds — the same plus the whole replicated embedding (tied: the
    lm_head rows are a view of it, not counted twice). At n = 1 `held` equals cfg.weight_bytes(fmt).
    So sum(held) = weight_bytes + (n-1)*(norms + embedding) and sum(streamed) = weight_bytes - (untied: embedding)
    + (n-1)*norms, exactly where every split's K is a multiple of 128 (fp8 scale groups; fp16 always)."""
    return [_bytes_of(cfg, s, fmt, held) for s in plan(cfg, n)]


def _bytes_of(cfg: ModelConfig, s: RankShard, fmt: str, held: bool) -> int:
    b = cfg.num_hidden_layers * sum(_proj_bytes(rows, k, fmt) for rows, k in s.shapes.values())
    b += norm_bytes(cfg) + 2 * (s.vocab_rows[1] - s.vocab_rows[0]) * cfg.hidden_size
    if held:
        b += embed_bytes(cfg) - (2 * (s.vocab_rows[1] - s.vocab_rows[0]) * cfg.hidden_size
                                 if cfg.tie_word_embeddings else 0)
    return b


def kv_bytes_per_token(cfg: ModelConfig, n: int) -> int:
    """KV cache bytes per position on each rank (fp16 K and V of its kv heads)."""
    return local_config(cfg, n).kv_bytes_per_token()


RESID_BYTES = 4   # the residual stream h is fp32 (arena "h"): the partial sums are reduced in fp32
ARGMAX_PAIR = 8   # (fp32 value, int32 index)


def comm_bytes_per_token(cfg: ModelConfig, n: int) -> dict:
    """What the ranks exchange per token (payloads, per rank; 0 at n = 1):
    `allreduce`: 2 sums of hidden fp32 per layer (o_proj's and down's partials); `argmax`: the all-gathered
    (value, index) pairs, n * 8; `total`; `collectives`: how many per token (2 per layer + 1). A ring all-reduce
    moves 2(n-1)/n of its payload over each rank's link: `link` is that traffic plus the all-gather's (n-1)*8."""
    if n == 1:
        return {"allreduce": 0, "argmax": 0, "total": 0, "collectives": 0, "link": 0}
    check(cfg, n)
    ar = 2 * cfg.num_hidden_layers * cfg.hidden_size * RESID_BYTES
    am = n * ARGMAX_PAIR
    return {"allreduce": ar, "argmax": am, "total": ar + am, "collectives": 2 * cfg.num_hidden_layers + 1,
            "link": 2 * (n - 1) * ar // n + (n - 1) * ARGMAX_PAIR}


# ---- loading: slicing HF tensors ---------------------------------------------------------------------------------

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")


def slice_index(name: str, shard: RankShard) -> tuple[slice, slice]:
    """(rows, columns) of the full HF tensor `name` (row-major [out, in] as HF stores it) that rank `shard` holds:
    q/k/v/gate/up by rows, o/down by columns; norms and the embedding whole (replicated); lm_head by vocab rows."""
    hd = shard.head_dim
    whole = slice(None)
    m = _LAYER.fullmatch(name)
    if name in ("model.embed_tokens.weight", "model.norm.weight"):
        return whole, whole
    if name == "lm_head.weight":
        return slice(*shard.vocab_rows), whole
    if m:
        sub = m.group(2)
        kv = (shard.kv_heads[0] * hd, shard.kv_heads[1] * hd)
        rows = {"self_attn.q_proj": shard.q_rows, "self_attn.k_proj": kv, "self_attn.v_proj": kv,
                "mlp.gate_proj": shard.inter, "mlp.up_proj": shard.inter}
        cols = {"self_attn.o_proj": shard.wo_cols, "mlp.down_proj": shard.wd_cols}
        if sub in ("input_layernorm", "post_attention_layernorm"):
            return whole, whole
        if sub in rows:
            return slice(*rows[sub]), whole
        if sub in cols:
            return whole, slice(*cols[sub])
    raise AtomflowError(f"tensor parallel: no sharding rule for tensor {name!r}")


def slice_shape(name: str, full_shape: tuple, shard: RankShard) -> tuple:
    """The shape of the rank's part of a tensor of `full_shape` (slice_index)."""
    rs, cs = slice_index(name, shard)
    out = [len(range(*rs.indices(full_shape[0])))]
    if len(full_shape) > 1:
        out.append(len(range(*cs.indices(full_shape[1]))))
    return tuple(out)


def slice_weight(name: str, w: np.ndarray, shard: RankShard, cfg: ModelConfig | None = None) -> np.ndarray:
    """The rank's part of the full HF tensor `name` (slice_index), C-contiguous. (A tied model's lm_head shard is
    embedding[vocab_rows], a view of the replicated table.) `cfg` (optional) checks the tensor's full shape."""
    m = _LAYER.fullmatch(name)
    rs, cs = slice_index(name, shard)
    if cfg is not None:
        want = cfg.tensor_shapes().get(name) if not m else cfg.tensor_shapes().get(
            f"model.layers.0.{m.group(2)}.weight")
        if want is None or tuple(w.shape) != tuple(want):
            raise AtomflowError(f"tensor parallel: {name} has shape {tuple(w.shape)}, the config says {want}")
    part = w[rs] if w.ndim == 1 else w[rs, cs]
    return np.ascontiguousarray(part)


# ---- the distributed greedy argmax -------------------------------------------------------------------------------

def local_argmax(logits: np.ndarray, offset: int = 0) -> tuple[float, int]:
    """One rank's best (value, global index) over its vocab rows [offset, offset + len): the first maximum among
    the non-NaN values (argmax_common.cuh: NaN never wins); (-inf, NO_INDEX) when every value is NaN."""
    x = np.asarray(logits, dtype=np.float32).ravel()
    ok = np.flatnonzero(~np.isnan(x))
    if ok.size == 0:
        return float(-np.inf), NO_INDEX
    j = int(ok[np.argmax(x[ok])])
    return float(x[j]), offset + j


def combine_argmax(values, indices) -> tuple[float, int]:
    """Combine the ranks' (value, global index) bests: the larger value wins, a tie goes to the smaller index, a
    NaN value never wins (argmax_common.cuh `better`). When no rank saw a non-NaN value the token is 0, as the
    kernel writes (value -inf)."""
    vals = np.asarray(values, dtype=np.float32).ravel()
    idx = np.asarray(indices, dtype=np.int64).ravel()
    if vals.shape != idx.shape:
        raise AtomflowError(f"combine_argmax: {vals.size} values but {idx.size} indices")
    bv, bi = float(-np.inf), NO_INDEX
    for v, i in zip(vals.tolist(), idx.tolist()):
        if v > bv or (v == bv and i < bi):
            bv, bi = v, int(i)
    return bv, (0 if bi == NO_INDEX else bi)


def ranks_table(cfg: ModelConfig, ns=(1, 2, 4, 8)) -> list[dict]:
    """Per n: per-rank streamed / held bytes (fp16, fp8, max over ranks), KV bytes per position and comm bytes per
    token (a summary for reports)."""
    rows = []
    for n in ns:
        d = {"n": n}
        for fmt in ("fp16", "fp8"):
            d[f"stream_{fmt}"] = max(shard_bytes(cfg, fmt, n))
            d[f"held_{fmt}"] = max(shard_bytes(cfg, fmt, n, held=True))
        d["kv_per_pos"] = kv_bytes_per_token(cfg, n)
        d["comm"] = comm_bytes_per_token(cfg, n)["total"]
        rows.append(d)
    return rows


__all__ = ["RankShard", "plan", "check", "check_kernels", "check_model", "local_config", "shard_bytes", "norm_bytes",
           "embed_bytes", "kv_bytes_per_token", "comm_bytes_per_token", "slice_weight", "slice_index", "slice_shape",
           "local_argmax", "combine_argmax", "ranks_table", "NO_INDEX"]
