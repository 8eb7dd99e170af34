"""OpenAI's Responses API wire format, as a thin layer over chat completions' planning.

A Responses request (instructions, input items, function tools, `text.format`) becomes the chat
messages of a ChatCompletionRequest and is planned by `plan_chat`, so templates, tools, grammars and
sampling work exactly as they do for chat. What comes back is shaped into a Response object (output
items: an assistant `message`, `function_call`s) or into the typed event stream. Conversations
continue through `previous_response_id` from a bounded in-memory store of finished responses.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from runlm.engine import GenerationRequest, StreamRecord, Usage
from runlm.engine.tools import ToolCall
from runlm.server.errors import APIError
from runlm.server.openai_shapes import ChatPlan, plan_chat
from runlm.server.schemas import Bias, ChatCompletionRequest, Penalty, Seed, Strict, Temperature, Unit
from runlm.server.state import ServerState
from runlm.server.tools import ReplyStream, split_reply

DEFAULT_STORED_RESPONSES = 256  # per API key
DEFAULT_STORED_BYTES = 64 << 20  # per API key: the responses' JSON

# -- request bodies ---------------------------------------------------------------------------------


class InputPart(Strict):
    """A content part: input_text / output_text / refusal (text), input_image (a URL or data: URL)."""

    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class InputItem(Strict):
    """One input item: a message (the type may be left out), a function_call, a function_call_output.

    Items a previous response produced (its `output`) are valid input as they are."""

    type: str | None = None
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: list[InputPart] | str | None = None  # the list first: its errors say which part is wrong
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: list[InputPart] | str | None = None
    id: str | None = None


class ResponseTool(Strict):
    """Responses' flat function tool; other types (web_search, file_search...) are refused in planning."""

    type: str
    name: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceObject(Strict):
    type: str
    name: str | None = None


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None  # "none" turns the thinking off
    summary: str | None = None  # accepted; the thinking comes whole, as reasoning_text


class ResponsesRequest(Strict):
    model: str
    input: list[InputItem] | str | None = None  # the list first: its errors name the item (input.0.role)
    instructions: str | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: Unit | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None  # OpenAI's bounds: 16 pairs, 64 / 512 characters
    parallel_tool_calls: bool | None = None
    background: bool | None = None
    user: Annotated[str, Field(max_length=512)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    include: list[str] | None = None
    conversation: Any = None
    prompt: Any = None
    # runlm / llama.cpp extensions, as on chat completions
    seed: Seed | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Unit | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repeat_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    logit_bias: dict[str, Bias] | None = None
    cache_prompt: bool = True


EXTENSIONS = ("seed", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repeat_penalty", "logit_bias",
              "temperature", "top_p", "user")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- the store behind previous_response_id and GET / DELETE --------------------------------------------


@dataclass
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages through this response's output, instructions excluded


class ResponseStore:
    """Stored responses, each API key (tenant) with its own least-recently-used list of at most `capacity` responses
    and `max_bytes` bytes (their JSON), so that no key evicts another's; safe across threads. The server holds at
    most keys x quota: tenants are the API keys, a fixed set."""

    def __init__(self, capacity: int = DEFAULT_STORED_RESPONSES, max_bytes: int = DEFAULT_STORED_BYTES):
        self.capacity = max(1, int(capacity))
        self.max_bytes = max(1, int(max_bytes))
        self._tenants: dict[str, OrderedDict[str, tuple[StoredResponse, int]]] = {}
        self._bytes: dict[str, int] = {}
        self._lock = threading.Lock()

    def put(self, entry: StoredResponse, tenant: str = "") -> bool:
        """Keep `entry` under its response id, dropping the tenant's least recently used ones to make room; False
        (nothing kept) where it alone is over the tenant's byte quota."""
        size = len(json.dumps([entry.response, entry.conversation], ensure_ascii=False, default=str))
        if size > self.max_bytes:
            return False
        response_id = entry.response["id"]
        with self._lock:
            items = self._tenants.setdefault(tenant, OrderedDict())
            self._drop(tenant, response_id)
            items[response_id] = (entry, size)
            self._bytes[tenant] = self._bytes.get(tenant, 0) + size
            while len(items) > self.capacity or self._bytes[tenant] > self.max_bytes:
                self._drop(tenant, next(iter(items)))
        return True

    def _drop(self, tenant: str, response_id: str) -> bool:
        item = self._tenants.get(tenant, {}).pop(response_id, None)
        if item is not None:
            self._bytes[tenant] -= item[1]
        return item is not None

    def get(self, response_id: str, tenant: str = "") -> StoredResponse | None:
        with self._lock:
            items = self._tenants.get(tenant)
            item = items.get(response_id) if items is not None else None
            if item is None:
                return None
            items.move_to_end(response_id)
            return item[0]

    def delete(self, response_id: str, tenant: str = "") -> bool:
        with self._lock:
            return self._drop(tenant, response_id)

    def usage(self, tenant: str = "") -> tuple[int, int]:
        """(responses, bytes) the tenant holds."""
        with self._lock:
            return len(self._tenants.get(tenant, ())), self._bytes.get(tenant, 0)

    def scoped(self, tenant: str) -> TenantResponses:
        """The responses one tenant (API key) can store, find and delete: no other key sees them."""
        return TenantResponses(self, tenant)


class TenantResponses:
    """One tenant's view of a ResponseStore (the same calls, within the tenant's own list)."""

    def __init__(self, store: ResponseStore, tenant: str):
        self.store, self.tenant = store, tenant

    def put(self, entry: StoredResponse) -> bool:
        return self.store.put(entry, self.tenant)

    def get(self, response_id: str) -> StoredResponse | None:
        return self.store.get(response_id, self.tenant)

    def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id, self.tenant)


def not_found(response_id: str) -> APIError:
    return APIError(404, f"no stored response with id {response_id!r} (responses are kept in memory, the last "
                         "few hundred, and only with store: true)", param="response_id", code="response_not_found")


# -- input items -> chat messages ------------------------------------------------------------------


def _content(content: str | list[InputPart] | None, where: str) -> str | list[dict[str, Any]] | None:
    if content is None or isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if part.type in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.text or ""})
        elif part.type == "refusal":
            parts.append({"type": "text", "text": part.refusal or ""})
        elif part.type == "input_image" and part.image_url:
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
        else:
            raise APIError(400, f"{where}.{j}: content of type {part.type!r} is not supported (input_text, "
                                "output_text and input_image with an image_url are)", param=f"{where}.{j}.type",
                           code="unsupported_value")
    return parts


def _text_of(output: str | list[InputPart] | None) -> str:
    if output is None or isinstance(output, str):
        return output or ""
    return "\n".join(p.text or "" for p in output if p.type in ("input_text", "output_text", "text"))


def messages_from_items(items: list[InputItem], where: str = "input") -> list[dict[str, Any]]:
    """Responses items as chat messages: function_calls join the assistant turn before them (parallel
    calls), function_call_outputs become tool messages; reasoning items carry nothing we can use."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.type or "message"
        here = f"{where}.{i}"
        if kind == "message":
            if item.role is None:
                raise APIError(400, f"{here}.role: required for a message", param=f"{here}.role",
                               code="missing_required_parameter")
            messages.append({"role": item.role, "content": _content(item.content, f"{here}.content")})
        elif kind == "function_call":
            if not item.name or not item.call_id:
                raise APIError(400, f"{here}: a function_call needs name and call_id", param=here,
                               code="missing_required_parameter")
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not item.call_id:
                raise APIError(400, f"{here}.call_id: required for a function_call_output", param=f"{here}.call_id",
                               code="missing_required_parameter")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text_of(item.output)})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"{here}: input items of type {kind!r} are not supported (message, function_call, "
                                "function_call_output are)", param=f"{here}.type", code="unsupported_value")
    return messages


def _name_tool_results(messages: list[dict[str, Any]]) -> None:
    """Give each tool result the name of the call it answers (templates that do not know tools say it)."""
    names: dict[str, str] = {}
    for message in messages:
        for call in message.get("tool_calls") or []:
            names[call["id"]] = call["function"]["name"]
        if message["role"] == "tool" and message.get("tool_call_id") in names:
            message["name"] = names[message["tool_call_id"]]


# -- planning --------------------------------------------------------------------------------------


def _refuse_unsupported(body: ResponsesRequest) -> None:
    def refuse(param: str, message: str) -> None:
        raise APIError(400, message, param=param, code="unsupported_parameter")

    if body.background:
        refuse("background", "background mode is not supported: runlm answers while the request is open")
    if body.conversation is not None:
        refuse("conversation", "conversations are not supported: continue with previous_response_id")
    if body.prompt is not None:
        refuse("prompt", "stored prompt templates are not supported: send instructions and input")
    if body.top_logprobs or "message.output_text.logprobs" in (body.include or []):
        refuse("top_logprobs", "log-probs are not supported on /v1/responses (chat completions has them)")
    for i, tool in enumerate(body.tools or []):
        if tool.type != "function":
            refuse(f"tools.{i}.type", f"tools of type {tool.type!r} are not supported: runlm runs no hosted tools, "
                                      "only function tools the client executes")
        if not tool.name:
            raise APIError(400, f"tools.{i}.name: required for a function tool", param=f"tools.{i}.name",
                           code="missing_required_parameter")
    choice = body.tool_choice
    if isinstance(choice, ToolChoiceObject) and (choice.type != "function" or not choice.name):
        refuse("tool_choice", f"tool_choice of type {choice.type!r} is not supported (none, auto, required, or "
                              '{"type": "function", "name": ...})')


def _chat_param(param: str | None) -> str | None:
    """A chat-completions parameter name, as the Responses request spells it."""
    if param is None:
        return None
    for chat, responses in (("messages", "input"), ("response_format", "text.format"),
                            ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens")):
        if param == chat or param.startswith(chat + "."):
            return responses
    return param


def _chat_body(body: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "cache_prompt": body.cache_prompt}
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["reasoning_effort"] = body.reasoning.effort
    for name in EXTENSIONS:
        value = getattr(body, name)
        if value is not None:
            chat[name] = value
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in body.tools]
    if isinstance(body.tool_choice, ToolChoiceObject):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        spec = {"name": fmt.name, "description": fmt.description, "schema": fmt.schema_, "strict": fmt.strict}
        chat["response_format"] = {"type": "json_schema", "json_schema": {k: v for k, v in spec.items()
                                                                          if v is not None}}
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    return chat


@dataclass
class ResponsesPlan:
    request: GenerationRequest
    chat: ChatPlan
    body: ResponsesRequest
    conversation: list[dict[str, Any]]  # what the next turn continues from, this input included
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))


def plan_response(state: ServerState, body: ResponsesRequest, store: ResponseStore | TenantResponses) -> ResponsesPlan:
    """Resolve previous_response_id, turn instructions and input into chat messages, plan them as chat."""
    _refuse_unsupported(body)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            err = not_found(body.previous_response_id)
            err.param = "previous_response_id"
            raise err
        history = [dict(m) for m in previous.conversation]
    if isinstance(body.input, str):
        new = [{"role": "user", "content": body.input}]
    else:
        new = messages_from_items(body.input or [])
    conversation = history + new
    if not conversation:
        raise APIError(400, "input: nothing to respond to (send input, or previous_response_id with input)",
                       param="input", code="missing_required_parameter")
    _name_tool_results(conversation)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    try:
        chat = ChatCompletionRequest.model_validate(_chat_body(body, messages))
        chat_plan = plan_chat(state, chat)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _chat_param(".".join(str(p) for p in first.get("loc", ())) or None)
        raise APIError(400, f"{param}: {first.get('msg', 'invalid value')}", param=param,
                       code="invalid_value") from None
    except APIError as exc:
        exc.param = _chat_param(exc.param)
        raise
    return ResponsesPlan(chat_plan.request, chat_plan, body, conversation)


# -- output items and the Response object ---------------------------------------------------------------


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [text_part(text)] if status == "completed" else []}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """The thinking as a reasoning item: its text whole in `content`, no summary."""
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}


def function_call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else "", "status": status}


def usage_json(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


def response_object(plan: ResponsesPlan, output: list[dict[str, Any]], status: str,
                    usage: Usage | None = None) -> dict[str, Any]:
    body = plan.body
    text_format = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format \
        else {"type": "text"}
    tool_choice = body.tool_choice.model_dump(exclude_none=True) if isinstance(body.tool_choice, ToolChoiceObject) \
        else (body.tool_choice or "auto")
    return {
        "id": plan.id, "object": "response", "created_at": plan.created_at, "status": status,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": body.model,
        "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
        "store": body.store, "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": text_format}, "tool_choice": tool_choice,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": body.truncation or "disabled",
        "usage": usage_json(usage), "user": body.user, "metadata": body.metadata or {}, "background": False,
    }


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def conversation_after(plan: ResponsesPlan, output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation a later `previous_response_id` continues: this input, then this output."""
    return plan.conversation + messages_from_items([InputItem.model_validate(item) for item in output], "output")


def finish_response(plan: ResponsesPlan, output: list[dict[str, Any]], finish_reason: str | None, usage: Usage,
                    store: ResponseStore | TenantResponses) -> dict[str, Any]:
    """The final Response object, kept in the store when the request asked for it (store defaults to true)."""
    response = response_object(plan, output, status_of(finish_reason), usage)
    if plan.body.store:
        store.put(StoredResponse(response, conversation_after(plan, output)))
    return response


def output_items(plan: ResponsesPlan, text: str) -> list[dict[str, Any]]:
    """A whole generation's output: its thinking as a reasoning item, its answer as a message, its tool calls as
    function_call items."""
    reasoning, content, calls = split_reply(plan.chat.tools, plan.chat.thinking, text)
    items = [reasoning_item(new_id("rs"), reasoning)] if reasoning else []
    items += [message_item(new_id("msg"), content)] if content or not calls else []
    return items + [function_call_item(new_id("fc"), call) for call in calls]


# -- the typed event stream --------------------------------------------------------------------------


class ResponseEvents:
    """The Responses stream for sse.event_stream(typed=True): created, in_progress, then the output items
    as they form (the thinking's reasoning_text deltas in a reasoning item, then a message's text deltas; tool
    calls as function_call items: a Hermes / Qwen JSON call's arguments as function_call_arguments deltas while it
    is written, a call in another format whole once the reply ends), then completed (or incomplete)."""

    def __init__(self, plan: ResponsesPlan, store: ResponseStore | TenantResponses):
        self.plan = plan
        self.store = store
        self.sequence = 0
        self.reply = ReplyStream(plan.chat.tools, plan.chat.thinking)
        self.output: list[dict[str, Any]] = []
        self.message_id: str | None = None  # the open message item
        self.text = ""
        self.reasoning_id: str | None = None  # the open reasoning item
        self.reasoning = ""
        self.finish_reason: str | None = None
        self.call: tuple[str, ToolCall] | None = None  # the function_call item streaming now, and its call so far

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def opening(self) -> list[dict[str, Any]]:
        snapshot = response_object(self.plan, [], "in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def _open_message(self) -> list[dict[str, Any]]:
        if self.message_id is not None:
            return []
        self.message_id = new_id("msg")
        index = len(self.output)
        return [self._event("response.output_item.added", output_index=index,
                            item=message_item(self.message_id, "", "in_progress")),
                self._event("response.content_part.added", item_id=self.message_id, output_index=index,
                            content_index=0, part=text_part(""))]

    def _thinking(self, text: str) -> list[dict[str, Any]]:
        """A piece of the thinking, in the reasoning item (opened on the first piece)."""
        events = []
        if self.reasoning_id is None:
            self.reasoning_id = new_id("rs")
            events.append(self._event("response.output_item.added", output_index=len(self.output),
                                      item=reasoning_item(self.reasoning_id, "", "in_progress")))
        self.reasoning += text
        return events + [self._event("response.reasoning_text.delta", item_id=self.reasoning_id,
                                     output_index=len(self.output), content_index=0, delta=text)]

    def _end_thinking(self) -> list[dict[str, Any]]:
        """The reasoning item done, once the answer starts (or the reply ends)."""
        if self.reasoning_id is None or (self.output and self.output[-1]["id"] == self.reasoning_id):
            return []
        index, item = len(self.output), reasoning_item(self.reasoning_id, self.reasoning)
        self.output.append(item)
        return [self._event("response.reasoning_text.done", item_id=self.reasoning_id, output_index=index,
                            content_index=0, text=self.reasoning),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _pieces(self, reasoning: str, text: str) -> list[dict[str, Any]]:
        events = self._thinking(reasoning) if reasoning else []
        return events + (self._end_thinking() + self._delta(text) if text else [])

    def _delta(self, text: str) -> list[dict[str, Any]]:
        events = self._open_message()
        self.text += text
        events.append(self._event("response.output_text.delta", item_id=self.message_id,
                                  output_index=len(self.output), content_index=0, delta=text, logprobs=[]))
        return events

    def _end_message(self) -> list[dict[str, Any]]:
        """The open message item done (before a function_call item follows it, or at the end)."""
        if self.message_id is None:
            return []
        index, item = len(self.output), message_item(self.message_id, self.text)
        events = [self._event("response.output_text.done", item_id=self.message_id, output_index=index,
                              content_index=0, text=self.text, logprobs=[]),
                  self._event("response.content_part.done", item_id=self.message_id, output_index=index,
                              content_index=0, part=text_part(self.text)),
                  self._event("response.output_item.done", output_index=index, item=item)]
        self.output.append(item)
        self.message_id, self.text = None, ""
        return events

    def _end_call(self) -> list[dict[str, Any]]:
        """The streaming function_call item done, its arguments whole."""
        if self.call is None:
            return []
        (item_id, call), index = self.call, len(self.output)
        item = function_call_item(item_id, call)
        self.output.append(item)
        self.call = None
        return [self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                            name=call.name, arguments=call.arguments),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _call_pieces(self) -> list[dict[str, Any]]:
        """The pieces of the calls being written: each opens its function_call item, then streams its arguments."""
        events: list[dict[str, Any]] = []
        for piece in self.reply.take_call_deltas():
            if piece.id is not None:
                events += self._end_thinking() + self._end_message() + self._end_call()
                self.call = (new_id("fc"), ToolCall(piece.name or "", "", piece.id))
                events.append(self._event("response.output_item.added", output_index=len(self.output),
                                          item=function_call_item(self.call[0], self.call[1], "in_progress")))
            if piece.arguments and self.call is not None:
                self.call[1].arguments += piece.arguments
                events.append(self._event("response.function_call_arguments.delta", item_id=self.call[0],
                                          output_index=len(self.output), delta=piece.arguments))
        return events

    def on_record(self, record: StreamRecord) -> list[dict[str, Any]]:
        if record.finish_reason is not None:
            self.finish_reason = record.finish_reason
        return self._pieces(*self.reply.push(record.text)) + self._call_pieces()

    def closing(self, last: StreamRecord, usage: Usage) -> list[dict[str, Any]]:
        reasoning, rest, calls = self.reply.finish()
        events = self._pieces(reasoning, rest) + self._end_thinking() + self._end_call()
        if self.message_id is None and not calls and not any(i["type"] == "message" for i in self.output):
            events += self._open_message()  # an empty answer is still one (empty) message
        events += self._end_message()
        for call in calls[self.reply.calls_streamed :]:
            index, item_id = len(self.output), new_id("fc")
            item = function_call_item(item_id, call)
            events += [self._event("response.output_item.added", output_index=index,
                                   item=function_call_item(item_id, call, "in_progress")),
                       self._event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                                   delta=call.arguments),
                       self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                   name=call.name, arguments=call.arguments),
                       self._event("response.output_item.done", output_index=index, item=item)]
            self.output.append(item)
        response = finish_response(self.plan, self.output, self.finish_reason or last.finish_reason, usage,
                                   self.store)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return events + [self._event(kind, response=response)]

    def failure(self, err: APIError) -> list[dict[str, Any]]:
        """A mid-stream failure: the Responses error event, then the response marked failed."""
        failed = response_object(self.plan, self.output, "failed")
        failed["error"] = {"code": err.code or "server_error", "message": err.message}
        return [self._event("error", code=err.code, message=err.message, param=err.param),
                self._event("response.failed", response=failed)]
