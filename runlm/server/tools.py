"""Function tools in chat requests: which tools are on, and how calls and results reach the template.

A template that knows tools (its source mentions `tools` and `tool_calls`) gets them as the template
expects; for any other template the tools are described in the system prompt and earlier calls are
spelled as the `<tool_call>` JSON the model was told to write (engine.tools parses it back).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from runlm.engine.harmony import HarmonySplitter
from runlm.engine.reasoning import ThinkingPlan
from runlm.engine.tools import CallDelta, ToolCall, ToolCallStreamFilter, tools_system_prompt
from runlm.server.errors import APIError
from runlm.server.schemas import ChatCompletionRequest, ChatMessage, ToolChoiceFunction


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    active: bool = False
    forced: str | None = None  # a tool_choice that names one function
    required: bool = False  # tool_choice "required"
    template_aware: bool = False  # the chat template renders tools itself

    @property
    def parameters(self) -> dict[str, Any]:
        """Tool name -> the JSON schema of its arguments (types the values of calls written as text)."""
        return {t["function"]["name"]: t["function"].get("parameters") or {} for t in self.tools}


def template_source(template: Any) -> str:
    for attr in ("source", "template", "text", "_source", "raw"):
        value = getattr(template, attr, None)
        if isinstance(value, str):
            return value
    return ""


def plan_tools(body: ChatCompletionRequest, template: Any) -> ToolPlan:
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
    source = template_source(template)
    return ToolPlan(tools, names, bool(tools) and choice != "none", forced, choice == "required",
                    "tools" in source and "tool_calls" in source)


def _arguments_obj(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def template_message(message: ChatMessage, text: str | None, plan: ToolPlan) -> dict[str, Any]:
    """One chat message as the template takes it, tool calls and tool results included."""
    msg: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role, "content": text or ""}
    if message.name:
        msg["name"] = message.name
    if message.tool_calls:
        calls = [{"id": c.id or "", "type": "function",
                  "function": {"name": c.function.name, "arguments": _arguments_obj(c.function.arguments)}}
                 for c in message.tool_calls]
        if plan.template_aware:
            msg["tool_calls"] = calls
        else:  # spell the calls the way we told the model to make them
            spelled = "".join("<tool_call>" + json.dumps({"name": c["function"]["name"], "arguments":
                              c["function"]["arguments"]}, ensure_ascii=False) + "</tool_call>" for c in calls)
            msg["content"] = (msg["content"] + "\n" if msg["content"] else "") + spelled
    if message.role in ("tool", "function"):
        if plan.template_aware:
            msg["role"] = "tool"
            if message.tool_call_id:
                msg["tool_call_id"] = message.tool_call_id
        else:
            who = message.name or message.tool_call_id or "tool"
            msg = {"role": "user", "content": f"Tool result ({who}): {text or ''}"}
    return msg


def add_tools_prompt(messages: list[dict[str, Any]], plan: ToolPlan) -> None:
    """Describe the tools in the system prompt when the template cannot render them."""
    if not plan.active or plan.template_aware:
        return
    note = tools_system_prompt(plan.tools)
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + note}
    else:
        messages.insert(0, {"role": "system", "content": note})


class ReplyStream:
    """A chat reply as it streams: the thinking split off first (ThinkSplitter), then tool calls held back from
    the answer (ToolCallStreamFilter). A harmony reply's splitter finds both (its calls are messages of their own)."""

    def __init__(self, tools: ToolPlan, thinking: ThinkingPlan):
        self.thinking = thinking.splitter(tools.names if tools.active else None)
        self.calls = (self.thinking.calls if isinstance(self.thinking, HarmonySplitter)
                      else ToolCallStreamFilter(tools.active, tools.names, tools.parameters))

    def push(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) to send now."""
        reasoning, content = self.thinking.push(delta)
        return reasoning, self.calls.push(content)

    def take_call_deltas(self) -> list[CallDelta]:
        """Pieces of tool calls streamed as they were written (Hermes / Qwen JSON and harmony calls), since the last
        call."""
        return self.calls.take_deltas()

    @property
    def calls_streamed(self) -> int:
        """How many of the answer's calls went out in pieces (`finish` returns them too, first)."""
        return len(self.calls.streamed)

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        """(reasoning, content) not yet sent, and the tool calls in the whole answer."""
        reasoning, content = self.thinking.finish()
        content = self.calls.push(content)
        rest, calls = self.calls.finish()
        return reasoning, content + rest, calls


def split_reply(tools: ToolPlan, thinking: ThinkingPlan, text: str) -> tuple[str, str, list[ToolCall]]:
    """A whole reply as (reasoning, content, tool calls), as a ReplyStream splits it."""
    stream = ReplyStream(tools, thinking)
    reasoning, content = stream.push(text)
    more_reasoning, rest, calls = stream.finish()
    return reasoning + more_reasoning, content + rest, calls
