"""The front's scheduler: the server's routes submit to replicas on Ray Serve as they would to a local one.

`RemoteScheduler` has the face of `runlm.engine.Scheduler` (submit, submit_group, run, queue_depth,
in_flight, busy, close), so `create_app` composes the very same routes over it. A request is validated
and mirrored here (the front's Engine makes its Generations, which are never stepped: the replica's
`Ended` fills in how each ended), sent with its prompt's block hashes for the prefix-affinity router,
and its records are pumped from the replica's stream into ordinary RequestHandles.

Faults: a request whose replica dies before its first record is sent again (the router picks among the
survivors); a stream that had started ends with a `ReplicaLostError` (an error event for the client).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

from runlm.cluster.replica import Ended, portable_request
from runlm.cluster.routing import prefix_hashes
from runlm.engine import Engine
from runlm.engine.core import GenerationRequest
from runlm.engine.scheduler import (
    QueueFullError,
    ReplicaLostError,
    RequestGroup,
    RequestHandle,
    SchedulerClosedError,
)

T = TypeVar("T")
# This process's Ray request routers (ray_router.RunlmRouter): they hold the replicas' latest reports. Kept
# here, not in ray_router, whose globals Ray may replace when it ships the router class to a process.
_ROUTERS: weakref.WeakSet = weakref.WeakSet()
SEND_ATTEMPTS = 3  # a request is sent at most this often while replicas die before it starts


class RemoteHandle(RequestHandle):
    """A RequestHandle whose cancel also stops the pump (and with it the replica's generation)."""

    on_cancel: Callable[[], None] | None = None

    def cancel(self) -> None:
        super().cancel()
        if self.on_cancel is not None:
            self.on_cancel()


class RemoteScheduler:
    """Submits to a Ray Serve deployment of `ModelReplica`s (its DeploymentHandle)."""

    def __init__(self, engine: Engine, replicas: Any, *, max_batch: int = 8, max_queue: int = 16,
                 stats: Callable[[], list[dict[str, Any]]] | None = None):
        self.engine = engine  # the front's: validates and mirrors requests; runs only `run(fn)` work
        self.max_batch = max_batch
        self.max_queue = max_queue
        self._streams = replicas.options(stream=True, method_name="generate")
        self._stats = stats
        self._waiting = 0
        self._planning = 0  # on the event loop only, as _waiting
        self._running = 0
        self._closed = False
        self._calls = ThreadPoolExecutor(1, thread_name_prefix="runlm-front")  # the front's runner: one thread

    @property
    def queue_depth(self) -> int:
        """Requests sent and not yet started (waiting in the router or in a replica's queue)."""
        return self._waiting

    @property
    def in_flight(self) -> int:
        return self._running

    @property
    def busy(self) -> bool:
        return bool(self._running)

    def replica_stats(self) -> list[dict[str, Any]]:
        """Each replica's last report (load, prompt-cache hit rate, tokens/s), as the router last heard it."""
        return self._stats() if self._stats is not None else []

    @contextmanager
    def planning(self) -> Iterator[None]:
        """Hold a place in the front's line while a request is planned (Scheduler.planning)."""
        if self._closed:
            raise SchedulerClosedError("the server is shutting down")
        if self._waiting + self._planning >= self.max_queue + self.max_batch:
            raise QueueFullError(f"the server is busy: {self._waiting + self._planning} requests are already "
                                 "waiting; retry later")
        self._planning += 1
        try:
            yield
        finally:
            self._planning -= 1

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None,
               on_done: Callable[[RequestHandle], None] | None = None) -> RequestHandle:
        return self.submit_group(request, 1, loop, on_done).handles[0]

    def submit_group(self, request: GenerationRequest, n: int, loop: asyncio.AbstractEventLoop | None = None,
                     on_done: Callable[[RequestHandle], None] | None = None) -> RequestGroup:
        """Validate here (bad input raises at once, as the local scheduler does), then send to a replica."""
        if self._closed:
            raise SchedulerClosedError("the server is shutting down")
        if loop is None:
            raise TypeError("the cluster's scheduler delivers records into an event loop: pass `loop`")
        if self._waiting >= self.max_queue + self.max_batch:
            raise QueueFullError(f"the server is busy: {self._waiting} requests are already waiting; retry later")
        handles = RemoteHandle.choices(self.engine.new_choices(request, n, submitted_at=time.perf_counter()),
                                       loop, on_done)
        self._waiting += 1
        pump = loop.create_task(self._pump(request, handles))
        for handle in handles:
            handle.on_cancel = pump.cancel
        return RequestGroup(handles)

    async def _pump(self, request: GenerationRequest, handles: list[RemoteHandle]) -> None:
        """Send the request, deliver its records; resend while no record has come and replicas die."""
        from ray.exceptions import RayActorError, RayTaskError
        from ray.serve.exceptions import BackPressureError

        payload, prefix = portable_request(request), prefix_hashes(request.prompt_ids)
        started = False
        try:
            for attempt in range(1, SEND_ATTEMPTS + 1):
                stream = self._streams.remote(payload, len(handles), prefix=prefix)
                try:
                    async for item in stream:
                        if not started:
                            started = True
                            self._waiting -= 1
                            self._running += 1
                        if isinstance(item, Ended):
                            mirror(handles[item.index], item)
                        else:
                            handles[item.index]._put(item)
                    return
                except asyncio.CancelledError:
                    stream.cancel()
                    return
                except RayActorError as exc:
                    if started or attempt == SEND_ATTEMPTS:
                        raise ReplicaLostError(
                            "the replica serving this request failed" + (" mid-stream" if started else "")
                        ) from exc
                except BackPressureError as exc:
                    raise QueueFullError("the server is busy: every replica's queue is full; retry later") from exc
                except RayTaskError as exc:  # the replica raised: deliver its own exception
                    raise exc.cause if isinstance(exc.cause, Exception) else exc from None
        except Exception as exc:  # delivered to the caller, as the local scheduler does
            for handle in handles:
                handle.gen.fail()
                handle._put(exc)
        finally:
            if started:
                self._running -= 1
            else:
                self._waiting -= 1
            for handle in handles:
                handle._finish_reported()

    def run(self, fn: Callable[[], T]) -> Future[T]:
        """Model work that is not a generation (embeddings) runs on the front's own copy of the model."""
        if self._closed:
            raise SchedulerClosedError("the server is shutting down")
        return self._calls.submit(fn)

    def close(self, timeout: float = 5.0) -> None:
        self._closed = True
        self._calls.shutdown(wait=False, cancel_futures=True)


def mirror(handle: RequestHandle, ended: Ended) -> None:
    """The front's Generation takes over how the replica's ended (what the routes and metrics read)."""
    gen = handle.gen
    gen.finish_reason, gen.usage = ended.finish_reason, ended.usage
    gen.stops.matched = ended.matched_stop


def track_router(router: Any) -> None:
    """Called by each RunlmRouter as it starts, so replica_reports can read what replicas reported to it."""
    _ROUTERS.add(router)


def replica_reports() -> list[dict[str, Any]]:
    """The replicas' latest reports, as this process's routers hold them (one entry per replica)."""
    reports: dict[str, dict[str, Any]] = {}
    for router in list(_ROUTERS):
        for replica_id, replica in router.curr_replicas.items():
            reports[replica_id.unique_id] = {**(replica.routing_stats or {}), "replica": replica_id.unique_id}
    return [reports[k] for k in sorted(reports)]
