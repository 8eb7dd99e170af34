"""OpenAI's wire format: requests planned into GenerationRequests, results and stream records shaped back.

Nothing here runs a model or touches the app: every function takes the ServerState and a parsed body
(or a finished result) and returns plain data, so each can be tested on its own.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from typing import Any

from runlm.engine import Completion, GenerationRequest, StreamRecord, Usage
from runlm.engine.core import merged_usage
from runlm.engine.grammar import (
    GrammarConstraint,
    grammar_for_forced_call,
    grammar_for_harmony_call,
    grammar_for_json_schema,
)
from runlm.engine.harmony import CHANNEL, CONSTRAIN, FORCED_CALL_HEAD, MESSAGE, harmony_effort
from runlm.engine.reasoning import ThinkingBudget, ThinkingPlan, thinking_switch
from runlm.engine.speculative import Speculation
from runlm.engine.tools import FORMAT_MARKERS, forced_call_format
from runlm.errors import RunlmError
from runlm.runner import ImageInput
from runlm.sampling import SamplingParams, TokenLogprob
from runlm.server.errors import APIError
from runlm.server.images import fetch_image
from runlm.server.infill import fim_request
from runlm.server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ResponseFormat,
    SamplingFields,
)
from runlm.server.state import ServerState
from runlm.server.tools import (
    ReplyStream,
    ToolPlan,
    add_tools_prompt,
    plan_tools,
    split_reply,
    template_message,
    template_source,
)

MIN_LOGPROB = -9999.0  # what OpenAI reports for probabilities that underflow
RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}

# -- tokens, log-probs, usage ---------------------------------------------------------------------


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    return tokenizer.token_to_bytes(token_id)


def token_text(tokenizer: Any, token_id: int) -> str:
    return token_bytes(tokenizer, token_id).decode("utf-8", errors="replace")


def _lp(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


def chat_logprob_entry(tokenizer: Any, lp: TokenLogprob) -> dict[str, Any]:
    def one(token_id: int, value: float) -> dict[str, Any]:
        data = token_bytes(tokenizer, token_id)
        return {"token": data.decode("utf-8", errors="replace"), "logprob": _lp(value), "bytes": list(data)}

    entry = one(lp.token_id, lp.logprob)
    entry["top_logprobs"] = [one(t.token_id, t.logprob) for t in lp.top]
    return entry


def completion_logprobs(tokenizer: Any, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        text = token_text(tokenizer, lp.token_id)
        tokens.append(text)
        values.append(_lp(lp.logprob))
        tops.append({token_text(tokenizer, t.token_id): _lp(t.logprob) for t in lp.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        # speculative decoding's drafted tokens the model kept, and the ones it drew otherwise
        "completion_tokens_details": {"accepted_prediction_tokens": usage.accepted_tokens,
                                      "rejected_prediction_tokens": usage.draft_tokens - usage.accepted_tokens},
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
        "draft_n": usage.draft_tokens,
        "draft_n_accepted": usage.accepted_tokens,
    }


def finish_reason(reason: str | None) -> str:
    return reason if reason in ("stop", "length", "tool_calls") else "stop"


# -- request -> GenerationRequest --------------------------------------------------------------------


def speculation_from(body: SamplingFields, server: Speculation) -> Speculation | None:
    """A request's `speculative.n_max` (llama-server's): 0 turns drafting off, N drafts up to N tokens a step (with
    the server's draft model, or by prompt lookup); absent, the server's --speculative / --draft-max."""
    n = body.speculative_n_max
    if n is None:
        return None
    mode = "off" if n == 0 else server.mode if server.mode != "off" else "ngram"
    return replace(server, mode=mode, draft_max=n)


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


def schema_from_format(fmt: ResponseFormat | None) -> tuple[bool, Any]:
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


def constraint(state: ServerState, grammar: str) -> GrammarConstraint:
    """A request's matcher for `grammar` on the model's vocabulary, ended by its end-of-turn tokens."""
    tok = state.tokenizer
    eos = sorted(tok.stop_ids or ([tok.eos_id] if tok.eos_id is not None else []))
    return GrammarConstraint(grammar, tok, state.engine.vocab_size, eos)


def json_grammar(state: ServerState, schema: Any) -> GrammarConstraint:
    return constraint(state, grammar_for_json_schema(schema))


def special_markers(state: ServerState, markers: tuple[str, ...]) -> set[str]:
    """Which of a format's markers are special tokens in the model's vocabulary."""
    tok = state.tokenizer
    return {marker for marker in markers if tok.token_to_id(marker) in tok.special_ids}


def forced_call_grammar(state: ServerState, tools: ToolPlan, template: Any) -> GrammarConstraint:
    """A forced call in the format the chat template writes (a template that knows no tools was told to write
    bare JSON)."""
    call_format = forced_call_format(template_source(template)) if tools.template_aware else "json"
    return constraint(state, grammar_for_forced_call(call_format, tools.tools, special_markers(state, FORMAT_MARKERS),
                                                     tools.forced))


def harmony_call_grammar(state: ServerState, tools: ToolPlan) -> GrammarConstraint:
    """The grammar of a forced harmony call after the header the prompt wrote: a name, then its JSON arguments."""
    return constraint(state, grammar_for_harmony_call(tools.tools, special_markers(state, (CONSTRAIN, MESSAGE)),
                                                      tools.forced))


def message_text(state: ServerState, message: ChatMessage, index: int, images: list[ImageInput],
                 image_slot: str | None = None) -> str | None:
    """The message's text; each image part becomes the model's image marker (or `image_slot`, to be replaced
    by it later) and its pixels go to `images`."""
    if message.content is None or isinstance(message.content, str):
        return message.content
    parts = []
    for j, part in enumerate(message.content):
        where = f"messages.{index}.content.{j}"
        if part.type == "text":
            parts.append(part.text or "")
        elif part.type == "image_url" and part.image_url is not None:
            marker = state.loaded.runner.image_marker()
            if marker is None:
                raise APIError(400, f"{where}: this model has no vision tower and cannot take images",
                               param=f"messages.{index}.content", code="invalid_value")
            images.append(fetch_image(part.image_url.url, where, state.remote_images))
            parts.append(image_slot or marker)
        else:
            raise APIError(400, f"{where}: content of type {part.type!r} is not supported (text and image_url are)",
                           param=f"messages.{index}.content", code="invalid_value")
    return "\n".join(parts)


@dataclass
class ChatPlan:
    request: GenerationRequest
    tools: ToolPlan
    thinking: ThinkingPlan = ThinkingPlan()


# How deep client JSON may nest where the chat template renders it: far beyond any tool schema, and shallow enough
# that hiding special tokens and rendering never meet Python's recursion limit.
MAX_TEMPLATE_DEPTH = 64


def deeper_than(value: Any, limit: int) -> bool:
    """Whether lists / dicts in `value` nest more than `limit` levels (walked without recursion)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list | tuple):
            if depth >= limit:
                return True
            stack.extend((child, depth + 1) for child in item)
    return False


def thinking_budget(state: ServerState, thinking: ThinkingPlan, tokens: int,
                    gates_grammar: bool = False) -> ThinkingBudget | None:
    """What the engine watches of a split reply's thinking: its bound (none where it is -1), and, under a grammar,
    where it ends (the grammar holds what follows). None where there is nothing to watch."""
    if not thinking.active or (tokens < 0 and not gates_grammar):
        return None
    close = state.tokenizer.encode(thinking.close_text, add_bos=False, add_eos=False)
    return ThinkingBudget(tokens if tokens >= 0 else None, tuple(close), thinking)


def plan_chat(state: ServerState, body: ChatCompletionRequest) -> ChatPlan:
    """Render the messages through the chat template and build the generation request."""
    template = state.loaded.chat_template
    if template is None:
        raise APIError(400, "this model has no chat template: use /v1/completions with a raw prompt",
                       param="messages", code="no_chat_template")
    tools = plan_tools(body, template)
    image_parts = sum(1 for m in body.messages if isinstance(m.content, list)
                      for part in m.content if part.type == "image_url")
    if image_parts > 1:  # counted before any is fetched or decoded
        raise APIError(400, "only one image per request is supported", param="messages", code="invalid_value")
    images: list[ImageInput] = []
    literal = state.literal_specials
    # While client text has its special-token strings hidden, an image's place is a slot no client can write, made
    # the runner's image marker once the template has run: then only that and the template's markers are special.
    slot = f"runlm-image-{secrets.token_hex(16)}" if literal is not None else None
    messages = [template_message(m, message_text(state, m, i, images, slot), tools)
                for i, m in enumerate(body.messages)]
    add_tools_prompt(messages, tools)
    extra = dict(body.chat_template_kwargs or {})
    reserved = sorted(set(extra) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}",
                       param="chat_template_kwargs", code="invalid_value")
    constrained, schema = schema_from_format(body.response_format)
    harmony = CHANNEL in template_source(template)
    if body.reasoning_effort is not None:  # gpt-oss's template takes low, medium or high
        extra.setdefault("reasoning_effort", harmony_effort(body.reasoning_effort) if harmony else
                         body.reasoning_effort)
    budget = body.reasoning_budget if body.reasoning_budget is not None else state.reasoning_budget
    if budget == 0:  # no thinking allowed: the template's thinking off
        extra.setdefault("enable_thinking", False)
    elif body.reasoning_effort is not None:
        extra.setdefault("enable_thinking", thinking_switch(body.reasoning_effort))
    thinking_off = extra.get("enable_thinking") is False
    template_tools = tools.tools if tools.active and tools.template_aware else None
    for name, value in (("chat_template_kwargs", extra), ("tools", template_tools), ("messages", messages)):
        if deeper_than(value, MAX_TEMPLATE_DEPTH):
            raise APIError(400, f"{name} is nested more than {MAX_TEMPLATE_DEPTH} levels deep", param=name,
                           code="invalid_value")
    if literal is not None:  # special-token strings the client wrote stay text: only the template's are markers
        messages, template_tools, extra = literal.hide(messages), literal.hide(template_tools), literal.hide(extra)
    try:
        prompt = template.render(messages, add_generation_prompt=True, tools=template_tools, **extra)
    except Exception as exc:  # the template's own checks (role order...) are about the client's input
        raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages",
                       code="invalid_value") from exc
    if slot is not None and images:
        prompt = prompt.replace(slot, state.loaded.runner.image_marker() or "")
    thinking = ThinkingPlan.for_prompt(body.reasoning_format or state.reasoning_format, template_source(template),
                                       prompt)
    grammar = None
    forced_call = tools.forced is not None or tools.required
    if forced_call and thinking.parser == "harmony":  # the call in harmony: its header written, the rest held
        prompt += FORCED_CALL_HEAD
        thinking = ThinkingPlan("harmony", written=FORCED_CALL_HEAD)
        grammar = harmony_call_grammar(state, tools)
    elif constrained or forced_call:  # the grammar holds the answer, from the thinking's end (the engine gates it)
        grammar = forced_call_grammar(state, tools, template) if forced_call else json_grammar(state, schema)
        if thinking.parser == "harmony":
            pass  # the final channel's body is the answer; the analysis before it runs free
        elif thinking.active and not thinking_off and not thinking.opened:  # open it here, as the model would
            prompt += thinking.open_text
            thinking = ThinkingPlan(thinking.parser, True)
        elif thinking_off or not thinking.active:
            if thinking.opened:  # the template opened the thinking whatever it was told: close it empty
                prompt += thinking.close_text
            thinking = ThinkingPlan()
    top = body.top_logprobs or 0
    if top and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    request = GenerationRequest(
        prompt_ids=literal.encode(prompt) if literal is not None else state.tokenizer.encode_prompt(prompt),
        max_tokens=body.max_completion_tokens or body.max_tokens or state.default_max_tokens,
        sampling=sampling_from(body, state.engine.vocab_size, body.logprobs, top),
        stop=stop_list(body.stop),
        ignore_eos=body.ignore_eos,
        grammar=grammar,
        use_prompt_cache=body.cache_prompt,
        thinking_budget=None if thinking.written else thinking_budget(state, thinking, budget,
                                                                        gates_grammar=grammar is not None),
        speculation=speculation_from(body, state.engine.speculation),
    )
    if images:
        try:
            # the runner expands its image marker into soft tokens; `literal` tokenizes the expansion
            state.engine.with_image(request, prompt, images[0], encode=literal.encode if literal is not None else None)
        except RunlmError as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_value") from exc
    return ChatPlan(request, tools, thinking)


@dataclass
class CompletionPlan:
    request: GenerationRequest
    echo_text: str


def choices_asked(body: CompletionRequest) -> tuple[int, int]:
    """(n, best_of): best_of candidates are generated and the n most likely per token returned."""
    n = body.n or 1
    best_of = body.best_of or n
    if best_of < n:
        raise APIError(400, f"best_of ({best_of}) must be at least n ({n})", param="best_of", code="invalid_value")
    if best_of > n and body.stream:
        raise APIError(400, "best_of cannot be streamed: the best candidates are known only at the end",
                       param="best_of", code="invalid_value")
    return n, best_of


def plan_completion(state: ServerState, body: CompletionRequest) -> CompletionPlan:
    """A text completion; with a `suffix`, a fill-in-the-middle between the prompt and it (server.infill)."""
    n, best_of = choices_asked(body)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    stop_ids = None
    if body.suffix:
        if not isinstance(prompt, str):
            raise APIError(400, "suffix needs the prompt as text (the code before the gap), not token ids",
                           param="prompt", code="invalid_value")
        if body.echo:
            raise APIError(400, "echo cannot be combined with suffix", param="echo", code="invalid_value")
        ids, stop_ids = fim_request(state, prompt, body.suffix, param="suffix")
        echo_text = ""
    elif isinstance(prompt, str):
        ids = state.tokenizer.encode_prompt(prompt)
        echo_text = prompt
    else:
        ids = list(prompt)
        state.engine.check_prompt(ids)
        echo_text = state.tokenizer.decode(ids) if body.echo else ""
    constrained, schema = schema_from_format(body.response_format)
    request = GenerationRequest(
        prompt_ids=ids,
        max_tokens=body.max_tokens or state.default_max_tokens,
        # best_of ranks candidates by their log-probs, so they are computed even when not asked for
        sampling=sampling_from(body, state.engine.vocab_size, body.logprobs is not None or best_of > n,
                               body.logprobs or 0),
        stop=stop_list(body.stop),
        ignore_eos=body.ignore_eos,
        grammar=json_grammar(state, schema) if constrained else None,
        use_prompt_cache=body.cache_prompt,
        stop_ids=stop_ids,
        speculation=speculation_from(body, state.engine.speculation),
    )
    return CompletionPlan(request, echo_text if body.echo else "")


# -- whole responses ------------------------------------------------------------------------------


def _envelope(state: ServerState, obj: str, rid: str, created: int, model: str) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": state.fingerprint}


def chat_choice(state: ServerState, plan: ChatPlan, body: ChatCompletionRequest, result: Completion,
                index: int) -> dict[str, Any]:
    reasoning, content, calls = split_reply(plan.tools, plan.thinking, result.text)
    message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    finish = finish_reason(result.finish_reason)
    if calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
        finish = "tool_calls"
    choice: dict[str, Any] = {"index": index, "message": message, "finish_reason": finish, "logprobs": None}
    if body.logprobs:
        choice["logprobs"] = {"content": [chat_logprob_entry(state.tokenizer, lp) for lp in result.logprobs]}
    return choice


def chat_response(state: ServerState, plan: ChatPlan, body: ChatCompletionRequest, results: list[Completion],
                  rid: str, created: int) -> dict[str, Any]:
    """A chat.completion with one choice per result (`n`); usage counts the prompt once."""
    usage = merged_usage([r.usage for r in results])
    return {**_envelope(state, "chat.completion", rid, created, body.model),
            "choices": [chat_choice(state, plan, body, r, i) for i, r in enumerate(results)],
            "usage": usage_json(usage), "timings": timings_json(usage)}


def mean_logprob(result: Completion) -> float:
    return sum(lp.logprob for lp in result.logprobs) / len(result.logprobs) if result.logprobs else float("-inf")


def completion_response(state: ServerState, plan: CompletionPlan, body: CompletionRequest,
                        results: list[Completion], rid: str, created: int) -> dict[str, Any]:
    """A text_completion with one choice per result (`n`), or the `n` of `best_of` results with the highest
    log-probability per token, best first; usage counts the prompt once and every generated token."""
    n = body.n or 1
    chosen = sorted(results, key=mean_logprob, reverse=True)[:n] if len(results) > n else results
    choices = []
    for index, result in enumerate(chosen):
        choice: dict[str, Any] = {"index": index, "text": plan.echo_text + result.text,
                                  "finish_reason": finish_reason(result.finish_reason), "logprobs": None}
        if body.logprobs is not None:
            choice["logprobs"] = completion_logprobs(state.tokenizer, result.logprobs, len(plan.echo_text))
        choices.append(choice)
    usage = merged_usage([r.usage for r in results])
    return {**_envelope(state, "text_completion", rid, created, body.model), "choices": choices,
            "usage": usage_json(usage), "timings": timings_json(usage)}


# -- streams: what each record becomes (server.sse sends it) ------------------------------------------


def _delta(reasoning: str, content: str) -> dict[str, str]:
    """A chunk's delta: the thinking as `reasoning_content` (llama-server's and vLLM's field), the answer."""
    return ({"reasoning_content": reasoning} if reasoning else {}) | ({"content": content} if content else {})


class ChatChunks:
    """chat.completion.chunk events: a role delta, content deltas, tool calls at the end, finish, usage.

    With `n` choices each chunk carries its choice's index; the choices' chunks interleave as the batch
    makes them, and each choice's tool calls and finish come at the end.
    """

    def __init__(self, state: ServerState, plan: ChatPlan, body: ChatCompletionRequest, rid: str, created: int):
        self.tokenizer = state.tokenizer
        self.base = _envelope(state, "chat.completion.chunk", rid, created, body.model)
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        n = body.n or 1
        self.replies = [ReplyStream(plan.tools, plan.thinking) for _ in range(n)]
        self.finish_reasons: list[str | None] = [None] * n

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None,
               index: int = 0) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**self.base, "choices": [choice]} | ({"usage": None} if self.include_usage else {})

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""}, index=i) for i in range(len(self.replies))]

    def on_record(self, record: StreamRecord) -> list[dict[str, Any]]:
        if record.finish_reason is not None:
            self.finish_reasons[record.index] = record.finish_reason
        reply = self.replies[record.index]
        reasoning, text = reply.push(record.text)
        delta = _delta(reasoning, text)
        lps = {"content": [chat_logprob_entry(self.tokenizer, record.logprob)]} if record.logprob is not None else None
        events = [self._chunk(delta, logprobs=lps, index=record.index)] if delta or lps else []
        pieces = reply.take_call_deltas()
        if pieces:  # tool calls whose arguments stream as they are written
            events.append(self._chunk({"tool_calls": [p.to_openai() for p in pieces]}, index=record.index))
        return events

    def closing(self, last: StreamRecord, usage: Usage) -> list[dict[str, Any]]:
        events = []
        for index, reply in enumerate(self.replies):
            reasoning, rest, calls = reply.finish()
            if reasoning or rest:
                events.append(self._chunk(_delta(reasoning, rest), index=index))
            finish = finish_reason(self.finish_reasons[index] or last.finish_reason)
            unsent = [c.to_openai(index=i) for i, c in enumerate(calls) if i >= reply.calls_streamed]
            if unsent:  # calls in a format that does not stream go out whole
                events.append(self._chunk({"tool_calls": unsent}, index=index))
            if calls:
                finish = "tool_calls"
            events.append(self._chunk({}, finish=finish, index=index))
        if self.include_usage:
            events.append({**self.base, "choices": [], "usage": usage_json(usage), "timings": timings_json(usage)})
        return events


class CompletionChunks:
    """text_completion events: the echoed prompt, text deltas with their log-probs, finish, usage (each
    chunk tagged with its choice's index when there are `n`)."""

    def __init__(self, state: ServerState, plan: CompletionPlan, body: CompletionRequest, rid: str, created: int):
        self.tokenizer = state.tokenizer
        self.base = _envelope(state, "text_completion", rid, created, body.model)
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.logprobs = body.logprobs is not None
        self.echo_text = plan.echo_text
        n = body.n or 1
        self.offsets = [len(plan.echo_text)] * n
        self.finish_reasons: list[str | None] = [None] * n

    def _chunk(self, text: str, finish: str | None = None, lps: Any = None, index: int = 0) -> dict[str, Any]:
        return {**self.base, "choices": [{"index": index, "text": text, "logprobs": lps, "finish_reason": finish}]}

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk(self.echo_text, index=i) for i in range(len(self.offsets))] if self.echo_text else []

    def on_record(self, record: StreamRecord) -> list[dict[str, Any]]:
        if record.finish_reason is not None:
            self.finish_reasons[record.index] = record.finish_reason
        lps = None
        if self.logprobs and record.logprob is not None:
            lps = completion_logprobs(self.tokenizer, [record.logprob], self.offsets[record.index])
        self.offsets[record.index] += len(record.text)
        return [self._chunk(record.text, lps=lps, index=record.index)] if record.text or lps else []

    def closing(self, last: StreamRecord, usage: Usage) -> list[dict[str, Any]]:
        events = [self._chunk("", finish=finish_reason(reason or last.finish_reason), index=i)
                  for i, reason in enumerate(self.finish_reasons)]
        if self.include_usage:
            events.append({**self.base, "choices": [], "usage": usage_json(usage), "timings": timings_json(usage)})
        return events
