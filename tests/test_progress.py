"""Progress on long work (CPU): `validate --backend numpy` (a second a position on a 1B model), the peers' torch.compile
(half a minute) and a wheel's download (tens of MB) say what they are doing on stderr while they run; stdout keeps
only the output."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from atomflow_bench.errors import FetchError
from atomflow_bench.store import wheels


def test_validate_numpy_shows_its_positions(tiny_llama_dir, tmp_path):
    argv = [sys.executable, "-m", "atomflow_bench.cli", "validate", str(tiny_llama_dir), "--backend", "numpy",
            "--weights", "fp16", "--steps", "3", "--prompt", "w5 w17 w42", "--truth", str(tmp_path / "truth"),
            "--format", "json"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, ATOMFLOW_HOME=str(tmp_path / "home"), PYTHONPATH=os.getcwd()))
    assert p.returncode == 0, p.stderr
    assert "NumPy reference: positions" in p.stderr and "6/6" in p.stderr, p.stderr  # 4 prompt ids + 3 steps - 1
    assert "positions" not in p.stdout


def test_a_wheel_download_shows_it_is_running(tmp_path, monkeypatch, capsys):
    def slow_pip(cmd, **kw):
        time.sleep(0.2)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for nosuch==1.0")

    monkeypatch.setattr(wheels.subprocess, "run", slow_pip)
    with pytest.raises(FetchError, match="No matching distribution"):
        wheels._pip_download("nosuch==1.0", tmp_path)
    err = capsys.readouterr().err
    assert "pip download nosuch==1.0" in err, err


def test_the_peers_compile_shows_it_is_running(tiny_llama_dir, monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from atomflow_bench.measure.peers import measure_peers

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # the step uncompiled: the test is the line, not inductor
    recs = measure_peers(tiny_llama_dir, context=4, tokens=2, modes=("compiled",), device="cpu", repeats=1,
                         warmup_steps=1)
    assert recs[0]["mode"] == "compiled"
    err = capsys.readouterr().err
    assert "torch.compile of HF's decode step (cpu)" in err, err
