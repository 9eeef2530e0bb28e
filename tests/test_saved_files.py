"""Files the package saves for later (a tune, a cached HF truth) and writes for the user (store, records): a corrupt
or truncated one is reported in one line, ignored and made again; two processes writing one file at once leave a
whole file; the files follow the umask.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from atomflow_bench.validate import truth

ROOT = Path(__file__).resolve().parents[1]


def _warnings(err: str, needle: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning:") and needle in line]


# ---- a saved tune ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncated", "garbage", "no forms"])
def test_a_corrupt_saved_tune_is_reported_ignored_and_made_again(tmp_path, monkeypatch, capsys, damage):
    from atomflow_bench.gpu.forms import Forms
    from atomflow_bench.measure import tune
    from test_forms import _Engine

    monkeypatch.setenv("ATOMFLOW_HOME", str(tmp_path))
    monkeypatch.delenv("ATOMFLOW_FORMS", raising=False)
    eng, forms = _Engine(), Forms.parse("short:ring/l2=8;split:ring/l2=0")
    p = tune.save(eng, forms, {"lengths": [192]})
    text = p.read_text()
    p.write_text({"truncated": text[: len(text) // 2], "garbage": "\x00\x01 not json",
                  "no forms": json.dumps({"schema": tune.SCHEMA})}[damage])
    capsys.readouterr()
    assert tune.load(eng) is None
    err = capsys.readouterr().err
    assert len(_warnings(err, str(p))) == 1 and err.count("\n") == 1, err
    monkeypatch.setattr(tune, "tune", lambda engine, progress=None: (forms, {"lengths": [192]}))
    assert tune.resolve(eng)["origin"] == "tuned now"  # `run` tunes again and saves over it
    capsys.readouterr()
    assert tune.load(eng) == (forms, p) and capsys.readouterr().err == ""


WRITER = """
import sys
from pathlib import Path
from atomflow_bench.store.store import write_json_atomic
path, tag = Path(sys.argv[1]), sys.argv[2]
for i in range(300):
    write_json_atomic(path, {"writer": tag, "i": i, "pad": "x" * 200000})
"""


def test_two_writers_of_one_file_leave_a_whole_file(tmp_path):
    """Two processes saving one file (two `run`s tuning the same key, two `validate`s making one truth) at once: a
    reader meanwhile sees a whole file from one of them, never a mix or a truncated one."""
    path = tmp_path / "max_seq-384.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), tag], env=env) for tag in "ab"]
    seen = set()
    while any(p.poll() is None for p in procs):
        try:
            obj = json.loads(path.read_text())
        except FileNotFoundError:
            continue
        assert obj["pad"] == "x" * 200000
        seen.add(obj["writer"])
    assert [p.wait() for p in procs] == [0, 0]
    assert json.loads(path.read_text())["i"] == 299
    assert [n for n in os.listdir(tmp_path) if n != path.name] == []  # no temporary file left


# ---- a cached truth ----------------------------------------------------------------------------------------
def _validate(home: Path, model: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "ATOMFLOW_HOME": str(home), "COLUMNS": "200", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "atomflow_bench.cli", "validate", str(model), "--weights", "fp16",
                           "--backend", "numpy", "--prompt", "w9 w10", "--steps", "3"],
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("damage", ["truth.json truncated", "truth.safetensors truncated", "truth.json no steps"])
def test_a_corrupt_cached_truth_is_reported_ignored_and_made_again(tiny_llama_dir, tmp_path, damage):
    pytest.importorskip("transformers")
    home = tmp_path / "home"
    r = _validate(home, tiny_llama_dir)
    assert r.returncode == 0 and "ground truth written to" in r.stdout, r.stdout + r.stderr
    [made] = list((home / "truth").iterdir())
    name = damage.split()[0]
    f = made / name
    if damage.endswith("truncated"):
        os.truncate(f, f.stat().st_size // 2)
    else:
        f.write_text(json.dumps({k: v for k, v in json.loads(f.read_text()).items() if k != "steps"}))
    r = _validate(home, tiny_llama_dir)
    assert r.returncode == 0 and "ground truth written to" in r.stdout, r.stdout + r.stderr
    assert len(_warnings(r.stderr, "cached ground truth unreadable")) == 1, r.stderr
    assert truth.Truth(made).manifest["steps"] == 3
    r = _validate(home, tiny_llama_dir)
    assert r.returncode == 0 and "reusing" in r.stdout and "warning" not in r.stderr, r.stdout + r.stderr


def test_two_validates_make_one_truth_at_once(tiny_llama_dir, tmp_path):
    pytest.importorskip("transformers")
    home = tmp_path / "home"
    env = {**os.environ, "ATOMFLOW_HOME": str(home), "COLUMNS": "200", "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "atomflow_bench.cli", "validate", str(tiny_llama_dir), "--weights", "fp16",
            "--backend", "numpy", "--prompt", "w9 w10", "--steps", "3"]
    procs = [subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: os.umask(0o022)) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    [made] = list((home / "truth").iterdir())
    assert sorted(os.listdir(made)) == ["truth.json", "truth.safetensors"]
    assert [oct(p.stat().st_mode & 0o777) for p in sorted(made.iterdir())] == ["0o644", "0o644"]  # the umask
    t = truth.Truth(made)
    assert t.get("fp16", 0, "embed").size > 0


# ---- the umask -------------------------------------------------------------------------------------------
UMASK_WRITER = """
import sys
from pathlib import Path
from atomflow_bench.measure import sweep
from atomflow_bench.store.store import write_json_atomic
out = Path(sys.argv[1])
write_json_atomic(out / "record.json", {"a": 1})
sweep.write_text_atomic(out / "sweep.md", "# x\\n")
"""


@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_store_and_result_files_follow_the_umask(tmp_path, umask, file_mode, dir_mode):
    """A fetched model (every file and its directory, the manifest included) and a record follow the umask, as
    files that `open` makes do; nothing is forced to 0600 or to 0644."""
    from test_user_errors import _model

    src = _model(tmp_path / "src" / "tiny", tokenizer=True)
    home, out = tmp_path / "home", tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "ATOMFLOW_HOME": str(home), "PYTHONPATH": str(ROOT)}
    for args in (["-m", "atomflow_bench.cli", "fetch", str(src)], ["-c", UMASK_WRITER, str(out)]):
        r = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=120,
                           preexec_fn=lambda: os.umask(umask))
        assert r.returncode == 0, r.stderr
    entry = home / "models" / "local--tiny"
    files = sorted(entry.iterdir()) + sorted(out.iterdir())
    assert {p.name for p in files} >= {"manifest.json", "tokenizer.json", "model.safetensors", "record.json",
                                       "sweep.md"}
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: oct(file_mode) for p in files}
    assert oct(entry.stat().st_mode & 0o777) == oct(dir_mode)


# ---- where ATOMFLOW_HOME points -------------------------------------------------------------------------------
def _doctor_disk(env: dict) -> dict:
    r = subprocess.run([sys.executable, "-m", "atomflow_bench.cli", "doctor", "--no-bandwidth", "--format", "json"],
                       env=env, capture_output=True, text=True, timeout=120)
    return {row["check"]: row for row in json.loads(r.stdout)}["disk"]


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_doctor_fails_the_disk_when_atomflow_home_is_a_file(tmp_path, where):
    f = tmp_path / "home"
    f.write_text("not a directory\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "ATOMFLOW_HOME": str(f if where == "a file" else f / "sub")}
    disk = _doctor_disk(env)
    assert disk["status"] == "FAIL" and f"{f} is not a directory" in disk["detail"], disk


def test_a_tilde_in_atomflow_home_is_the_home_directory(tmp_path):
    """`ATOMFLOW_HOME="~/x"` (quoted, so no shell expands it) is $HOME/x: doctor checks it, fetch stores there."""
    from test_user_errors import _model

    user = tmp_path / "user"
    user.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(user), "ATOMFLOW_HOME": "~/x"}
    disk = _doctor_disk(env)
    assert f"under {user / 'x'}" in disk["detail"] and "not a directory" not in disk["detail"], disk
    r = subprocess.run([sys.executable, "-m", "atomflow_bench.cli", "fetch", str(_model(tmp_path / "tiny"))],
                       env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (user / "x" / "models" / "local--tiny" / "manifest.json").is_file()
    assert not (tmp_path / "~").exists()
