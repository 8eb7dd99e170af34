"""The browser chat page: plain HTML/CSS/JS shipped as package data and served by the runlm server itself.

`WebPage` is an ASGI middleware placed outside the API-key guard: the page and its assets hold no secrets
and must load before the user has typed a key (the page asks for the key on its first 401 and sends it as a
bearer header). Only GET/HEAD of `/` and `/web/<asset>` are answered here; everything else passes through.
Every asset is read once, at start-up, from the package; nothing is fetched from the network at run time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

PREFIX = "/web/"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".txt": "text/plain; charset=utf-8",
}
# The page runs only its own scripts and styles and talks only to this server: model output that slipped
# past the renderer's escaping still could not run script, load remote resources, or post anywhere else.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "connect-src 'self'; font-src 'self'; manifest-src 'self'; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")


def load_assets() -> dict[str, tuple[bytes, str, str]]:
    """{url path: (body, content type, etag)} for every file under static/."""
    root = resources.files(__name__) / "static"
    assets: dict[str, tuple[bytes, str, str]] = {}
    for entry in root.iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1] if "." in entry.name else ""
        if not entry.is_file() or suffix not in CONTENT_TYPES:
            continue
        body = entry.read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'
        assets[PREFIX + entry.name] = (body, CONTENT_TYPES[suffix], etag)
    if PREFIX + "index.html" in assets:
        assets["/"] = assets[PREFIX + "index.html"]
    return assets


class WebPage:
    """Serve the chat page at `/` and its assets under `/web/`; pass every other request to `app`."""

    def __init__(self, app: Any, metrics: Any = None):
        self.app = app
        self.metrics = metrics
        self.assets = load_assets()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or (path != "/" and not path.startswith(PREFIX)):
            await self.app(scope, receive, send)
            return
        method = scope.get("method", "GET")
        if method not in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        asset = self.assets.get(path)
        if asset is None:
            status, body, headers = 404, b"not found\n", [(b"content-type", b"text/plain; charset=utf-8")]
        else:
            content, ctype, etag = asset
            request_headers = dict(scope.get("headers") or [])
            headers = [(b"content-type", ctype.encode()), (b"etag", etag.encode()),
                       (b"cache-control", b"no-cache"), (b"x-content-type-options", b"nosniff"),
                       (b"referrer-policy", b"no-referrer")]
            if ctype.startswith("text/html"):
                headers += [(b"content-security-policy", CSP.encode()), (b"x-frame-options", b"DENY")]
            if etag.encode() in [t.strip() for t in request_headers.get(b"if-none-match", b"").split(b",")]:
                status, body = 304, b""
            else:
                status, body = 200, content
        if status != 304:
            headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body})
        if self.metrics is not None:
            self.metrics.count_request("/" if path == "/" else PREFIX, status)


__all__ = ["WebPage", "load_assets", "CSP"]
