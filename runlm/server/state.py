"""What the routes of one model share: the model, its engine and scheduler, the served names; and what every model
of a server shares (metrics, planning threads, the server's options). A server of several models holds one
ServerState per loaded model (server.pool)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from fastapi import Request

from runlm.engine import Engine, QueueFullError, Scheduler
from runlm.engine.embeddings import Pooling, declared_pooling
from runlm.engine.rerank import Reranker
from runlm.runner import ServedModel
from runlm.server.errors import APIError
from runlm.server.images import RemoteImages, public_address
from runlm.server.metrics import Metrics
from runlm.server.workers import Workers
from runlm.text import Tokenizer
from runlm.text.literal import LiteralSpecials


@dataclass
class ServerState:
    loaded: ServedModel
    engine: Engine
    scheduler: Scheduler
    metrics: Metrics
    model_name: str
    aliases: set[str]
    default_max_tokens: int | None
    prompt_cache_mb: float = 0
    allow_remote_images: bool = False
    allow_private_image_urls: bool = False  # remote images from loopback / private / link-local addresses too
    pooling: Pooling | None = None  # embeddings: None pools as the model's files declare
    special_tokens_in_content: bool = False  # True: special-token strings in message text become control tokens
    reasoning_format: str = "auto"  # how chat replies split their thinking (engine.reasoning.REASONING_FORMATS)
    reasoning_budget: int = -1  # tokens of thinking before it is closed (-1: no bound, 0: thinking off)
    tenants: int = 1  # the API keys the server knows, each a tenant
    reranker: Reranker | None = None  # rerank scores: this model's P(yes) (None: embedding similarity)
    created: int = field(default_factory=lambda: int(time.time()))
    workers: Workers = field(default_factory=Workers)  # planning, large bodies, JSON replies
    # How chat prompts keep special-token strings in client text as text (None: they are not kept). Made with
    # the state, so that no request pays for compiling its patterns (0.35 s for Gemma's 6k special tokens).
    literal_specials: LiteralSpecials | None = field(init=False)

    # per tenant, with several: the turns at the planning threads (shared by the models of a server, as the
    # threads are), and requests being planned for this model (event loop only)
    planning_turns: dict[str, asyncio.Semaphore] = field(default_factory=dict)
    _planning: dict[str, int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.literal_specials = None if self.special_tokens_in_content else LiteralSpecials(self.tokenizer)

    @contextmanager
    def tenant_planning(self, tenant: str) -> Iterator[None]:
        """With several API keys, one key holds at most half the queue's places for requests being planned: a key
        that sends many slow requests (chat templates that run to their deadline) gets the 429, not the others."""
        if self.tenants < 2:
            yield
            return
        share = max(1, self.scheduler.max_queue // 2)
        held = self._planning.get(tenant, 0)
        if held >= share:
            raise QueueFullError(f"this API key has {held} requests being planned already; retry later")
        self._planning[tenant] = held + 1
        try:
            yield
        finally:
            self._planning[tenant] -= 1

    @asynccontextmanager
    async def planning_turn(self, tenant: str) -> AsyncIterator[None]:
        """With several API keys, one key plans on all but one of the planning threads at most, so another key's
        request always finds one free."""
        if self.tenants < 2:
            yield
            return
        turn = self.planning_turns.setdefault(tenant, asyncio.Semaphore(max(1, self.workers.threads - 1)))
        async with turn:
            yield

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    @property
    def fingerprint(self) -> str:
        return f"runlm-0.1.0-{self.loaded.quantization}"

    def check_model(self, name: str) -> None:
        if name not in self.aliases:
            raise APIError(404, f"model {name!r} is not served here; this server serves {self.model_name!r} "
                                "(see GET /v1/models)", param="model", code="model_not_found")

    @property
    def remote_images(self) -> RemoteImages:
        anywhere = self.allow_private_image_urls
        return RemoteImages(self.allow_remote_images, (lambda _ip: True) if anywhere else public_address)

    @cached_property
    def embedding_pooling(self) -> Pooling:
        """How embeddings are pooled: as the server was told, else as the model declares (mean by default)."""
        return self.pooling or declared_pooling(self.loaded.path, self.loaded.metadata)

    def model_meta(self) -> dict[str, Any]:
        loaded = self.loaded
        return {"family": loaded.runner.family(), "context_length": loaded.context_length,
                "quantization": loaded.quantization, "format": loaded.format, "vocab_size": self.engine.vocab_size,
                "file": loaded.path.name, "multimodal": bool(loaded.runner.supports_multimodal())}


async def get_state(request: Request) -> ServerState:
    """FastAPI dependency of the routes whose requests name no model: the server's default model (the one it
    serves, or was started with), loaded first where it is not (async: FastAPI runs a plain function dependency
    in its thread pool, a hop for every request)."""
    return await request.app.state.models.use(request, None)


async def model_state(request: Request, name: str | None, keep_alive: str | int | float | None = None) -> ServerState:
    """The state of the model a request names (None: the default one), loaded first where it is not, and held
    until the response has been sent (server.pool.ModelLeases); `keep_alive` is Ollama's field."""
    return await request.app.state.models.use(request, name, keep_alive)
