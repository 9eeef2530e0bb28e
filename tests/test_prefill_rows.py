"""The prefill row kernels' launch factories (gpu/ops/prefill_rows.py) refuse the shapes their vector loads cannot
read, before any kernel is fetched (the kernels themselves are checked against NumPy in test_prefill_gpu.py)."""
from __future__ import annotations

import numpy as np
import pytest

from atomflow_bench.errors import AtomflowError
from atomflow_bench.gpu.ops.prefill_rows import SWIGLU_VEC, rmsnorm_rows_launch, rope_kv_rows_launch, swiglu_rows_launch


class NoKernels:
    def __getitem__(self, name):
        raise AssertionError(f"kernel {name} fetched for a shape it cannot read")


class Kernels:
    def __getitem__(self, name):
        return name


@pytest.mark.parametrize("H", [258, 16388])
def test_rmsnorm_rows_needs_a_multiple_of_4_a_thread_holds(H):
    """A row is held in registers, 4 or 16 float4s a thread (the fewer that hold it): a multiple of 4 up to 16384
    (405B's hidden size)."""
    with pytest.raises(AtomflowError, match=f"hidden size {H} must be a multiple of 4 and at most 16384"):
        rmsnorm_rows_launch(NoKernels(), None, np.zeros(H, np.float16), None, 3, 1e-5)
    for ok, kernel in ((256, "rmsnorm_rows_4"), (4096, "rmsnorm_rows_4"), (4100, "rmsnorm_rows_16"),
                       (16384, "rmsnorm_rows_16")):
        ln = rmsnorm_rows_launch(Kernels(), None, np.zeros(ok, np.float16), None, 3, 1e-5)
        assert ln.fn == kernel and ln.grid == (3,) and ln.bytes_moved == 3 * ok * 6


def test_rope_kv_rows_needs_head_dim_a_multiple_of_4():
    with pytest.raises(AtomflowError, match="head_dim 66 is not a multiple of 4"):
        rope_kv_rows_launch(NoKernels(), None, None, None, None, 4, 2, 66, 0, 3)
    ln = rope_kv_rows_launch(Kernels(), None, None, None, None, 4, 2, 64, 0, 3)
    assert ln.grid == (3,)


def test_swiglu_rows_needs_a_multiple_of_the_vector():
    with pytest.raises(AtomflowError, match=f"intermediate size 700 is not a multiple of {SWIGLU_VEC}"):
        swiglu_rows_launch(NoKernels(), None, np.zeros((2, 700), np.float16), 2)
    ln = swiglu_rows_launch(Kernels(), None, np.zeros((2, 4104), np.float16), 2)
    assert ln.grid == (3, 2) and ln.bytes_moved == 2 * 4104 * 6  # 513 threads of 8: three blocks of 256
