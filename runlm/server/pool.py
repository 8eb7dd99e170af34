"""Several models behind one server, each loaded on the first request that names it.

Each loaded model has a ServerState of its own (its Engine, Scheduler, prompt cache and KV budget), so one model's
batch, queue and cache never hold another's requests. A model loads in a thread, once however many requests wait
for it, while the event loop serves /health and the other models. At most `max_loaded` models are loaded: making
room unloads the least recently used one that no request holds, and a loaded model that stays idle past its
keep-alive (Ollama's `keep_alive`, or the server's default) is unloaded by a timer. A request holds its model from
the moment it is resolved until its response has been sent, streams included (ModelLeases).

A server started on one model with nothing to load it again from (create_app without a models directory) is the
pool of that model alone, pinned: it is never unloaded and keep_alive does not apply to it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from runlm.errors import InvalidInputError, RunlmError
from runlm.server.errors import APIError
from runlm.server.library import ModelLibrary, ModelSource
from runlm.server.state import ServerState
from runlm.server.workers import Workers
from runlm.system import release_free_heap

log = logging.getLogger("runlm.server")

FOREVER = math.inf
# Ollama's defaults: a model stays loaded 5 minutes after its last request. One model at a time here, where
# Ollama keeps 3: runlm does not measure what a model will take before loading it, each model's KV budget is half
# the memory available at its load, and a machine sized for one model that loads two swaps or is killed, where a
# switch costs a reload (from the page cache, for a file read recently).
DEFAULT_KEEP_ALIVE_S = 300.0
DEFAULT_MAX_LOADED = 1
DEFAULT_LOAD_WAIT_S = 300.0  # how long a request may wait for a loaded model to become free to unload
BUSY_RECHECK_S = 0.25  # how often a wait for room, or an expiry that found the model busy, looks again
NAMES_IN_ERRORS = 20
LEASES_KEY = "runlm.model_leases"  # the ASGI scope entry listing the models a request holds

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: str | int | float, param: str = "keep_alive") -> float:
    """Ollama's keep_alive in seconds: a number is seconds, a string a Go duration ("5m", "1h30m", "0.5s") or a
    number of seconds; negative: forever (FOREVER); 0: unload as soon as the request is done. Anything else is an
    InvalidInputError naming `param`."""
    seconds: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.removeprefix("+"))
            parts = _DURATION_PART.findall(body)
            if parts and "".join(number + unit for number, unit in parts) == body:
                seconds = sign * sum(float(number) * _UNIT_S[unit] for number, unit in parts)
    if seconds is None or math.isnan(seconds):
        raise InvalidInputError(f"{param}: expected a duration such as \"5m\", \"1h30m\" or \"30s\", or a number of "
                                f"seconds (negative: forever, 0: unload at once), got {value!r}")
    return FOREVER if seconds < 0 else seconds


@dataclass(eq=False)
class Resident:
    """A loaded model: its state, the requests holding it, and when it goes if nothing holds it."""

    source: ModelSource
    state: ServerState
    keep_alive_s: float
    pinned: bool = False  # nothing can load it again: never unloaded
    leases: int = 0
    last_used: float = field(default_factory=time.monotonic)
    expires_at: float = FOREVER  # wall-clock time it unloads at, while idle
    timer: asyncio.TimerHandle | None = None

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def idle(self) -> bool:
        """Nothing holds it and its scheduler has nothing to finish (a stream whose client left)."""
        scheduler = self.state.scheduler
        return self.leases == 0 and not scheduler.busy and scheduler.queue_depth == 0

    def expiry(self) -> float:
        """When it unloads if no request comes (wall-clock; FOREVER for never)."""
        if self.pinned or self.keep_alive_s == FOREVER:
            return FOREVER
        return time.time() + self.keep_alive_s if self.leases else self.expires_at


@dataclass(eq=False)
class Loading:
    """A load under way, and how many requests wait for it: the model comes loaded with a lease for each."""

    task: asyncio.Task
    waiters: int = 0


def freeze_loaded() -> None:
    """Freeze a model just loaded out of the garbage collector's view, as the server's first model is
    (workers.tune_for_latency): the full collections requests trigger then scan only what the requests made."""
    gc.collect()
    gc.freeze()


def release_memory() -> None:
    """Collect what an unloaded model left (its reference cycles, out of the collector's view while frozen),
    freeze what lives again, and give the freed pages back to the system."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    release_free_heap()


class ModelPool:
    """The models a server serves by name: the loaded ones (Resident) and, with a `library`, every one it may
    load. `build` makes a model's ServerState from its source (in a worker thread: it loads the model)."""

    def __init__(self, workers: Workers, library: ModelLibrary | None = None,
                 build: Callable[[ModelSource], ServerState] | None = None, *, max_loaded: int = DEFAULT_MAX_LOADED,
                 keep_alive_s: float = DEFAULT_KEEP_ALIVE_S, load_wait_s: float = DEFAULT_LOAD_WAIT_S):
        if max_loaded < 1:
            raise InvalidInputError(f"max_loaded must be at least 1, got {max_loaded}")
        self.workers = workers
        self.library = library
        self.build = build
        self.max_loaded = max_loaded
        self.keep_alive_s = keep_alive_s
        self.load_wait_s = load_wait_s
        self.default_name: str | None = None  # what a request that names no model gets (the preloaded model)
        self._resident: dict[str, Resident] = {}
        self._loading: dict[str, Loading] = {}
        self._reserved = 0  # room taken by loads under way
        self._changed: asyncio.Event | None = None
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    # -- what is served ------------------------------------------------------------------------------------

    def add(self, source: ModelSource, state: ServerState, pinned: bool = False) -> Resident:
        """A model loaded before the server starts (the one it was started with); the default model."""
        resident = Resident(source, state, FOREVER if pinned else self.keep_alive_s, pinned=pinned)
        self._resident[source.name] = resident
        self.default_name = self.default_name or source.name
        return resident

    def start(self) -> None:
        """On the event loop, as the server starts: the preloaded models' keep-alive timers."""
        for resident in self._resident.values():
            self._schedule_expiry(resident)

    def sources(self) -> list[ModelSource]:
        """Every model that can be served: the loaded ones first, then those the library can load."""
        loaded = [r.source for r in self._resident.values()]
        listed = self.library.sources() if self.library is not None else []
        return loaded + [s for s in listed if not any(r.answers_to(s.name) for r in loaded)]

    def find(self, name: str) -> ModelSource:
        """The source a name means, or a 404 that lists the names served."""
        resident = next((r for r in self._resident.values() if r.source.answers_to(name)), None)
        if resident is not None:
            return resident.source
        source = self.library.find(name) if self.library is not None else None
        if source is None:
            raise APIError(404, f"model {name!r} is not served here; this server serves {self.names_text()} "
                                "(see GET /v1/models)", param="model", code="model_not_found")
        return source

    def names_text(self) -> str:
        names = [s.name for s in self.sources()]
        more = f" and {len(names) - NAMES_IN_ERRORS} more" if len(names) > NAMES_IN_ERRORS else ""
        return ", ".join(repr(n) for n in names[:NAMES_IN_ERRORS]) + more if names else "no models"

    def default_source(self) -> ModelSource:
        """The model of a request that names none: the preloaded one, the only one, or the last one used."""
        if self.default_name is not None and self.default_name in self._resident:
            return self._resident[self.default_name].source
        if self.default_name is not None:
            return self.find(self.default_name)
        sources = self.sources()
        if len(sources) == 1:
            return sources[0]
        if self._resident:
            return max(self._resident.values(), key=lambda r: r.last_used).source
        raise APIError(400, f"model: this server serves several models; name one of {self.names_text()}",
                       param="model", code="model_required")

    @property
    def loaded(self) -> list[Resident]:
        return list(self._resident.values())

    def resident(self, name: str) -> Resident | None:
        return self._resident.get(name)

    def loading(self, name: str) -> bool:
        return name in self._loading

    @property
    def max_context(self) -> int:
        """The longest context of the loaded models (a bound on the items a request body may hold before its
        model is known); a generous one while none is loaded."""
        return max((r.state.engine.context_length for r in self._resident.values()), default=1 << 17)

    # -- holding a model for a request ---------------------------------------------------------------------

    async def use(self, request: Request, name: str | None, keep_alive: str | int | float | None = None) -> ServerState:
        """The state of the model `name` names (None: the default one), loaded first where it is not, held until
        the request's response has been sent (ModelLeases releases it)."""
        keep_alive_s = None if keep_alive is None else parse_keep_alive(keep_alive)
        resident = await self.acquire(name, keep_alive_s)
        leases = request.scope.get(LEASES_KEY)
        if leases is None:  # not under ModelLeases: held no longer than this call
            self.release(resident)
        else:
            leases.append(resident)
        return resident.state

    async def acquire(self, name: str | None, keep_alive_s: float | None = None) -> Resident:
        """The loaded model, one lease more; a model being loaded is waited for, one not loaded is loaded (one
        load per model at a time). `keep_alive_s`: how long it stays loaded once idle (None: the server's
        default). Pair with `release`."""
        source = self.default_source() if name is None else self.find(name)
        resident = self._resident.get(source.name)
        if resident is not None:
            # a name the library resolved beyond those listed (hf.co/user/repo:Q4_K_M, as pulled) is the model's too
            resident.state.aliases |= source.aliases
            resident.leases += 1
            if resident.timer is not None:
                resident.timer.cancel()
                resident.timer = None
        else:
            resident = await self._wait_for_load(source)
        resident.last_used = time.monotonic()
        if not resident.pinned:  # as Ollama: each request sets it, to its keep_alive or the server's default
            resident.keep_alive_s = self.keep_alive_s if keep_alive_s is None else keep_alive_s
        return resident

    async def _wait_for_load(self, source: ModelSource) -> Resident:
        """Load the model, or wait for the load under way; it comes with this request's lease taken."""
        if self.build is None or self._closed:
            raise APIError(503, f"model {source.name!r} is not loaded", code="model_not_loaded")
        loading = self._loading.get(source.name)
        if loading is None:
            loading = Loading(asyncio.get_running_loop().create_task(self._load(source)))
            loading.task.add_done_callback(lambda done, name=source.name: self._load_done(name, loading))
            self._loading[source.name] = loading
        loading.waiters += 1
        try:
            return await asyncio.shield(loading.task)
        except asyncio.CancelledError:  # the request went away: give back what was taken for it
            task = loading.task
            if task.done() and not task.cancelled() and task.exception() is None:
                self.release(task.result())
            else:
                loading.waiters -= 1
            raise

    def release(self, resident: Resident) -> None:
        """A request is done with the model: from its last request on, its keep-alive counts."""
        resident.leases -= 1
        resident.last_used = time.monotonic()
        if resident.leases == 0:
            self._schedule_expiry(resident)
        self._notify()

    async def unload(self, name: str) -> None:
        """Unload a model now, or, while requests hold it, as soon as they are done (Ollama's keep_alive 0 on an
        empty request). A pinned model stays."""
        resident = self._resident.get(name)
        if resident is None or resident.pinned:
            return
        resident.keep_alive_s = 0.0
        if resident.idle:
            await self._unload(resident)
        elif not resident.leases:  # a stream still ending: the expiry looks again until it has
            self._schedule_expiry(resident)

    # -- loading and unloading -----------------------------------------------------------------------------

    def _load_done(self, name: str, loading: Loading) -> None:
        if self._loading.get(name) is loading:
            del self._loading[name]
        if not loading.task.cancelled():
            loading.task.exception()  # read, so a load no request waits for any more does not warn

    async def _load(self, source: ModelSource) -> Resident:
        await self._make_room()
        started = time.perf_counter()
        try:
            state = await asyncio.to_thread(self._build_state, source)
        except APIError:
            raise
        except (RunlmError, OSError, MemoryError) as exc:
            log.warning("model %s could not be loaded: %s", source.name, exc)
            raise APIError(422, f"model {source.name!r} could not be loaded: {exc}", param="model",
                           code="model_load_failed") from None
        finally:
            self._reserved -= 1
            self._notify()
        if self._closed:
            await asyncio.to_thread(state.scheduler.close)
            raise APIError(503, "the server is shutting down", code="shutting_down")
        # held at once for the requests that waited (none can unload it before they resume); if they all left,
        # its keep-alive counts from now
        waiting = self._loading[source.name].waiters
        resident = Resident(source, state, self.keep_alive_s, leases=waiting)
        self._resident[source.name] = resident
        if not waiting:
            self._schedule_expiry(resident)
        log.info("loaded model %s in %.1f s", source.name, time.perf_counter() - started)
        return resident

    def _build_state(self, source: ModelSource) -> ServerState:
        assert self.build is not None
        state = self.build(source)
        freeze_loaded()
        return state

    async def _make_room(self) -> None:
        """Take room for one more model: unload the least recently used idle ones while the pool is full, or
        wait for one to become idle (503 after `load_wait_s`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.load_wait_s
        while len(self._resident) + self._reserved >= self.max_loaded:
            idle = [r for r in self._resident.values() if not r.pinned and r.idle]
            if idle:
                await self._unload(min(idle, key=lambda r: r.last_used))
                continue
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise APIError(503, f"{len(self._resident)} models are loaded (at most {self.max_loaded}) and all "
                                    "are in use; retry later", code="models_busy", headers={"Retry-After": "5"})
            await self._wait_for_change(min(remaining, BUSY_RECHECK_S))
        self._reserved += 1

    async def _unload(self, resident: Resident) -> None:
        if self._resident.get(resident.name) is not resident:
            return
        del self._resident[resident.name]
        if resident.timer is not None:
            resident.timer.cancel()
            resident.timer = None
        await asyncio.to_thread(resident.state.scheduler.close)
        self._notify()
        log.info("unloaded model %s", resident.name)
        # once this step is over, and the references of this coroutine and its caller with it
        asyncio.get_running_loop().call_soon(lambda: self._spawn(asyncio.to_thread(release_memory)))

    def _schedule_expiry(self, resident: Resident) -> None:
        if resident.timer is not None:
            resident.timer.cancel()
            resident.timer = None
        if resident.pinned or resident.keep_alive_s == FOREVER:
            resident.expires_at = FOREVER
            return
        resident.expires_at = time.time() + resident.keep_alive_s
        resident.timer = asyncio.get_running_loop().call_later(resident.keep_alive_s, self._expire, resident)

    def _expire(self, resident: Resident) -> None:
        resident.timer = None
        if self._resident.get(resident.name) is not resident or resident.leases:
            return
        if not resident.idle:  # a generation still ending after its response (a client that hung up)
            resident.timer = asyncio.get_running_loop().call_later(BUSY_RECHECK_S, self._expire, resident)
            return
        self._spawn(self._unload(resident))

    def _spawn(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def _wait_for_change(self, timeout: float) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def close(self) -> None:
        """Stop every model's scheduler (the server is shutting down)."""
        self._closed = True
        for resident in self._resident.values():
            if resident.timer is not None:
                resident.timer.cancel()
            resident.state.scheduler.close()
        self._resident.clear()


async def get_pool(request: Request) -> ModelPool:
    """FastAPI dependency: the app's models."""
    return request.app.state.models


class ModelLeases:
    """ASGI middleware: the models a request resolved (ModelPool.use) are released once its response has been
    sent, a streamed one included, so no model is unloaded under a request and keep-alive counts from its end."""

    def __init__(self, app: Any, pool: ModelPool):
        self.app = app
        self.pool = pool

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        leases: list[Resident] = []
        scope[LEASES_KEY] = leases
        try:
            await self.app(scope, receive, send)
        finally:
            for resident in leases:
                self.pool.release(resident)


__all__ = ["DEFAULT_KEEP_ALIVE_S", "DEFAULT_LOAD_WAIT_S", "DEFAULT_MAX_LOADED", "FOREVER", "ModelLeases", "ModelPool",
           "Resident", "get_pool", "parse_keep_alive"]
