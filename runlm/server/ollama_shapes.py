"""Ollama's wire format over the chat and text-completion planning.

/api/chat and /api/generate requests are translated into the OpenAI requests they mean (options ->
sampling fields, `format` -> response_format, base64 `images` -> image parts, tool calls and tool
messages) and planned by `openai_shapes.plan_chat` / `plan_completion`. Replies are Ollama's objects:
the message or response text, `done` / `done_reason`, token counts and durations in nanoseconds; streamed,
one object per line (server.sse writes them), the last one with `done: true`.
"""

from __future__ import annotations

import hashlib
import json
import math
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field

from runlm.engine import Completion, Generation, StreamRecord, ToolCall, Usage
from runlm.engine.harmony import CHANNEL
from runlm.engine.reasoning import GEMMA4_THINK_OPEN, THINK_OPEN, ThinkingPlan
from runlm.formats.gguf import find_mmproj
from runlm.server.adapters import openai_request
from runlm.server.errors import APIError
from runlm.server.library import FileFacts
from runlm.server.openai_shapes import ChatPlan, CompletionPlan, plan_chat, plan_completion
from runlm.server.schemas import ChatCompletionRequest, CompletionRequest, Seed, StopString, Strict, Unit
from runlm.server.state import ServerState
from runlm.server.tools import ReplyStream, ToolPlan, split_reply, template_source

OLLAMA_API_VERSION = "0.12.0"  # the Ollama API these routes follow; clients gate features on /api/version

# -- request bodies ----------------------------------------------------------------------------------


class Options(Strict):
    """The runtime options runlm honours; load-time ones (num_ctx, num_gpu, ...) are accepted and ignored."""

    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Unit | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Unit | None = None
    typical_p: Unit | None = None
    num_predict: int | None = None  # -1: no limit, -2: fill the context
    seed: Seed | None = None
    stop: Annotated[list[StopString], Field(max_length=16)] | None = None
    repeat_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    repeat_last_n: Annotated[int, Field(ge=-1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None


class ToolCallFunction(Strict):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCallIn(Strict):
    function: ToolCallFunction


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[str] | None = None  # base64
    tool_calls: list[ToolCallIn] | None = None
    tool_name: str | None = None


Format = Literal["", "json"] | dict[str, Any]


class Generating(Strict):
    model: str
    format: Format | None = None
    options: Options | None = None
    stream: bool = True
    keep_alive: str | int | float | None = None  # how long the model stays loaded after this request (server.pool)
    think: bool | Literal["low", "medium", "high"] | None = None  # the template's thinking switch (and level)


class ChatBody(Generating):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class GenerateBody(Generating):
    prompt: str = ""
    system: str | None = None
    images: list[str] | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None


class EmbedBody(Strict):
    model: str
    input: str | list[str]
    truncate: bool = True
    dimensions: Annotated[int, Field(ge=1)] | None = None
    options: Options | None = None
    keep_alive: str | int | float | None = None


class CopyBody(Strict):
    source: str
    destination: str


class NamedModel(Strict):
    """A body that names one model (/api/show, /api/delete)."""

    model: str | None = None
    name: str | None = None  # older clients' spelling

    @property
    def model_name(self) -> str:
        if not (self.model or self.name):
            raise APIError(400, "model: required field is missing", param="model")
        return self.model or self.name or ""


class ShowBody(NamedModel):
    verbose: bool = False


class PullBody(NamedModel):
    insecure: bool = False  # Ollama's plain-HTTP registries; runlm pulls from the Hub (or HF_ENDPOINT) as it is
    stream: bool = True


# -- request -> OpenAI request -> plan -------------------------------------------------------------------


def _sampling(body: Generating) -> dict[str, Any]:
    opts = body.options or Options()
    fields = opts.model_dump(exclude={"num_predict"}, exclude_none=True)
    if opts.num_predict is not None and opts.num_predict > 0:
        fields["max_tokens"] = opts.num_predict
    if body.format == "json":
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(body.format, dict):
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": body.format}}
    if body.think is not None:
        fields["reasoning_effort"] = body.think if isinstance(body.think, str) else ("medium" if body.think else "none")
    return {"model": body.model, **fields}


def _image_parts(images: list[str] | None) -> list[dict[str, Any]]:
    """Ollama sends bare base64 (no media type); the image decoder finds the format by itself."""
    return [{"type": "image_url", "image_url": {"url": f"data:application/octet-stream;base64,{b64}"}}
            for b64 in images or []]


def _user_content(text: str, images: list[str] | None) -> str | list[dict[str, Any]]:
    if not images:
        return text
    return [*_image_parts(images), {"type": "text", "text": text}]


def _chat_message(message: Message, index: int) -> dict[str, Any]:
    text = message.content or ""
    out: dict[str, Any] = {"role": message.role,
                           "content": _user_content(text, message.images) if message.role == "user" else text}
    if message.images and message.role != "user":
        raise APIError(400, f"messages.{index}.images: images belong in user messages", param=f"messages.{index}")
    if message.tool_calls:
        out["tool_calls"] = [{"id": f"call_{index}_{j}", "type": "function",
                              "function": {"name": c.function.name,
                                           "arguments": json.dumps(c.function.arguments, ensure_ascii=False)}}
                             for j, c in enumerate(message.tool_calls)]
    if message.role == "tool" and message.tool_name:
        out["name"] = message.tool_name
    return out


def plan_ollama_chat(state: ServerState, body: ChatBody) -> ChatPlan:
    data = {**_sampling(body), "messages": [_chat_message(m, i) for i, m in enumerate(body.messages)],
            "tools": body.tools or None}
    return plan_chat(state, openai_request(ChatCompletionRequest, data))


def plan_ollama_generate(state: ServerState, body: GenerateBody) -> ChatPlan | CompletionPlan:
    """A raw prompt runs as a text completion, a `suffix` as a fill-in-the-middle between prompt and suffix (the
    system prompt and the chat template take no part, as in Ollama's FIM templates); otherwise system + prompt go
    through the chat template."""
    unsupported = {"template": body.template, "context": body.context}
    for field, value in unsupported.items():
        if value:
            raise APIError(400, f"{field} is not supported by this server (use /api/chat for conversations)",
                           param=field)
    if body.suffix:
        if body.images:
            raise APIError(400, "images cannot be combined with suffix", param="images")
        return plan_completion(state, openai_request(CompletionRequest, {**_sampling(body), "prompt": body.prompt,
                                                                         "suffix": body.suffix}))
    if body.raw:
        if body.images:
            raise APIError(400, "images need the chat template: send them without raw", param="images")
        return plan_completion(state, openai_request(CompletionRequest, {**_sampling(body), "prompt": body.prompt}))
    messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
        {"role": "user", "content": _user_content(body.prompt, body.images)}]
    return plan_chat(state, openai_request(ChatCompletionRequest, {**_sampling(body), "messages": messages}))


# -- replies ----------------------------------------------------------------------------------------


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def done_reason(gen: Generation) -> str:
    return "length" if gen.finish_reason == "length" else "stop"


def final_fields(usage: Usage, reason: str) -> dict[str, Any]:
    """What Ollama's last object carries: why it ended, token counts, durations in nanoseconds."""
    ns = 1_000_000_000
    return {"done": True, "done_reason": reason,
            "total_duration": int((usage.queued_s + usage.prefill_s + usage.decode_s) * ns), "load_duration": 0,
            "prompt_eval_count": usage.prompt_tokens, "prompt_eval_duration": int(usage.prefill_s * ns),
            "eval_count": usage.completion_tokens, "eval_duration": int(usage.decode_s * ns)}


def loaded_reply(body: Generating, chat: bool, reason: str = "load") -> dict[str, Any]:
    """Ollama's answer to an empty prompt or message list: the model is loaded (or, `reason` "unload", unloaded),
    nothing is generated."""
    field = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return {"model": body.model, "created_at": now_iso(), **field, "done": True, "done_reason": reason}


def ollama_tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in calls]


def chat_reply(plan: ChatPlan, body: ChatBody, result: Completion, gen: Generation) -> dict[str, Any]:
    reasoning, content, calls = split_reply(plan.tools, plan.thinking, result.text)
    message: dict[str, Any] = {"role": "assistant", "content": content} | ({"thinking": reasoning} if reasoning else {})
    if calls:
        message["tool_calls"] = ollama_tool_calls(calls)
    return {"model": body.model, "created_at": now_iso(), "message": message,
            **final_fields(result.usage, done_reason(gen))}


def generate_reply(plan: ChatPlan | CompletionPlan, body: GenerateBody, result: Completion,
                   gen: Generation) -> dict[str, Any]:
    thinking = plan.thinking if isinstance(plan, ChatPlan) else ThinkingPlan()
    reasoning, content, _ = split_reply(ToolPlan(), thinking, result.text)
    return {"model": body.model, "created_at": now_iso(), "response": content,
            **({"thinking": reasoning} if reasoning else {}), **final_fields(result.usage, done_reason(gen))}



def _message_lines(line: Any, reasoning: str, content: str) -> list[dict[str, Any]]:
    """One stream line for a piece of thinking and answer, where there is either."""
    if not (reasoning or content):
        return []
    return [line({"content": content} | ({"thinking": reasoning} if reasoning else {}))]


class ChatLines:
    """/api/chat's stream: message fragments, tool calls once the reply is whole, then the done object."""

    def __init__(self, plan: ChatPlan, body: ChatBody, gen: Generation):
        self.body, self.gen = body, gen
        self.reply = ReplyStream(plan.tools, plan.thinking)

    def _line(self, message: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {"model": self.body.model, "created_at": now_iso(), "message": {"role": "assistant", **message},
                "done": False, **extra}

    def opening(self) -> list[dict[str, Any]]:
        return []

    def on_record(self, record: StreamRecord) -> list[dict[str, Any]]:
        return _message_lines(self._line, *self.reply.push(record.text))

    def closing(self, last: StreamRecord, usage: Usage) -> list[dict[str, Any]]:
        reasoning, rest, calls = self.reply.finish()
        lines = _message_lines(self._line, reasoning, rest)
        if calls:
            lines.append(self._line({"content": "", "tool_calls": ollama_tool_calls(calls)}))
        return lines + [self._line({"content": ""}, **final_fields(usage, done_reason(self.gen)))]


class GenerateLines:
    """/api/generate's stream: response fragments, then the done object."""

    def __init__(self, plan: ChatPlan | CompletionPlan, body: GenerateBody, gen: Generation):
        self.body, self.gen = body, gen
        self.splitter = (plan.thinking if isinstance(plan, ChatPlan) else ThinkingPlan()).splitter()

    def _line(self, text: str, reasoning: str = "", **extra: Any) -> dict[str, Any]:
        return {"model": self.body.model, "created_at": now_iso(), "response": text,
                **({"thinking": reasoning} if reasoning else {}), "done": False, **extra}

    def opening(self) -> list[dict[str, Any]]:
        return []

    def on_record(self, record: StreamRecord) -> list[dict[str, Any]]:
        reasoning, text = self.splitter.push(record.text)
        return [self._line(text, reasoning)] if text or reasoning else []

    def closing(self, last: StreamRecord, usage: Usage) -> list[dict[str, Any]]:
        reasoning, text = self.splitter.finish()
        lines = [self._line(text, reasoning)] if text or reasoning else []
        return lines + [self._line("", **final_fields(usage, done_reason(self.gen)))]


# -- the model, as Ollama describes it ---------------------------------------------------------------


def _files_size(path: Path) -> tuple[int, float]:
    """(bytes, last modification) of a model's file, or of a directory's files."""
    try:
        files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
        stats = [p.stat() for p in files]
    except OSError:  # removed meanwhile
        return 0, 0.0
    return sum(s.st_size for s in stats), max((s.st_mtime for s in stats), default=0.0)


def iso_time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")


def model_details(state: ServerState) -> dict[str, Any]:
    loaded, family = state.loaded, state.loaded.runner.family()
    return {"parent_model": "", "format": loaded.format, "family": family, "families": [family],
            "parameter_size": str(loaded.metadata.get("general.size_label", "")),
            "quantization_level": loaded.quantization}


def file_details(path: Path, facts: FileFacts | None) -> dict[str, Any]:
    """model_details of a model that is not loaded, from its GGUF header (empty where it has none)."""
    family = facts.family if facts else ""
    return {"parent_model": "", "format": "gguf" if path.is_file() else "safetensors", "family": family,
            "families": [family] if family else None, "parameter_size": facts.size_label if facts else "",
            "quantization_level": facts.quantization if facts else ""}


def model_entry(name: str, path: Path, details: dict[str, Any]) -> dict[str, Any]:
    """One model as /api/tags and /api/ps list it. The digest identifies the file (path, size, time), it is
    not a hash of its bytes (that would read the whole file on every listing)."""
    size, mtime = _files_size(path)
    digest = hashlib.sha256(f"{path}:{size}:{mtime}".encode()).hexdigest()
    return {"name": name, "model": name, "modified_at": iso_time(mtime), "size": size, "digest": digest,
            "details": details}


def running_entry(state: ServerState, expires_at: float) -> dict[str, Any]:
    """A loaded model as /api/ps lists it: `expires_at` (wall-clock seconds, inf: never) is when it unloads if
    no request comes; `size` is its file's bytes (the weights, mapped from it)."""
    entry = model_entry(state.model_name, state.loaded.path, model_details(state))
    never = datetime.now(timezone.utc) + timedelta(days=3650)
    expires = never.isoformat().replace("+00:00", "Z") if math.isinf(expires_at) else iso_time(expires_at)
    return {**entry, "expires_at": expires, "size_vram": 0, "context_length": state.engine.context_length}


def _capabilities(template: str, vision: bool) -> list[str]:
    thinks = any(tag in template for tag in (THINK_OPEN, GEMMA4_THINK_OPEN, CHANNEL))
    return ["completion", "tools"] + (["vision"] if vision else []) + (["thinking"] if thinks else [])


def show_reply(state: ServerState) -> dict[str, Any]:
    loaded = state.loaded
    # A GGUF's own metadata (scalars), as Ollama shows it; other formats get the same keys under the family name.
    info = {k: v for k, v in loaded.metadata.items()
            if loaded.format == "gguf" and isinstance(v, str | int | float | bool) and k != "tokenizer.chat_template"}
    arch = info.setdefault("general.architecture", loaded.runner.family())
    info |= {f"{arch}.context_length": state.engine.context_length,
             f"{arch}.embedding_length": loaded.config.hidden_size, f"{arch}.block_count": loaded.config.num_layers}
    template = template_source(loaded.chat_template) if loaded.chat_template is not None else ""
    return {"modelfile": f"FROM {loaded.path}\n", "parameters": "", "template": template,
            "details": model_details(state), "model_info": info,
            "capabilities": _capabilities(template, loaded.runner.supports_multimodal()),
            "modified_at": iso_time(_files_size(loaded.path)[1])}


def show_file_reply(path: Path, facts: FileFacts | None) -> dict[str, Any]:
    """/api/show of a model that is not loaded, from its GGUF header (it is not loaded to describe it)."""
    info = dict(facts.metadata) if facts else {}
    template = facts.chat_template if facts else ""
    return {"modelfile": f"FROM {path}\n", "parameters": "", "template": template,
            "details": file_details(path, facts), "model_info": info,
            "capabilities": _capabilities(template, bool(find_mmproj(path)) if path.is_file() else False),
            "modified_at": iso_time(_files_size(path)[1])}
