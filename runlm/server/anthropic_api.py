"""Anthropic's Messages API: POST /v1/messages (whole or streamed) and POST /v1/messages/count_tokens.

A thin adapter: the request is planned as its chat-completions equivalent (server.anthropic_shapes), runs
through the same scheduler, and streams through the one SSE generator as typed events. Errors under
/v1/messages take Anthropic's shape (server.errors picks it by path); `x-api-key` carries the server's key.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from runlm.server.anthropic_shapes import (
    CountTokensRequest,
    MessageEvents,
    MessagesRequest,
    message_id,
    message_response,
    plan_messages,
)
from runlm.server.errors import anthropic_error_body
from runlm.server.openai_api import collect, streaming, submit
from runlm.server.sse import event_stream
from runlm.server.state import model_state
from runlm.server.workers import json_body

router = APIRouter()


@router.post("/v1/messages")
async def messages(request: Request, body: MessagesRequest = Depends(json_body(MessagesRequest))):
    state = await model_state(request, body.model)
    plan, handle, _ = await submit(state, plan_messages, body, "msg", request)
    mid = message_id()
    if body.stream:
        events = MessageEvents(plan, body, handle.gen, mid)
        return streaming(event_stream(handle, events, typed=True, failure=lambda err: [anthropic_error_body(err)]))
    return await state.workers.reply(message_response, plan, body, await collect(handle, request), handle.gen, mid)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, body: CountTokensRequest = Depends(json_body(CountTokensRequest))):
    state = await model_state(request, body.model)
    with state.scheduler.planning():
        plan = await state.workers.run(plan_messages, state, body)
    return {"input_tokens": len(plan.request.prompt_ids)}
