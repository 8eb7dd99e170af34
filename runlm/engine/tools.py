"""Tool calls in model output, in each family's own format (engine.tool_formats reads them): Hermes / Qwen
`<tool_call>` JSON, Qwen3-Coder's XML, Mistral's `[TOOL_CALLS]`, Gemma 4's `<|tool_call>`, pythonic lists and bare
JSON calls.

Also the JSON schema a forced tool call must follow, so `tool_choice: "required"` or a named function
can be enforced by the grammar sampler instead of hoped for.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from runlm.engine.stops import partial_suffix
from runlm.engine.tool_formats import (
    FUNCTION_CLOSE,
    FUNCTION_OPEN,
    GEMMA4_CALL_CLOSE,
    GEMMA4_CALL_OPEN,
    MISTRAL_ARGS,
    MISTRAL_CALLS,
    PARAMETER_CLOSE,
    PARAMETER_OPEN,
    PYTHONIC_HEAD,
    Gemma4Arguments,
    PythonicArguments,
    RawCall,
    gemma4_calls,
    mistral_calls,
    pythonic_calls,
    textual,
    typed_value,
    xml_calls,
)

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# where a reply's calls start, whatever came before them (the text before stays the answer)
CALL_MARKERS = (TOOL_CALL_OPEN, MISTRAL_CALLS, FUNCTION_OPEN, GEMMA4_CALL_OPEN)


def first_marker(text: str, start: int = 0) -> int:
    """Where the first call marker in `text[start:]` begins, or -1."""
    found = [i for i in (text.find(marker, start) for marker in CALL_MARKERS) if i != -1]
    return min(found, default=-1)


def tool_call_bodies(text: str) -> list[str]:
    """The stripped text of each `<tool_call>` block, the last one possibly unclosed. Plain string search, so
    linear in the text (a lazy regex with `\\s*` around the body was quadratic on long whitespace runs)."""
    bodies = []
    start = text.find(TOOL_CALL_OPEN)
    while start != -1:
        start += len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, start)
        bodies.append((text[start:] if end == -1 else text[start:end]).strip())
        start = -1 if end == -1 else text.find(TOOL_CALL_OPEN, end + len(TOOL_CALL_CLOSE))
    return bodies


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = "call_" + uuid.uuid4().hex[:24]

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def _call(name: Any, arguments: Any, known: set[str] | None, call_id: str = "") -> ToolCall | None:
    """A call to a known tool with an object of JSON arguments, or None."""
    if not isinstance(name, str) or not name or (known is not None and name not in known):
        return None
    if not isinstance(arguments, dict):
        return None
    try:
        text = json.dumps(arguments, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):  # a pythonic literal JSON has no spelling for (a set, bytes)
        return None
    return ToolCall(name=name, arguments=text, id=call_id)


def _call_from_obj(obj: Any, known: set[str] | None) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    if "function" in obj and isinstance(obj["function"], dict):  # {"type": "function", "function": {...}}
        obj = obj["function"]
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return _call(obj.get("name"), args, known)


def _decode_json_values(text: str) -> list[Any] | None:
    """All JSON values in `text` back to back (a model may emit a list or several objects)."""
    decoder = json.JSONDecoder()
    values, i = [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n,;":
            i += 1
        if i >= len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except (json.JSONDecodeError, RecursionError):  # a reply nested past Python's stack is no call
            return None
        values.append(value)


def _marked_calls(tail: str, known: set[str] | None, parameters: dict[str, Any] | None) -> list[ToolCall]:
    """The calls in `tail`, which starts at a call marker."""
    raw: list[RawCall] = []
    if tail.startswith(MISTRAL_CALLS):
        raw = mistral_calls(tail) or []
    elif tail.startswith(GEMMA4_CALL_OPEN):
        raw = gemma4_calls(tail) or []
    elif tail.startswith(FUNCTION_OPEN):
        raw = xml_calls(tail, parameters)
    else:
        calls = []
        for body in tool_call_bodies(tail):
            if body.startswith(FUNCTION_OPEN):
                raw += xml_calls(body, parameters)
                continue
            for value in _decode_json_values(body) or []:
                for item in value if isinstance(value, list) else [value]:
                    call = _call_from_obj(item, known)
                    if call is not None:
                        calls.append(call)
        if calls:
            return calls
    return [call for name, arguments, call_id in raw if (call := _call(name, arguments, known, call_id))]


def parse_tool_calls(text: str, known_names: set[str] | None = None,
                     parameters: dict[str, Any] | None = None) -> tuple[str, list[ToolCall]]:
    """Split model output into (content, tool calls); content is what is left before the calls.

    Output that does not parse as calls to known tools stays content, so a model that merely talks
    about JSON is not turned into a broken call. `parameters` (tool name -> JSON schema of its arguments) types
    the values of formats that write them as text (Qwen3-Coder's XML).
    """
    start = first_marker(text)
    if start != -1:
        calls = _marked_calls(text[start:], known_names, parameters)
        return (text[:start].strip(), calls) if calls else (text, [])
    stripped = text.strip()
    if stripped.startswith(("{", "[")):
        values = _decode_json_values(stripped)
        if values:
            calls = []
            for value in values:
                for item in value if isinstance(value, list) else [value]:
                    call = _call_from_obj(item, known_names)
                    if call is None:
                        return text, []
                    calls.append(call)
            return "", calls
        raw = pythonic_calls(stripped) if stripped.startswith("[") else None
        calls = [call for name, arguments, _ in raw or [] if (call := _call(name, arguments, known_names))]
        if raw and len(calls) == len(raw):
            return "", calls
    return text, []


def might_be_tool_call(text: str) -> bool:
    """Whether streamed output so far could still turn out to be a bare JSON tool call (reads only the leading
    whitespace and one character: the stream filter asks on every token)."""
    for ch in text:
        if not ch.isspace():
            return ch in "{["
    return True


# How a forced call is written, by what the chat template writes: Qwen3-Coder's `<function=NAME>` XML, Hermes / Qwen
# `<tool_call>` JSON, Mistral's `[TOOL_CALLS]NAME[ARGS]{...}` or older `[TOOL_CALLS][{...}]`, Gemma 4's
# `<|tool_call>call:NAME{...}`, a pythonic `[NAME(key=value)]` where the template shows one (Llama 4's writes
# `[func_name1(params_name1=params_value1...)]`), else a bare JSON call (harmony's is the reasoning parser's).
FORCED_CALL_FORMATS = ("qwen3-coder", "hermes", "mistral-args", "mistral", "gemma4", "pythonic", "json")
PYTHONIC_EXAMPLE = "[func_name1("  # how a template that asks for pythonic calls shows them
# the markers each format writes, which a vocabulary may hold as special tokens
FORMAT_MARKERS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, MISTRAL_CALLS, MISTRAL_ARGS)


def forced_call_format(template_source: str) -> str:
    """The format a forced call is written in, read from the chat template's source."""
    if GEMMA4_CALL_OPEN in template_source:
        return "gemma4"
    if MISTRAL_CALLS in template_source:
        return "mistral-args" if MISTRAL_ARGS in template_source else "mistral"
    if FUNCTION_OPEN in template_source:
        return "qwen3-coder"
    if TOOL_CALL_OPEN in template_source:
        return "hermes"
    return "pythonic" if PYTHONIC_EXAMPLE in template_source else "json"


def tool_call_schema(tools: list[dict[str, Any]], name: str | None = None) -> dict[str, Any]:
    """JSON schema of one call `{"name": ..., "arguments": {...}}` to `name` (or any of `tools`)."""
    variants = []
    for tool in tools:
        fn = tool.get("function", {})
        if name is not None and fn.get("name") != name:
            continue
        params = fn.get("parameters") or {"type": "object"}
        variants.append({
            "type": "object",
            "properties": {"name": {"const": fn.get("name")}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """For chat templates that know nothing of tools: describe them and the call format in a system
    message (what llama.cpp's generic tool format does)."""
    specs = json.dumps([t.get("function", t) for t in tools], ensure_ascii=False, indent=1)
    return (
        "You can call these tools:\n"
        f"{specs}\n"
        "To call a tool, reply with only a JSON object of the form "
        '{"name": "<tool name>", "arguments": {<arguments>}}, '
        "or wrap each call as <tool_call>{...}</tool_call>. Otherwise answer normally."
    )


MARKER_SPAN = max(len(marker) for marker in CALL_MARKERS)


# the head of a call, up to where its arguments' JSON object starts: after `<tool_call>` a Hermes / Qwen call's
# (the name, no id), after `[TOOL_CALLS]` a Mistral call's (the name, then the id its newest templates write)
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]{1,256})"\s*,\s*"arguments"\s*:\s*()')
_MISTRAL_HEAD = re.compile(r"\s*([^\s\[\]{}]{1,256})\s*(?:\[CALL_ID\]\s*([^\s\[\]{}]{1,256})\s*)?\[ARGS\]\s*")
# a Qwen3-Coder call's head, `<function=NAME>`, after `<tool_call>` or alone
_XML_HEAD = re.compile(r"\s*<function=\s*([^>\s]{1,256})\s*>()")
# a Gemma 4 call's head after `<|tool_call>`: `call:NAME`, its arguments' `{` next
_GEMMA4_HEAD = re.compile(r"\s*call:\s*([^{}\s<]{1,256})\s*()")
_STREAMED_HEADS = {TOOL_CALL_OPEN: _HERMES_HEAD, MISTRAL_CALLS: _MISTRAL_HEAD, FUNCTION_OPEN: _XML_HEAD,
                   GEMMA4_CALL_OPEN: _GEMMA4_HEAD}
_HEAD_WAIT = 300  # characters of a block after which a head that has not matched never will


@dataclass
class CallDelta:
    """A piece of a tool call as it streams: the first of each call carries its id and name, every one a piece of
    its arguments' JSON text (OpenAI's `delta.tool_calls` items)."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index, "function": {"arguments": self.arguments}}
        if self.id is not None:
            out |= {"id": self.id, "type": "function"}
            out["function"]["name"] = self.name
        return out


class JsonObjectEnd:
    """Where a JSON object being written ends: bracket depth outside strings, followed character by character."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> int:
        """How many characters of `text` belong to the object (all of them, or up to its closing brace)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return len(text)


class XmlArguments:
    """A Qwen3-Coder call's `<parameter=KEY>\\nVALUE\\n</parameter>` list read as it is written, given out as the
    JSON object xml_calls makes of it: a string's value in pieces as it comes, any other value (typed by the tool's
    schema) once its closing tag is read, the closing brace at `</function>`."""

    def __init__(self, properties: dict[str, Any]):
        self.properties = properties
        self.state = "between"  # or "string" / "typed": inside a value
        self.key = ""
        self.keys = 0  # parameters opened so far
        self.broken = False  # not the format: the call goes out whole at the end

    def feed(self, text: str, at: int) -> tuple[str, int, bool]:
        """(JSON text to send, how far `text` is read, whether the call is complete) from position `at` on."""
        out = ""
        while True:
            rest = text[at:]
            if self.state == "between":
                body = rest.lstrip()
                skipped = len(rest) - len(body)
                if body.startswith(FUNCTION_CLOSE):
                    return out + ("}" if self.keys else "{}"), at + skipped + len(FUNCTION_CLOSE), True
                if body.startswith(PARAMETER_OPEN):
                    close = body.find(">")
                    if close == -1 or close + 1 == len(body):  # the name, then whether a newline opens the value
                        return out, at, False
                    self.key = body[len(PARAMETER_OPEN):close].strip()
                    at += skipped + close + 1 + (body[close + 1] == "\n")
                    out += ("{" if not self.keys else ", ") + json.dumps(self.key, ensure_ascii=False) + ": "
                    self.keys += 1
                    self.state = "string" if textual(self.properties.get(self.key)) else "typed"
                    out += '"' if self.state == "string" else ""
                    continue
                if not any(marker.startswith(body) for marker in (FUNCTION_CLOSE, PARAMETER_OPEN)):
                    self.broken = True
                return out, at, False
            end = rest.find(PARAMETER_CLOSE)
            if end == -1:
                if self.state == "string":  # the value so far, less what may still be its closing
                    ready = rest[: len(rest) - partial_suffix(rest, ("\n" + PARAMETER_CLOSE,))]
                    out += json.dumps(ready, ensure_ascii=False)[1:-1]
                    at += len(ready)
                return out, at, False
            value = rest[:end].removesuffix("\n")
            if self.state == "string":
                out += json.dumps(value, ensure_ascii=False)[1:-1] + '"'
            else:
                out += json.dumps(typed_value(value, self.properties.get(self.key)), ensure_ascii=False)
            at += end + len(PARAMETER_CLOSE)
            self.state = "between"


@dataclass
class _StreamedCall:
    index: int
    id: str
    name: str
    start: int  # where its arguments' text starts in the output
    end: int  # how far they were sent
    scan: JsonObjectEnd = field(default_factory=JsonObjectEnd)
    done: bool = False
    # arguments not written as JSON (Qwen3-Coder's, Gemma 4's, pythonic ones), read into it
    reader: XmlArguments | Gemma4Arguments | PythonicArguments | None = None
    sent: str = ""  # the arguments' text as sent


class ToolCallStreamFilter:
    """Streams content while holding back anything that may turn into a tool call.

    Text before a call marker (`<tool_call>`, `[TOOL_CALLS]`, `<function=`, `<|tool_call>`) streams, minus a tail
    that could be the start of one; output that opens with `{` or `[` is held whole, since it may be a bare JSON or
    pythonic call. Calls in Hermes / Qwen JSON (`<tool_call>{"name": ..., "arguments": {...}}`), Mistral's
    `[TOOL_CALLS]NAME[ARGS]{...}`, Qwen3-Coder's XML (`<function=NAME><parameter=KEY>...`) and Gemma 4's
    `<|tool_call>call:NAME{...}` (the last two given out as the JSON object they read as) to a known tool stream as
    they are written (`take_deltas`): the name once read, then the arguments' JSON text piece by piece; the call
    `finish` returns carries that text as its arguments, so the pieces add up to them. `finish` parses what was
    held: calls come back as ToolCall objects, anything else is released as content.
    """

    def __init__(self, active: bool, known_names: set[str] | None = None, parameters: dict[str, Any] | None = None):
        self.active = active
        self.known = known_names
        self.parameters = parameters
        self.text = ""
        self.emitted = 0
        self.open_at = -1  # where the first call marker starts in text, once seen
        self.searched = 0  # text before this was searched for one (each token searches only its new text)
        self.streamed: list[_StreamedCall] = []  # the calls whose pieces went out, in order
        self._deltas: list[CallDelta] = []
        self._next_block = 0  # where to look for the next <tool_call> block to stream
        self._streaming = True  # off for good once a block is not one that streams (its calls go out whole)
        self._list_at: int | None = None  # in a reply that opens with "[": where the next pythonic call may start

    def push(self, delta: str) -> str:
        self.text += delta
        if not self.active:
            out, self.emitted = self.text[self.emitted:], len(self.text)
            return out
        if might_be_tool_call(self.text) and not self.text.lstrip().startswith(MISTRAL_CALLS):
            if self._streaming and self.text.lstrip().startswith("["):
                self._stream_pythonic()  # a pythonic list's calls stream; anything else in brackets waits whole
            return ""  # held whole (a `[TOOL_CALLS]` reply is not: its calls may stream)
        if self.open_at == -1:
            self.open_at = first_marker(self.text, max(0, self.searched - MARKER_SPAN + 1))
            self.searched = len(self.text)
        i = self.open_at
        if i != -1:
            end = i
            marker = next((m for m in _STREAMED_HEADS if self.text.startswith(m, i)), None)
            if self._streaming and marker is not None:
                self._stream_calls(marker, max(i, self._next_block))
        else:
            end = len(self.text) - partial_suffix(self.text, CALL_MARKERS)
        end = max(end, self.emitted)
        out, self.emitted = self.text[self.emitted:end], end
        return out

    def take_deltas(self) -> list[CallDelta]:
        """The call pieces written since the last call."""
        deltas, self._deltas = self._deltas, []
        return deltas

    def _stream_calls(self, marker: str, search_from: int) -> None:
        """Send what can be sent of the calls `marker` opens (`<tool_call>` blocks of JSON or of Qwen3-Coder's XML,
        `<function=` alone, Mistral's `[TOOL_CALLS]NAME[ARGS]`) from `search_from` on, one call at a time."""
        text = self.text
        while True:
            call = self.streamed[-1] if self.streamed and not self.streamed[-1].done else None
            if call is None:
                start = text.find(marker, search_from)
                if start == -1:
                    return
                body = start if marker == FUNCTION_OPEN else start + len(marker)
                xml = text[body:].lstrip().startswith(FUNCTION_OPEN)
                head = (_XML_HEAD if xml else _STREAMED_HEADS[marker]).match(text, body)
                if head is None or (head.end() == len(text) and not xml):
                    # a block closed without a head, or Mistral's older JSON list: not one that streams
                    cannot = (text.find(TOOL_CALL_CLOSE, body) != -1 if marker == TOOL_CALL_OPEN
                              else text.find(FUNCTION_CLOSE, body) != -1 if marker == FUNCTION_OPEN
                              else text.find(GEMMA4_CALL_CLOSE, body) != -1 if marker == GEMMA4_CALL_OPEN
                              else text[body:].lstrip()[:1] in ("[", "{"))
                    if cannot or len(text) - body > _HEAD_WAIT:
                        self._streaming = False  # not a call that streams: this one and the rest go out whole
                    return
                name = head.group(1)
                if (self.known is not None and name not in self.known) or (not xml and text[head.end()] != "{"):
                    self._streaming = False
                    return
                reader = (XmlArguments(((self.parameters or {}).get(name) or {}).get("properties") or {}) if xml
                          else Gemma4Arguments() if marker == GEMMA4_CALL_OPEN else None)
                call = _StreamedCall(len(self.streamed), head.group(2) or "call_" + uuid.uuid4().hex[:24], name,
                                     head.end(), head.end(), reader=reader)
                self.streamed.append(call)
                self._deltas.append(CallDelta(call.index, "", call.id, name))
            if call.reader is not None:
                piece, call.end, complete = call.reader.feed(text, call.end)
                if call.reader.broken:
                    self._streaming = False
                    return
            else:
                fresh = text[call.end:]
                taken = call.scan.feed(fresh)
                piece, call.end = fresh[:taken], call.end + taken
                complete = call.scan.depth == 0 and call.end > call.start
            if piece:
                self._deltas.append(CallDelta(call.index, piece))
                call.sent += piece
            if not complete:
                return
            call.done = True
            search_from = self._next_block = call.end

    def _stream_pythonic(self) -> None:
        """Send what can be sent of a pythonic list's calls, `[NAME(key=value, ...), ...]`, one call at a time: the
        name once its parenthesis opens, then each argument as its value ends."""
        text = self.text
        if self._list_at is None:
            self._list_at = text.index("[") + 1
        while True:
            call = self.streamed[-1] if self.streamed and not self.streamed[-1].done else None
            if call is None:
                rest = text[self._list_at:]
                body = rest.lstrip()
                if self.streamed and body.startswith(","):
                    self._list_at += len(rest) - len(body) + 1
                    continue
                head = PYTHONIC_HEAD.match(text, self._list_at)
                if head is None:
                    # only a name so far may still become a call; anything else (JSON, a number) never streams
                    if re.fullmatch(r"\s*[A-Za-z_][A-Za-z0-9_.]*\s*", body) is None or len(body) > _HEAD_WAIT:
                        self._streaming = not body or (bool(self.streamed) and body.startswith("]"))
                    return
                name = head.group(1)
                if self.known is not None and name not in self.known:
                    self._streaming = False
                    return
                call = _StreamedCall(len(self.streamed), "call_" + uuid.uuid4().hex[:24], name, head.end(),
                                     head.end(), reader=PythonicArguments())
                self.streamed.append(call)
            piece, call.end, complete = call.reader.feed(text, call.end)
            if call.reader.broken:
                self._streaming = False
                return
            if piece:  # the call's name goes out with its first argument, once that has read as a literal
                if not call.sent:
                    self._deltas.append(CallDelta(call.index, "", call.id, call.name))
                self._deltas.append(CallDelta(call.index, piece))
                call.sent += piece
            if not complete:
                return
            call.done = True
            self._list_at = call.end

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet emitted, tool calls found in the whole output). A call whose arguments streamed keeps
        its id and the arguments' text as written."""
        if self.active:
            content, calls = parse_tool_calls(self.text, self.known, self.parameters)
            for call, sent in zip(calls, self.streamed):
                if sent.done and call.name == sent.name:
                    call.id, call.arguments = sent.id, sent.sent
            if calls:
                i = first_marker(self.text)
                rest = self.text[self.emitted:i] if i != -1 else ""
                return rest.rstrip() if rest.strip() else "", calls
        out, self.emitted = self.text[self.emitted:], len(self.text)
        return out, []
