"""OpenAI's Responses API routes: create (whole or streamed), retrieve and delete stored responses.

Creation is chat completions underneath (server.responses_shapes plans the request with `plan_chat`),
submitted and collected by the same helpers as the chat route; finished responses with `store: true`
go into the app's ResponseStore, where `previous_response_id`, GET and DELETE find them.
"""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter, Depends, Request

from runlm.server.middleware import tenant_of
from runlm.server.openai_api import collect, streaming, submit
from runlm.server.responses_shapes import (
    ResponseEvents,
    ResponsesRequest,
    ResponseStore,
    TenantResponses,
    finish_response,
    not_found,
    output_items,
    plan_response,
)
from runlm.server.sse import event_stream
from runlm.server.state import model_state
from runlm.server.workers import json_body

router = APIRouter()


async def get_store(request: Request) -> TenantResponses:
    """FastAPI dependency: the calling tenant's view of the store create_app put on the app (one API key
    never finds another's stored responses)."""
    store: ResponseStore = request.app.state.responses
    return store.scoped(tenant_of(request.scope))


@router.post("/v1/responses")
async def create_response(request: Request, body: ResponsesRequest = Depends(json_body(ResponsesRequest)),
                          store: TenantResponses = Depends(get_store)):
    state = await model_state(request, body.model)
    plan, handle, _ = await submit(state, partial(plan_response, store=store), body, "resp", request)
    if body.stream:
        events = ResponseEvents(plan, store)
        return streaming(event_stream(handle, events, typed=True, failure=events.failure))
    result = await collect(handle, request)
    response = finish_response(plan, output_items(plan, result.text), result.finish_reason, result.usage, store)
    return await state.workers.reply(lambda: response)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, store: TenantResponses = Depends(get_store)):
    entry = store.get(response_id)
    if entry is None:
        raise not_found(response_id)
    return entry.response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, store: TenantResponses = Depends(get_store)):
    if not store.delete(response_id):
        raise not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}
