"""The server's own thread pool for CPU work a request brings: planning (chat templates, tokenizing, images),
parsing and validating large request bodies, and writing replies as JSON.

A pool of its own, sized to the cores, instead of Starlette's shared one (40 threads): more threads than
cores only share the same CPUs, and a flood of hostile requests queues here without starving anything
else. The event loop keeps only short work, so /health and streams answer while a large body is parsed.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import lru_cache, partial
from types import UnionType
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, TypeAdapter, ValidationError

# Bodies up to this size are parsed on the event loop (well under a millisecond); larger ones in the pool.
INLINE_BODY_BYTES = 64 * 1024

# How long a thread may hold the GIL while another waits for it (Python's default is 5 ms). The event loop
# takes the GIL back after every system call; with planning threads busy in Python, each of those waits a
# full interval, and a /health reply makes dozens of them.
SWITCH_INTERVAL_S = 0.001

Value = TypeVar("Value")
Body = TypeVar("Body", bound=BaseModel)


def core_count() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class Workers:
    """A thread pool of `threads` (default: one per core, at least two, so a slow template does not hold
    every planning slot on a one-core machine)."""

    def __init__(self, threads: int | None = None):
        self.threads = threads or max(2, core_count())
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="runlm-worker")

    async def run(self, fn: Callable[..., Value], *args: Any, **kwargs: Any) -> Value:
        """`fn(*args, **kwargs)` in the pool; the event loop waits without blocking."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, partial(fn, *args, **kwargs))

    async def reply(self, shape: Callable[..., Any], *args: Any) -> JSONResponse:
        """The JSON reply `shape(*args)` describes, shaped and written in the pool (n choices with logprobs,
        or many embeddings, run to megabytes of JSON)."""
        return await self.run(lambda: PartedJSONResponse(shape(*args)))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# At most about this many JSON values are written by one json.dumps call: a call holds the GIL throughout
# (200,000 token pieces: 0.2 s), so larger replies are written in parts and the event loop runs between them.
JSON_PART_VALUES = 8192


def json_weight(value: Any) -> int:
    """About how many JSON values `value` holds, judged from each list's first item (cheap: one path down)."""
    if isinstance(value, dict):
        return 1 + sum(json_weight(item) for item in value.values())
    if isinstance(value, list | tuple):
        return 1 + len(value) * json_weight(value[0]) if value else 1
    return 1


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def json_text(value: Any) -> str:
    """Compact JSON (as Starlette's JSONResponse writes it), in parts of about JSON_PART_VALUES values."""
    if json_weight(value) <= JSON_PART_VALUES:
        return compact_json(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json_text(str(key))}:{json_text(item)}" for key, item in value.items()) + "}"
    per_part = JSON_PART_VALUES // json_weight(value[0])
    if per_part < 2:
        return "[" + ",".join(json_text(item) for item in value) + "]"
    parts = (compact_json(list(value[i : i + per_part]))[1:-1] for i in range(0, len(value), per_part))
    return "[" + ",".join(parts) + "]"


class PartedJSONResponse(JSONResponse):
    """A JSONResponse written by json_text: the same bytes, without one long GIL-holding call."""

    def render(self, content: Any) -> bytes:
        return json_text(content).encode("utf-8")


def tune_for_latency() -> None:
    """Called once the model is loaded, as the server starts: keep the event loop's pauses short while worker
    threads run Python. Everything alive now (the model, torch, the modules) is frozen out of the garbage
    collector's view, so a full collection, which a request that allocates 100,000 objects triggers in
    whatever thread it runs, scans only what requests made (measured: 150 ms -> 15-40 ms with SmolLM2 loaded);
    and the GIL's switch interval is shortened (SWITCH_INTERVAL_S)."""
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))


_paused_lock = threading.Lock()
_paused_count = 0
_resume_collector = False  # whether the collector was on when the first pause began


@contextmanager
def collector_paused(pause: bool = True) -> Iterator[None]:
    """No automatic garbage collection while a large body is read and validated: its 100,000s of new objects
    would trigger full collections that each scan all of them holding the GIL (100-300 ms at 200,000 messages).
    A refused body's objects are freed by reference counting, so nothing is left to scan."""
    global _paused_count, _resume_collector
    if not pause:
        yield
        return
    with _paused_lock:
        _paused_count += 1
        if _paused_count == 1:
            _resume_collector = gc.isenabled()
            gc.disable()
    try:
        yield
    finally:
        with _paused_lock:
            _paused_count -= 1
            if _paused_count == 0 and _resume_collector:
                gc.enable()


def parse_body(model: type[Body], raw: bytes, content_type: str | None, max_object_items: int | None = None) -> Body:
    """`raw` as a `model`, failing exactly as FastAPI's own body parsing would: a RequestValidationError
    (server.errors turns it into a 400 naming the field). A top-level list of objects (messages, input items)
    longer than `max_object_items` is refused before it is validated."""
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required",
                                       "input": None}])
    data: Any = raw
    large = len(raw) > JSON_IN_PARTS_BYTES
    try:
        with collector_paused(large):
            if is_json(content_type):
                data = load_json(raw)
            return validate_in_parts(model, data, max_object_items)
    except json.JSONDecodeError as exc:
        raise invalid_json(exc.msg, exc.pos) from None
    except UnicodeDecodeError:
        raise invalid_json("it is not UTF-8") from None
    except RecursionError:
        raise invalid_json("it is nested too deeply") from None
    except ValidationError as exc:
        errors = [{**error, "loc": ("body", *error.get("loc", ()))} for error in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None
    finally:
        if large and isinstance(data, dict):  # the parsed lists (the model holds copies)
            for items in data.values():
                if isinstance(items, list):
                    release_in_parts(items)


def release_in_parts(items: list[Any]) -> None:
    """Empty `items` VALIDATE_PART_ITEMS at a time: freeing 200,000 parsed messages is one C call that holds the
    GIL for 30-90 ms; in parts, the event loop runs between them."""
    while items:
        del items[-VALIDATE_PART_ITEMS:]


def _parse_body_or_error(model: type[Body], raw: bytes, content_type: str | None,
                         max_object_items: int | None) -> Body | RequestValidationError:
    """parse_body for the pool: a refusal is returned without its traceback, whose frames hold the parsed body
    (200,000 messages), so that body is freed here, not on the event loop (50-80 ms of deallocation)."""
    try:
        return parse_body(model, raw, content_type, max_object_items)
    except RequestValidationError as exc:
        return exc.with_traceback(None)


# Bodies larger than this are read in parts: json.loads holds the GIL for its whole call, ~10 ms per MB.
JSON_IN_PARTS_BYTES = 1024 * 1024
# Lists longer than this are validated this many items at a time: a pydantic call holds the GIL throughout
# (200,000 messages: ~1 s), so the event loop runs between the parts.
VALIDATE_PART_ITEMS = 1000
_DECODER = json.JSONDecoder()
_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def load_json(raw: bytes) -> Any:
    """json.loads(raw); above JSON_IN_PARTS_BYTES a top-level object and its arrays are walked here, one
    member or item per C call, so no call holds the GIL for the whole body. Same values, same errors."""
    if len(raw) <= JSON_IN_PARTS_BYTES:
        return json.loads(raw)
    text = raw.decode("utf-8")
    at = _JSON_SPACE.match(text).end()
    if not text.startswith("{", at):
        return json.loads(text)
    value, at = _json_object_in_parts(text, at)
    if _JSON_SPACE.match(text, at).end() != len(text):
        raise json.JSONDecodeError("Extra data", text, at)
    return value


def _json_object_in_parts(text: str, at: int) -> tuple[dict[str, Any], int]:
    members: dict[str, Any] = {}

    def member(at: int) -> int:
        if not text.startswith('"', at):
            raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, at)
        key, at = _DECODER.raw_decode(text, at)
        at = _JSON_SPACE.match(text, at).end()
        if not text.startswith(":", at):
            raise json.JSONDecodeError("Expecting ':' delimiter", text, at)
        at = _JSON_SPACE.match(text, at + 1).end()
        if text.startswith("[", at):
            members[key], at = _json_array_in_parts(text, at)
        else:
            members[key], at = _DECODER.raw_decode(text, at)
        return at

    return members, _json_elements(text, at, "}", member)


def _json_array_in_parts(text: str, at: int) -> tuple[list[Any], int]:
    items: list[Any] = []

    def item(at: int) -> int:
        value, at = _DECODER.raw_decode(text, at)
        items.append(value)
        return at

    return items, _json_elements(text, at, "]", item)


def _json_elements(text: str, at: int, closer: str, element: Callable[[int], int]) -> int:
    """Read the comma-separated elements of the container opening at `at` with `element` (which reads one
    at a position and returns where it ends), up to `closer`; where the container ends."""
    at = _JSON_SPACE.match(text, at + 1).end()
    if text.startswith(closer, at):
        return at + 1
    while True:
        at = _JSON_SPACE.match(text, element(at)).end()
        if text.startswith(closer, at):
            return at + 1
        if not text.startswith(",", at):
            raise json.JSONDecodeError("Expecting ',' delimiter", text, at)
        at = _JSON_SPACE.match(text, at + 1).end()


def validate_in_parts(model: type[Body], data: Any, max_object_items: int | None = None) -> Body:
    """model.model_validate(data), with the body's long lists (messages...) validated VALIDATE_PART_ITEMS
    items at a time first; a failing item is reported where it stands in the body."""
    if isinstance(data, dict):
        for name, field in model.model_fields.items():
            key = field.alias or name
            items = data.get(key)
            if max_object_items is not None and isinstance(items, list) and len(items) > max_object_items \
                    and isinstance(items[0], dict):
                raise RequestValidationError([{
                    "type": "too_long", "loc": ("body", key), "input": None,
                    "msg": f"has {len(items)} items; at most {max_object_items} fit (the model's context length: "
                           "every chat template writes at least one token per item)"}])
            if isinstance(items, list) and len(items) > VALIDATE_PART_ITEMS:
                adapter = _list_adapter(field.annotation)
                if adapter is not None:
                    data = {**data, key: _validated_items(adapter, items, key)}
    return model.model_validate(data)


def _validated_items(adapter: TypeAdapter, items: list[Any], key: str) -> list[Any]:
    validated: list[Any] = []
    for start in range(0, len(items), VALIDATE_PART_ITEMS):
        try:
            validated += adapter.validate_python(items[start : start + VALIDATE_PART_ITEMS])
        except ValidationError as exc:
            errors = [{**error, "loc": ("body", key, start + error["loc"][0], *error["loc"][1:])}
                      for error in exc.errors(include_url=False)]
            release_in_parts(validated)
            raise RequestValidationError(errors) from None
    return validated


@lru_cache(maxsize=64)
def _list_adapter(annotation: Any) -> TypeAdapter | None:
    """A validator for lists of the item type in `annotation` (a list, Annotated, or a union holding one
    list type): None when it holds none."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) is list:
        return TypeAdapter(list[get_args(annotation)[0]])  # type: ignore[misc]
    if get_origin(annotation) in (Union, UnionType):
        found = [adapter for adapter in map(_list_adapter, get_args(annotation)) if adapter is not None]
        return found[0] if len(found) == 1 else None  # several list types: only the whole union can tell
    return None


def invalid_json(reason: str, position: int | None = None) -> RequestValidationError:
    where = ("body",) if position is None else ("body", position)
    return RequestValidationError([{"type": "json_invalid", "loc": where, "msg": "JSON decode error", "input": {},
                                    "ctx": {"error": reason}}])


def is_json(content_type: str | None) -> bool:
    """application/json or application/*+json (parameters ignored), as FastAPI decides."""
    if not content_type:
        return False
    kind = content_type.split(";", 1)[0].strip().lower()
    major, _, minor = kind.partition("/")
    return major == "application" and (minor == "json" or minor.endswith("+json"))


def json_body(model: type[Body]) -> Callable[[Request], Any]:
    """A FastAPI dependency that reads the request body as a `model`: in the pool when it is larger than
    INLINE_BODY_BYTES (a list of 100,000 messages takes a second to validate), else on the event loop."""

    async def read(request: Request) -> Body:
        raw = await request.body()
        content_type = request.headers.get("content-type")
        models = request.app.state.models  # server.pool.ModelPool
        # a conversation of more items than the context has tokens cannot fit: 200,000 validated messages
        # would cost seconds of CPU and 100 ms pauses of the garbage collector for a certain 400
        max_items = models.max_context
        if len(raw) <= INLINE_BODY_BYTES:
            return parse_body(model, raw, content_type, max_items)
        workers: Workers = models.workers
        parsed = await workers.run(_parse_body_or_error, model, raw, content_type, max_items)
        if isinstance(parsed, RequestValidationError):
            raise parsed
        return parsed

    read.__name__ = f"{model.__name__}_body"
    return read
