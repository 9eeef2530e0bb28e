"""The store after a writer dies and when two writers meet: a fetch killed with SIGKILL leaves its staging directory,
which `models` reports and the next `fetch` removes (never a running writer's); `rm` removes a model; two local
directories of one name do not share a store entry; weights that are not float, or bf16 out of fp16's range, are
refused; a corrupt saved tune or cached truth is rebuilt; files follow the umask.

Real processes throughout: the CLI in a subprocess, a writer killed mid-write, two writers at once.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from atomflow_bench.store import store
from atomflow_bench.store.listing import dir_bytes
from test_user_errors import _cli, _listdir, _model, _no_partial, _one_line_error, _wait_for

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOMFLOW_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _popen(home: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "ATOMFLOW_HOME": str(home), "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    return subprocess.Popen([sys.executable, "-m", "atomflow_bench.cli", *args], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _partials(home: Path) -> list[str]:
    return [n for n in _listdir(home / "models") if ".partial-" in n]


# ---- a writer killed mid-write ---------------------------------------------------------------------------
def test_sigkilled_fetch_is_reported_then_removed(home, tmp_path):
    """SIGKILL cannot be caught: the staging directory stays. `models` names it (one note on stderr, its size) and
    the next `fetch`, of any model, removes it."""
    p = _popen(home, "fetch", "llama-3.2-1b", "--source", "synthetic")
    _wait_for(lambda: any(dir_bytes(home / "models" / n) > 8 << 20 for n in _partials(home)), p)
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=60)
    [left] = _partials(home)
    assert dir_bytes(home / "models" / left) > 8 << 20

    r = _cli(home, "models")
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stderr.splitlines() if left in line]
    assert len(notes) == 1 and f"pid {p.pid}" in notes[0] and "MiB" in notes[0], r.stderr
    assert _partials(home) == [left]  # listing removes nothing

    r = _cli(home, "fetch", str(_model(tmp_path / "src" / "tiny")))
    assert r.returncode == 0, r.stderr
    assert _partials(home) == []
    assert [line for line in r.stderr.splitlines() if left in line], r.stderr
    r = _cli(home, "models")
    assert r.returncode == 0 and ".partial-" not in r.stderr, r.stderr


def test_a_running_writers_directory_is_never_removed(home, tmp_path):
    """A staging directory whose writer still runs (here: a sleeping process's pid) is neither removed nor reported,
    and a name without a pid (its writer cannot be checked) is reported but kept."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        live = home / "models" / f".big.partial-{store._HOST}-{sleeper.pid}-abcd1234"
        unknown = home / "models" / ".old-style.partial-q1w2e3r4"
        for d in (live, unknown):
            d.mkdir(parents=True)
            (d / "model.safetensors").write_bytes(b"\0" * 4096)
        r = _cli(home, "fetch", str(_model(tmp_path / "src" / "tiny")))
        assert r.returncode == 0, r.stderr
        assert live.is_dir() and unknown.is_dir()
        r = _cli(home, "models")
        assert r.returncode == 0 and live.name not in r.stderr, r.stderr
        assert len([line for line in r.stderr.splitlines() if unknown.name in line]) == 1, r.stderr
    finally:
        sleeper.kill()
        sleeper.wait()
    r = _cli(home, "fetch", "local--tiny")  # its writer is gone now
    assert r.returncode == 0 and not live.exists() and unknown.is_dir(), r.stderr


# ---- rm ----------------------------------------------------------------------------------------------------
def test_rm_removes_a_model_and_reclaims_its_space(home, tmp_path):
    r = _cli(home, "fetch", str(_model(tmp_path / "src" / "tiny")))
    assert r.returncode == 0, r.stderr
    entry = home / "models" / "local--tiny"
    assert dir_bytes(entry) > 0

    r = _cli(home, "rm", "local--tiny")  # stdin is not a terminal: no way to confirm
    _one_line_error(r.returncode, r.stdout, r.stderr, "--yes")
    assert entry.is_dir()

    r = _cli(home, "rm", "local--tiny", "--yes")
    assert r.returncode == 0 and "removed" in r.stdout and r.stderr == "", r.stdout + r.stderr
    assert not entry.exists()
    _no_partial(home)
    r = _cli(home, "models")
    assert "local--tiny" not in r.stdout

    for name in ("local--tiny", "nosuch", "../home", ".", "llama-3.2-1b"):
        r = _cli(home, "rm", name, "--yes")
        _one_line_error(r.returncode, r.stdout, r.stderr, "not in the store")
    assert (home / "models").is_dir()


def test_rm_asks_in_a_terminal(home, tmp_path):
    """In a terminal `rm` asks; anything but yes keeps the model."""
    import pty

    assert _cli(home, "fetch", str(_model(tmp_path / "src" / "tiny"))).returncode == 0
    entry = home / "models" / "local--tiny"
    for answer, kept in ((b"n\n", True), (b"y\n", False)):
        pid, fd = pty.fork()
        if pid == 0:
            os.environ.update(ATOMFLOW_HOME=str(home), PYTHONPATH=str(ROOT))
            os.execv(sys.executable, [sys.executable, "-m", "atomflow_bench.cli", "rm", "local--tiny"])
        out = b""
        deadline = time.monotonic() + 60
        while b"?" not in out and time.monotonic() < deadline:
            out += os.read(fd, 4096)
        os.write(fd, answer)
        with_rest = out
        try:
            while chunk := os.read(fd, 4096):
                with_rest += chunk
        except OSError:
            pass
        _, status = os.waitpid(pid, 0)
        os.close(fd)
        assert (os.waitstatus_to_exitcode(status) != 0) == kept, with_rest
        assert entry.is_dir() == kept, with_rest


# ---- two sources, one base name ------------------------------------------------------------------------
def test_two_local_directories_of_one_name_do_not_share_an_entry(home, tmp_path):
    """`fetch /a/tiny; fetch /b/tiny`: the second is refused in one line and the first stays; --force replaces it."""
    from atomflow_bench.store.listing import manifest_source

    a, b = _model(tmp_path / "a" / "tiny"), _model(tmp_path / "b" / "tiny")
    (b / "config.json").write_text((b / "config.json").read_text().replace("\n", " \n"))  # other bytes
    assert _cli(home, "fetch", str(a)).returncode == 0
    entry = home / "models" / "local--tiny"
    r = _cli(home, "fetch", str(b))
    _one_line_error(r.returncode, r.stdout, r.stderr, "local--tiny", str(a.resolve()), "--force")
    assert manifest_source(entry) == ("local", str(a.resolve()))
    assert store.verify_dir(entry) == [] and (entry / "config.json").read_bytes() == (a / "config.json").read_bytes()
    _no_partial(home)
    assert _cli(home, "fetch", str(a)).returncode == 0  # the same directory again: already there
    r = _cli(home, "fetch", str(b), "--force")
    assert r.returncode == 0, r.stderr
    assert manifest_source(entry) == ("local", str(b.resolve()))


# ---- weights the store cannot hold as they are ---------------------------------------------------------
def _rewrite(directory: Path, dtype: str, convert) -> dict:
    """Rewrite model.safetensors with every 2-D tensor as `dtype` (raw bits from `convert(fp16 array)`); returns
    the fp16 tensors it started from."""
    import json
    import struct

    from safetensors.numpy import load_file

    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        data = convert(t).tobytes() if t.ndim == 2 else t.tobytes()
        header[name] = {"dtype": dtype if t.ndim == 2 else "F16", "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    return tensors


def _bf16_bits(t):
    import numpy as np

    return (t.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def test_integer_weights_are_refused(home, tmp_path):
    import numpy as np

    src = _model(tmp_path / "src" / "ints")
    _rewrite(src, "I16", lambda t: np.round(t.astype(np.float32) * 100).astype(np.int16))
    r = _cli(home, "fetch", str(src))
    _one_line_error(r.returncode, r.stdout, r.stderr, "I16", "not floating point")
    _no_partial(home, "local--ints")


def test_bf16_is_stored_as_fp16(home, tmp_path):
    import numpy as np
    from safetensors.numpy import load_file

    src = _model(tmp_path / "src" / "bf")
    before = _rewrite(src, "BF16", _bf16_bits)
    r = _cli(home, "fetch", str(src))
    assert r.returncode == 0, r.stderr
    entry = home / "models" / "local--bf"
    after = load_file(str(entry / "model.safetensors"))
    for name, t in before.items():
        want = (_bf16_bits(t).astype(np.uint32) << 16).view(np.float32) if t.ndim == 2 else t
        assert after[name].dtype == np.float16 and np.array_equal(after[name], want.astype(np.float16)), name
    assert _cli(home, "fetch", "local--bf", "--verify").returncode == 0


def test_bf16_beyond_fp16_range_is_refused(home, tmp_path):
    import numpy as np

    src = _model(tmp_path / "src" / "big")

    def with_a_big_value(t):
        bits = _bf16_bits(t)
        bits.flat[5] = _bf16_bits(np.array([1e5], np.float32))[0]
        return bits

    _rewrite(src, "BF16", with_a_big_value)
    r = _cli(home, "fetch", str(src))
    _one_line_error(r.returncode, r.stdout, r.stderr, "bf16", "fp16", "[0, 5]")
    _no_partial(home, "local--big")


def test_bf16_conversion_leaves_a_linked_file_alone(tmp_path):
    """A file hard-linked from the HF cache is replaced in the store, not changed in the cache."""
    from atomflow_bench.store.dtypes import to_fp16

    src = _model(tmp_path / "m")
    _rewrite(src, "BF16", _bf16_bits)
    (tmp_path / "cache").mkdir()
    os.link(src / "model.safetensors", tmp_path / "cache" / "blob")
    cached = (tmp_path / "cache" / "blob").read_bytes()
    assert to_fp16(src) == ["model.safetensors"]
    assert (tmp_path / "cache" / "blob").read_bytes() == cached != (src / "model.safetensors").read_bytes()
