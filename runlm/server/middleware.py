"""Key auth (a bearer token, or Anthropic's x-api-key header), a request-body size limit and request
counting, as one plain ASGI middleware.

Plain ASGI (not BaseHTTPMiddleware) so streaming responses and client disconnects pass straight
through. The body is read up front, at most `max_body_bytes` of it, so an oversized upload is refused
before any route sees it.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from runlm.server.errors import APIError, error_body_for
from runlm.server.metrics import Metrics

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})
KNOWN_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/embeddings", "/v1/messages",
                "/api/chat", "/api/generate", "/api/embed", "/api/tags", "/api/show", "/api/ps", "/api/version",
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


class GuardMiddleware:
    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int, metrics: Metrics):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
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
        if self.api_key is not None and path not in OPEN_PATHS and not self._authorized(scope):
            await _send_error(send, path, 401, "missing or invalid API key: send 'Authorization: Bearer <key>' "
                              "(or 'x-api-key: <key>')", "invalid_api_key", [(b"www-authenticate", b"Bearer")])
            return
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
        while True:
            message = await receive()
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

    def _authorized(self, scope: Scope) -> bool:
        """A bearer token (OpenAI, Ollama clients) or an x-api-key header (Anthropic's) holding the key."""
        for name, value in scope.get("headers") or []:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key):
                    return True
            elif name == b"x-api-key" and hmac.compare_digest(value.strip(), self.api_key):
                return True
        return False
