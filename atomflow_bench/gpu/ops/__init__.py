"""The ops of one decode step on one GPU, one module per .cu: its constants, plan, layout and launch factory, and the
kernels it launches (its KERNELS). `kernel_lib` is the product's KernelLib: it knows every kernel these modules
declare, so it compiles a file only when one of its kernels is first asked for."""
from __future__ import annotations

from pathlib import Path

from ..nvrtc import KERNELS_DIR, KernelLib
from . import attention, attention_prefill, gemv, lm_head, prefill_gemm, prefill_rows, small, untile


def declared_kernels() -> dict[str, tuple[str, ...]]:
    """{.cu file: its kernels} over every op module's KERNELS: what the one-GPU step launches and where it is defined.
    The tensor-parallel wing declares its own (`KernelLib.declare`)."""
    out: dict[str, tuple[str, ...]] = {}
    for mod in (attention, attention_prefill, gemv, lm_head, prefill_gemm, prefill_rows, small, untile):
        for cu, names in mod.KERNELS.items():
            out[cu] = out.get(cu, ()) + tuple(names)
    return out


def kernel_lib(kernels_dir: Path | None = None, extra_defines: tuple = ()) -> KernelLib:
    """The product's kernels (kernels_cu/, or `kernels_dir`), built with the extra -D's `extra_defines`."""
    return KernelLib(declared_kernels(), kernels_dir or KERNELS_DIR, extra_defines)
