"""HF transformers' API where the releases the optional extras allow (pyproject: transformers>=4.45) differ, and its
chatter kept out of our output. Every function takes the modules or objects it works on: torch and transformers are
imported only where a command needs them (measure/peers.py, validate/truth.py)."""
from __future__ import annotations

import inspect
import warnings
from contextlib import contextmanager


def cache_keyword(model) -> str:
    """The name under which `model`'s forward takes its KV cache (and its output returns it): `cache` where the
    forward declares it (the other name is then deprecated and warns on every call), else `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def dtype_keyword(transformers) -> str:
    """`from_pretrained`'s keyword for the weights' dtype: `dtype` from transformers 5, `torch_dtype` before."""
    return "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"


@contextmanager
def quiet(transformers):
    """transformers' log lines (below errors) and the FutureWarning / UserWarning / DeprecationWarning raised inside
    it, off for the block: `validate` prints its own lines only. The verbosity and the warning filters are restored
    after it."""
    log = transformers.utils.logging
    level = log.get_verbosity()
    log.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            for category in (FutureWarning, UserWarning, DeprecationWarning):
                warnings.simplefilter("ignore", category)
            yield
    finally:
        log.set_verbosity(level)
