"""One line per user error: every mistake a user can make with `fetch` (and what follows it) ends in exactly one
line on stderr, a non-zero exit and no traceback, and leaves nothing half-written in the store.

Each test runs the real CLI on a tiny model it builds: `python -m atomflow_bench.cli` in a subprocess, or
`cli.main()` in-process where a failure has to be injected with monkeypatch (a full disk, a failed rename).
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from atomflow_bench.store import store
from atomflow_bench.config import ModelConfig
from atomflow_bench.store.sources.synthetic import make_synthetic

ROOT = Path(__file__).resolve().parents[1]
TINY = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOMFLOW_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _model(directory: Path, tokenizer: bool = False, **config) -> Path:
    """A tiny synthetic Llama in HF layout; `config` overrides fields of its config.json as written."""
    make_synthetic(TINY, directory, seed=3)
    if config:
        (directory / "config.json").write_text(json.dumps({**TINY.to_hf_dict(), **config}))
    if tokenizer:
        from helpers_hf import _tiny_tokenizer

        _tiny_tokenizer(TINY.vocab_size).save(str(directory / "tokenizer.json"))
    return directory


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ATOMFLOW_HOME": str(home), "COLUMNS": "200",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", "atomflow_bench.cli", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def _main(capsys, *args: str) -> tuple[int, str, str]:
    """`atomflow-bench ARGS` in this process (the console-script entry point): (exit code, stdout, stderr)."""
    from atomflow_bench.cli import main

    try:
        rc = main(list(args))
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line_error(rc: int, out: str, err: str, *needles: str) -> None:
    assert rc not in (0, None), out + err
    assert "Traceback" not in out + err, err
    assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err


def _no_partial(home: Path, name: str | None = None) -> None:
    """Nothing half-written: no staging/old directory in the store, and no directory for the failed model."""
    models = home / "models"
    entries = os.listdir(models) if models.is_dir() else []
    assert [n for n in entries if n.startswith(".")] == []
    if name is not None:
        assert name not in entries


def _refused(home: Path, src: Path, *needles: str) -> None:
    r = _cli(home, "fetch", str(src))
    _one_line_error(r.returncode, r.stdout, r.stderr, *needles)
    _no_partial(home, f"local--{src.name}")


@contextlib.contextmanager
def _tmpfs(path: Path, options: str):
    """A tmpfs mounted at `path` (root only); skips the test where mounting is not permitted."""
    path.mkdir(parents=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True,
                           text=True)
    except FileNotFoundError:
        pytest.skip("no mount command")
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


# ---- unreadable files: one line, not a traceback -------------------------------------------------------
def test_truncated_safetensors(home, tmp_path):
    src = _model(tmp_path / "trunc")
    p = src / "model.safetensors"
    os.truncate(p, p.stat().st_size // 2)
    _refused(home, src, "model.safetensors: not a readable safetensors file")
    r = _cli(home, "generate", str(src))  # used in place, without fetch
    _one_line_error(r.returncode, r.stdout, r.stderr, "model.safetensors: not a readable safetensors file")


def test_garbage_safetensors(home, tmp_path):
    src = _model(tmp_path / "garbage")
    (src / "model.safetensors").write_bytes(np.random.default_rng(0).bytes(5000))
    _refused(home, src, "model.safetensors: not a readable safetensors file")


def test_truncated_gguf(home, tmp_path):
    import gguf

    g = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(g), "llama")
    w.add_block_count(1)
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    g.write_bytes(g.read_bytes()[:35])  # inside the first key: gguf's reader fails with an IndexError
    r = _cli(home, "fetch", str(g))
    _one_line_error(r.returncode, r.stdout, r.stderr, f"{g}: not a readable GGUF file, truncated or corrupt")
    _no_partial(home, "gguf--tiny")


# ---- the store's disk: read-only, full ------------------------------------------------------------------
def test_read_only_home(tmp_path):
    src = _model(tmp_path / "good")
    ro = tmp_path / "ro"
    with contextlib.ExitStack() as stack:
        if os.geteuid() == 0:  # root writes through permission bits: a read-only mount it is
            stack.enter_context(_tmpfs(ro, "ro,size=64k"))
        else:
            ro.mkdir()
            ro.chmod(0o555)
            stack.callback(ro.chmod, 0o755)
            if os.access(ro, os.W_OK):
                pytest.skip("this user writes through permission bits")
        r = _cli(ro, "fetch", str(src))
        _one_line_error(r.returncode, r.stdout, r.stderr, f"cannot write to the store {ro}", "ATOMFLOW_HOME")
        assert os.listdir(ro) == []


def test_full_disk_tmpfs(tmp_path):
    """A real ENOSPC: the store on a 64 KiB tmpfs, the model ~170 KB."""
    src = _model(tmp_path / "good")
    with _tmpfs(tmp_path / "full", "size=64k") as full:
        r = _cli(full, "fetch", str(src))
        _one_line_error(r.returncode, r.stdout, r.stderr, "no space left on the device holding", str(full))
        _no_partial(full, "local--good")


def test_full_disk_simulated(home, tmp_path, monkeypatch, capsys):
    """The same without mounting anything: the copy into the store writes half a file, then ENOSPC."""
    from atomflow_bench.store.sources import local

    src = _model(tmp_path / "good")

    def full_copy(a, b):
        Path(b).write_bytes(Path(a).read_bytes()[:1000])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(local.shutil, "copyfile", full_copy)
    rc, out, err = _main(capsys, "fetch", str(src))
    _one_line_error(rc, out, err, "no space left on the device holding", str(home))
    _no_partial(home, "local--good")


def test_too_little_space_refused_before_writing(tmp_path):
    """A synthetic model's size is known before anything is written: on a 64 KiB disk `fetch` refuses at once."""
    with _tmpfs(tmp_path / "small", "size=64k") as small:
        r = _cli(small, "fetch", "llama-3.2-1b", "--source", "synthetic")
        _one_line_error(r.returncode, r.stdout, r.stderr, "llama-3.2-1b: needs 2.5 GB on the disk holding",
                        "nothing was written")
        assert not (small / "models").exists() or os.listdir(small / "models") == []


def test_too_little_space_simulated(home, monkeypatch, capsys):
    """The same without mounting anything: the disk reports 1 GB free; fp16 and fp8 name their own sizes."""
    from atomflow_bench.store import fetch

    monkeypatch.setattr(fetch.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12 - 10**9, 10**9))
    rc, out, err = _main(capsys, "fetch", "llama-3.1-405b", "--source", "synthetic")
    _one_line_error(rc, out, err, "llama-3.1-405b: needs 811.7 GB", "1.0 GB free", "ATOMFLOW_HOME")
    rc, out, err = _main(capsys, "fetch", "llama-3.1-8b", "--source", "synthetic", "--weights", "fp8")
    _one_line_error(rc, out, err, "llama-3.1-8b: needs 23.3 GB")  # 16.06 GB fp16 + 7.20 GB fp8 codes and scales
    _no_partial(home)


def test_fp8_bytes_is_the_fp8_file(tmp_path):
    """ModelConfig.fp8_projection_bytes (what the space check asks for) is what write_fp8 writes, less the header."""
    from atomflow_bench.store.fetch import _safetensors_header, write_fp8

    path = write_fp8(_model(tmp_path / "m"))
    _, data_start = _safetensors_header(path)
    assert path.stat().st_size - data_start == TINY.fp8_projection_bytes() > 0


def test_sigterm_removes_what_it_was_writing(home):
    """`timeout` or a scheduler sends SIGTERM: `fetch` stops with one line and exit 143, nothing half-written."""
    env = {**os.environ, "ATOMFLOW_HOME": str(home), "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    p = subprocess.Popen([sys.executable, "-m", "atomflow_bench.cli", "fetch", "llama-3.2-1b", "--source", "synthetic"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: any(n.startswith(".llama-3.2-1b.partial-") for n in _listdir(home / "models")), p)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 143 and err == "terminated\n", (p.returncode, err)
    assert os.listdir(home / "models") == []


def test_sigterm_to_a_launcher_stops_its_ranks(home, tmp_path):
    """A tensor-parallel launcher that is terminated stops its ranks (a rank left running would hold its GPU). The
    ranks here run `fetch` (no GPU needed), long enough to outlive the check if nobody stopped them."""
    env = {**os.environ, "ATOMFLOW_HOME": str(home), "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    launcher = ("import signal, sys\n"
                "from atomflow_bench.errors import Terminated\n"
                "from atomflow_bench.gpu.tp.group import launch\n"
                "def stop(s, f): raise Terminated()\n"
                "signal.signal(signal.SIGTERM, stop)\n"
                "try:\n"
                "    launch(2, ['fetch', 'llama-3.1-8b', '--source', 'synthetic'], 2)\n"
                "except Terminated:\n"
                "    sys.exit(143)\n")
    p = subprocess.Popen([sys.executable, "-c", launcher], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)
    _wait_for(lambda: len(_ranks(home)) == 2, p)
    ranks = _ranks(home)
    try:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
        assert p.returncode == 143
        _wait_for(lambda: not any(_alive(r) for r in ranks), None, timeout=10)  # an 8B takes a minute to write
    finally:
        for r in filter(_alive, ranks):
            os.kill(r, signal.SIGKILL)


def _listdir(d: Path) -> list[str]:
    return os.listdir(d) if d.is_dir() else []


def _wait_for(cond, proc, timeout: float = 60) -> None:
    import time

    end = time.monotonic() + timeout
    while not cond():
        assert proc is None or proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def _ranks(home: Path) -> list[int]:
    """The pids of the rank processes (RANK set) whose ATOMFLOW_HOME is `home`."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"ATOMFLOW_HOME={home}".encode() in env and any(e.startswith(b"RANK=") for e in env):
            out.append(int(pid))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_failed_replace_keeps_the_stored_version(home, tmp_path, monkeypatch, capsys):
    """A re-fetch whose final rename fails leaves the previous version in place, not nothing."""
    src = _model(tmp_path / "good")
    assert _main(capsys, "fetch", str(src))[0] == 0
    path = home / "models" / "local--good"
    before = store.read_manifest(path)
    real = os.replace

    def failing(a, b):
        if Path(a).name.startswith(".local--good.partial-"):  # the staged directory onto the stored one
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(a))
        real(a, b)
    monkeypatch.setattr(store.os, "replace", failing)
    rc, out, err = _main(capsys, "fetch", str(src), "--force")
    _one_line_error(rc, out, err, "Input/output error")
    assert store.read_manifest(path) == before and store.verify_dir(path, full=True) == []
    _no_partial(home)


# ---- broken models that used to be fetched "ok" ---------------------------------------------------------
@pytest.mark.parametrize("value, word", [(np.nan, "a NaN"), (np.inf, "an inf"), (-np.inf, "an inf")])
def test_non_finite_weights(home, tmp_path, value, word):
    src = _model(tmp_path / "bad")
    t = load_file(src / "model.safetensors")
    t["model.layers.0.mlp.up_proj.weight"][3, 5] = value
    save_file(t, src / "model.safetensors")
    _refused(home, src, f"tensor 'model.layers.0.mlp.up_proj.weight' has {word} at [3, 5]")


def test_verify_refuses_non_finite_weights(home, tmp_path):
    """A store entry whose files match its manifest but whose weights are NaN (e.g. fetched by an older
    version): `fetch --verify` refuses it."""
    src = _model(tmp_path / "good")
    assert _cli(home, "fetch", str(src)).returncode == 0
    path = home / "models" / "local--good"
    t = load_file(path / "model.safetensors")
    t["model.norm.weight"][7] = np.nan
    (path / "model.safetensors").unlink()  # hard links: do not write through to anything else
    save_file(t, path / "model.safetensors")
    m = store.read_manifest(path)
    store.write_manifest(path, m["model"], m["source"])
    r = _cli(home, "fetch", "local--good", "--verify")
    _one_line_error(r.returncode, r.stdout, r.stderr, "tensor 'model.norm.weight' has a NaN at [7]")


@pytest.mark.parametrize("change, needle", [
    ({"vocab_size": 512}, "tensor 'model.embed_tokens.weight' has shape (300, 64), config.json says (512, 64)"),
    ({"intermediate_size": 128}, "tensor 'model.layers.0.mlp.gate_proj.weight' has shape (160, 64), "
                                 "config.json says (128, 64)"),
    ({"num_hidden_layers": 1, "layers": 2}, "tensor 'model.layers.1.input_layernorm.weight' is beyond "
                                            "config.json's num_hidden_layers = 1"),
])
def test_shapes_against_config(home, tmp_path, change, needle):
    """The config says one shape, the tensors another (here: vocab_size 512 against a 300-row embedding)."""
    layers = change.pop("layers", TINY.num_hidden_layers)
    src = tmp_path / "shapes"
    make_synthetic(dataclasses.replace(TINY, num_hidden_layers=layers), src, seed=3)
    (src / "config.json").write_text(json.dumps({**TINY.to_hf_dict(), **change}))
    _refused(home, src, needle)


@pytest.mark.parametrize("change, needle", [
    ({"max_position_embeddings": -5}, "field 'max_position_embeddings' must be a positive integer, got -5"),
    ({"initializer_range": float("inf")}, "field 'initializer_range' must be a positive finite number, got inf"),
    ({"rope_theta": float("inf")}, "field 'rope_theta' must be a positive finite number, got inf"),
    ({"head_dim": "16"}, "field 'head_dim' must be a positive integer, got '16'"),
    ({"rope_scaling": "llama3"}, "field 'rope_scaling' must be an object or null"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": "big"}}, "field 'rope_scaling.factor'"),
    ({"tie_word_embeddings": "false"}, "field 'tie_word_embeddings' must be true or false"),
    ({"eos_token_id": 300}, "field 'eos_token_id' = 300 is not a token id below vocab_size = 300"),
])
def test_nonsensical_config_values(home, tmp_path, change, needle):
    src = _model(tmp_path / "cfg", **change)
    _refused(home, src, "config.json: " + needle)


def test_no_tokenizer_is_one_warning(home, tmp_path):
    src = _model(tmp_path / "notok")
    r = _cli(home, "fetch", str(src))
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert r.stderr.startswith("warning: ") and r.stderr.count("\n") == 1, r.stderr
    assert "no tokenizer (tokenizer.json)" in r.stderr
    assert (home / "models" / "local--notok" / store.MANIFEST).is_file()


# ---- the name `fetch` reports works afterwards ----------------------------------------------------------
def test_reported_name_works_in_every_command(home, tmp_path):
    src = _model(tmp_path / "good", tokenizer=True)
    r = _cli(home, "fetch", str(src))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    path = Path(r.stdout.strip().splitlines()[-1].removeprefix("ok "))
    assert path == home / "models" / "local--good"
    name = path.name
    r = _cli(home, "generate", name, "--prompt", "w5 w6", "--tokens", "2")
    assert r.returncode == 0 and r.stderr.count("\n") == 1 and " new tokens in " in r.stderr, r.stderr  # its status
    assert r.stdout.startswith("w5 w6")
    r = _cli(home, "fetch", name, "--verify")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    r = _cli(home, "fetch", name)
    assert r.returncode == 0 and "already in the store" in r.stdout, r.stdout + r.stderr
    # and once its source is gone, the stored copy still serves
    shutil.rmtree(src)
    r = _cli(home, "generate", name, "--prompt", "w7", "--tokens", "1")
    assert r.returncode == 0 and r.stderr.count("\n") == 1 and r.stdout.startswith("w7"), r.stderr
    r = _cli(home, "generate", "local--nosuch")
    _one_line_error(r.returncode, r.stdout, r.stderr, "unknown model 'local--nosuch'")
