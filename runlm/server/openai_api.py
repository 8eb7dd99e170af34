"""OpenAI's routes: chat and text completions (whole or streamed) and the model list.

Each route checks the model, plans the request off the event loop (tokenizing and template
rendering cost CPU), submits it to the scheduler, and shapes what comes back (server.openai_shapes).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from runlm.engine import Completion, RequestHandle
from runlm.server.openai_shapes import (
    ChatChunks,
    CompletionChunks,
    chat_response,
    completion_response,
    plan_chat,
    plan_completion,
)
from runlm.server.schemas import ChatCompletionRequest, CompletionRequest
from runlm.server.sse import event_stream
from runlm.server.state import ServerState, get_state

router = APIRouter()
DISCONNECT_POLL_S = 0.25


async def submit(state: ServerState, planner: Callable, body: Any, id_prefix: str) -> tuple[Any, RequestHandle, str]:
    """Check the model, plan off the event loop, queue the request: (plan, handle, response id)."""
    state.check_model(body.model)
    plan = await run_in_threadpool(planner, state, body)

    def observe(handle: RequestHandle) -> None:
        state.metrics.observe_generation(handle.gen.usage, handle.gen.finish_reason or "error")

    handle = state.scheduler.submit(plan.request, loop=asyncio.get_running_loop(), on_done=observe)
    return plan, handle, f"{id_prefix}-{uuid.uuid4().hex}"


async def collect(handle: RequestHandle, request: Request) -> Completion:
    """Wait for a whole generation; a client that hangs up cancels it."""

    async def watch() -> None:
        while not handle.done.is_set():
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
async def chat_completions(body: ChatCompletionRequest, request: Request, state: ServerState = Depends(get_state)):
    plan, handle, rid = await submit(state, plan_chat, body, "chatcmpl")
    created = int(time.time())
    if body.stream:
        return streaming(event_stream(handle, ChatChunks(state, plan, body, rid, created)))
    return chat_response(state, plan, body, await collect(handle, request), rid, created)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: ServerState = Depends(get_state)):
    plan, handle, rid = await submit(state, plan_completion, body, "cmpl")
    created = int(time.time())
    if body.stream:
        return streaming(event_stream(handle, CompletionChunks(state, plan, body, rid, created)))
    return completion_response(state, plan, body, await collect(handle, request), rid, created)


def model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "runlm",
            "meta": state.model_meta()}


@router.get("/v1/models")
async def list_models(state: ServerState = Depends(get_state)):
    return {"object": "list", "data": [model_card(state)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, state: ServerState = Depends(get_state)):
    state.check_model(model_id)
    return model_card(state)
