"""Ollama's API: /api/chat, /api/generate (newline-delimited JSON streams by default, one object with
`"stream": false`), /api/embed, /api/tags, /api/show, /api/ps, /api/version; /api/delete and /api/copy for the files
of the models directory; /api/pull into runlm's cache (server.pulls).

A thin adapter: requests are planned as their OpenAI equivalents (server.ollama_shapes) and run through
the same scheduler, the same stream generator (server.sse, as JSON lines) and the same embedding steps
(server.embeddings_api). Model names are the served names and their aliases, with or without `:latest`;
`keep_alive` says how long a model stays loaded after the request (server.pool).
Errors under /api/ are Ollama's {"error": "..."} (server.errors picks the shape by path).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from runlm.server.embeddings_api import check_dimensions, embed_all, input_ids
from runlm.server.errors import APIError, ollama_error_body
from runlm.server.library import ModelLibrary, ModelSource, file_facts
from runlm.server.ollama_shapes import (
    OLLAMA_API_VERSION,
    ChatBody,
    ChatLines,
    CopyBody,
    EmbedBody,
    GenerateBody,
    GenerateLines,
    Generating,
    NamedModel,
    PullBody,
    ShowBody,
    chat_reply,
    file_details,
    generate_reply,
    loaded_reply,
    model_details,
    model_entry,
    plan_ollama_chat,
    plan_ollama_generate,
    running_entry,
    show_file_reply,
    show_reply,
)
from runlm.server.openai_api import collect, submit
from runlm.server.pool import ModelPool, get_pool, parse_keep_alive
from runlm.server.pulls import PullRun, ndjson, prepare_pull
from runlm.server.sse import EventShaper, RecordSource, event_stream
from runlm.server.state import ServerState, model_state
from runlm.server.workers import json_body

router = APIRouter()


def json_lines(handle: RecordSource, shaper: EventShaper) -> StreamingResponse:
    events = event_stream(handle, shaper, lines=True, failure=lambda err: [ollama_error_body(err)])
    return StreamingResponse(events, media_type="application/x-ndjson")


async def load_or_unload(request: Request, pool: ModelPool, body: Generating, chat: bool) -> dict:
    """Ollama's empty request: load the model and answer, or with `keep_alive` 0 unload it."""
    if body.keep_alive is not None and parse_keep_alive(body.keep_alive) == 0:
        await pool.unload(pool.find(body.model).name)
        return loaded_reply(body, chat, reason="unload")
    await model_state(request, body.model, body.keep_alive)
    return loaded_reply(body, chat)


@router.post("/api/chat")
async def chat(request: Request, body: ChatBody = Depends(json_body(ChatBody)), pool: ModelPool = Depends(get_pool)):
    if not body.messages:
        return await load_or_unload(request, pool, body, chat=True)
    state = await model_state(request, body.model, body.keep_alive)
    plan, handle, _ = await submit(state, plan_ollama_chat, body, "chat", request)
    if body.stream:
        return json_lines(handle, ChatLines(plan, body, handle.gen))
    return await state.workers.reply(chat_reply, plan, body, await collect(handle, request), handle.gen)


@router.post("/api/generate")
async def generate(request: Request, body: GenerateBody = Depends(json_body(GenerateBody)),
                   pool: ModelPool = Depends(get_pool)):
    if not (body.prompt or body.images or body.suffix):
        return await load_or_unload(request, pool, body, chat=False)
    state = await model_state(request, body.model, body.keep_alive)
    plan, handle, _ = await submit(state, plan_ollama_generate, body, "generate", request)
    if body.stream:
        return json_lines(handle, GenerateLines(plan, body, handle.gen))
    return await state.workers.reply(generate_reply, plan, body, await collect(handle, request), handle.gen)


@router.post("/api/embed")
async def embed(request: Request, body: EmbedBody = Depends(json_body(EmbedBody))):
    state = await model_state(request, body.model, body.keep_alive)
    check_dimensions(state, body.dimensions)
    batch = await state.workers.run(input_ids, state, body.input, body.truncate)
    vectors = await embed_all(state, batch, body.dimensions)
    return await state.workers.reply(lambda: {"model": body.model, "embeddings": [v.tolist() for v in vectors],
                                              "prompt_eval_count": sum(len(ids) for ids in batch)})


def listing(models: list[tuple[ModelSource, ServerState | None]]) -> list[dict]:
    """/api/tags' entries (run in the worker threads: a model that is not loaded is described from its GGUF
    header, read once per version of the file)."""
    return [model_entry(source.name, source.path, model_details(state) if state is not None
                        else file_details(source.path, file_facts(source.path)))
            for source, state in models]


@router.get("/api/tags")
async def tags(pool: ModelPool = Depends(get_pool)):
    models = [(source, resident.state if (resident := pool.resident(source.name)) else None)
              for source in pool.sources()]
    return {"models": await pool.workers.run(listing, models)}


@router.get("/api/ps")
async def running(pool: ModelPool = Depends(get_pool)):
    return {"models": [running_entry(r.state, r.expiry()) for r in pool.loaded]}


@router.post("/api/show")
async def show(body: ShowBody = Depends(json_body(ShowBody)), pool: ModelPool = Depends(get_pool)):
    source = pool.find(body.model_name)
    resident = pool.resident(source.name)
    if resident is not None:
        return show_reply(resident.state)
    return await pool.workers.run(lambda: show_file_reply(source.path, file_facts(source.path)))


@router.delete("/api/delete")
async def delete(body: NamedModel = Depends(json_body(NamedModel)), pool: ModelPool = Depends(get_pool)):
    """Delete a model file of the models directory; a loaded model is unloaded now, or once the requests using it
    are done (they go on: the file's pages stay readable until then)."""
    source = pool.find(body.model_name)
    library = own_library(pool, source.in_models_dir)
    await pool.workers.run(library.delete, source)
    await pool.unload(source.name)
    return {}


@router.post("/api/copy")
async def copy(body: CopyBody = Depends(json_body(CopyBody)), pool: ModelPool = Depends(get_pool)):
    """Copy a model file of the models directory under a new name (a hard link where the file system allows)."""
    source = pool.find(body.source)
    library = own_library(pool, source.in_models_dir)
    try:
        await pool.workers.run(library.copy, source, body.destination)
    except ValueError as exc:  # "destination: ..." or "source: ..."
        raise APIError(400, str(exc), param=str(exc).split(":", 1)[0]) from None
    except FileExistsError as exc:
        raise APIError(409, str(exc), param="destination") from None
    except OSError as exc:
        raise APIError(400, f"destination: cannot write the copy ({exc.strerror or exc})") from None
    return {}


def own_library(pool: ModelPool, in_models_dir: bool) -> ModelLibrary:
    """The library whose directory holds the model, or a 400: only those files are deleted or copied here."""
    if pool.library is None or not in_models_dir:
        raise APIError(400, "model: only models in the server's models directory (--models-dir) can be deleted "
                            "or copied here; pulled models: `runlm rm`", param="model")
    return pool.library


@router.post("/api/pull")
async def pull(body: PullBody = Depends(json_body(PullBody))):
    """Pull a model into runlm's cache, as `runlm pull` does: a server with a models directory serves it by name at
    once (its pulled models are listed afresh on each look-up); a server of one model (-m alone) only stores it."""
    run = PullRun(await prepare_pull(body.model_name))
    if body.stream:
        return StreamingResponse(ndjson(run.lines()), media_type="application/x-ndjson")
    await run.finish()
    return {"status": "success"}


@router.get("/api/version")
async def version():
    return {"version": OLLAMA_API_VERSION}
