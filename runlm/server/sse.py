"""Server-sent events: one generator turns a request's stream records into `data:` lines for any API.

Each API supplies a shaper with `opening()`, `on_record(record)` and `closing(last, usage)`, each
returning the JSON events to send. A failure mid-stream is reported in-band as an OpenAI-shaped
error event (the status line is long gone), and the request is cancelled when the client leaves.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

from runlm.engine import RequestHandle, StreamRecord, Usage
from runlm.server.errors import api_error_from, error_body

DONE = "data: [DONE]\n\n"


class EventShaper(Protocol):
    def opening(self) -> list[dict[str, Any]]: ...

    def on_record(self, record: StreamRecord) -> list[dict[str, Any]]: ...

    def closing(self, last: StreamRecord, usage: Usage) -> list[dict[str, Any]]: ...


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def event_stream(handle: RequestHandle, shaper: EventShaper) -> AsyncIterator[str]:
    last = StreamRecord()
    try:
        for event in shaper.opening():
            yield sse(event)
        async for record in handle:
            last = record
            for event in shaper.on_record(record):
                yield sse(event)
        for event in shaper.closing(last, last.usage or handle.gen.usage):
            yield sse(event)
        yield DONE
    except Exception as exc:  # mid-stream failure: tell the client in-band, then end the stream
        err = api_error_from(exc)
        yield sse(error_body(err.status, err.message, err.param, err.code, err.type))
        yield DONE
    finally:
        handle.cancel()
