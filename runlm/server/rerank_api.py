"""Reranking: POST /v1/rerank, and llama-server's names for it, /rerank and /v1/reranking (Jina's and Cohere's
request and reply shape).

A reranker model (runlm.engine.rerank: a Qwen3-Reranker, found by its files or named by `--reranker`) scores each
document as P(yes); any other model by the cosine similarity of the query's and the document's embeddings
(server.embeddings_api's steps). The reply's `scoring` says which: "reranker" or "embedding-similarity". Prompts are
tokenized off the event loop, and each model call runs on the scheduler's worker, one document per call, so
generations in flight keep stepping between them.
"""

from __future__ import annotations

import asyncio
from functools import partial

from fastapi import APIRouter, Depends, Request

from runlm.engine.embeddings import check_embedding_input, embedding_ids
from runlm.engine.rerank import Reranker, cosine_scores
from runlm.server.embeddings_api import embed_all
from runlm.server.schemas import RerankRequest
from runlm.server.state import ServerState, model_state
from runlm.server.workers import json_body

router = APIRouter()


def document_texts(body: RerankRequest) -> list[str]:
    return [d if isinstance(d, str) else d.text for d in body.documents]


def reranker_prompts(state: ServerState, reranker: Reranker, body: RerankRequest) -> list[list[int]]:
    """One Qwen3-Reranker prompt per document, each checked against the context."""
    tok, engine = state.tokenizer, state.engine
    prompts = []
    for i, text in enumerate(document_texts(body)):
        ids = reranker.prompt_ids(tok, body.query, text, body.instruction)
        check_embedding_input(ids, engine.vocab_size, engine.context_length, f"documents.{i}")
        prompts.append(ids)
    return prompts


def embedding_inputs(state: ServerState, body: RerankRequest) -> list[list[int]]:
    """The query's ids, then each document's, as embeddings tokenize them, each checked against the context."""
    tok, engine = state.tokenizer, state.engine
    named = [("query", body.query), *((f"documents.{i}", t) for i, t in enumerate(document_texts(body)))]
    batch = []
    for where, text in named:
        ids = embedding_ids(tok, text)
        check_embedding_input(ids, engine.vocab_size, engine.context_length, where)
        batch.append(ids)
    return batch


async def relevance(state: ServerState, body: RerankRequest) -> tuple[list[float], int, str]:
    """(a score per document, prompt tokens, how they were scored)."""
    reranker = state.reranker
    if reranker is not None:
        prompts = await state.workers.run(reranker_prompts, state, reranker, body)
        runner = state.loaded.runner
        scores = [await asyncio.wrap_future(state.scheduler.run(partial(reranker.score, runner, ids)))
                  for ids in prompts]
        return scores, sum(len(ids) for ids in prompts), "reranker"
    batch = await state.workers.run(embedding_inputs, state, body)
    query, *documents = await embed_all(state, batch, None)
    return cosine_scores(query, documents), sum(len(ids) for ids in batch), "embedding-similarity"


def rerank_reply(body: RerankRequest, model: str, scores: list[float], tokens: int, scoring: str) -> dict:
    texts = document_texts(body)
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)[:body.top_n or len(scores)]
    results = [{"index": i, "relevance_score": scores[i]} | ({"document": {"text": texts[i]}}
                                                              if body.return_documents else {}) for i in order]
    return {"model": model, "object": "list", "scoring": scoring, "usage": {"prompt_tokens": tokens,
                                                                           "total_tokens": tokens},
            "results": results}


@router.post("/v1/rerank")
@router.post("/v1/reranking")
@router.post("/rerank")
async def rerank(request: Request, body: RerankRequest = Depends(json_body(RerankRequest))):
    state = await model_state(request, body.model)
    scores, tokens, scoring = await relevance(state, body)
    return await state.workers.reply(rerank_reply, body, body.model or state.model_name, scores, tokens, scoring)
