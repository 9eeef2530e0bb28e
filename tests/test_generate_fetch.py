"""`generate` on a model not in the store (CPU, real processes): a large fetch is asked for in a terminal and refused in
one line elsewhere unless --yes, with nothing written; text from synthetic weights comes with a note saying so."""
from __future__ import annotations

import os
import pty
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_cli import invoke

from atomflow_bench.cli_setup import LARGE_FETCH, _agree_to_fetch
from atomflow_bench.errors import AtomflowError
from atomflow_bench.store import store

CMD = [sys.executable, "-m", "atomflow_bench.cli", "generate", "llama-3.2-1b", "--tokens", "2"]


def _env(home: Path) -> dict:
    return dict(os.environ, ATOMFLOW_HOME=str(home), PYTHONPATH=os.getcwd())


def _empty(home: Path) -> bool:
    return not home.exists() or not any(home.rglob("*"))


def test_a_script_is_refused_without_yes(tmp_path):
    home = tmp_path / "home"
    p = subprocess.run(CMD, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=_env(home), timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert lines[0].startswith("error: llama-3.2-1b is not in the store; fetching it (synthetic) writes about 2.")
    assert "pass --yes" in lines[0]
    assert _empty(home), "something was fetched before the refusal"


def _read_until(fd, want: bytes, timeout: float) -> bytes:
    got, end = b"", time.monotonic() + timeout
    while want not in got and time.monotonic() < end:
        if select.select([fd], [], [], 0.5)[0]:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            got += chunk
    return got


def test_a_terminal_is_asked_and_no_fetches_nothing(tmp_path):
    home = tmp_path / "home"
    master, slave = pty.openpty()
    p = subprocess.Popen(CMD, stdin=slave, stdout=slave, stderr=slave, env=_env(home))
    os.close(slave)
    try:
        asked = _read_until(master, b"Fetch it now?", 120)
        assert b"Fetch it now?" in asked and b"about 2." in asked, asked
        os.write(master, b"n\n")
        rest = _read_until(master, b"not fetched", 60)
        assert p.wait(timeout=60) == 1
        assert b"llama-3.2-1b: not fetched" in rest and b"error:" in rest, rest
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(master)
    assert _empty(home)


def test_yes_and_small_fetches_are_not_asked():
    _agree_to_fetch("llama-3.2-1b", "synthetic", 5 * LARGE_FETCH, yes=True)
    _agree_to_fetch("smollm2-135m", "pypi-gguf", LARGE_FETCH // 4, yes=False)
    with pytest.raises(AtomflowError, match="an unknown size: pass --yes"):
        _agree_to_fetch("org/model", "hf", None, yes=False)  # the tests' stdin is not a terminal


def test_synthetic_weights_are_named(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    monkeypatch.setenv("ATOMFLOW_HOME", str(home))
    entry = store.models_dir() / "tiny-synthetic"
    shutil.copytree(tiny_llama_dir, entry)
    store.write_manifest(entry, "tiny-synthetic", {"kind": "synthetic", "seed": 0})
    code, out, err = invoke(capsys, "generate", "tiny-synthetic", "--prompt", "w5 w17", "--tokens", "2")
    assert code == 0, err
    assert "note: tiny-synthetic has synthetic weights" in err and "not a language model's" in err
    code, out, err = invoke(capsys, "generate", tiny_llama_dir, "--prompt", "w5 w17", "--tokens", "2")
    assert code == 0 and "synthetic" not in err, err
