"""A loopback server that answers the Hugging Face Hub's HTTP API for a few repos, so the real `huggingface_hub`
client can be tested against it (`HF_ENDPOINT`): model info with the files' sizes and sha256, and `resolve` URLs
with HEAD, GET and byte ranges. It can cut a download partway, hold it partway, serve a corrupted file, or gate a
repo."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "6f1c2ad4b58e3e5f4a0d1b2c3d4e5f60718293a4"
TOKEN = "hf_loopback_test_token"


class FakeHub:
    """`repos`: repo id -> {file name in the repo: local path}; `gated`: repos that need TOKEN. `cut_after`: file
    name -> the first GET of it stops after that many bytes; `corrupt`: files served with one byte flipped;
    `hold_after`: file name -> every GET of it pauses after that many bytes until `release` is set (`holding` is
    set once one does). `ranges` records the start of every ranged GET, per file; `gets` counts the GETs."""

    def __init__(self, repos: dict[str, dict[str, Path]], gated: set[str] | None = None):
        self.repos = repos
        self.gated = gated or set()
        self.cut_after: dict[str, int] = {}
        self.corrupt: set[str] = set()
        self.ranges: dict[str, list[int]] = {}
        self.hold_after: dict[str, int] = {}
        self.holding = threading.Event()
        self.release = threading.Event()
        self.gets: Counter[str] = Counter()
        self.digests = {path: _sha256(path) for files in repos.values() for path in files.values()}
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub.answer(self, head=True)

            def do_GET(self) -> None:
                hub.answer(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _refuse(self, handler: BaseHTTPRequestHandler, status: int, code: str) -> None:
        handler.send_response(status)
        handler.send_header("X-Error-Code", code)
        handler.send_header("Content-Type", "application/json")
        body = json.dumps({"error": code}).encode()
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def answer(self, handler: BaseHTTPRequestHandler, head: bool) -> None:
        path = handler.path.split("?", 1)[0]
        info = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path)
        repo = (info or resolve).group(1) if (info or resolve) else None
        if repo not in self.repos:
            return self._refuse(handler, 404 if repo is None else 401, "RepoNotFound")
        if repo in self.gated and handler.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._refuse(handler, 401, "GatedRepo")
        files = self.repos[repo]
        if info:
            siblings = [{"rfilename": name, "size": p.stat().st_size,
                         "lfs": {"sha256": self.digests[p], "size": p.stat().st_size, "pointerSize": 134}}
                        for name, p in files.items()]
            body = json.dumps({"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                               "siblings": siblings}).encode()
            handler.send_response(200)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)
            return None
        name = resolve.group(2)
        if name not in files:
            return self._refuse(handler, 404, "EntryNotFound")
        self._send_file(handler, name, files[name], head)
        return None

    def _send_file(self, handler: BaseHTTPRequestHandler, name: str, path: Path, head: bool) -> None:
        size = path.stat().st_size
        asked = re.fullmatch(r"bytes=(\d+)-", handler.headers.get("Range", ""))
        start = int(asked.group(1)) if asked else 0
        if asked and not head:
            self.ranges.setdefault(name, []).append(start)
        if not head:
            self.gets[name] += 1
        handler.send_response(206 if asked else 200)
        for key, value in (("X-Repo-Commit", COMMIT), ("ETag", f'"{self.digests[path]}"'),
                           ("X-Linked-Etag", f'"{self.digests[path]}"'), ("X-Linked-Size", str(size)),
                           ("Accept-Ranges", "bytes"), ("Content-Length", str(size - start)),
                           ("Content-Type", "application/octet-stream")):
            handler.send_header(key, value)
        if asked:
            handler.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        handler.end_headers()
        if head:
            return
        stop = size
        if name in self.cut_after:
            stop = min(size, start + self.cut_after.pop(name))
        hold_at = start + self.hold_after[name] if name in self.hold_after else None
        with path.open("rb") as source:
            source.seek(start)
            at = start
            while at < stop:
                if at == hold_at:
                    self.holding.set()
                    self.release.wait(60)  # bounded: a test that never releases fails, the harness does not hang
                until = min(stop, hold_at) if hold_at is not None and at < hold_at else stop
                chunk = source.read(min(1 << 20, until - at))
                if name in self.corrupt and at == start:
                    chunk = bytes([chunk[0] ^ 0xFF]) + chunk[1:]
                try:
                    handler.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    return
                at += len(chunk)
        if stop < size:  # a cut download: the connection ends short of Content-Length
            handler.close_connection = True


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while chunk := source.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
