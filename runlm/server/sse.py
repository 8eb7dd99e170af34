"""Server-sent events: one generator turns a request's stream records into `data:` lines for any API.

Each API supplies a shaper with `opening()`, `on_record(record)` and `closing(last, usage)`, each
returning the JSON events to send. A failure mid-stream is reported in-band as an OpenAI-shaped
error event (the status line is long gone), and the request is cancelled when the client leaves.
Typed streams (the Responses API) name each event in an `event:` line, build their own error events
(`failure`) and end without chat completions' `[DONE]`. The same generator writes Ollama's streams as
newline-delimited JSON (`lines`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from runlm.engine import StreamRecord, Usage
from runlm.server.errors import APIError, api_error_from, openai_error_body

DONE = "data: [DONE]\n\n"


class EventShaper(Protocol):
    def opening(self) -> list[dict[str, Any]]: ...

    def on_record(self, record: StreamRecord) -> list[dict[str, Any]]: ...

    def closing(self, last: StreamRecord, usage: Usage) -> list[dict[str, Any]]: ...


class RecordSource(Protocol):
    """A RequestHandle, or a RequestGroup whose choices' records arrive interleaved (each with its index)."""

    @property
    def usage(self) -> Usage: ...

    def cancel(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[StreamRecord]: ...


def sse(obj: Any, typed: bool = False) -> str:
    """One event; a typed one also names itself (its "type") in an `event:` line, as the Responses API does."""
    head = f"event: {obj['type']}\n" if typed else ""
    return f"{head}data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def json_line(obj: Any) -> str:
    """One event of a newline-delimited JSON stream (Ollama's)."""
    return json.dumps(obj, ensure_ascii=False) + "\n"


def openai_failure(err: APIError) -> list[dict[str, Any]]:
    return [openai_error_body(err)]


async def event_stream(handle: RecordSource, shaper: EventShaper, *, typed: bool = False, lines: bool = False,
                       failure: Callable[[APIError], list[dict[str, Any]]] = openai_failure,
                       end_marker: bool = True) -> AsyncIterator[str]:
    """The stream of one request. `typed`: events carry a "type" sent as their `event:` line, and the
    stream ends without `[DONE]`; `lines`: one JSON object per line instead of SSE, no `[DONE]`; `failure`
    makes the in-band events that report a mid-stream error; `end_marker` False: no `[DONE]` either (llama-server's
    own routes end with their `stop: true` event)."""

    def frame(event: dict[str, Any]) -> str:
        return json_line(event) if lines else sse(event, typed)

    done = end_marker and not (typed or lines)
    last = StreamRecord()
    try:
        for event in shaper.opening():
            yield frame(event)
        async for record in handle:
            last = record
            for event in shaper.on_record(record):
                yield frame(event)
        for event in shaper.closing(last, handle.usage):
            yield frame(event)
        if done:
            yield DONE
    except Exception as exc:  # mid-stream failure: tell the client in-band, then end the stream
        for event in failure(api_error_from(exc)):
            yield frame(event)
        if done:
            yield DONE
    finally:
        handle.cancel()
