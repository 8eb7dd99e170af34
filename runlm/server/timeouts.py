"""Connection deadlines uvicorn does not have: a slow client (slowloris) cannot hold sockets open forever.

uvicorn times out an idle keep-alive connection, but not a request whose headers arrive a byte at a time (any
byte cancels its keep-alive timer, and a new connection has none). `HeaderDeadlineProtocol` gives every request
`header_timeout_s` from the connection's start (or the previous response's end) to finish its headers, then
closes the socket, and refuses a header block past MAX_HEADER_BYTES with a 400. The body is bounded by the key
guard (middleware.GuardMiddleware's `body_timeout_s`).

Built on uvicorn's httptools protocol (llhttp, in C) rather than its h11 one (pure Python): a streamed token's
event costs the event loop ~30 us less, CPU taken from the model's threads on a small machine.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0
KEEP_ALIVE_S = 5.0
MAX_HEADER_BYTES = 16 * 1024  # the most a request's target and header names and values may hold together


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, closing a connection whose request headers are not complete in time."""

    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        self._arm_header_deadline()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm_header_deadline()  # the headers are in: the request runs under the app's rules
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        idle = not self.pipeline  # no request of this connection's has its headers in yet
        super().on_response_complete()
        if idle and not self.transport.is_closing():
            self._arm_header_deadline()  # the next request on this connection gets its own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _count_header_bytes(self, count: int) -> None:
        self._header_bytes += count
        if self._header_bytes > MAX_HEADER_BYTES:  # the parser reports it: uvicorn answers 400 and closes
            raise httptools.HttpParserError(f"request headers past {MAX_HEADER_BYTES} bytes")

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm_header_deadline(self) -> None:
        if getattr(self, "_header_deadline", None) is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def protocol_with(header_timeout_s: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class with its own header deadline (uvicorn takes a class, not an instance)."""
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout_s": header_timeout_s})


def uvicorn_options(header_timeout_s: float = HEADER_TIMEOUT_S) -> dict[str, Any]:
    """uvicorn.Config keywords for runlm's server: header deadline and size bound, keep-alive timeout."""
    return {"http": protocol_with(header_timeout_s), "timeout_keep_alive": KEEP_ALIVE_S}
