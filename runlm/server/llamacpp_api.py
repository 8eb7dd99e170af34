"""llama-server's extra routes: /infill (fill-in-the-middle), /props, /health, /metrics (Prometheus), /tokenize,
/detokenize.

/infill is planned like an OpenAI text completion (the same sampling fields, scheduler and stream generator) with
the FIM prompt of server.infill, and answers in the shape of llama-server's /completion: `content`, `stop`,
`tokens_predicted` / `tokens_evaluated`, `stop_type`, `timings`; streamed, `data:` events of `content` pieces and a
last one with `stop: true` (no `[DONE]`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from runlm.engine import Completion, GenerationRequest, StreamRecord, Usage
from runlm.server.errors import APIError
from runlm.server.infill import fim_request
from runlm.server.metrics import replica_lines
from runlm.server.openai_api import collect, streaming, submit
from runlm.server.openai_shapes import CompletionPlan, sampling_from, stop_list, timings_json, token_text
from runlm.server.pool import ModelPool, get_pool
from runlm.server.schemas import DetokenizeRequest, InfillRequest, TokenizeRequest
from runlm.server.sse import event_stream
from runlm.server.state import ServerState, get_state, model_state
from runlm.server.tools import template_source
from runlm.server.workers import PartedJSONResponse, json_body
from runlm.text.fim import ExtraChunk

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
async def health(pool: ModelPool = Depends(get_pool)):
    """Never waits for a model: what the loaded models' schedulers hold, summed."""
    schedulers = [resident.state.scheduler for resident in pool.loaded]
    return {"status": "ok", "queue_depth": sum(s.queue_depth for s in schedulers),
            "busy": any(s.busy for s in schedulers), "models_loaded": [r.name for r in pool.loaded]}


@router.get("/metrics", response_class=PlainTextResponse)
async def prometheus_metrics(request: Request, pool: ModelPool = Depends(get_pool)):
    """The loaded models' gauges, summed (a server of one model: that model's)."""
    states = [resident.state for resident in pool.loaded]
    caches = [state.engine.prompt_cache for state in states if state.engine.prompt_cache]
    gauges = {
        "runlm_queue_depth": ("Requests waiting for the worker.", sum(s.scheduler.queue_depth for s in states)),
        "runlm_requests_running": ("Requests being generated.", sum(s.scheduler.in_flight for s in states)),
        "runlm_prompt_cache_bytes": ("Bytes held by the prompt cache.", sum(c.nbytes for c in caches)),
        "runlm_prompt_cache_entries": ("Snapshots in the prompt cache.", sum(len(c) for c in caches)),
        "runlm_models_loaded": ("Models loaded.", len(states)),
    }
    metrics = request.app.state.metrics
    text = metrics.render(gauges, extra=lambda: replica_lines([report for s in states
                                                               for report in s.scheduler.replica_stats()]))
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


# -- /infill ----------------------------------------------------------------------------------------


def plan_infill(state: ServerState, body: InfillRequest) -> CompletionPlan:
    """[extra] [fim_pre] input_prefix [fim_suf] input_suffix [fim_mid] prompt, sampled as a text completion."""
    if body.n_predict == 0:
        raise APIError(400, "n_predict must be -1 (no limit) or at least 1", param="n_predict", code="invalid_value")
    extra = [ExtraChunk(chunk.filename, chunk.text) for chunk in body.input_extra or ()]
    ids, stop_ids = fim_request(state, body.input_prefix, body.input_suffix, extra=extra, prompt=body.prompt,
                                param="input_prefix")
    limit = body.n_predict if body.n_predict is not None and body.n_predict > 0 else body.max_tokens
    request = GenerationRequest(
        prompt_ids=ids,
        max_tokens=limit or state.default_max_tokens,
        sampling=sampling_from(body, state.engine.vocab_size, False, 0),
        stop=stop_list(body.stop),
        stop_ids=stop_ids,
        ignore_eos=body.ignore_eos,
        use_prompt_cache=body.cache_prompt,
    )
    return CompletionPlan(request, "")


def stop_type(plan: CompletionPlan, finish_reason: str | None, last_token: int | None) -> str:
    """llama-server's account of why it stopped: the token limit, an end-of-generation token, or a stop word."""
    if finish_reason == "length":
        return "limit"
    stop_ids = plan.request.stop_ids or frozenset()
    return "word" if plan.request.stop and last_token not in stop_ids else "eos"


def infill_final(state: ServerState, plan: CompletionPlan, body: InfillRequest, usage: Usage, reason: str) -> dict:
    """What llama-server's last (or only) /completion object carries besides the text."""
    return {"index": 0, "id_slot": 0, "stop": True, "model": body.model, "stop_type": reason, "stopping_word": "",
            "tokens_predicted": usage.completion_tokens, "tokens_evaluated": usage.prompt_tokens,
            "tokens_cached": usage.cached_tokens, "truncated": False,
            "prompt": state.tokenizer.decode(plan.request.prompt_ids), "timings": timings_json(usage)}


def infill_reply(state: ServerState, plan: CompletionPlan, body: InfillRequest, result: Completion) -> dict:
    last = result.token_ids[-1] if result.token_ids else None
    reason = stop_type(plan, result.finish_reason, last)
    return {"content": result.text, "tokens": list(result.token_ids) if body.return_tokens else [],
            **infill_final(state, plan, body, result.usage, reason)}


class InfillChunks:
    """llama-server's stream: {content, stop: false} per piece, then the final object with `stop: true`."""

    def __init__(self, state: ServerState, plan: CompletionPlan, body: InfillRequest):
        self.state, self.plan, self.body = state, plan, body
        self.last_token: int | None = None

    def opening(self) -> list[dict[str, Any]]:
        return []

    def on_record(self, record: StreamRecord) -> list[dict[str, Any]]:
        if record.token_id is not None:
            self.last_token = record.token_id
        if not record.text:
            return []
        tokens = [record.token_id] if self.body.return_tokens and record.token_id is not None else []
        return [{"index": 0, "content": record.text, "tokens": tokens, "stop": False}]

    def closing(self, last: StreamRecord, usage: Usage) -> list[dict[str, Any]]:
        reason = stop_type(self.plan, last.finish_reason, self.last_token)
        return [{"content": "", "tokens": [], **infill_final(self.state, self.plan, self.body, usage, reason)}]


@router.post("/infill")
async def infill(request: Request, body: InfillRequest = Depends(json_body(InfillRequest))):
    state = await model_state(request, body.model)
    if body.model is None:
        body = body.model_copy(update={"model": state.model_name})
    plan, handle, _ = await submit(state, plan_infill, body, "infill", request)
    if body.stream:
        return streaming(event_stream(handle, InfillChunks(state, plan, body), end_marker=False))
    return await state.workers.reply(infill_reply, state, plan, body, await collect(handle, request))
