"""Launch policy as one typed value: which form of each op a decode step runs.

A step has one or two attention buckets: with `short_attention` the short kernel serves every length up to its
capacity (ops/attention.short_capacity) and the split kernel the lengths beyond; without it the split kernel serves
all. Each bucket runs the layer GEMVs in one form (`GemvForm`): warp-specialised or the ring path, the slots filled
before the PDL wait (o_proj's apart), and how many MB of gate/up's weights QKV asks into L2. The text form, for the
CLI's --forms and ATOMFLOW_FORMS, is

    short:<gemv>;split:<gemv>      e.g.  short:ws-pre2/l2=8;split:ring/l2=0
    split:<gemv>                   the split kernel for every length
    <gemv> = ring | ws | ws-pre<N>, then /l2=<MB>, then (ws) /wo-pre=<N>

Forms are resolved once (given, saved by `tune`, or the defaults below) and handed to the step builder; nothing
below that reads the environment.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .. import envs
from ..errors import AtomflowError
from .ops.gemv import GEMV_WS_MAX

# What the tuner tries. Each list holds the values that won on some measured shape, since the best differs per shape:
L2_TAILS = (0, 4, 8, 16, 24)  # MB of gate/up's tail asked into L2
WS_PRE_TRY = {"fp16": (2,), "fp8": ()}  # slots-before-the-wait counts besides the default (1B fp16 is fastest at 2)
# o_proj's own count besides the form's: 2 pays on 8B W8A16; on fp16 shapes every count measured slower
WO_PRE_TRY = {"fp16": (), "fp8": (2,)}


@dataclass(frozen=True)
class GemvForm:
    ws: bool = False            # warp-specialised (producer warp + bulk copies, sm_90+), else the ring form
    ws_pre: int | None = None   # ws: ring slots filled before the PDL wait (None: the format's default)
    l2_tail_mb: int = 0         # MB of gate/up's last weights each QKV launch asks into L2 after its epilogue
    # ws: o_proj's slots before its wait (None: as ws_pre). Its blocks land while the attention runs, and what they
    # ask before the release queues in front of the attention's completion
    wo_pre: int | None = None

    def __post_init__(self):
        for name, n in (("ws-pre<N>", self.ws_pre), ("wo-pre=<N>", self.wo_pre)):
            if n is not None and (not self.ws or not 0 <= n <= GEMV_WS_MAX):
                raise AtomflowError(f"{name} needs the ws form and 0 <= N <= {GEMV_WS_MAX}")
        if self.l2_tail_mb < 0:
            raise AtomflowError(f"l2={self.l2_tail_mb}: MB must be >= 0")

    @property
    def text(self) -> str:
        base = "ring" if not self.ws else "ws" if self.ws_pre is None else f"ws-pre{self.ws_pre}"
        wo = "" if self.wo_pre is None else f"/wo-pre={self.wo_pre}"
        return f"{base}/l2={self.l2_tail_mb}{wo}"

    def slots_before_wait(self, role: str) -> int | None:
        """What a ws launch of `role` fills before its wait (None: the format's default)."""
        return self.wo_pre if role == "wo" and self.wo_pre is not None else self.ws_pre

    @classmethod
    def parse(cls, text: str) -> "GemvForm":
        usage = f"GEMV form {text!r}: ring, ws or ws-pre<N>, then optionally /l2=<MB>, then (ws) /wo-pre=<N>"
        rest, sep_wo, wo = text.strip().partition("/wo-pre=")
        base, sep, l2 = rest.partition("/l2=")
        if (sep and not l2.isdigit()) or (sep_wo and not wo.isdigit()):
            raise AtomflowError(usage)
        tail, wo_pre = int(l2) if sep else 0, int(wo) if sep_wo else None
        if base == "ring":
            return cls(False, None, tail, wo_pre)
        if base == "ws":
            return cls(True, None, tail, wo_pre)
        if base.startswith("ws-pre") and base[6:].isdigit():
            return cls(True, int(base[6:]), tail, wo_pre)
        raise AtomflowError(usage)


@dataclass(frozen=True)
class Forms:
    short_attention: bool     # the short kernel serves lengths up to its capacity (else the split one serves all)
    gemv: GemvForm            # the layer GEMVs of the short bucket (unused without short attention)
    gemv_split: GemvForm      # the layer GEMVs of the split bucket

    @property
    def text(self) -> str:
        split = f"split:{self.gemv_split.text}"
        return f"short:{self.gemv.text};{split}" if self.short_attention else split

    @classmethod
    def parse(cls, text: str) -> "Forms":
        parts: dict[str, GemvForm] = {}
        for seg in filter(None, (s.strip() for s in text.split(";"))):
            bucket, sep, form = seg.partition(":")
            if not sep or bucket not in ("short", "split") or bucket in parts:
                raise AtomflowError(f"forms {text!r}: expected short:<gemv>;split:<gemv> or split:<gemv> "
                                    "(<gemv> = ring | ws | ws-pre<N>, then /l2=<MB>, then (ws) /wo-pre=<N>)")
            parts[bucket] = GemvForm.parse(form)
        if not parts:
            raise AtomflowError("forms: empty")
        short = parts.get("short")
        return cls(short is not None, short or parts["split"], parts.get("split", short))

    def bucket_form(self, short: bool) -> GemvForm:
        return self.gemv if short else self.gemv_split

    def check(self, cc: int) -> "Forms":
        """Refuse what this GPU cannot run (one line): ws and the L2 prefetch need sm_90+ (bulk copies)."""
        for g in {self.gemv, self.gemv_split}:
            if cc < 90 and (g.ws or g.l2_tail_mb):
                raise AtomflowError(f"forms {self.text!r}: ws and /l2=<MB> need sm_90+ (bulk copies); this GPU is "
                                    f"sm_{cc}")
        return self


def default_forms(fmt: str, cc: int, short_capacity: int) -> Forms:
    """The forms when nothing was tuned or given (validate, generate, tests): short attention where it fits; on
    sm_90+ fp16 warp-specialised, fp8 the ring (ws measured slower for fp8 on 3B), each asking 8 MB of gate/up into
    L2 (the size most shapes chose); before sm_90 the ring form alone."""
    g = GemvForm(ws=fmt == "fp16", l2_tail_mb=8) if cc >= 90 else GemvForm()
    return Forms(short_capacity > 0, g, g)


# W8A16 under tensor parallel, each part the faster on 70B: the warp-specialised form (TP2: 14.11 ms against 14.84 for
# the one-GPU default ring/l2=8), o_proj filling 2 slots before its wait (GemvForm.wo_pre: what its blocks ask
# before the release queues in front of the attention's completion), and 8 MB of L2 tail, the fastest tail with
# o_proj at 2 on 2x H100 and on 2x H200.
TP_FP8_GEMV = "ws/l2=8/wo-pre=2"


def tp_defaults(forms: Forms, fmt: str, cc: int) -> Forms:
    """The defaults of a tensor-parallel step (never tuned: each rank would time its own candidates): `forms` with
    W8A16's layer GEMVs in TP_FP8_GEMV on sm_90+; fp16 and sm_89 unchanged."""
    if fmt == "fp8" and cc >= 90:
        g = GemvForm.parse(TP_FP8_GEMV)
        return replace(forms, gemv=g, gemv_split=g)
    return forms


def candidates(fmt: str, cc: int, short_capacity: int) -> tuple[list[GemvForm], list[bool]]:
    """What `tune` times: every GEMV form (ws, ws-pre<N> of WS_PRE_TRY, ws with o_proj's count of WO_PRE_TRY, ring)
    at every L2_TAILS size on sm_90+, the ring alone before; with and without the short bucket where it fits."""
    if cc < 90:
        gemv = [GemvForm()]
    else:
        bases = [GemvForm(True), *(GemvForm(True, n) for n in WS_PRE_TRY[fmt]),
                 *(GemvForm(True, wo_pre=n) for n in WO_PRE_TRY[fmt]), GemvForm(False)]
        gemv = [replace(b, l2_tail_mb=t) for b in bases for t in L2_TAILS]
    return gemv, ([True, False] if short_capacity else [False])


def from_env() -> Forms | None:
    """ATOMFLOW_FORMS, for experts (the CLI's --forms wins)."""
    text = envs.ATOMFLOW_FORMS
    return Forms.parse(text) if text else None
