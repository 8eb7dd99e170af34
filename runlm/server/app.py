"""The HTTP server: one engine and scheduler behind each API's routes, composed here.

Routes live by API (`openai_api`, `llamacpp_api`, `embeddings_api`, `rerank_api` ...); request planning
and response shaping in `openai_shapes`; streaming in `sse`; images in `images`; tools in `tools`; auth, body limits and
request counting in `middleware`; error shapes in `errors`. Safe by default: loopback bind, optional
bearer key, a body size limit, and every bad input answered with an OpenAI-shaped 4xx.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI

from runlm.engine import Engine, Scheduler
from runlm.engine.embeddings import check_pooling
from runlm.engine.reasoning import check_reasoning_budget, check_reasoning_format
from runlm.engine.rerank import Reranker, looks_like_reranker
from runlm.engine.scheduler import kv_budget_bytes
from runlm.engine.speculative import Speculation
from runlm.runner import ServedModel
from runlm.server import (
    anthropic_api,
    embeddings_api,
    llamacpp_api,
    ollama_api,
    openai_api,
    rerank_api,
    responses_api,
)
from runlm.server.errors import install_error_handlers
from runlm.server.metrics import Metrics
from runlm.server.middleware import DEFAULT_ALLOWED_HOSTS, GuardMiddleware, HostList, OriginGuard, api_keys_from
from runlm.server.responses_shapes import DEFAULT_STORED_RESPONSES, ResponseStore
from runlm.server.state import ServerState, served_names
from runlm.server.timeouts import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, uvicorn_options
from runlm.server.web import WebPage
from runlm.server.workers import tune_for_latency

log = logging.getLogger("runlm.server")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def create_app(
    loaded: ServedModel,
    *,
    api_key: str | Sequence[str] | None = None,
    shared_prompt_cache: bool = False,
    prompt_cache_mb: float = 256,
    max_queue: int = 16,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout_s: float = BODY_TIMEOUT_S,
    model_name: str | None = None,
    default_max_tokens: int | None = None,
    max_batch: int = 8,
    allow_remote_images: bool = False,
    allow_private_image_urls: bool = False,
    pooling: str | None = None,
    stored_responses: int = DEFAULT_STORED_RESPONSES,
    allowed_hosts: Sequence[str] = (),
    api_docs: bool = False,
    special_tokens_in_content: bool = False,
    scheduler: Any = None,
    kv_budget_mb: float | None = None,
    speculation: Speculation | None = None,
    reasoning_format: str = "auto",
    reasoning_budget: int = -1,
    reranker: bool | None = None,
) -> FastAPI:
    """A FastAPI app serving one loaded model (a runlm.LoadedModel).

    `api_key` (or env RUNLM_API_KEY when None; "" turns it off) guards every route but /health: one key, or
    several (a list or comma-separated), each a tenant whose prompt-cache entries no other key can reuse or
    probe, unless `shared_prompt_cache`.
    `max_queue` requests may wait behind the running ones; more get 429. `default_max_tokens` caps
    requests that set no max_tokens (None: up to the context's end). `pooling` ("mean" or "last") sets how
    embeddings pool token states; None pools as the model's files declare (mean where they say nothing).
    `stored_responses` bounds the in-memory store behind /v1/responses' previous_response_id (LRU).
    `allowed_hosts` extends the host names the server answers to (loopback names and IP addresses always;
    "*": any), see middleware.OriginGuard. `api_docs` serves FastAPI's /docs, /redoc and /openapi.json (off:
    the docs pages load their scripts from a CDN). `allow_remote_images` fetches http(s) image URLs, from public
    addresses only unless `allow_private_image_urls`. `special_tokens_in_content` lets special-token strings in
    message text become control tokens (by default only the chat template's own markers are).
    `scheduler`: one made elsewhere with the Scheduler's face (runlm.cluster's RemoteScheduler over replicas),
    whose `engine` validates requests; None: a local Engine and Scheduler over `loaded.runner`. `kv_budget_mb`
    bounds the local Scheduler's KV-cache memory, all requests in flight together (None: half the memory
    available when the app is made; 0: no bound). `reasoning_format` ("auto", "none", "think"; a request's own
    `reasoning_format` wins) says whether chat replies give their thinking apart, as `reasoning_content`;
    `reasoning_budget` tokens of thinking are written before the model is made to close it (-1: no bound; 0: the
    template's thinking is off). `reranker` True scores /v1/rerank with the model as a Qwen3-Reranker (P(yes)),
    False by embedding similarity; None decides by the model's files (runlm.engine.rerank.looks_like_reranker).
    """
    if api_key is None:
        api_key = os.environ.get("RUNLM_API_KEY") or None
    api_keys = api_keys_from(api_key)
    pooling = check_pooling(pooling) if pooling is not None else None
    if reranker is None:
        reranker = looks_like_reranker(loaded)
    rerank_model = Reranker.for_tokenizer(loaded.tokenizer) if reranker else None
    hosts = HostList((*DEFAULT_ALLOWED_HOSTS, *allowed_hosts))
    if scheduler is None:
        engine = Engine(loaded.runner, loaded.tokenizer, context_length=loaded.context_length,
                        prompt_cache_mb=prompt_cache_mb, speculation=speculation)
        scheduler = Scheduler(engine, max_queue=max_queue, max_batch=max_batch,
                              kv_budget_bytes=kv_budget_bytes(kv_budget_mb))
    engine = scheduler.engine
    metrics = Metrics()
    name, aliases = served_names(loaded, model_name)
    state = ServerState(loaded, engine, scheduler, metrics, name, aliases, default_max_tokens,
                        prompt_cache_mb=prompt_cache_mb, allow_remote_images=allow_remote_images,
                        allow_private_image_urls=allow_private_image_urls,
                        pooling=pooling, special_tokens_in_content=special_tokens_in_content,
                        reasoning_format=check_reasoning_format(reasoning_format),
                        reasoning_budget=check_reasoning_budget(reasoning_budget), tenants=len(api_keys) or 1,
                        reranker=rerank_model)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tune_for_latency()
        yield
        scheduler.close()
        state.workers.close()

    docs = {} if api_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="runlm", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API over a local runlm model", **docs)
    app.state.runlm = state
    app.state.responses = ResponseStore(stored_responses)
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, api_keys=api_keys, max_body_bytes=max_body_bytes, metrics=metrics,
                       shared_tenant=shared_prompt_cache, body_timeout_s=body_timeout_s)
    # The chat page at / (outside the key guard: it holds no secrets and asks for the key on a 401).
    app.add_middleware(WebPage, metrics=metrics)
    # Outermost: a request for a foreign host name or from a foreign web origin reaches nothing else.
    app.add_middleware(OriginGuard, hosts=hosts, metrics=metrics)
    app.include_router(openai_api.router)
    app.include_router(llamacpp_api.router)
    app.include_router(embeddings_api.router)
    app.include_router(rerank_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(ollama_api.router)
    app.include_router(responses_api.router)
    return app


def warn_if_open(host: str, api_key: str | Sequence[str] | None) -> None:
    """One warning where a server (the single one, or the Ray front) listens beyond loopback with no API key."""
    if api_key is None:
        api_key = os.environ.get("RUNLM_API_KEY") or None
    if host not in LOOPBACK_HOSTS and not api_key:
        log.warning("serving on %s without an API key: anyone who can reach this address can use the model",
                    host)


def serve(loaded: ServedModel, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
          header_timeout_s: float = HEADER_TIMEOUT_S, **kw: Any) -> None:
    """Run the server until interrupted (the CLI's `runlm serve`). Binds loopback unless told otherwise; a
    request's headers must arrive within `header_timeout_s` (server.timeouts)."""
    warn_if_open(host, kw.get("api_key"))
    uvicorn.run(create_app(loaded, **kw), host=host, port=port, log_level=log_level,
                **uvicorn_options(header_timeout_s))


__all__ = ["create_app", "serve", "ServerState", "warn_if_open"]
