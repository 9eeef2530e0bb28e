"""A Hugging Face Hub stand-in on 127.0.0.1 speaking the endpoints `huggingface_hub` downloads use.

    GET  /api/models/{repo}[/revision/{rev}][?blobs=true]   repo info: sha, siblings (+ size/blobId/lfs)
    HEAD /{repo}/resolve/{rev}/{file}                       X-Repo-Commit, ETag / X-Linked-Etag, X-Linked-Size
    GET  /{repo}/resolve/{rev}/{file}                       the bytes; honours `Range: bytes=a-[b]` with 206

Errors carry the hub's X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound), which is how
`huggingface_hub` tells them apart. *.safetensors are served as LFS files (ETag = sha256), others as git
files (ETag = git blob sha1). Fault injection: `corrupt()` serves other bytes of the same length under
the original hashes; `drop_once()` cuts the next GET of a file short (the client must resume).
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class HubFile:
    data: bytes
    lfs: bool
    served: bytes | None = None  # what GET returns when it differs from `data` (corruption)
    drop_after: int | None = None  # bytes the next GET sends before the server hangs up

    @property
    def etag(self) -> str:
        return hashlib.sha256(self.data).hexdigest() if self.lfs else git_blob_id(self.data)


@dataclass
class HubRepo:
    commit: str
    files: dict[str, HubFile] = field(default_factory=dict)


class FakeHub:
    """`with FakeHub() as hub: hub.add_repo("org/name", directory)`; `hub.url` is the HF_ENDPOINT."""

    def __init__(self):
        self.repos: dict[str, HubRepo] = {}
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add_repo(self, repo_id: str, directory: Path, extra: dict[str, bytes] | None = None) -> str:
        """Publish every file under `directory` (plus `extra` {path: bytes}) as one commit; returns its sha."""
        directory = Path(directory)
        files = {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*"))
                 if p.is_file()}
        files.update(extra or {})
        commit = hashlib.sha1(json.dumps({k: git_blob_id(v) for k, v in files.items()}).encode()).hexdigest()
        self.repos[repo_id] = HubRepo(commit, {name: HubFile(data, lfs=name.endswith(".safetensors"))
                                               for name, data in files.items()})
        return commit

    def corrupt(self, repo_id: str, name: str) -> None:
        """Serve `name` with one byte flipped in the middle, still advertising the true hashes."""
        f = self.repos[repo_id].files[name]
        bad = bytearray(f.data)
        bad[len(bad) // 2] ^= 0xFF
        f.served = bytes(bad)

    def drop_once(self, repo_id: str, name: str, after: int) -> None:
        """Hang up on the next GET of `name` after sending `after` bytes of it."""
        self.repos[repo_id].files[name].drop_after = after


def _make_handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep pytest output clean
            pass

        # -- helpers ------------------------------------------------------------------------------
        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, str(v))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _error(self, status: int, code: str, message: str, head: bool, extra: dict | None = None):
            body = json.dumps({"error": message}).encode()
            self._send(status, body, {"Content-Type": "application/json", "X-Error-Code": code,
                                      "X-Error-Message": message, **(extra or {})}, head)

        def _repo(self, repo_id: str, rev: str | None, head: bool) -> HubRepo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found", head)
                return None
            if rev not in (None, "main", repo.commit):
                self._error(404, "RevisionNotFound", "Invalid rev id: " + rev, head)
                return None
            return repo

        # -- endpoints ----------------------------------------------------------------------------
        def do_GET(self):
            self._route(head=False)

        def do_HEAD(self):
            self._route(head=True)

        def _route(self, head: bool):
            url = urlsplit(self.path)
            path = unquote(url.path)
            hub.log.append((self.command, path, self.headers.get("Range")))
            if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path):
                return self._info(m[1], m[2], blobs="blobs=true" in url.query, head=head)
            if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
                return self._resolve(m[1], m[2], m[3], head)
            self._error(404, "NotFound", "no such endpoint", head)

        def _info(self, repo_id: str, rev: str | None, blobs: bool, head: bool):
            repo = self._repo(repo_id, rev, head)
            if repo is None:
                return
            siblings = []
            for name, f in repo.files.items():
                s = {"rfilename": name}
                if blobs:
                    s.update(size=len(f.data), blobId=git_blob_id(f.data))
                    if f.lfs:
                        s["lfs"] = {"size": len(f.data), "sha256": hashlib.sha256(f.data).hexdigest(),
                                    "pointerSize": 134}
                siblings.append(s)
            info = {"_id": "0" * 24, "id": repo_id, "modelId": repo_id, "author": repo_id.split("/")[0],
                    "sha": repo.commit, "private": False, "gated": False, "disabled": False, "downloads": 0,
                    "likes": 0, "tags": ["safetensors", "llama"], "library_name": "transformers",
                    "siblings": siblings}
            self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)

        def _resolve(self, repo_id: str, rev: str, name: str, head: bool):
            repo = self._repo(repo_id, rev, head)
            if repo is None:
                return
            f = repo.files.get(name)
            if f is None:
                return self._error(404, "EntryNotFound", f"{name} does not exist on {rev!r}", head,
                                   {"X-Repo-Commit": repo.commit})
            body = f.data if f.served is None else f.served
            headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{f.etag}"', "Accept-Ranges": "bytes",
                       "Content-Type": "application/octet-stream"}
            if f.lfs:
                headers.update({"X-Linked-Etag": f'"{f.etag}"', "X-Linked-Size": len(f.data)})
            status = 200
            if not head and (rng := self.headers.get("Range")):
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng)
                start, end = int(m[1]), int(m[2]) if m[2] else len(body) - 1
                headers["Content-Range"] = f"bytes {start}-{end}/{len(body)}"
                body, status = body[start:end + 1], 206
            if head or f.drop_after is None:
                return self._send(status, body, headers, head)
            after, f.drop_after = f.drop_after, None  # send the headers and part of the body, then hang up
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, str(v))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[:after])
            self.wfile.flush()
            self.close_connection = True

    return Handler
