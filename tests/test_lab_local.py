"""atomflow_bench/lab/local.py (CPU): the lab's `name/tpN` model spec is refused in one line when it names no catalog
model or no rank count, before anything touches a GPU."""
import pytest

from atomflow_bench.errors import AtomflowError
from atomflow_bench.lab.local import lab_engine


@pytest.mark.parametrize("spec", ["llama-9b/tp4", "llama-3.1-70b/tpx", "llama-3.1-70b/tp0", "llama-3.1-70b/tp"])
def test_bad_rank_spec_is_refused(spec):
    with pytest.raises(AtomflowError, match=r"<catalog model>/tp<N>") as e:
        lab_engine(spec, "fp8", 16)
    assert "\n" not in str(e.value)
