"""Ollama's API: /api/chat, /api/generate (newline-delimited JSON streams by default, one object with
`"stream": false`), /api/embed, /api/tags, /api/show, /api/ps, /api/version.

A thin adapter: requests are planned as their OpenAI equivalents (server.ollama_shapes) and run through
the same scheduler, the same stream generator (server.sse, as JSON lines) and the same embedding steps
(server.embeddings_api). Model names are the served name and its aliases, with or without `:latest`.
Errors under /api/ are Ollama's {"error": "..."} (server.errors picks the shape by path).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from runlm.server.embeddings_api import check_dimensions, embed_all, input_ids
from runlm.server.errors import ollama_error_body
from runlm.server.ollama_shapes import (
    OLLAMA_API_VERSION,
    ChatBody,
    ChatLines,
    EmbedBody,
    GenerateBody,
    GenerateLines,
    ShowBody,
    chat_reply,
    generate_reply,
    loaded_reply,
    model_entry,
    plan_ollama_chat,
    plan_ollama_generate,
    running_entry,
    show_reply,
)
from runlm.server.openai_api import collect, submit
from runlm.server.sse import EventShaper, RecordSource, event_stream
from runlm.server.state import ServerState, get_state
from runlm.server.workers import json_body

router = APIRouter()


def json_lines(handle: RecordSource, shaper: EventShaper) -> StreamingResponse:
    events = event_stream(handle, shaper, lines=True, failure=lambda err: [ollama_error_body(err)])
    return StreamingResponse(events, media_type="application/x-ndjson")


@router.post("/api/chat")
async def chat(request: Request, body: ChatBody = Depends(json_body(ChatBody)),
               state: ServerState = Depends(get_state)):
    if not body.messages:
        state.check_model(body.model)
        return loaded_reply(body, chat=True)
    plan, handle, _ = await submit(state, plan_ollama_chat, body, "chat", request)
    if body.stream:
        return json_lines(handle, ChatLines(plan, body, handle.gen))
    return await state.workers.reply(chat_reply, plan, body, await collect(handle, request), handle.gen)


@router.post("/api/generate")
async def generate(request: Request, body: GenerateBody = Depends(json_body(GenerateBody)),
                   state: ServerState = Depends(get_state)):
    if not (body.prompt or body.images or body.suffix):
        state.check_model(body.model)
        return loaded_reply(body, chat=False)
    plan, handle, _ = await submit(state, plan_ollama_generate, body, "generate", request)
    if body.stream:
        return json_lines(handle, GenerateLines(plan, body, handle.gen))
    return await state.workers.reply(generate_reply, plan, body, await collect(handle, request), handle.gen)


@router.post("/api/embed")
async def embed(body: EmbedBody = Depends(json_body(EmbedBody)), state: ServerState = Depends(get_state)):
    state.check_model(body.model)
    check_dimensions(state, body.dimensions)
    batch = await state.workers.run(input_ids, state, body.input, body.truncate)
    vectors = await embed_all(state, batch, body.dimensions)
    return await state.workers.reply(lambda: {"model": body.model, "embeddings": [v.tolist() for v in vectors],
                                              "prompt_eval_count": sum(len(ids) for ids in batch)})


@router.get("/api/tags")
async def tags(state: ServerState = Depends(get_state)):
    return {"models": [model_entry(state)]}


@router.get("/api/ps")
async def running(state: ServerState = Depends(get_state)):
    return {"models": [running_entry(state)]}


@router.post("/api/show")
async def show(body: ShowBody = Depends(json_body(ShowBody)), state: ServerState = Depends(get_state)):
    state.check_model(body.model_name)
    return show_reply(state)


@router.get("/api/version")
async def version():
    return {"version": OLLAMA_API_VERSION}
