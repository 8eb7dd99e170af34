"""Anthropic's Messages wire format over the chat-completions planning.

A Messages request is translated into the ChatCompletionRequest it means (system prompt, text and image
blocks, tool_use / tool_result blocks as tool calls and tool messages, tool_choice, stop_sequences,
sampling) and planned by `openai_shapes.plan_chat`: one chat template path, one tool path, one image path.
What comes back is shaped as a `message` object, or as the typed event stream (`message_start`,
`content_block_start` / `_delta` / `_stop`, `message_delta`, `message_stop`) that server.sse sends.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import Field

from runlm.engine import Completion, Generation, StreamRecord, ToolCall, Usage
from runlm.server.adapters import openai_request
from runlm.server.errors import APIError
from runlm.server.openai_shapes import ChatPlan, plan_chat
from runlm.server.schemas import ChatCompletionRequest, StopString, Strict, Unit
from runlm.server.state import ServerState
from runlm.server.tools import ReplyStream, split_reply

# -- request bodies ----------------------------------------------------------------------------------


class TextBlock(Strict):
    type: Literal["text"]
    text: str


class ImageSource(Strict):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(Strict):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(Strict):
    """Extended-thinking blocks clients echo back from other models: accepted and left out of the prompt."""

    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class Message(Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(Strict):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    format: OutputFormat | None = None
    effort: str | None = None  # accepted; a local model has one effort


class ThinkingConfig(Strict):
    """Extended thinking: on or off for the model's own thinking phase (its template's switch)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=1)] | None = None  # thinking tokens before it is made to close


class CountTokensRequest(Strict):
    """What count_tokens takes: the prompt side of a Messages request."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]  # required by this API
    stop_sequences: Annotated[list[StopString], Field(max_length=16)] | None = None
    stream: bool = False
    temperature: Unit | None = None  # Anthropic's range is 0..1
    top_p: Unit | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    output_config: OutputConfig | None = None


# -- request -> chat completion request -> plan --------------------------------------------------------


def _text(blocks: str | list[TextBlock] | None) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    return "\n".join(b.text for b in blocks)


def _image_part(block: ImageBlock, where: str) -> dict[str, Any]:
    source = block.source
    if source.type == "base64":
        if not source.data or not source.media_type:
            raise APIError(400, f"{where}.source: a base64 image needs media_type and data", param=where)
        url = f"data:{source.media_type};base64,{source.data}"
    else:
        if not source.url:
            raise APIError(400, f"{where}.source: a url image needs url", param=where)
        url = source.url
    return {"type": "image_url", "image_url": {"url": url}}


def _chat_messages(message: Message, index: int, tool_names: dict[str, str]) -> list[dict[str, Any]]:
    """One Messages turn as chat messages: tool results become tool messages ahead of the user's own text."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        where = f"messages.{index}.content.{j}"
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            if message.role != "user":
                raise APIError(400, f"{where}: images belong in user turns", param=where)
            parts.append(_image_part(block, where))
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise APIError(400, f"{where}: tool_use blocks belong in assistant turns", param=where)
            tool_names[block.id] = block.name
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ToolResultBlock):
            if message.role != "user":
                raise APIError(400, f"{where}: tool_result blocks belong in user turns", param=where)
            result = _text(block.content)
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": f"Error: {result}" if block.is_error else result,
                        **({"name": tool_names[block.tool_use_id]} if block.tool_use_id in tool_names else {})})
    if message.role == "assistant":
        text = "".join(p["text"] for p in parts)
        out.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
    elif parts:
        out.append({"role": "user", "content": parts})
    return out


def _tool_choice(choice: ToolChoice | None) -> Any:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, "tool_choice: type 'tool' needs the tool's name", param="tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion request a Messages request means."""
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text(body.system)})
    tool_names: dict[str, str] = {}
    for i, message in enumerate(body.messages):
        messages.extend(_chat_messages(message, i, tool_names))
    data: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools:
        data["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in body.tools]
    choice = _tool_choice(body.tool_choice)
    if choice is not None:
        data["tool_choice"] = choice
    if body.thinking is not None:
        data["reasoning_effort"] = "none" if body.thinking.type == "disabled" else "medium"
        if body.thinking.type != "disabled" and body.thinking.budget_tokens is not None:
            data["reasoning_budget"] = body.thinking.budget_tokens
    if isinstance(body, MessagesRequest):
        data |= {"max_tokens": body.max_tokens, "temperature": body.temperature, "top_p": body.top_p,
                 "top_k": body.top_k, "stop": body.stop_sequences}
        if body.output_config is not None and body.output_config.format is not None:
            data["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": body.output_config.format.schema_}}
    return openai_request(ChatCompletionRequest, data)


def plan_messages(state: ServerState, body: CountTokensRequest) -> ChatPlan:
    """Plan a Messages (or count_tokens) request exactly as the chat route plans its chat equivalent."""
    return plan_chat(state, chat_request(body))


# -- responses --------------------------------------------------------------------------------------


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": json.loads(call.arguments)}


def thinking_block(text: str) -> dict[str, Any]:
    """A thinking block; its signature is empty: the text comes back as the client sends it, unverified, and
    stays out of later prompts as other models' thinking does."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def stop_reason(gen: Generation, calls: list[ToolCall]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): a tool call, the token budget, a stop sequence, or the end of the turn."""
    if calls:
        return "tool_use", None
    if gen.finish_reason == "length":
        return "max_tokens", None
    matched = gen.stops.matched
    return ("stop_sequence", matched) if matched is not None else ("end_turn", None)


def usage_json(usage: Usage) -> dict[str, int]:
    return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}


def message_response(plan: ChatPlan, body: MessagesRequest, result: Completion, gen: Generation,
                     mid: str) -> dict[str, Any]:
    reasoning, content, calls = split_reply(plan.tools, plan.thinking, result.text)
    blocks = [thinking_block(reasoning)] if reasoning else []
    blocks += ([{"type": "text", "text": content}] if content or not calls else []) + [tool_use_block(c) for c in calls]
    reason, sequence = stop_reason(gen, calls)
    return {"id": mid, "type": "message", "role": "assistant", "model": body.model, "content": blocks,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage_json(result.usage)}


class MessageEvents:
    """The typed event stream of one message: the thinking streams as thinking_delta events in a thinking block,
    then the answer as text_delta events in a text block; tool calls follow as tool_use blocks, their input as
    input_json_delta pieces while a Hermes / Qwen JSON call is written, or in one piece once the reply is whole
    (the other formats)."""

    def __init__(self, plan: ChatPlan, body: MessagesRequest, gen: Generation, mid: str):
        self.plan, self.body, self.gen, self.mid = plan, body, gen, mid
        self.reply = ReplyStream(plan.tools, plan.thinking)
        self.blocks = 0  # content blocks opened so far
        self.open: str | None = None  # the kind of the block open now ("thinking" or "text")

    def opening(self) -> list[dict[str, Any]]:
        message = {"id": self.mid, "type": "message", "role": "assistant", "model": self.body.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": len(self.plan.request.prompt_ids), "output_tokens": 0}}
        return [{"type": "message_start", "message": message}]

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            events.append({"type": "content_block_delta", "index": self.blocks - 1,
                           "delta": {"type": "signature_delta", "signature": ""}})
        self.open = None
        return events + [{"type": "content_block_stop", "index": self.blocks - 1}]

    def _in_block(self, kind: str, text: str) -> list[dict[str, Any]]:
        """`text` streamed into a block of `kind` ("thinking" or "text"), opening it (and closing another)."""
        events = []
        if self.open != kind:
            events += self._close()
            block = thinking_block("") if kind == "thinking" else {"type": "text", "text": ""}
            events.append({"type": "content_block_start", "index": self.blocks, "content_block": block})
            self.open, self.blocks = kind, self.blocks + 1
        if text:
            delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else \
                {"type": "text_delta", "text": text}
            events.append({"type": "content_block_delta", "index": self.blocks - 1, "delta": delta})
        return events

    def _pieces(self, reasoning: str, text: str) -> list[dict[str, Any]]:
        return (self._in_block("thinking", reasoning) if reasoning else []) + \
            (self._in_block("text", text) if text else [])

    def on_record(self, record: StreamRecord) -> list[dict[str, Any]]:
        events = self._pieces(*self.reply.push(record.text))
        for piece in self.reply.take_call_deltas():
            if piece.id is not None:  # a call begins: its tool_use block opens
                events += self._close()
                block = {"type": "tool_use", "id": "toolu_" + piece.id.removeprefix("call_"), "name": piece.name,
                         "input": {}}
                events.append({"type": "content_block_start", "index": self.blocks, "content_block": block})
                self.open, self.blocks = "tool_use", self.blocks + 1
            if piece.arguments:
                events.append({"type": "content_block_delta", "index": self.blocks - 1,
                               "delta": {"type": "input_json_delta", "partial_json": piece.arguments}})
        return events

    def closing(self, last: StreamRecord, usage: Usage) -> list[dict[str, Any]]:
        reasoning, rest, calls = self.reply.finish()
        events = self._pieces(reasoning, rest)
        if not calls and self.open != "text":
            events += self._in_block("text", "")  # an empty answer is still one (empty) text block
        events += self._close()
        for call in calls[self.reply.calls_streamed :]:
            block = tool_use_block(call)
            index, self.blocks = self.blocks, self.blocks + 1
            events += [{"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}},
                       {"type": "content_block_delta", "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": call.arguments}},
                       {"type": "content_block_stop", "index": index}]
        reason, sequence = stop_reason(self.gen, calls)
        return events + [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                          "usage": usage_json(usage)},
                         {"type": "message_stop"}]
