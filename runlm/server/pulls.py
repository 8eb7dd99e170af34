"""Ollama's /api/pull: a model pulled into runlm's cache while the server runs, reported as Ollama reports it.

The names are those `runlm pull` takes: `hf.co/<user>/<repo>[:<quantization>]` (runlm.hub: HF_ENDPOINT and HF_TOKEN
honored) and the catalog's (runlm.catalog). The Hub is asked which files a pull takes before the reply starts, so a
missing repo or quantization is a 4xx rather than a line in a stream. The download runs in a thread of its own,
never on the event loop nor in the worker pool requests are planned in (it takes minutes), and tells its bytes as
they arrive; a streamed pull whose client leaves stops at the next chunk. Two pulls of one model take turns: the
second finds the files in place and only checks them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from runlm import catalog, hub
from runlm.errors import RunlmError
from runlm.server.errors import APIError, api_error_from, ollama_error_body
from runlm.server.library import LATEST
from runlm.server.sse import json_line

log = logging.getLogger("runlm.server")

PROGRESS_EVERY_S = 0.25  # at most one progress line per file this often, besides its first and its last
PULLABLE = ("hf.co/<user>/<repo>[:<quantization>] (a GGUF repo of the Hugging Face Hub) or a catalog model ("
            f"{', '.join(sorted(catalog.CATALOG))})")


class PullCancelled(Exception):
    """The client of a streamed pull left: its download stops."""


@dataclass(frozen=True)
class Pull:
    """A pull to run: `model_key` names the files it writes (pulls of one key take turns); `download` fetches them,
    telling a hook its progress from the thread it runs in."""

    model_key: str
    download: Callable[[hub.ProgressHook], Any]


@dataclass(frozen=True)
class Finished:
    """The end of a pull, as its thread tells it: None, or what it failed with."""

    error: BaseException | None


async def prepare_pull(name: str) -> Pull:
    """What pulling `name` means: a 400 for a name runlm cannot pull; a 404 (or 403, 502) from the Hub for a repo
    or quantization it does not have (asked in a thread)."""
    bare = name.removesuffix(LATEST)
    if bare in catalog.CATALOG:
        return Pull(f"catalog:{bare}", lambda hook: catalog.pull(bare, progress=False, on_progress=hook))
    try:
        ref = hub.parse_ref(name)
    except RunlmError as exc:
        raise APIError(400, f"model: {exc}", param="model") from None
    if ref is None:
        raise APIError(400, f"model: runlm cannot pull {name!r}; it pulls {PULLABLE}", param="model",
                       code="model_not_pullable")
    chosen = await asyncio.to_thread(hub.files_to_pull, ref)
    return Pull(f"hub:{ref.repo}:{chosen.model[0].name}",
                lambda hook: hub.download(chosen, progress=False, on_progress=hook))


_turn_locks: dict[str, threading.Lock] = {}  # one per model key pulled since the server started
_turn_locks_guard = threading.Lock()


@contextmanager
def model_turn(model_key: str) -> Iterator[None]:
    """Held while a model's files are pulled: a second pull of the same model waits, then finds them in place."""
    with _turn_locks_guard:
        lock = _turn_locks.setdefault(model_key, threading.Lock())
    with lock:
        yield


def progress_line(report: hub.FileProgress) -> dict[str, Any]:
    """Ollama's line for a layer being pulled, a layer here being a file (named by its sha256 where it has one)."""
    label = report.sha256[:12] if report.sha256 else report.name
    digest = f"sha256:{report.sha256}" if report.sha256 else report.name
    return {"status": f"pulling {label}", "digest": digest, "total": report.total, "completed": report.completed}


class PullRun:
    """One pull, started at once in a thread of its own; `lines()` gives Ollama's progress objects as it goes,
    `finish()` waits for its end."""

    def __init__(self, pull: Pull):
        self.pull = pull
        self.loop = asyncio.get_running_loop()
        self.reports: asyncio.Queue[hub.FileProgress | Finished] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.error: BaseException | None = None
        threading.Thread(target=self._download, name="runlm-pull", daemon=True).start()

    def _send(self, item: hub.FileProgress | Finished) -> None:
        try:
            self.loop.call_soon_threadsafe(self.reports.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server has stopped
            self.cancelled.set()

    def _tell(self, report: hub.FileProgress) -> None:
        if self.cancelled.is_set():
            raise PullCancelled()
        self._send(report)

    def _download(self) -> None:
        error: BaseException | None = PullCancelled()  # what the pull ends with unless it gets further
        try:
            with model_turn(self.pull.model_key):
                if self.cancelled.is_set():
                    raise PullCancelled()
                self.pull.download(self._tell)
            error = None
        except Exception as exc:
            if not isinstance(exc, RunlmError | PullCancelled):
                log.error("pull %s failed", self.pull.model_key, exc_info=exc)
            error = exc
        finally:  # always: the stream waits for it
            self._send(Finished(error))

    async def lines(self) -> AsyncIterator[dict[str, Any]]:
        """`pulling manifest`, each file's progress (at most one line per PROGRESS_EVERY_S, besides its first and its
        last), `verifying sha256 digest` per file, then `success` or an `error` line. Leaving early cancels."""
        last_sent = -math.inf
        sent: dict[str, Any] | None = None
        held: dict[str, Any] | None = None  # the newest line not sent yet, sent once its turn comes
        verified: set[str] = set()
        try:
            yield {"status": "pulling manifest"}
            while True:
                wait = max(0.0, last_sent + PROGRESS_EVERY_S - self.loop.time()) if held is not None else None
                try:
                    item = await asyncio.wait_for(self.reports.get(), wait)
                except asyncio.TimeoutError:
                    assert held is not None
                    yield held
                    sent, held, last_sent = held, None, self.loop.time()
                    continue
                if isinstance(item, Finished):
                    self.error = item.error
                    yield {"status": "success"} if item.error is None else ollama_error_body(api_error_from(item.error))
                    return
                if item.verifying:
                    held = None  # that file's last line is sent already
                    if item.name not in verified:
                        verified.add(item.name)
                        yield {"status": "verifying sha256 digest"}
                    continue
                line = progress_line(item)
                if line == sent:
                    continue
                first = sent is None or sent["digest"] != line["digest"]
                if first or item.completed >= item.total or self.loop.time() - last_sent >= PROGRESS_EVERY_S:
                    yield line
                    sent, held, last_sent = line, None, self.loop.time()
                else:
                    held = line
        finally:
            self.cancelled.set()  # a client that left stops the download; after the end, nothing to stop

    async def finish(self) -> None:
        """Wait for the pull's end; what it failed with, as an APIError."""
        async for _ in self.lines():
            pass
        if self.error is not None:
            raise api_error_from(self.error)


async def ndjson(lines: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Objects as a newline-delimited JSON stream, Ollama's."""
    async for line in lines:
        yield json_line(line)
