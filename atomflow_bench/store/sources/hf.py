"""A Hugging Face Hub repo, downloaded through `huggingface_hub` and checked file by file against the hub.

The revision is resolved once (`HfApi.model_info(..., files_metadata=True)`: GET
/api/models/{repo}/revision/{rev}?blobs=true) and every file is then fetched at that commit with
`hf_hub_download` (HEAD + GET /{repo}/resolve/{commit}/{file}), so all files come from one commit. The
hub's cache conventions apply (HF_HOME, HF_HUB_CACHE, HF_ENDPOINT, HF_TOKEN): files already in the cache
are reused and interrupted transfers resume with Range requests. `huggingface_hub` checks sizes only, so
each file is hashed here: LFS files against the hub's `lfs.sha256`, small git files against their git blob
id. A mismatching file is evicted from the cache and the fetch fails.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib
import os
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

from ...errors import FetchError
from ..store import sha256_file
from . import byte_progress, is_model_file, link_or_copy

MAX_WORKERS = 8


def git_blob_sha1(path: Path, bufsize: int = 1 << 22) -> str:
    """The git object id of a file's content: sha1(b"blob <size>\\0" + content)."""
    h = hashlib.sha1(b"blob %d\0" % Path(path).stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Network errors of the HTTP client this huggingface_hub uses (httpx2 or httpx; requests' are OSErrors)."""
    for name in ("httpx2", "httpx"):
        with contextlib.suppress(ImportError):
            return (OSError, importlib.import_module(name).TransportError)
    return (OSError,)


@contextlib.contextmanager
def _hub_errors(repo_id: str, revision: str | None, endpoint: str):
    """Turn huggingface_hub and network exceptions into one-line FetchErrors."""
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RepositoryNotFoundError,
                                        RevisionNotFoundError)
    try:
        yield
    except GatedRepoError:
        raise FetchError(f"{repo_id}: gated repository; accept its license at {endpoint}/{repo_id} "
                         "and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise FetchError(f"{repo_id}: repository not found on {endpoint} "
                         "(private and gated repositories need HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise FetchError(f"{repo_id}: revision {revision!r} not found on {endpoint}") from None
    except HfHubHTTPError as e:
        raise FetchError(f"{repo_id}: hub request failed: {_first_line(e)}") from None
    except _transport_errors() as e:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise FetchError(f"{repo_id}: no space left on the device while downloading into the HF cache "
                             "(free some space or set HF_HUB_CACHE to another disk)") from None
        raise FetchError(f"{repo_id}: cannot download from {endpoint}: {_first_line(e)}") from None


def _tqdm_class(advance):
    """A tqdm stand-in for `hf_hub_download(tqdm_class=...)` feeding `advance(nbytes)`.

    Same interface as the aggregating bar `snapshot_download` hands to `hf_hub_download`; `update_transfer`
    exists (as a no-op) so Xet downloads report written bytes once, not network bytes a second time.
    """
    class Bar:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def update(self, n=1):
            advance(n or 0)

        def update_transfer(self, n=1):
            pass

        def set_postfix_str(self, *args, **kwargs):
            pass

        def set_transfer_postfix_str(self, *args, **kwargs):
            pass

        def close(self):
            pass

    return Bar


def _evict(path: str) -> None:
    """Remove a cached file: the snapshot entry and the blob it points to."""
    blob = os.path.realpath(path)
    for p in (path, blob):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


def _check_against_hub(path: str, sibling) -> None:
    """Raise FetchError (after evicting the cached file) unless `path` is exactly the hub's file."""
    name = sibling.rfilename
    if sibling.lfs is not None:
        kind, want, size = "sha256", sibling.lfs.sha256, sibling.lfs.size
    else:
        kind, want, size = "git blob sha1", sibling.blob_id, sibling.size
    if not want:
        raise FetchError(f"{name}: the hub gave no hash for this file, so it cannot be verified")
    got_size = os.path.getsize(path)
    if size is not None and got_size != size:
        _evict(path)
        raise FetchError(f"{name}: size {got_size} != hub {size} (removed from the HF cache; fetch again)")
    got = sha256_file(Path(path)) if sibling.lfs is not None else git_blob_sha1(Path(path))
    if got != want:
        _evict(path)
        raise FetchError(f"{name}: {kind} {got[:16]}… != hub {want[:16]}… "
                         "(corrupt download, removed from the HF cache; fetch again)")


def fetch_hf(repo_id: str, out_dir: Path, revision: str | None = None, console=None) -> dict:
    """Download the model files of `repo_id` at `revision` into `out_dir`, each verified against the hub.

    Returns the source record {"kind": "hf", "repo", "revision", "commit", "endpoint"}.
    """
    from huggingface_hub import HfApi, constants, hf_hub_download

    # Read at call time (not import time) so a patched configuration is honoured; passed explicitly below.
    endpoint, cache_dir = constants.ENDPOINT, constants.HF_HUB_CACHE
    revision = revision or constants.DEFAULT_REVISION
    with _hub_errors(repo_id, revision, endpoint):
        info = HfApi(endpoint=endpoint).model_info(repo_id, revision=revision, files_metadata=True)
    commit = info.sha
    if not commit:
        raise FetchError(f"{repo_id}: the hub did not say which commit {revision!r} is")
    files = [s for s in info.siblings or [] if is_model_file(s.rfilename)]
    names = {s.rfilename for s in files}
    if "config.json" not in names:
        raise FetchError(f"{repo_id}@{commit[:12]}: no config.json")
    if not any(n.endswith(".safetensors") for n in names):
        raise FetchError(f"{repo_id}@{commit[:12]}: no *.safetensors files (only safetensors checkpoints "
                         "are supported)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = {s.rfilename: (s.lfs.size if s.lfs is not None else s.size) or 0 for s in files}
    if console is not None:
        console.print(f"{repo_id} @ {commit[:12]}: {len(files)} files, {sum(sizes.values()) / 2**30:.2f} GiB")

    with byte_progress(console, f"hf {repo_id}", sum(sizes.values())) as advance:
        def download(sibling) -> None:
            reported = 0

            def count(n: int) -> None:
                nonlocal reported
                reported += n
                advance(n)

            with _hub_errors(repo_id, revision, endpoint):
                path = hf_hub_download(repo_id, sibling.rfilename, revision=commit, cache_dir=cache_dir,
                                       endpoint=endpoint,
                                       tqdm_class=_tqdm_class(count) if console is not None else None)
            advance(sizes[sibling.rfilename] - reported)  # cached files report nothing
            _check_against_hub(path, sibling)
            link_or_copy(Path(path), out_dir / sibling.rfilename)

        with ThreadPoolExecutor(max_workers=min(MAX_WORKERS, len(files))) as pool:
            done, pending = wait([pool.submit(download, s) for s in files], return_when=FIRST_EXCEPTION)
            for job in pending:
                job.cancel()
            for job in done:
                job.result()  # re-raises the first failure
    return {"kind": "hf", "repo": repo_id, "revision": revision, "commit": commit,
            "endpoint": endpoint}
