"""The OpenAI-compatible HTTP server: chat and text completions (plain and SSE), models, tokenize, metrics.

One `Scheduler` worker owns the runner; route handlers only validate, render the prompt, submit, and
turn stream records into OpenAI JSON. Safe by default: loopback bind, optional bearer key, a body
size limit, and every bad input answered with an OpenAI-shaped 4xx.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from runlm.engine import Engine, GenerationRequest, ImageInput, RequestHandle, Scheduler, StreamRecord, Usage
from runlm.engine.grammar import GrammarConstraint, grammar_for_json_schema
from runlm.engine.tools import ToolCallStreamFilter, tool_call_schema, tools_system_prompt
from runlm.errors import InvalidInputError, RunlmError
from runlm.sampling import SamplingParams, TokenLogprob
from runlm.server.errors import APIError, api_error_from, error_body, install_error_handlers
from runlm.server.metrics import Metrics
from runlm.server.middleware import GuardMiddleware
from runlm.server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    ResponseFormat,
    SamplingFields,
    TokenizeRequest,
    ToolChoiceFunction,
)
from runlm.server.web import WebPage

if TYPE_CHECKING:
    from runlm import LoadedModel

log = logging.getLogger("runlm.server")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
MIN_LOGPROB = -9999.0  # what OpenAI reports for probabilities that underflow


@dataclass
class ServerState:
    """What the routes share: the model, its engine and scheduler, the served name, the metrics."""

    loaded: Any
    engine: Engine
    scheduler: Scheduler
    metrics: Metrics
    model_name: str
    aliases: set[str]
    default_max_tokens: int | None
    created: int = field(default_factory=lambda: int(time.time()))
    allow_remote_images: bool = False

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    def check_model(self, name: str) -> None:
        if name not in self.aliases:
            raise APIError(404, f"model {name!r} is not served here; this server serves {self.model_name!r} "
                                "(see GET /v1/models)", param="model", code="model_not_found")


# -- helpers: tokens, log-probs, usage ---------------------------------------------------------


def _token_bytes(tokenizer: Any, token_id: int) -> bytes:
    to_bytes = getattr(tokenizer, "token_to_bytes", None)
    if to_bytes is not None:
        return to_bytes(token_id)
    return tokenizer.decode([token_id]).encode("utf-8")


def _token_text(tokenizer: Any, token_id: int) -> str:
    return _token_bytes(tokenizer, token_id).decode("utf-8", errors="replace")


def _lp(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


def chat_logprob_entry(tokenizer: Any, lp: TokenLogprob) -> dict[str, Any]:
    def one(token_id: int, value: float) -> dict[str, Any]:
        data = _token_bytes(tokenizer, token_id)
        return {"token": data.decode("utf-8", errors="replace"), "logprob": _lp(value), "bytes": list(data)}

    entry = one(lp.token_id, lp.logprob)
    entry["top_logprobs"] = [one(t.token_id, t.logprob) for t in lp.top]
    return entry


def completion_logprobs(tokenizer: Any, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        text = _token_text(tokenizer, lp.token_id)
        tokens.append(text)
        values.append(_lp(lp.logprob))
        tops.append({_token_text(tokenizer, t.token_id): _lp(t.logprob) for t in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def timings_json(usage: Usage) -> dict[str, Any]:
    """llama.cpp-style timings, for people comparing the two."""
    prompt_run = max(0, usage.prompt_tokens - usage.cached_tokens)
    return {
        "cache_n": usage.cached_tokens,
        "prompt_n": prompt_run,
        "prompt_ms": usage.prefill_s * 1000,
        "prompt_per_second": prompt_run / usage.prefill_s if usage.prefill_s > 0 else 0.0,
        "predicted_n": usage.completion_tokens,
        "predicted_ms": usage.decode_s * 1000,
        "predicted_per_second": usage.decode_tokens_per_s,
        "queued_ms": usage.queued_s * 1000,
        "ttft_ms": usage.ttft_s * 1000,
    }


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _finish_reason(reason: str | None) -> str:
    return reason if reason in ("stop", "length", "tool_calls") else "stop"


# -- request -> GenerationRequest ---------------------------------------------------------------


def sampling_from(body: SamplingFields, vocab: int, logprobs: bool, top_logprobs: int) -> SamplingParams:
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias: key {key!r} is not a token id", param="logit_bias",
                           code="invalid_value") from None
        if not 0 <= token < vocab:
            raise APIError(400, f"logit_bias: token id {token} is outside the vocabulary [0, {vocab})",
                           param="logit_bias", code="invalid_value")
        bias[token] = float(value)
    params = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        typical_p=1.0 if body.typical_p is None else body.typical_p,
        repeat_penalty=body.repeat_penalty or 1.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        penalty_last_n=64 if body.repeat_last_n is None else body.repeat_last_n,
        seed=body.seed,
        logit_bias=bias,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    return params.validate(vocab)


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s]


def _schema_from_format(fmt: ResponseFormat | None) -> tuple[bool, Any]:
    """(constrained?, schema) for a response_format."""
    if fmt is None or fmt.type == "text":
        return False, None
    if fmt.type == "json_object":
        return True, fmt.schema_ or {"type": "object"}
    spec = fmt.json_schema
    if spec is None and fmt.schema_ is None:
        raise APIError(400, "response_format.json_schema is required when type is 'json_schema'",
                       param="response_format.json_schema", code="invalid_value")
    schema = spec.schema_ if spec is not None else fmt.schema_
    return True, schema if schema is not None else {}


def _grammar(state: ServerState, schema: Any) -> GrammarConstraint:
    tok = state.tokenizer
    eos = sorted(getattr(tok, "stop_ids", ()) or ([tok.eos_id] if tok.eos_id is not None else []))
    return GrammarConstraint(grammar_for_json_schema(schema), tok, state.engine.vocab_size, eos)


def _template_source(template: Any) -> str:
    for attr in ("source", "template", "text", "_source", "raw"):
        value = getattr(template, attr, None)
        if isinstance(value, str):
            return value
    return ""


MAX_IMAGE_BYTES = 20 * 1024 * 1024


def _message_text(state: ServerState, message: ChatMessage, index: int, images: list[ImageInput]) -> str | None:
    """The message's text; each image part becomes Gemma's image marker and its pixels go to `images`."""
    if message.content is None or isinstance(message.content, str):
        return message.content
    parts = []
    for j, part in enumerate(message.content):
        where = f"messages.{index}.content.{j}"
        if part.type == "text":
            parts.append(part.text or "")
        elif part.type == "image_url" and part.image_url is not None:
            if not state.loaded.runner.supports_multimodal():
                raise APIError(400, f"{where}: this model has no vision tower and cannot take images",
                               param=f"messages.{index}.content", code="invalid_value")
            images.append(_fetch_image(state, part.image_url.url, where))
            parts.append(state.loaded.runner.image_marker())
        else:
            raise APIError(400, f"{where}: content of type {part.type!r} is not supported (text and image_url are)",
                           param=f"messages.{index}.content", code="invalid_value")
    return "\n".join(parts)


def _fetch_image(state: ServerState, url: str, where: str) -> ImageInput:
    """Pixels of a `data:` URL, or of an http(s) URL when the server allows remote images."""
    import base64
    import binascii

    from runlm.models.vision import image_bytes_to_rgb

    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if ";base64" not in header:
            raise APIError(400, f"{where}: only base64 data: URLs are supported", param=where, code="invalid_value")
        if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
            raise APIError(400, f"{where}: the image is larger than {MAX_IMAGE_BYTES} bytes", param=where,
                           code="invalid_value")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise APIError(400, f"{where}: invalid base64 image data", param=where, code="invalid_value") from exc
    elif url.startswith(("http://", "https://")):
        if not state.allow_remote_images:
            raise APIError(400, f"{where}: remote image URLs are disabled on this server (send a base64 data: URL, "
                                "or start the server with --allow-remote-images)", param=where, code="invalid_value")
        data = _download_image(url, where)
    else:
        raise APIError(400, f"{where}: image_url must be a data: URL or http(s) URL", param=where,
                       code="invalid_value")
    try:
        return ImageInput(*image_bytes_to_rgb(data, where))
    except InvalidInputError as exc:
        raise APIError(400, str(exc), param=where, code="invalid_value") from exc


def _download_image(url: str, where: str) -> bytes:
    import httpx

    try:
        with httpx.stream("GET", url, timeout=10.0, follow_redirects=True) as response:
            response.raise_for_status()
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > MAX_IMAGE_BYTES:
                    raise APIError(400, f"{where}: the image is larger than {MAX_IMAGE_BYTES} bytes", param=where,
                                   code="invalid_value")
                chunks.append(chunk)
    except httpx.HTTPError as exc:
        raise APIError(400, f"{where}: could not fetch the image ({exc})", param=where, code="invalid_value") from exc
    return b"".join(chunks)


def _arguments_obj(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


@dataclass
class ChatPlan:
    request: GenerationRequest
    tools_active: bool
    tool_names: set[str]


def plan_chat(state: ServerState, body: ChatCompletionRequest) -> ChatPlan:
    """Render the messages through the chat template and build the generation request."""
    template = state.loaded.chat_template
    if template is None:
        raise APIError(400, "this model has no chat template: use /v1/completions with a raw prompt",
                       param="messages", code="no_chat_template")
    tools = [t.model_dump(by_alias=True, exclude_none=True) for t in body.tools] if body.tools else []
    names = {t["function"]["name"] for t in tools}
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    forced: str | None = None
    if isinstance(choice, ToolChoiceFunction):
        forced = choice.function.name
        if forced not in names:
            raise APIError(400, f"tool_choice names function {forced!r}, which is not in tools",
                           param="tool_choice", code="invalid_value")
    elif choice == "required" and not tools:
        raise APIError(400, "tool_choice 'required' needs a non-empty tools list", param="tool_choice",
                       code="invalid_value")
    tools_active = bool(tools) and choice != "none"
    source = _template_source(template)
    tool_aware = "tools" in source and "tool_calls" in source
    messages: list[dict[str, Any]] = []
    images: list[ImageInput] = []
    for i, m in enumerate(body.messages):
        text = _message_text(state, m, i, images)
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": text or ""}
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            calls = [{"id": c.id or "", "type": "function",
                      "function": {"name": c.function.name, "arguments": _arguments_obj(c.function.arguments)}}
                     for c in m.tool_calls]
            if tool_aware:
                msg["tool_calls"] = calls
            else:  # spell the calls the way we told the model to make them
                spelled = "".join("<tool_call>" + json.dumps({"name": c["function"]["name"], "arguments":
                                  c["function"]["arguments"]}, ensure_ascii=False) + "</tool_call>" for c in calls)
                msg["content"] = (msg["content"] + "\n" if msg["content"] else "") + spelled
        if m.role in ("tool", "function"):
            if tool_aware:
                msg["role"] = "tool"
                if m.tool_call_id:
                    msg["tool_call_id"] = m.tool_call_id
            else:
                msg = {"role": "user", "content": f"Tool result ({m.name or m.tool_call_id or 'tool'}): {text or ''}"}
        messages.append(msg)
    if tools_active and not tool_aware:
        note = tools_system_prompt(tools)
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + note}
        else:
            messages.insert(0, {"role": "system", "content": note})
    try:
        extra = body.chat_template_kwargs or {}
        reserved = sorted(set(extra) & {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}",
                           param="chat_template_kwargs", code="invalid_value")
        prompt = template.render(messages, add_generation_prompt=True, tools=tools if tools_active and tool_aware
                                 else None, **extra)
    except APIError:
        raise
    except Exception as exc:  # the template's own checks (role order...) are about the client's input
        raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages",
                       code="invalid_value") from exc
    ids = encode_prompt(state, prompt)
    grammar = None
    if forced is not None or choice == "required":
        grammar = _grammar(state, tool_call_schema(tools, forced))
    else:
        constrained, schema = _schema_from_format(body.response_format)
        if constrained:
            grammar = _grammar(state, schema)
    top = body.top_logprobs or 0
    if top and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    request = GenerationRequest(
        prompt_ids=ids,
        max_tokens=body.max_completion_tokens or body.max_tokens or state.default_max_tokens,
        sampling=sampling_from(body, state.engine.vocab_size, body.logprobs, top),
        stop=stop_list(body.stop),
        ignore_eos=body.ignore_eos,
        grammar=grammar,
        use_prompt_cache=body.cache_prompt,
    )
    if len(images) > 1:
        raise APIError(400, "only one image per request is supported", param="messages", code="invalid_value")
    if images:
        try:
            state.engine.with_image(request, prompt, images[0])
        except RunlmError as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_value") from exc
    return ChatPlan(request, tools_active, names)


def encode_prompt(state: ServerState, text: str) -> list[int]:
    return state.tokenizer.encode_prompt(text)


@dataclass
class CompletionPlan:
    request: GenerationRequest
    echo_text: str


def plan_completion(state: ServerState, body: CompletionRequest) -> CompletionPlan:
    if body.suffix:
        raise APIError(400, "suffix (fill-in-the-middle) is not supported", param="suffix", code="unsupported")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = encode_prompt(state, prompt)
        echo_text = prompt
    else:
        ids = list(prompt)
        state.engine.check_prompt(ids)
        echo_text = state.tokenizer.decode(ids) if body.echo else ""
    constrained, schema = _schema_from_format(body.response_format)
    n_lp = body.logprobs or 0
    request = GenerationRequest(
        prompt_ids=ids,
        max_tokens=body.max_tokens or state.default_max_tokens,
        sampling=sampling_from(body, state.engine.vocab_size, body.logprobs is not None, n_lp),
        stop=stop_list(body.stop),
        ignore_eos=body.ignore_eos,
        grammar=_grammar(state, schema) if constrained else None,
        use_prompt_cache=body.cache_prompt,
    )
    return CompletionPlan(request, echo_text if body.echo else "")


# -- the app ----------------------------------------------------------------------------------------


def create_app(
    loaded: LoadedModel,
    *,
    api_key: str | None = None,
    prompt_cache_mb: float = 256,
    max_queue: int = 16,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    model_name: str | None = None,
    default_max_tokens: int | None = None,
    max_batch: int = 8,
    allow_remote_images: bool = False,
) -> FastAPI:
    """A FastAPI app serving one loaded model.

    `api_key` (or env RUNLM_API_KEY when None; "" turns it off) guards every route but /health.
    `max_queue` requests may wait behind the running one; more get 429. `default_max_tokens` caps
    requests that set no max_tokens (None: up to the context's end).
    """
    if api_key is None:
        api_key = os.environ.get("RUNLM_API_KEY") or None
    catalog_name = _catalog_name(loaded.path)
    name = model_name or catalog_name or loaded.path.stem
    engine = Engine(loaded.runner, loaded.tokenizer, context_length=loaded.context_length,
                    prompt_cache_mb=prompt_cache_mb)
    scheduler = Scheduler(engine, max_queue=max_queue, max_batch=max_batch)
    metrics = Metrics()
    aliases = {name, loaded.path.name, loaded.path.stem} | ({catalog_name} if catalog_name else set())
    state = ServerState(loaded, engine, scheduler, metrics, name, aliases, default_max_tokens,
                        allow_remote_images=allow_remote_images)

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        scheduler.close()

    app = FastAPI(title="runlm", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API over a local runlm model")
    app.state.runlm = state
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics)
    # The chat page at / (outside the key guard: it holds no secrets and asks for the key on a 401).
    app.add_middleware(WebPage, metrics=metrics)

    def observe(handle: RequestHandle) -> None:
        metrics.observe_generation(handle.gen.usage, handle.gen.finish_reason or "error")

    async def start(planner, body, id_prefix: str) -> tuple[Any, RequestHandle, str, int]:
        """Check the model, plan off the event loop, queue the request: (plan, handle, response id, created)."""
        state.check_model(body.model)
        plan = await run_in_threadpool(planner, state, body)
        handle = scheduler.submit(plan.request, loop=asyncio.get_running_loop(), on_done=observe)
        return plan, handle, f"{id_prefix}-{uuid.uuid4().hex}", int(time.time())

    # -- chat -----------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        plan, handle, rid, created = await start(plan_chat, body, "chatcmpl")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(chat_stream(state, handle, plan, rid, created, body.model, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        result = await collect(handle, request)
        filt = ToolCallStreamFilter(plan.tools_active, plan.tool_names)
        content = filt.push(result.text)
        rest, calls = filt.finish()
        content += rest
        message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
        finish = _finish_reason(result.finish_reason)
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
            finish = "tool_calls"
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if body.logprobs:
            choice["logprobs"] = {"content": [chat_logprob_entry(state.tokenizer, lp) for lp in result.logprobs]}
        return {"id": rid, "object": "chat.completion", "created": created, "model": body.model,
                "system_fingerprint": fingerprint(state), "choices": [choice], "usage": usage_json(result.usage),
                "timings": timings_json(result.usage)}

    # -- text completions -----------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        plan, handle, rid, created = await start(plan_completion, body, "cmpl")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(completion_stream(state, handle, plan, rid, created, body.model, include_usage,
                                                       body.logprobs is not None),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        result = await collect(handle, request)
        choice: dict[str, Any] = {"index": 0, "text": plan.echo_text + result.text,
                                  "finish_reason": _finish_reason(result.finish_reason), "logprobs": None}
        if body.logprobs is not None:
            choice["logprobs"] = completion_logprobs(state.tokenizer, result.logprobs, len(plan.echo_text))
        return {"id": rid, "object": "text_completion", "created": created, "model": body.model,
                "system_fingerprint": fingerprint(state), "choices": [choice], "usage": usage_json(result.usage),
                "timings": timings_json(result.usage)}

    # -- models, props, health, metrics -----------------------------------------------------------
    def model_card() -> dict[str, Any]:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "runlm",
                "meta": props_meta()}

    def props_meta() -> dict[str, Any]:
        return {"family": loaded.runner.family(),
                "context_length": loaded.context_length, "quantization": loaded.quantization,
                "format": getattr(loaded, "format", None), "vocab_size": engine.vocab_size,
                "file": loaded.path.name, "multimodal": bool(loaded.runner.supports_multimodal())}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        state.check_model(model_id)
        return model_card()

    @app.get("/props")
    async def props():
        return {"model": state.model_name, **props_meta(), "total_slots": scheduler.max_batch,
                "max_queue": scheduler.max_queue,
                "chat_template": _template_source(loaded.chat_template) or None,
                "has_chat_template": loaded.chat_template is not None,
                "prompt_cache_mb": prompt_cache_mb,
                "default_generation_settings": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                                "typical_p": 1.0, "repeat_penalty": 1.0, "repeat_last_n": 64,
                                                "max_tokens": default_max_tokens}}

    @app.get("/health")
    async def health():
        return {"status": "ok", "queue_depth": scheduler.queue_depth, "busy": scheduler.busy}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prom_metrics():
        cache = engine.prompt_cache
        gauges = {
            "runlm_queue_depth": ("Requests waiting for the worker.", scheduler.queue_depth),
            "runlm_requests_running": ("Requests being generated.", scheduler.in_flight),
            "runlm_prompt_cache_bytes": ("Bytes held by the prompt cache.", cache.nbytes if cache else 0),
            "runlm_prompt_cache_entries": ("Snapshots in the prompt cache.", len(cache) if cache else 0),
        }
        return PlainTextResponse(metrics.render(gauges), media_type="text/plain; version=0.0.4")

    # -- tokenize / detokenize ----------------------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        tok = state.tokenizer
        ids = tok.encode(body.content, add_bos=body.add_special) if body.add_special else tok.encode(
            body.content, add_bos=False)
        if body.with_pieces:
            return {"tokens": [{"id": i, "piece": _token_text(tok, i)} for i in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        vocab = state.tokenizer.vocab_size
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens: token id {bad} is outside the vocabulary [0, {vocab})", param="tokens",
                           code="invalid_value")
        return {"content": state.tokenizer.decode(body.tokens)}

    return app


def _catalog_name(path: Any) -> str | None:
    """The catalog name of a pulled model file, so clients can ask for "smollm2-135m"."""
    try:
        from runlm import catalog

        return next((m.name for m in catalog.CATALOG.values() if m.filename == path.name), None)
    except Exception:  # the catalog is a convenience here, never a reason to fail
        return None


def fingerprint(state: ServerState) -> str:
    return f"runlm-0.1.0-{state.loaded.quantization}"


async def collect(handle: RequestHandle, request: Request):
    """Wait for a whole generation; a client that hangs up cancels it."""

    async def watch() -> None:
        while not handle.done.is_set():
            await asyncio.sleep(0.25)
            if await request.is_disconnected():
                handle.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await handle.aresult()
    finally:
        watcher.cancel()
        handle.cancel()


async def chat_stream(state: ServerState, handle: RequestHandle, plan: ChatPlan, rid: str, created: int,
                      model: str, include_usage: bool) -> AsyncIterator[str]:
    tok = state.tokenizer
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": fingerprint(state)}

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse({**base, "choices": [choice]} | ({"usage": None} if include_usage else {}))

    filt = ToolCallStreamFilter(plan.tools_active, plan.tool_names)
    last = StreamRecord()
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for record in handle:
            last = record
            text = filt.push(record.text)
            lps = {"content": [chat_logprob_entry(tok, record.logprob)]} if record.logprob is not None else None
            if text or lps:
                yield chunk({"content": text} if text else {}, logprobs=lps)
        rest, calls = filt.finish()
        if rest:
            yield chunk({"content": rest})
        finish = _finish_reason(last.finish_reason)
        if calls:
            yield chunk({"tool_calls": [c.to_openai(index=i) for i, c in enumerate(calls)]})
            finish = "tool_calls"
        yield chunk({}, finish=finish)
        if include_usage:
            usage = last.usage or handle.gen.usage
            yield sse({**base, "choices": [], "usage": usage_json(usage), "timings": timings_json(usage)})
        yield SSE_DONE
    except Exception as exc:  # mid-stream failure: tell the client in-band, then end the stream
        err = api_error_from(exc)
        yield sse(error_body(err.status, err.message, err.param, err.code, err.type))
        yield SSE_DONE
    finally:
        handle.cancel()


async def completion_stream(state: ServerState, handle: RequestHandle, plan: CompletionPlan, rid: str,
                            created: int, model: str, include_usage: bool, logprobs: bool) -> AsyncIterator[str]:
    tok = state.tokenizer
    base = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": fingerprint(state)}
    offset = len(plan.echo_text)

    def chunk(text: str, finish: str | None = None, lps: Any = None) -> str:
        return sse({**base, "choices": [{"index": 0, "text": text, "logprobs": lps, "finish_reason": finish}]})

    last = StreamRecord()
    try:
        if plan.echo_text:
            yield chunk(plan.echo_text)
        async for record in handle:
            last = record
            lps = None
            if logprobs and record.logprob is not None:
                lps = completion_logprobs(tok, [record.logprob], offset)
            if record.text or lps:
                yield chunk(record.text, lps=lps)
            offset += len(record.text)
        yield chunk("", finish=_finish_reason(last.finish_reason))
        if include_usage:
            usage = last.usage or handle.gen.usage
            yield sse({**base, "choices": [], "usage": usage_json(usage), "timings": timings_json(usage)})
        yield SSE_DONE
    except Exception as exc:
        err = api_error_from(exc)
        yield sse(error_body(err.status, err.message, err.param, err.code, err.type))
        yield SSE_DONE
    finally:
        handle.cancel()


def serve(
    loaded: LoadedModel, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info", **kw: Any
) -> None:
    """Run the server until interrupted (the CLI's `runlm serve`). Binds loopback unless told otherwise."""
    import uvicorn

    api_key = kw.get("api_key")
    if api_key is None:
        api_key = os.environ.get("RUNLM_API_KEY") or None
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("serving on %s without an API key: anyone who can reach this address can use the model",
                    host)
    app = create_app(loaded, **kw)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


__all__ = ["create_app", "serve", "ServerState"]
