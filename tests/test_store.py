"""Store layout: the manifest catches damaged files; staging directories are all-or-nothing."""
import os

import pytest

from atomflow_bench.store import store
from atomflow_bench.errors import VerifyError


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model.safetensors").write_bytes(os.urandom(4096))
    store.write_manifest(d, "m", {"kind": "test"})
    return d


def test_fresh_manifest_verifies(model_dir):
    m = store.read_manifest(model_dir)
    assert set(m["files"]) == {"config.json", "model.safetensors"}
    assert m["source"] == {"kind": "test"}
    assert store.verify_dir(model_dir, full=True) == []


def test_flipped_byte_is_caught_by_full_check_only(model_dir):
    p = model_dir / "model.safetensors"
    data = bytearray(p.read_bytes())
    data[1000] ^= 0x01
    p.write_bytes(bytes(data))
    assert store.verify_dir(model_dir, full=False) == []  # same size: the cheap check cannot see it
    (problem,) = store.verify_dir(model_dir, full=True)
    assert problem.startswith("model.safetensors: sha256")


def test_truncated_and_missing_files(model_dir):
    with open(model_dir / "model.safetensors", "r+b") as f:
        f.truncate(100)
    (model_dir / "config.json").unlink()
    problems = store.verify_dir(model_dir, full=False)
    assert sorted(problems) == ["config.json: missing",
                                "model.safetensors: size 100 != manifest 4096 (truncated or replaced)"]


def test_no_manifest(tmp_path):
    with pytest.raises(VerifyError, match="no manifest"):
        store.verify_dir(tmp_path)


def test_staging_dir_failure_leaves_nothing(tmp_path):
    final = tmp_path / "models" / "x"
    with pytest.raises(RuntimeError):
        with store.staging_dir(final) as tmp:
            (tmp / "half-written").write_bytes(b"...")
            raise RuntimeError("boom")
    assert not final.exists()
    assert os.listdir(final.parent) == []


def test_staging_dir_failure_keeps_previous_version(model_dir):
    before = store.read_manifest(model_dir)
    with pytest.raises(RuntimeError):
        with store.staging_dir(model_dir, overwrite=True) as tmp:
            (tmp / "config.json").write_text("{}")
            raise RuntimeError("boom")
    assert store.read_manifest(model_dir) == before
    assert sorted(os.listdir(model_dir.parent)) == ["m"]


def test_staging_dir_success_replaces(model_dir):
    with store.staging_dir(model_dir, overwrite=True) as tmp:
        (tmp / "new").write_text("v2")
    assert sorted(os.listdir(model_dir)) == ["new"]
    assert sorted(os.listdir(model_dir.parent)) == ["m"]
