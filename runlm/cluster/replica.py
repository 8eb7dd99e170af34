"""One runlm replica: a loaded model with its own engine and scheduler, streaming records to the front.

A replica is the single server's model half (Engine + Scheduler) without HTTP: the front process plans
each request (template, tokens, validation) and sends the GenerationRequest; the replica streams back
the StreamRecords its scheduler makes and, per generation, an `Ended` that lets the front's mirror of
the generation answer what the routes ask of it (why it ended, usage, the stop string it matched).
Nothing here imports Ray: `deploy.py` wraps this class as a Serve deployment.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from runlm.engine import Engine, Scheduler
from runlm.engine.core import GenerationRequest, StreamRecord, Usage
from runlm.engine.grammar import GrammarConstraint
from runlm.engine.scheduler import RequestHandle, kv_budget_bytes
from runlm.engine.speculative import Speculation


@dataclass
class Ended:
    """How one of a request's generations ended, sent after its last record."""

    index: int
    finish_reason: str | None
    usage: Usage
    matched_stop: str | None


@dataclass(frozen=True)
class PortableGrammar:
    """A grammar constraint as it crosses processes: its grammar text (the matcher is native state and is
    rebuilt against the replica's own tokenizer)."""

    grammar: str
    n_vocab: int
    eos_ids: tuple[int, ...]


def portable_request(request: GenerationRequest) -> GenerationRequest:
    """The request as the front sends it: everything pickles (the grammar as its text)."""
    grammar = request.grammar
    if grammar is None:
        return request
    return replace(request, grammar=PortableGrammar(grammar.grammar, grammar.n_vocab, tuple(grammar.eos_ids)))


def local_request(request: GenerationRequest, tokenizer: Any) -> GenerationRequest:
    """The request as the replica runs it: a portable grammar becomes a matcher again."""
    grammar = request.grammar
    if not isinstance(grammar, PortableGrammar):
        return request
    return replace(request, grammar=GrammarConstraint(grammar.grammar, tokenizer, grammar.n_vocab,
                                                      list(grammar.eos_ids)))


@dataclass
class ReplicaOptions:
    """What a replica loads and how it runs (the single server's options that belong to the model half)."""

    model: str | None  # a catalog name or a path (None: the default model), resolved on each replica
    dtype: str = "auto"
    threads: int | None = None
    ctx: int | None = None
    swa_full: bool = False
    kv_type: str = "auto"  # the KV caches' element type (runlm.load's kv_type)
    runtime: str = "auto"  # runlm.load's runtime
    mmproj: str | None = None
    prompt_cache_mb: float = 256
    max_batch: int = 8
    max_queue: int = 16
    kv_budget_mb: float | None = None  # None: half the memory available when the replica starts; 0: no bound
    speculation: Speculation | None = None  # None: the engine's default (runlm.engine.speculative)


class ModelReplica:
    """A model, its engine and its scheduler; `generate` streams one request's records."""

    def __init__(self, options: ReplicaOptions, replica_id: str | None = None):
        from runlm.runtime import load

        self.loaded = load(options.model, dtype=options.dtype, max_context=options.ctx, mmproj=options.mmproj,
                           swa_full=options.swa_full, kv_type=options.kv_type, threads=options.threads,
                           runtime=options.runtime)
        self.engine = Engine(self.loaded.runner, self.loaded.tokenizer, context_length=self.loaded.context_length,
                             prompt_cache_mb=options.prompt_cache_mb, speculation=options.speculation)
        self.scheduler = Scheduler(self.engine, max_queue=options.max_queue, max_batch=options.max_batch,
                                   kv_budget_bytes=kv_budget_bytes(options.kv_budget_mb))
        self.replica_id = replica_id or f"pid-{os.getpid()}"
        self._started = time.monotonic()
        self._requests = self._prompt_tokens = self._cached_tokens = self._completion_tokens = 0
        self._decode_s = 0.0

    async def generate(self, request: GenerationRequest, n: int = 1,
                       prefix: list[int] | None = None) -> AsyncIterator[StreamRecord | Ended]:
        """Run one request (n choices) and stream its records, then one `Ended` per choice. `prefix` is the
        router's (the prompt's block hashes) and is not used here."""
        group = self.scheduler.submit_group(local_request(request, self.loaded.tokenizer), n,
                                            loop=asyncio.get_running_loop(), on_done=self._observe)
        try:
            async for record in group:
                yield record
        finally:
            group.cancel()  # a front that went away (or a cancelled stream) stops the generation here
        for handle in group.handles:
            gen = handle.gen
            yield Ended(gen.index, gen.finish_reason, gen.usage, gen.stops.matched)

    def _observe(self, handle: RequestHandle) -> None:
        """Per-replica counters (worker thread; plain int adds, read without a lock for stats)."""
        usage = handle.gen.usage
        if handle.gen.index == 0:
            self._requests += 1
            self._prompt_tokens += usage.prompt_tokens
            self._cached_tokens += usage.cached_tokens
        self._completion_tokens += usage.completion_tokens
        self._decode_s += usage.decode_s

    def stats(self) -> dict[str, Any]:
        """What this replica reports to the router and to /metrics: load and how well its prompt cache does."""
        cache = self.engine.prompt_cache
        return {
            "replica": self.replica_id,
            "queue_depth": self.scheduler.queue_depth,
            "running": self.scheduler.in_flight,
            "requests": self._requests,
            "prompt_tokens": self._prompt_tokens,
            "cached_tokens": self._cached_tokens,
            "completion_tokens": self._completion_tokens,
            "cache_hit_rate": self._cached_tokens / self._prompt_tokens if self._prompt_tokens else 0.0,
            "decode_tokens_per_s": self._completion_tokens / self._decode_s if self._decode_s else 0.0,
            "prompt_cache_entries": len(cache) if cache else 0,
            "prompt_cache_bytes": cache.nbytes if cache else 0,
        }

    def close(self) -> None:
        self.scheduler.close()
