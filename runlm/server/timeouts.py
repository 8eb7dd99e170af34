"""Connection deadlines uvicorn does not have: a slow client (slowloris) cannot hold sockets open forever.

uvicorn times out an idle keep-alive connection, but not a request whose headers arrive a byte at a time (any
byte cancels its keep-alive timer, and a new connection has none). `HeaderDeadlineProtocol` gives every request
`header_timeout_s` from the connection's start (or the previous response's end) to finish its headers, then
closes the socket. The body is bounded by the key guard (middleware.GuardMiddleware's `body_timeout_s`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0
KEEP_ALIVE_S = 5.0
MAX_HEADER_BYTES = 16 * 1024  # uvicorn's h11_max_incomplete_event_size: the most a header block may hold


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers are not complete in time."""

    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the headers are in: the request runs under the app's rules
            self._disarm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_deadline()  # the next request on this connection gets its own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm_header_deadline(self) -> None:
        if getattr(self, "_header_deadline", None) is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.transport.close()


def protocol_with(header_timeout_s: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class with its own header deadline (uvicorn takes a class, not an instance)."""
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout_s": header_timeout_s})


def uvicorn_options(header_timeout_s: float = HEADER_TIMEOUT_S) -> dict[str, Any]:
    """uvicorn.Config keywords for runlm's server: header deadline, keep-alive timeout, header size bound."""
    return {"http": protocol_with(header_timeout_s), "timeout_keep_alive": KEEP_ALIVE_S,
            "h11_max_incomplete_event_size": MAX_HEADER_BYTES}
