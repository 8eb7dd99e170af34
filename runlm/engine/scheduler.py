"""One worker thread owns the engine; requests wait in a bounded queue and stream back through handles.

Continuous batching: the worker keeps up to `max_batch` generations in flight, each in a session of
its own. Each loop admits the waiting requests that fit (their sessions opened from the prompt cache,
`Engine.begin`) and then runs ONE batched step (`Engine.step`): a decode step for every generation in
flight, each at its own position over its own session, and the next chunk of every prompt being
admitted (chunked prefill: a long prompt does not stall the streams); generations join and leave at
token boundaries. Every runner batches this way (the
contract's `extend_batch` steps sessions one by one where a runner has nothing faster). A request
that fails ends alone and the worker keeps serving the others. Cancellation is checked between
tokens, and a request cancelled while it waits leaves the queue at once. Other model work (embeddings)
is handed to the worker with `run(fn)` and runs between decode steps, one call per loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, TypeVar

from runlm.engine.core import Completion, Engine, Generation, GenerationRequest, StreamRecord, Usage, merged_usage
from runlm.errors import InvalidInputError, RunlmError
from runlm.system import meminfo_bytes


class QueueFullError(RunlmError):
    """Too many requests are waiting; the client should retry later (HTTP 429)."""


class SchedulerClosedError(RunlmError):
    """The scheduler was shut down."""


class ReplicaLostError(RunlmError):
    """The process generating a request went away (a cluster replica died); the request may be retried."""


_END = object()
T = TypeVar("T")
H = TypeVar("H", bound="RequestHandle")


class RequestHandle:
    """The caller's side of a submitted request: iterate (sync or async) for records, or cancel.

    The handles of one request's n choices (a RequestGroup) share one queue (`share_with`), so their
    records arrive interleaved in the order they were made.
    """

    def __init__(self, gen: Generation, loop: asyncio.AbstractEventLoop | None,
                 share_with: RequestHandle | None = None):
        self.gen = gen
        self.kv_bytes = 0  # the most KV-cache memory its session holds (Engine.kv_bytes)
        self.kv_held = 0  # what of the scheduler's KV budget it holds: kv_bytes from admission to its end
        self._loop = loop
        self._async_q: asyncio.Queue | None
        self._sync_q: queue.Queue | None
        if share_with is not None:
            self._async_q, self._sync_q = share_with._async_q, share_with._sync_q
        else:
            self._async_q = asyncio.Queue() if loop is not None else None
            self._sync_q = queue.Queue() if loop is None else None
        self._cancel = threading.Event()
        self.done = threading.Event()
        self.on_done: Callable[[RequestHandle], None] | None = None
        self.group: list[RequestHandle] | None = None  # the sibling handles, admitted together

    @classmethod
    def choices(cls: type[H], gens: list[Generation], loop: asyncio.AbstractEventLoop | None,
                on_done: Callable[[RequestHandle], None] | None) -> list[H]:
        """One handle per choice of a request, sharing one queue, each knowing its siblings (`group`)."""
        first = cls(gens[0], loop)
        handles = [first] + [cls(g, loop, share_with=first) for g in gens[1:]]
        for handle in handles:
            handle.on_done = on_done
            handle.group = handles
        return handles

    # -- worker side ---------------------------------------------------------------------
    def _put(self, item: Any) -> None:
        if self._sync_q is not None:
            self._sync_q.put(item)
            return
        try:
            self._loop.call_soon_threadsafe(self._async_q.put_nowait, item)
        except RuntimeError:  # the event loop is gone: nobody is listening any more
            self._cancel.set()

    def _finish(self) -> None:
        self.done.set()
        self._put(_END)

    def _finish_reported(self) -> None:
        """End a request that ran: `on_done` first, so its metrics are counted before the caller hears the end."""
        if self.on_done is not None:
            try:
                self.on_done(self)
            except Exception:  # a metrics hook must never kill the worker, nor lose the request's end
                pass
        self._finish()

    # -- caller side ---------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop at the next token (or drop from the queue if not started)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def usage(self) -> Usage:
        return self.gen.usage

    def __iter__(self) -> Iterator[StreamRecord]:
        if self._sync_q is None:
            raise TypeError("this handle was submitted with an event loop: use `async for`")
        while True:
            item = self._sync_q.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def __aiter__(self) -> AsyncIterator[StreamRecord]:
        if self._async_q is None:
            raise TypeError("this handle was submitted without an event loop: use `for`")
        while True:
            item = await self._async_q.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def result(self) -> Completion:
        return _gather(list(self))

    async def aresult(self) -> Completion:
        return _gather([r async for r in self])


class RequestGroup:
    """The caller's side of a request for n choices: one stream of records tagged with their choice
    `index`, interleaved as the batch makes them; `result()` gives one Completion per choice."""

    def __init__(self, handles: list[RequestHandle]):
        self.handles = handles

    def cancel(self) -> None:
        for handle in self.handles:
            handle.cancel()

    @property
    def usage(self) -> Usage:
        """The prompt counted once, the choices' completion tokens summed."""
        return merged_usage([h.gen.usage for h in self.handles])

    def __iter__(self) -> Iterator[StreamRecord]:
        q = self.handles[0]._sync_q
        if q is None:
            raise TypeError("this group was submitted with an event loop: use `async for`")
        ended = 0
        while ended < len(self.handles):
            item = q.get()
            if item is _END:
                ended += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item

    async def __aiter__(self) -> AsyncIterator[StreamRecord]:
        q = self.handles[0]._async_q
        if q is None:
            raise TypeError("this group was submitted without an event loop: use `for`")
        ended = 0
        while ended < len(self.handles):
            item = await q.get()
            if item is _END:
                ended += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item

    def _split(self, records: list[StreamRecord]) -> list[Completion]:
        return [_gather([r for r in records if r.index == i]) for i in range(len(self.handles))]

    def result(self) -> list[Completion]:
        return self._split(list(self))

    async def aresult(self) -> list[Completion]:
        return self._split([r async for r in self])


def _gather(records: list[StreamRecord]) -> Completion:
    text = "".join(r.text for r in records)
    ids = [r.token_id for r in records if r.token_id is not None]
    lps = [r.logprob for r in records if r.logprob is not None]
    last = records[-1] if records else StreamRecord(finish_reason="cancelled")
    return Completion(text, ids, lps, last.finish_reason or "cancelled", last.usage or Usage())


def release_openmp_pools() -> bool:
    """Free the idle OpenMP thread pools other threads left behind (libgomp's omp_pause_resource_all).

    Every thread that runs a parallel region keeps a pool of OpenMP threads. After the model loads on the main
    thread, its idle pool plus the worker's pool outnumber the cores of a small machine, libgomp then stops
    spinning between regions, and each of the ~150 parallel regions of a decode step waits on a wake-up: measured
    on 2 cores, the worker decoded SmolLM2 at 45 tok/s against 120+ with the main pool released. Returns whether
    the call was made (False where the runtime is not libgomp).
    """
    try:
        pause = ctypes.CDLL("libgomp.so.1").omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(1) == 0  # omp_pause_soft: pools are rebuilt on the next parallel region


def default_kv_budget_bytes() -> int | None:
    """Half the memory the system has available now (the model is loaded by then), from /proc/meminfo's
    MemAvailable; None (no bound) where that cannot be read."""
    available = meminfo_bytes("MemAvailable")
    return None if available is None else available // 2


def kv_budget_bytes(megabytes: float | None) -> int | None:
    """A KV budget asked for in MiB (0: no bound), or the default (half of what is available now)."""
    return default_kv_budget_bytes() if megabytes is None else int(megabytes * 2**20) or None


MIN_MIXED_CHUNK = 4  # prompt tokens per step beside running streams, until the steps' costs are learnt
# A step that carries prompt rows beside running streams may take this many times their plain decode step:
# the prompt rows per step are paced to it (the bound on their inter-token latency is 2x).
MIXED_STEP_RATIO = 1.6


class StepPacer:
    """How many prompt rows a step may carry beside `streams` running streams: learnt from the steps' own
    times, so the streams' inter-token latency stays within MIXED_STEP_RATIO of a plain decode step whatever
    the model, the machine or how far the prompt has come (its rows attend to more positions as it grows)."""

    SMOOTHING = 0.3  # weight of the newest step in the running averages
    PLAIN_EVERY = 8  # while a prompt comes in, one step in this many is a plain one: its time stays current

    def __init__(self, most_rows: int):
        self.most_rows = most_rows
        self.decode_s: dict[int, float] = {}  # a plain decode step's time, by the number of streams in it
        self.plain_steps: dict[int, int] = {}  # plain steps seen, by the number of streams
        self.row_s: float | None = None  # the cost of one prompt row in a mixed step, beyond its plain step
        self.last_rows = MIN_MIXED_CHUNK
        self.mixed_in_a_row = 0

    def plain_due(self, streams: int) -> bool:
        """Whether the next step should carry no prompt rows: the plain step of this many streams is not
        known yet (two are taken: the first may be cold), or was last measured PLAIN_EVERY steps ago (a
        machine that got busier since would otherwise be read as costly prompt rows)."""
        return self.plain_steps.get(streams, 0) < 2 or self.mixed_in_a_row >= self.PLAIN_EVERY

    def prompt_rows(self, streams: int) -> int:
        """At most twice the last mixed step's rows: one step's noise never makes a giant step."""
        plain = self.decode_s.get(streams)
        if plain is None or self.row_s is None:
            return max(MIN_MIXED_CHUNK, streams)
        fitting = int((MIXED_STEP_RATIO - 1.0) * plain / self.row_s)
        return max(1, min(self.most_rows, 2 * self.last_rows, fitting))  # one row at least: the prompt goes on

    def observe(self, streams: int, prompt_rows: int, elapsed_s: float) -> None:
        if not streams:
            return
        plain = self.decode_s.get(streams)
        if not prompt_rows:
            # Down at once, up slowly: a slow step (the first one, cold; a moment the machine was busy) taken for
            # the plain time would make the prompt rows look free, and the next mixed steps would stall the streams.
            self.mixed_in_a_row = 0
            self.plain_steps[streams] = self.plain_steps.get(streams, 0) + 1
            slower = plain is not None and elapsed_s > plain
            self.decode_s[streams] = plain + self.SMOOTHING * (elapsed_s - plain) if slower else elapsed_s
            return
        self.mixed_in_a_row += 1
        self.last_rows = prompt_rows
        if plain is None:
            return
        if elapsed_s <= plain:  # a step with prompt rows does a plain step's work and more: the plain time is less
            self.decode_s[streams] = elapsed_s
            return
        row_s = (elapsed_s - plain) / prompt_rows
        self.row_s = row_s if self.row_s is None else self.row_s + self.SMOOTHING * (row_s - self.row_s)


class Scheduler:
    """A bounded FIFO of requests in front of one worker thread that owns the engine."""

    def __init__(self, engine: Engine, max_queue: int = 16, name: str = "runlm-worker", max_batch: int = 8,
                 prefill_chunk: int = 512, kv_budget_bytes: int | None = None):
        self.engine = engine
        self.max_queue = max(0, int(max_queue))
        self.max_batch = max(1, int(max_batch))
        # The KV-cache memory of all sessions in flight together, counted at each request's most (its prompt
        # and max_tokens, Engine.kv_bytes): a request admitted only while its most fits beside the others',
        # so memory never runs out mid-generation; one that could never fit is refused at submit. None: no bound.
        self.kv_budget = kv_budget_bytes if kv_budget_bytes else None
        self.kv_held = 0
        # Prompt tokens run per step for the requests being admitted: `prefill_chunk` between them while nothing
        # else runs; beside running streams, as many as keep the step within MIXED_STEP_RATIO times a plain
        # decode step of those streams (StepPacer), so their tokens keep coming while a long prompt comes in.
        self.prefill_chunk = max(1, int(prefill_chunk))
        self.pacer = StepPacer(self.prefill_chunk)
        self.active: list[RequestHandle] = []  # in flight, each with its generation's session
        self.prefilling: list[RequestHandle] = []  # admitted; their prompts run chunk by chunk in the steps
        self._waiting: deque[RequestHandle] = deque()
        self._planning = 0  # requests holding a queue place while they are planned (Scheduler.planning)
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()  # run(fn): model work besides decoding
        self._cond = threading.Condition()
        self._closed = False
        release_openmp_pools()  # the loading thread's pool would slow every step of the worker's
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Requests waiting (not counting those running)."""
        with self._cond:
            return sum(1 for h in self._waiting if not h.cancelled)

    @property
    def busy(self) -> bool:
        return bool(self.active or self.prefilling)

    @property
    def in_flight(self) -> int:
        return len(self.active) + len(self.prefilling)

    def replica_stats(self) -> list[dict[str, Any]]:
        """Per-replica reports for /metrics: none here (one local worker; the server's own gauges cover it).
        A cluster's scheduler (runlm.cluster.remote) returns one per replica."""
        return []

    @contextmanager
    def planning(self) -> Iterator[None]:
        """Hold a place in the queue while a request is planned (its chat template rendered, its prompt
        tokenized, its image decoded), or raise QueueFullError before any of that work: a flood of requests
        is refused at the door instead of each decoding its image and then finding the queue full."""
        with self._cond:
            if self._closed:
                raise SchedulerClosedError("the server is shutting down")
            ahead = self.queue_depth + self._planning
            if ahead >= self._queue_room():
                raise QueueFullError(
                    f"the server is busy: {ahead} requests are already waiting "
                    f"(max_queue {self.max_queue}); retry later")
            self._planning += 1
        try:
            yield
        finally:
            with self._cond:
                self._planning -= 1

    def submit(
        self,
        request: GenerationRequest,
        loop: asyncio.AbstractEventLoop | None = None,
        on_done: Callable[[RequestHandle], None] | None = None,
    ) -> RequestHandle:
        """Validate and enqueue; raises InvalidInputError / ContextOverflowError / QueueFullError at once.

        With `loop`, records are delivered into that asyncio loop (iterate with `async for`); `on_done`
        runs on the worker thread when the request ends (metrics).
        """
        gen = self.engine.new_generation(request, submitted_at=time.perf_counter())
        handle = RequestHandle(gen, loop)
        handle.on_done = on_done
        self._enqueue([handle])
        return handle

    def submit_group(
        self,
        request: GenerationRequest,
        n: int,
        loop: asyncio.AbstractEventLoop | None = None,
        on_done: Callable[[RequestHandle], None] | None = None,
    ) -> RequestGroup:
        """Enqueue one request for `n` choices (Engine.new_choices): admitted together, prefilled once
        (Engine.start_group), then decoded side by side in the batch. A group larger than the free batch
        slots waits for them, or runs alone above `max_batch` when nothing else is in flight."""
        handles = RequestHandle.choices(self.engine.new_choices(request, n, submitted_at=time.perf_counter()),
                                        loop, on_done)
        self._enqueue(handles)
        return RequestGroup(handles)

    def _enqueue(self, handles: list[RequestHandle]) -> None:
        """Queue one request's handles (a group's together), or raise QueueFullError / SchedulerClosedError.

        Waiting requests first fill the free batch slots (the worker admits what fits each step), then the
        queue; a group larger than the whole queue is still taken when nothing waits."""
        self._check_kv(handles)
        with self._cond:
            if self._closed:
                raise SchedulerClosedError("the server is shutting down")
            if any(h.cancelled for h in self._waiting):  # cancelled requests do not hold slots
                self._waiting = deque(h for h in self._waiting if not h.cancelled or self._drop(h))
            over = len(self._waiting) + len(handles) > self._queue_room()
            if over and (self._waiting or len(handles) == 1):
                raise QueueFullError(
                    f"the server is busy: {len(self._waiting)} requests are already waiting (max_queue "
                    f"{self.max_queue}); retry later"
                )
            self._waiting.extend(handles)
            self._cond.notify()

    def _queue_room(self) -> int:
        """How many requests may wait: the queue, plus the batch slots free now (they are admitted next step)."""
        return self.max_queue + max(0, self.max_batch - self.in_flight)

    def _check_kv(self, handles: list[RequestHandle]) -> None:
        """Set each handle's KV need; a request whose need is past the whole budget is refused (InvalidInputError:
        it could never run, so waiting would not help)."""
        for handle in handles:
            handle.kv_bytes = self.engine.kv_bytes(handle.gen)
        need = sum(handle.kv_bytes for handle in handles)
        if self.kv_budget is not None and need > self.kv_budget:
            positions = self.engine.positions(handles[0].gen)
            choices = f" for each of {len(handles)} choices" if len(handles) > 1 else ""
            raise InvalidInputError(
                f"max_tokens: this request's KV cache may reach {need / 2**20:.0f} MiB ({positions} positions"
                f"{choices}), more than the server's KV-cache budget of {self.kv_budget / 2**20:.0f} MiB: ask for "
                "fewer tokens (max_tokens, a shorter prompt) or fewer choices (n)")

    def run(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the worker between decode steps; the future gets its result or its exception.

        For model work that is not a generation (embeddings): the runner is not thread-safe, so whatever
        touches it runs on this one thread. Calls wait in a bounded line of their own (QueueFullError).
        """
        future: Future[T] = Future()
        with self._cond:
            if self._closed:
                raise SchedulerClosedError("the server is shutting down")
            if len(self._calls) >= self.max_queue + self.max_batch:
                raise QueueFullError(f"the server is busy: {len(self._calls)} calls are already waiting; retry later")
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    def _drop(self, handle: RequestHandle) -> bool:
        self._release_kv(handle)
        handle._put(handle.gen.cancel())
        handle._finish()
        return False

    def _release_kv(self, handle: RequestHandle) -> None:
        """Give back what `handle` holds of the KV budget (on the worker: only admitted handles hold any)."""
        if handle.kv_held:
            self.kv_held -= handle.kv_held
            handle.kv_held = 0

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking requests, cancel what waits and what runs, and end the worker."""
        with self._cond:
            self._closed = True
            waiting, self._waiting = list(self._waiting), deque()
            calls, self._calls = list(self._calls), deque()
            for handle in self.active:
                handle.cancel()
            for handle in self.prefilling:
                handle.cancel()
            self._cond.notify_all()
        for h in waiting:
            self._drop(h)
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(SchedulerClosedError("the server is shutting down"))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- the worker ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self.busy or self._calls or self._closed):
                    self._cond.wait()
                if self._closed and not self.busy:
                    return
                call = self._calls.popleft() if self._calls else None
                admitted = self._next_admissions() if not self._closed else []
            if call is not None:
                self._run_call(*call)
            for group in admitted:
                if len(group) == 1:
                    self._admit(group[0])
                else:
                    self._admit_group(group)
            if self.busy:
                self._step()

    def _next_admissions(self) -> list[list[RequestHandle]]:
        """The waiting requests the batch has room for, in order: each one handle, or all of a group's that
        still wait (a group fits when its choices fit the free slots, or when nothing else runs)."""
        admitted: list[list[RequestHandle]] = []
        taken = 0
        while self._waiting:
            head = self._waiting[0]
            size = 1
            if head.group is not None:
                for handle in itertools.islice(self._waiting, 1, None):
                    if handle.group is not head.group:
                        break
                    size += 1
            if (self.busy or admitted) and self.in_flight + taken + size > self.max_batch:
                break
            need = sum(h.kv_bytes for h in itertools.islice(self._waiting, size))
            if self.kv_budget is not None and self.kv_held + need > self.kv_budget:
                break  # it waits (first in line) until enough of the running requests end
            group = [self._waiting.popleft() for _ in range(size)]
            for handle in group:
                handle.kv_held = handle.kv_bytes
            self.kv_held += need
            admitted.append(group)
            taken += size
        return admitted

    @staticmethod
    def _run_call(fn: Callable[[], Any], future: Future) -> None:
        if not future.set_running_or_notify_cancel():  # the caller gave up while it waited
            return
        try:
            future.set_result(fn())
        except Exception as exc:  # delivered to the caller; the worker lives on
            future.set_exception(exc)

    def _admit(self, handle: RequestHandle) -> None:
        """Open a new request's session; its prompt then runs chunk by chunk in the next steps, beside the
        decode steps of the requests in flight (an image prompt runs whole, at once)."""
        if handle.cancelled:
            self._drop(handle)
            return
        try:
            record = self.engine.begin(handle.gen)
        except Exception as exc:  # delivered to the caller; the worker lives on
            handle.gen.fail()
            self._end(handle, exc)
            return
        if record is None:
            self.prefilling.append(handle)
            return
        self._started(handle, record)

    def _started(self, handle: RequestHandle, record: StreamRecord) -> None:
        """A request's first record: it joins the batch, or ends at once."""
        handle._put(record)
        if handle.gen.finished:
            self._end(handle)
        else:
            self.active.append(handle)

    def _admit_group(self, handles: list[RequestHandle]) -> None:
        """Prefill a request's choices once (the engine forks the session); they join the batch together."""
        for handle in [h for h in handles if h.cancelled]:
            handles.remove(handle)
            self._drop(handle)
        if len(handles) <= 1:
            for handle in handles:
                self._admit(handle)
            return
        try:
            records = self.engine.start_group([h.gen for h in handles])
        except Exception as exc:  # every choice gets the error; the worker lives on
            for handle in handles:
                handle.gen.fail()
                self._end(handle, exc)
            return
        for handle, record in zip(handles, records):
            handle._put(record)
            if handle.gen.finished:
                self._end(handle)
            else:
                self.active.append(handle)

    def _step(self) -> None:
        """One batched step: a decode step for every generation in flight, plus the next chunk of the prompt
        being admitted."""
        for handle in [h for h in self.active if h.cancelled]:
            self.active.remove(handle)
            self._end(handle, handle.gen.cancel())
        for handle in [h for h in self.prefilling if h.cancelled]:
            self.prefilling.remove(handle)
            self._end(handle, handle.gen.cancel())
        if not self.busy:
            return
        streams = len(self.active)
        prefilling = [] if streams and self.pacer.plain_due(streams) else self.prefilling
        if self.active:
            chunk = max(1, self.pacer.prompt_rows(streams) // max(1, len(prefilling)))
        else:
            chunk = max(MIN_MIXED_CHUNK, self.prefill_chunk // len(prefilling))
        admitting = {id(h.gen): h for h in prefilling}
        by_gen = {id(h.gen): h for h in self.active}
        started = time.perf_counter()
        results = self.engine.step([h.gen for h in self.active], [h.gen for h in prefilling], chunk)
        self.pacer.observe(streams, chunk * len(prefilling), time.perf_counter() - started)
        for gen, result in results:
            if id(gen) in admitting:  # its prompt's last chunk ran (or it failed)
                handle = admitting[id(gen)]
                self.prefilling.remove(handle)
                if isinstance(result, Exception):
                    self._end(handle, result)
                else:
                    self._started(handle, result)
                continue
            handle = by_gen[id(gen)]  # a generation that kept a draft has several records, the last one ending it
            if isinstance(result, Exception) or result.finish_reason is not None:
                self.active.remove(handle)
                self._end(handle, result)
            else:
                handle._put(result)

    def _end(self, handle: RequestHandle, last: StreamRecord | Exception | None = None) -> None:
        """Deliver the last record (or the error), keep the session for the prompt cache, end the request."""
        self._release_kv(handle)
        if last is not None:
            handle._put(last)
        try:
            self.engine.finish(handle.gen)
        except Exception:  # the prompt cache is an optimisation: never a reason to lose the worker
            pass
        handle._finish_reported()
