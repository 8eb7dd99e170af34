"""The HTTP server: each API's routes over a pool of models (one engine and scheduler per loaded model), composed
here.

Routes live by API (`openai_api`, `llamacpp_api`, `embeddings_api`, `rerank_api` ...); request planning
and response shaping in `openai_shapes`; streaming in `sse`; images in `images`; tools in `tools`; auth, body limits and
request counting in `middleware`; error shapes in `errors`. Safe by default: loopback bind, optional
bearer key, a body size limit, and every bad input answered with an OpenAI-shaped 4xx.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from runlm.engine import Engine, Scheduler
from runlm.engine.embeddings import check_pooling
from runlm.engine.reasoning import check_reasoning_budget, check_reasoning_format
from runlm.engine.rerank import Reranker, looks_like_reranker
from runlm.engine.scheduler import kv_budget_bytes
from runlm.engine.speculative import Speculation
from runlm.errors import InvalidInputError
from runlm.runner import ServedModel
from runlm.runtime import load
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
from runlm.server.library import ModelLibrary, ModelSource
from runlm.server.metrics import Metrics
from runlm.server.middleware import DEFAULT_ALLOWED_HOSTS, GuardMiddleware, HostList, OriginGuard, api_keys_from
from runlm.server.pool import (
    DEFAULT_KEEP_ALIVE_S,
    DEFAULT_LOAD_WAIT_S,
    DEFAULT_MAX_LOADED,
    FOREVER,
    ModelLeases,
    ModelPool,
    parse_keep_alive,
)
from runlm.server.responses_shapes import DEFAULT_STORED_RESPONSES, ResponseStore
from runlm.server.state import ServerState
from runlm.server.timeouts import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, uvicorn_options
from runlm.server.web import WebPage
from runlm.server.workers import Workers, tune_for_latency

log = logging.getLogger("runlm.server")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def create_app(
    loaded: ServedModel | None,
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
    models_dir: str | Path | None = None,
    loader: Callable[[str], ServedModel] | None = None,
    max_loaded: int = DEFAULT_MAX_LOADED,
    keep_alive: str | float | None = None,
    load_wait_s: float = DEFAULT_LOAD_WAIT_S,
) -> FastAPI:
    """A FastAPI app serving one loaded model (a runlm.LoadedModel), or, with `models_dir`, every model of that
    directory and of runlm's cache, each loaded on the first request that names it (server.pool).

    `models_dir`: the GGUF files there (named by their stems) and the pulled models (named as `runlm list` names
    them) are served; `loaded`, where given, is served too and loaded from the start. `loader` loads a model from
    a path or catalog name in a worker thread (default: runlm.load); at most `max_loaded` models are loaded at once
    (the least recently used idle one is unloaded to make room; a request waits up to `load_wait_s` for one to
    become idle); one idle for `keep_alive` (Ollama's durations: "5m", seconds, negative for ever; default 5
    minutes) is unloaded. Without `models_dir`, `loaded` is the only model and is never unloaded.

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
    reasoning_format = check_reasoning_format(reasoning_format)
    reasoning_budget = check_reasoning_budget(reasoning_budget)
    hosts = HostList((*DEFAULT_ALLOWED_HOSTS, *allowed_hosts))
    if loaded is None and models_dir is None:
        raise InvalidInputError("create_app needs a loaded model, or a models directory to load models from")
    if scheduler is not None and models_dir is not None:
        raise InvalidInputError("a scheduler made elsewhere serves one model: it cannot be combined with models_dir")
    metrics = Metrics()
    workers = Workers()
    planning_turns: dict[str, asyncio.Semaphore] = {}

    def new_state(model: ServedModel, name: str, aliases: frozenset[str], made: Any = None) -> ServerState:
        """One model's state: its own engine, scheduler (batch, queue, KV budget) and prompt cache."""
        if made is None:
            engine = Engine(model.runner, model.tokenizer, context_length=model.context_length,
                            prompt_cache_mb=prompt_cache_mb, speculation=speculation)
            made = Scheduler(engine, max_queue=max_queue, max_batch=max_batch,
                             kv_budget_bytes=kv_budget_bytes(kv_budget_mb))
        rerank = looks_like_reranker(model) if reranker is None else reranker
        return ServerState(model, made.engine, made, metrics, name, set(aliases), default_max_tokens,
                           prompt_cache_mb=prompt_cache_mb, allow_remote_images=allow_remote_images,
                           allow_private_image_urls=allow_private_image_urls,
                           pooling=pooling, special_tokens_in_content=special_tokens_in_content,
                           reasoning_format=reasoning_format, reasoning_budget=reasoning_budget,
                           tenants=len(api_keys) or 1,
                           reranker=Reranker.for_tokenizer(model.tokenizer) if rerank else None,
                           workers=workers, planning_turns=planning_turns)

    library = ModelLibrary(models_dir) if models_dir is not None else None
    load_model = loader or load

    def build(source: ModelSource) -> ServerState:
        return new_state(load_model(source.ref), source.name, source.aliases)

    keep_alive_s = DEFAULT_KEEP_ALIVE_S if keep_alive is None else parse_keep_alive(keep_alive, "keep_alive")
    pool = ModelPool(workers, library, build if library is not None else None, max_loaded=max_loaded,
                     keep_alive_s=keep_alive_s if library is not None else FOREVER, load_wait_s=load_wait_s)
    state = None
    if loaded is not None:
        source = ModelSource.of(loaded.path, model_name)
        if library is not None:
            source = library.find(source.name) or source
            library.add(source)  # served, and loaded again after an unload, under the name it was started with
        state = new_state(loaded, source.name, source.aliases, scheduler)
        pool.add(source, state, pinned=library is None)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tune_for_latency()
        pool.start()
        yield
        pool.close()
        workers.close()

    docs = {} if api_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="runlm", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API over a local runlm model", **docs)
    app.state.runlm = state  # the model the app was made with (None: it loads every model by name)
    app.state.models = pool
    app.state.metrics = metrics
    app.state.responses = ResponseStore(stored_responses)
    install_error_handlers(app)
    app.add_middleware(ModelLeases, pool=pool)
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


def serve(loaded: ServedModel | None, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
          header_timeout_s: float = HEADER_TIMEOUT_S, **kw: Any) -> None:
    """Run the server until interrupted (the CLI's `runlm serve`). Binds loopback unless told otherwise; a
    request's headers must arrive within `header_timeout_s` (server.timeouts)."""
    warn_if_open(host, kw.get("api_key"))
    uvicorn.run(create_app(loaded, **kw), host=host, port=port, log_level=log_level,
                **uvicorn_options(header_timeout_s))


__all__ = ["create_app", "serve", "ServerState", "warn_if_open"]
