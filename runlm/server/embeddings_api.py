"""OpenAI's embeddings route, and the embedding steps every API's embeddings share (Ollama's /api/embed).

Inputs are tokenized and checked off the event loop; each input's forward then runs on the scheduler's
worker (the runner is not thread-safe), one input per call so generations in flight keep stepping
between them. Pooling and normalization are runlm.engine.embeddings'.
"""

from __future__ import annotations

import asyncio
import base64
from functools import partial

import numpy as np
from fastapi import APIRouter, Depends, Request

from runlm.engine.embeddings import check_embedding_input, embed, embedding_ids
from runlm.server.errors import APIError
from runlm.server.schemas import EmbeddingRequest
from runlm.server.state import ServerState, model_state
from runlm.server.workers import json_body

router = APIRouter()


def input_ids(state: ServerState, inputs: str | list[str] | list[int] | list[list[int]],
              truncate: bool = False) -> list[list[int]]:
    """Token ids of every input (a string, strings, one id list, id lists), each checked against the context;
    `truncate` cuts an input that is too long to the context instead (Ollama's default)."""
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        batch, single = [inputs], True
    else:
        batch, single = list(inputs), False
    context = state.engine.context_length
    out = []
    for i, item in enumerate(batch):
        ids = embedding_ids(state.tokenizer, item) if isinstance(item, str) else list(item)
        if truncate:
            ids = ids[:context]
        check_embedding_input(ids, state.engine.vocab_size, context, "input" if single else f"input.{i}")
        out.append(ids)
    return out


def check_dimensions(state: ServerState, dimensions: int | None) -> None:
    hidden = state.loaded.config.hidden_size
    if dimensions is not None and dimensions > hidden:
        raise APIError(400, f"dimensions: this model's embeddings have {hidden} dimensions, {dimensions} asked for",
                       param="dimensions", code="invalid_value")


async def embed_all(state: ServerState, batch: list[list[int]], dimensions: int | None) -> list[np.ndarray]:
    """Unit embeddings of each input, computed on the scheduler's worker one input at a time."""
    runner, pooling = state.loaded.runner, state.embedding_pooling
    return [await asyncio.wrap_future(state.scheduler.run(partial(embed, runner, ids, pooling, dimensions)))
            for ids in batch]


def base64_floats(vector: np.ndarray) -> str:
    """Little-endian float32 bytes in base64: what the openai SDK decodes (and asks for by default)."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


@router.post("/v1/embeddings")
async def embeddings(request: Request, body: EmbeddingRequest = Depends(json_body(EmbeddingRequest))):
    state = await model_state(request, body.model)
    check_dimensions(state, body.dimensions)
    batch = await state.workers.run(input_ids, state, body.input)
    vectors = await embed_all(state, batch, body.dimensions)
    return await state.workers.reply(embeddings_reply, body, batch, vectors)


def embeddings_reply(body: EmbeddingRequest, batch: list[list[int]], vectors: list[np.ndarray]) -> dict:
    encode = base64_floats if body.encoding_format == "base64" else (lambda v: v.tolist())
    tokens = sum(len(ids) for ids in batch)
    return {"object": "list", "model": body.model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
