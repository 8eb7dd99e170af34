"""OpenAI's routes: chat and text completions (whole or streamed) and the model list.

Each route checks the model, plans the request off the event loop (tokenizing and template
rendering cost CPU), submits it to the scheduler, and shapes what comes back (server.openai_shapes).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from runlm.engine import RequestGroup, RequestHandle
from runlm.server.library import ModelSource
from runlm.server.middleware import tenant_of
from runlm.server.openai_shapes import (
    ChatChunks,
    CompletionChunks,
    chat_response,
    choices_asked,
    completion_response,
    plan_chat,
    plan_completion,
)
from runlm.server.pool import ModelPool, get_pool
from runlm.server.schemas import ChatCompletionRequest, CompletionRequest
from runlm.server.sse import event_stream
from runlm.server.state import ServerState, model_state
from runlm.server.workers import json_body

router = APIRouter()
DISCONNECT_POLL_S = 0.25
Result = TypeVar("Result", covariant=True)


class Pending(Protocol[Result]):
    """What `collect` waits on: a RequestHandle (one Completion) or a RequestGroup (one per choice)."""

    def cancel(self) -> None: ...

    async def aresult(self) -> Result: ...


async def plan_request(state: ServerState, planner: Callable, body: Any, request: Request) -> Any:
    """Check the model and plan the request off the event loop (templates, tokenizing and images cost CPU),
    holding a place in the queue meanwhile; the generation reuses only the prompt cache of the tenant the key
    check found (never one the body names)."""
    state.check_model(body.model)
    tenant = tenant_of(request.scope)
    # a queue place first: a full queue refuses before any planning work
    with state.scheduler.planning(), state.tenant_planning(tenant):
        async with state.planning_turn(tenant):
            plan = await state.workers.run(planner, state, body)
    plan.request.cache_scope = tenant
    return plan


def metrics_hook(state: ServerState) -> Callable[[RequestHandle], None]:
    def observe(handle: RequestHandle) -> None:
        usage = handle.gen.usage
        if handle.gen.index:  # a further choice of an n > 1 request: its prompt is counted with choice 0
            usage = replace(usage, prompt_tokens=0, cached_tokens=0, prefill_s=0.0)
        state.metrics.observe_generation(usage, handle.gen.finish_reason or "error")

    return observe


async def submit(state: ServerState, planner: Callable, body: Any, id_prefix: str,
                 request: Request) -> tuple[Any, RequestHandle, str]:
    """Check the model, plan off the event loop, queue the request: (plan, handle, response id)."""
    plan = await plan_request(state, planner, body, request)
    handle = state.scheduler.submit(plan.request, loop=asyncio.get_running_loop(), on_done=metrics_hook(state))
    return plan, handle, f"{id_prefix}-{uuid.uuid4().hex}"


async def submit_choices(state: ServerState, planner: Callable, body: Any, id_prefix: str, n: int,
                         request: Request) -> tuple[Any, RequestGroup, str]:
    """`submit` for a request that asks for `n` choices: prefilled once, decoded side by side."""
    plan = await plan_request(state, planner, body, request)
    group = state.scheduler.submit_group(plan.request, n, loop=asyncio.get_running_loop(),
                                         on_done=metrics_hook(state))
    return plan, group, f"{id_prefix}-{uuid.uuid4().hex}"


async def collect(handle: Pending[Result], request: Request) -> Result:
    """Wait for a whole generation (or all of a group's); a client that hangs up cancels it."""

    async def watch() -> None:
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await request.is_disconnected():
                handle.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await handle.aresult()
    finally:
        watcher.cancel()
        handle.cancel()


def streaming(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionRequest = Depends(json_body(ChatCompletionRequest))):
    state = await model_state(request, body.model)
    plan, group, rid = await submit_choices(state, plan_chat, body, "chatcmpl", body.n or 1, request)
    created = int(time.time())
    if body.stream:
        return streaming(event_stream(group, ChatChunks(state, plan, body, rid, created)))
    return await state.workers.reply(chat_response, state, plan, body, await collect(group, request), rid, created)


@router.post("/v1/completions")
async def completions(request: Request, body: CompletionRequest = Depends(json_body(CompletionRequest))):
    state = await model_state(request, body.model)
    plan, group, rid = await submit_choices(state, plan_completion, body, "cmpl", choices_asked(body)[1], request)
    created = int(time.time())
    if body.stream:
        return streaming(event_stream(group, CompletionChunks(state, plan, body, rid, created)))
    return await state.workers.reply(completion_response, state, plan, body, await collect(group, request), rid,
                                     created)


def model_card(pool: ModelPool, source: ModelSource) -> dict[str, Any]:
    """A model as /v1/models lists it; `state` says whether it is loaded ("loaded", "loading", "unloaded")."""
    resident = pool.resident(source.name)
    if resident is not None:
        state = resident.state
        return {"id": source.name, "object": "model", "created": state.created, "owned_by": "runlm",
                "state": "loaded", "meta": state.model_meta()}
    try:
        created = int(source.path.stat().st_mtime)
    except OSError:
        created = 0
    return {"id": source.name, "object": "model", "created": created, "owned_by": "runlm",
            "state": "loading" if pool.loading(source.name) else "unloaded",
            "meta": {"file": source.path.name, "format": "gguf" if source.path.is_file() else "safetensors"}}


@router.get("/v1/models")
async def list_models(pool: ModelPool = Depends(get_pool)):
    return {"object": "list", "data": [model_card(pool, source) for source in pool.sources()]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, pool: ModelPool = Depends(get_pool)):
    return model_card(pool, pool.find(model_id))
