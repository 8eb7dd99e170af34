"""Key auth (a bearer token, or Anthropic's x-api-key header), a request-body size limit and request
counting, as one plain ASGI middleware; and OriginGuard, the Host / Origin checks in front of it.

Plain ASGI (not BaseHTTPMiddleware) so streaming responses and client disconnects pass straight
through. The body is read up front, at most `max_body_bytes` of it, so an oversized upload is refused
before any route sees it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from runlm.errors import InvalidInputError
from runlm.server.errors import APIError, error_body_for
from runlm.server.metrics import Metrics

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})
TENANT_KEY = "runlm.tenant"  # the ASGI scope entry naming the authenticated tenant (see tenant_of)
KNOWN_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/embeddings", "/v1/messages",
                "/api/chat", "/api/generate", "/api/embed", "/api/tags", "/api/show", "/api/ps", "/api/version",
                "/api/delete", "/api/copy",
                "/health", "/metrics", "/tokenize", "/detokenize", "/props", "/openapi.json", "/docs")


async def _send_error(send: Send, path: str, status: int, message: str, code: str,
                      headers: list | None = None) -> None:
    body = json.dumps(error_body_for(path, APIError(status, message, code=code))).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def route_label(path: str) -> str:
    for route in KNOWN_ROUTES:
        if path == route or path.startswith(route + "/"):
            return route
    return "other"


def api_keys_from(value: str | Sequence[str] | None) -> list[str]:
    """Keys from a comma-separated string (`--api-key`, RUNLM_API_KEY) or a list; blanks dropped."""
    items = value.split(",") if isinstance(value, str) else list(value or ())
    return [key.strip() for key in items if key.strip()]


def read_api_keys_file(path: str) -> list[str]:
    """`--api-keys-file`: one key per line, blank lines and '#' comments skipped (keeps keys out of `ps`)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"cannot read the API keys file {path!r}: {exc}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise InvalidInputError(f"the API keys file {path!r} holds no key")
    return keys


def tenant_of(scope: Scope) -> str:
    """Who sent this request, as the key check found it: "" without keys (one tenant) or with a shared cache."""
    return scope.get(TENANT_KEY, "")


def key_tenant(key: bytes) -> str:
    """A key's tenant name: a digest, so the key itself is kept nowhere else."""
    return "key-" + hashlib.sha256(key).hexdigest()[:16]


class GuardMiddleware:
    """Key auth, body limit and request counting. With several `api_keys`, each key is its own tenant (its
    prompt-cache entries are its own) unless `shared_tenant`."""

    def __init__(self, app: Any, api_keys: Sequence[str], max_body_bytes: int, metrics: Metrics,
                 shared_tenant: bool = False, body_timeout_s: float = 60.0):
        self.app = app
        self.body_timeout_s = body_timeout_s
        self.api_keys = [key.encode() for key in api_keys if key]
        self.shared_tenant = shared_tenant
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status_box = [500]

        async def counting_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
            await send(message)

        try:
            await self._handle(scope, receive, counting_send)
        finally:
            self.metrics.count_request(route_label(scope.get("path", "")), status_box[0])

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        key = self._presented_key(scope) if self.api_keys else None
        if self.api_keys and path not in OPEN_PATHS and key is None:
            await _send_error(send, path, 401, "missing or invalid API key: send 'Authorization: Bearer <key>' "
                              "(or 'x-api-key: <key>')", "invalid_api_key", [(b"www-authenticate", b"Bearer")])
            return
        if key is not None and not self.shared_tenant:
            scope[TENANT_KEY] = key_tenant(key)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await _send_error(send, path, 400, "invalid Content-Length header", "invalid_value")
                return
            if declared > self.max_body_bytes:
                await self._too_large(send, path)
                return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        while True:
            try:  # a body sent a byte at a time would hold the connection (and its handler) forever
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                await _send_error(send, path, 408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                                  "request_timeout", [(b"connection", b"close")])
                return
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(send, path)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the server would say

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send, path: str) -> None:
        await _send_error(send, path, 413, f"the request body is larger than the limit of {self.max_body_bytes} bytes",
                          "request_too_large")

    def _presented_key(self, scope: Scope) -> bytes | None:
        """The configured key a bearer token (OpenAI, Ollama clients) or an x-api-key header (Anthropic's) holds."""
        for name, value in scope.get("headers") or []:
            token = None
            if name == b"authorization":
                scheme, _, rest = value.partition(b" ")
                token = rest.strip() if scheme.lower() == b"bearer" else None
            elif name == b"x-api-key":
                token = value.strip()
            if token is not None:
                # every key compared, in constant time each: which key matched does not show in the timing
                matches = [key for key in self.api_keys if hmac.compare_digest(token, key)]
                if matches:
                    return matches[0]
        return None


# -- origins ---------------------------------------------------------------------------------------

DEFAULT_ALLOWED_HOSTS = ("localhost", "127.0.0.1", "[::1]")
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def split_authority(value: str) -> tuple[str, int | None] | None:
    """'Host:8000' -> ('host', 8000), '[::1]' -> ('[::1]', None); None when it is not a host[:port]."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        name, rest = (value[: end + 1], value[end + 1 :]) if end > 0 else ("", "")
        if not name or not _is_ip(name):
            return None
    else:
        name, sep, port_text = value.partition(":")
        rest = ":" + port_text if sep else ""
        name = name.rstrip(".")  # 'localhost.' is localhost
        if not name or not all(c.isalnum() or c in "-._" for c in name) or not name.isascii():
            return None
    if not rest:
        return name, None
    port_text = rest[1:]
    if not rest.startswith(":") or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        return None
    return name, int(port_text)


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name[1:-1] if name.startswith("[") else name)
    except ValueError:
        return False
    return True


class HostList:
    """Allowed host names, each optionally with a port: 'example.com', 'box:8000', '.example.com' (and its
    subdomains), '*' (any host: turns the check off)."""

    def __init__(self, entries: Iterable[str]):
        self.any = False
        self.entries: list[tuple[str, int | None]] = []
        for entry in entries:
            entry = entry.strip()
            if entry == "*":
                self.any = True
                continue
            parsed = split_authority(entry.lstrip(".")) if entry else None
            if parsed is None:
                raise InvalidInputError(f"allowed host {entry!r} is not a host name, IP address or host:port")
            self.entries.append(("." + parsed[0] if entry.startswith(".") else parsed[0], parsed[1]))

    def allows(self, name: str, port: int | None) -> bool:
        if self.any:
            return True
        for entry, entry_port in self.entries:
            matches = name == entry or (entry.startswith(".") and (name == entry[1:] or name.endswith(entry)))
            if matches and (entry_port is None or entry_port == port):
                return True
        return False


class OriginGuard:
    """Refuse requests addressed to a host name this server does not answer to, and state-changing requests sent
    by a page of another origin, before the key check or any route sees them.

    Host: a web page can rebind its own DNS name to 127.0.0.1 and then drive a keyless local server as
    same-origin; its requests still carry that name in Host. So Host must be an allowed name (loopback names
    by default), or an IP address (a rebinding needs a name). A request without Host (not a browser) passes.
    Origin: browsers send it on cross-origin POSTs; it must be this server's own origin (the chat page) or an
    allowed host, else 403: no other site can make the user's browser post to the model.
    """

    def __init__(self, app: Any, hosts: HostList, metrics: Metrics | None = None):
        self.app = app
        self.hosts = hosts
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.hosts.any:
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if scope["type"] == "websocket":  # no HTTP answer to send before the handshake: close it
            await send({"type": "websocket.close", "code": 1008})
            return
        await _send_error(send, path, 403, refusal, "forbidden_origin")
        if self.metrics is not None:
            self.metrics.count_request(route_label(path), 403)

    def _refusal(self, scope: Scope) -> str | None:
        headers = dict(scope.get("headers") or [])
        host_header = headers.get(b"host", b"").decode("latin-1")
        host = None
        if host_header:
            host = split_authority(host_header)
            if host is None:
                return f"invalid Host header {host_header[:100]!r}"
            if not (_is_ip(host[0]) or self.hosts.allows(*host)):
                return (f"this server does not answer to the host {host[0]!r} (a guard against DNS rebinding): "
                        f"start it with --allowed-hosts {host[0]} to allow that name")
        origin_header = headers.get(b"origin")
        if origin_header is None or scope.get("method", "GET") not in STATE_CHANGING:
            return None
        origin = origin_header.decode("latin-1")
        scheme, sep, authority = origin.partition("://")
        parsed = split_authority(authority) if sep and scheme in ("http", "https") else None
        if parsed is not None:
            own_port = 443 if scope.get("scheme") in ("https", "wss") else 80
            origin_port = parsed[1] or (443 if scheme == "https" else 80)
            same_origin = host is not None and (parsed[0], origin_port) == (host[0], host[1] or own_port)
            if same_origin or self.hosts.allows(*parsed):
                return None
        return (f"requests from the web origin {origin[:100]!r} are not allowed: only this server's own pages "
                f"and its allowed hosts may send them (see --allowed-hosts)")
