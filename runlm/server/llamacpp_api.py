"""llama-server's extra routes: /props, /health, /metrics (Prometheus), /tokenize, /detokenize."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse

from runlm.server.errors import APIError
from runlm.server.metrics import replica_lines
from runlm.server.openai_shapes import token_text
from runlm.server.schemas import DetokenizeRequest, TokenizeRequest
from runlm.server.state import ServerState, get_state
from runlm.server.tools import template_source
from runlm.server.workers import PartedJSONResponse, json_body

router = APIRouter()


@router.get("/props")
async def props(state: ServerState = Depends(get_state)):
    loaded, scheduler = state.loaded, state.scheduler
    return {"model": state.model_name, **state.model_meta(), "total_slots": scheduler.max_batch,
            "max_queue": scheduler.max_queue,
            "chat_template": template_source(loaded.chat_template) or None,
            "has_chat_template": loaded.chat_template is not None,
            "prompt_cache_mb": state.prompt_cache_mb,
            "default_generation_settings": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                            "typical_p": 1.0, "repeat_penalty": 1.0, "repeat_last_n": 64,
                                            "max_tokens": state.default_max_tokens}}


@router.get("/health")
async def health(state: ServerState = Depends(get_state)):
    return {"status": "ok", "queue_depth": state.scheduler.queue_depth, "busy": state.scheduler.busy}


@router.get("/metrics", response_class=PlainTextResponse)
async def prometheus_metrics(state: ServerState = Depends(get_state)):
    cache, scheduler = state.engine.prompt_cache, state.scheduler
    gauges = {
        "runlm_queue_depth": ("Requests waiting for the worker.", scheduler.queue_depth),
        "runlm_requests_running": ("Requests being generated.", scheduler.in_flight),
        "runlm_prompt_cache_bytes": ("Bytes held by the prompt cache.", cache.nbytes if cache else 0),
        "runlm_prompt_cache_entries": ("Snapshots in the prompt cache.", len(cache) if cache else 0),
    }
    text = state.metrics.render(gauges, extra=lambda: replica_lines(scheduler.replica_stats()))
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def tokenized(state: ServerState, body: TokenizeRequest) -> JSONResponse:
    """The reply, serialized here in the worker: a quarter-million pieces take a second to write as JSON."""
    tok = state.tokenizer
    ids = tok.encode(body.content, add_bos=bool(body.add_special))
    if body.with_pieces:
        return PartedJSONResponse({"tokens": [{"id": i, "piece": token_text(tok, i)} for i in ids]})
    return PartedJSONResponse({"tokens": ids})


def detokenized(state: ServerState, body: DetokenizeRequest) -> JSONResponse:
    vocab = state.tokenizer.vocab_size
    bad = next((t for t in body.tokens if t >= vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens: token id {bad} is outside the vocabulary [0, {vocab})", param="tokens",
                       code="invalid_value")
    return PartedJSONResponse({"content": state.tokenizer.decode(body.tokens)})


# Tokenizing a megabyte costs seconds of CPU: off the event loop, so /health and streams keep answering.
@router.post("/tokenize")
async def tokenize(body: TokenizeRequest = Depends(json_body(TokenizeRequest)),
                   state: ServerState = Depends(get_state)):
    return await state.workers.run(tokenized, state, body)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest = Depends(json_body(DetokenizeRequest)),
                     state: ServerState = Depends(get_state)):
    return await state.workers.run(detokenized, state, body)
