"""No GPU, no pretending (CPU): the GPU commands say why there is no usable GPU in one line, exit 3, and fetch or write
nothing first; every error is one line unless --debug; the exit codes of `main`."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from atomflow_bench.cli import EXIT_INTERNAL, EXIT_NO_GPU, main
from atomflow_bench.gpu.device import gpu_problem

NO_GPU = gpu_problem()
needs_no_gpu = pytest.mark.skipif(NO_GPU is None, reason="this machine has a usable GPU")


def cli(args, home: Path, capsys) -> tuple[int, str, str]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATOMFLOW_HOME", str(home))
        try:
            main(args)
            code = 0
        except SystemExit as e:
            code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@needs_no_gpu
@pytest.mark.parametrize("args", [
    ["run"], ["run", "llama-3.2-1b", "--json", "OUT.json"], ["run", "llama-3.2-1b", "--tokens", "8", "--ctx", "4"],
    ["profile"], ["gemv", "llama-3.2-1b"], ["tune", "llama-3.2-1b"],
    ["generate", "llama-3.2-1b", "--backend", "gpu"], ["validate", "llama-3.2-1b"]],
    ids=["run", "run-json", "run-options", "profile", "gemv", "tune", "generate-gpu", "validate"])
def test_gpu_commands_refuse_before_fetching(args, tmp_path, capsys):
    home = tmp_path / "home"
    args = [a.replace("OUT.json", str(tmp_path / "out.json")) for a in args]
    code, out, err = cli(args, home, capsys)
    assert code == EXIT_NO_GPU
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0] == f"error: {NO_GPU}", err
    assert "Traceback" not in err and out == ""
    assert not home.exists() or not any(home.rglob("*")), "something was fetched or written before the refusal"
    assert not (tmp_path / "out.json").exists()


@needs_no_gpu
def test_the_cause_is_named(monkeypatch):
    """Each cause in its own words: no driver; CuPy missing (naming the extra); a CUDA major mismatch; no device."""
    import atomflow_bench.gpu.device as dev

    monkeypatch.setattr(dev, "driver_cuda_version", lambda: None)
    assert dev.gpu_problem().startswith("no NVIDIA driver (libcuda.so.1 not found)")
    monkeypatch.setattr(dev, "driver_cuda_version", lambda: 12040)
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    assert dev.gpu_problem() == ("CuPy is not installed: pip install 'atomflow-bench[cuda12]' (the driver supports "
                                 "CUDA 12.4)")

    class Runtime:
        def __init__(self, version, count=1, error=None):
            self.version, self.count, self.error = version, count, error

        def runtimeGetVersion(self):
            return self.version

        def getDeviceCount(self):
            if self.error:
                raise RuntimeError(self.error)
            return self.count

    fake = type("cupy", (), {"__version__": "14.2.0"})
    fake.cuda = type("cuda", (), {})
    fake.cuda.runtime = Runtime(13000)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert dev.gpu_problem().startswith("CUDA major mismatch: the driver supports CUDA 12.4, CuPy 14.2.0 was built "
                                        "for CUDA 13: install cupy-cuda12x")
    fake.cuda.runtime = Runtime(12040, count=0)
    assert dev.gpu_problem() == "no CUDA device visible (check CUDA_VISIBLE_DEVICES)"
    fake.cuda.runtime = Runtime(12040, error="cudaErrorNoDevice: no CUDA-capable device is detected\nmore")
    assert dev.gpu_problem() == ("the CUDA driver reports no usable device (cudaErrorNoDevice: no CUDA-capable device "
                                 "is detected)")
    fake.cuda.runtime = Runtime(12040, count=2)
    assert dev.gpu_problem() is None


@needs_no_gpu
def test_doctor_names_what_is_missing_and_exits_3(tmp_path, capsys):
    code, out, err = cli(["doctor", "--no-bandwidth", "--format", "json"], tmp_path / "home", capsys)
    assert code == EXIT_NO_GPU
    rows = {r["check"]: r for r in json.loads(out)}
    assert rows["NVIDIA driver"]["status"] == "FAIL" and rows["atomflow-bench"]["status"] == "ok"
    assert {"CuPy", "disk", "nvcc"} <= set(rows)


def test_an_internal_error_is_one_line_and_debug_shows_the_traceback(tmp_path, monkeypatch, capsys):
    import atomflow_bench.cli as cli_mod

    def boom(*a, **k):
        raise ZeroDivisionError("division by zero\nsecond line")

    monkeypatch.setattr(cli_mod, "parse_forms", boom)  # `run --forms x` parses its forms first
    code, out, err = cli(["run", "--forms", "x"], tmp_path / "home", capsys)
    assert code == EXIT_INTERNAL
    assert err.strip().splitlines() == ["error: internal error (ZeroDivisionError: division by zero second line); "
                                        "rerun with --debug for the traceback"]
    with pytest.raises(ZeroDivisionError):
        main(["run", "--forms", "x", "--debug"])


def test_bad_forms_are_one_line_exit_2(tmp_path, capsys):
    code, out, err = cli(["run", "--forms", "short:fast"], tmp_path / "home", capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "GEMV form 'fast'" in err


def test_os_errors_are_one_line(tmp_path, capsys):
    """An OSError escaping a command (here: validate's --json into a missing directory's file is refused by click,
    so use compare's own gate: a directory as a record) is one line with exit 1 or compare's 2, never a traceback."""
    code, out, err = cli(["compare", str(tmp_path), str(tmp_path)], tmp_path / "home", capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_console_script_exit_code_and_one_line(tmp_path):
    """The installed entry point (python -m atomflow_bench.cli, as `atomflow-bench` calls main) keeps the contract."""
    r = subprocess.run([sys.executable, "-m", "atomflow_bench.cli", "run", "--forms", "split:nope"],
                       capture_output=True, text=True, env={"ATOMFLOW_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
                       timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
