"""The ways families write tool calls, each read into `(name, arguments)` pairs (engine.tools checks the names
and builds the calls):

* Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and Llama 3's bare JSON with
  "parameters" (engine.tools reads the JSON values);
* Qwen3-Coder: `<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>`, the values
  typed by the tool's JSON schema;
* Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}]`, or one `[TOOL_CALLS]NAME[ARGS]{...}` per call
  (with `[CALL_ID]ID` after the name in the newest templates);
* pythonic (Llama 3.2 and 4): `[get_weather(city="Paris"), get_time()]`, read by Python's parser, never run
  (PythonicArguments reads one call's arguments into JSON as they are written, a value at a time);
* Gemma 4: `<|tool_call>call:NAME{key:value,...}<tool_call|>`, its own notation of JSON: keys bare, strings between
  `<|"|>` marks (Gemma4Arguments reads it into JSON text, whole or as it streams).

Every reader is a linear scan (string search, no backtracking regex), so a hostile reply costs its length.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from typing import Any

FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
GEMMA4_CALL_OPEN, GEMMA4_CALL_CLOSE, GEMMA4_QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
GEMMA4_CALL_HEAD = "call:"
# (name, arguments as a dict, the call's own id or "")
RawCall = tuple[str, dict[str, Any], str]


def textual(schema: Any) -> bool:
    """Whether a parameter's JSON schema takes a string (or says no type): its value is written as bare text."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    return kind in (None, "string") or (isinstance(kind, list) and "string" in kind)


def typed_value(value: str, schema: Any) -> Any:
    """A Qwen3-Coder parameter's text as its schema's type: JSON where the schema says it is not a string."""
    if textual(schema):
        return value
    try:
        return json.loads(value)
    except (json.JSONDecodeError, RecursionError):
        return value


def _named_blocks(text: str, opening: str, closing: str) -> Iterator[tuple[str, str]]:
    """(NAME, body) of each `{opening}NAME>body{closing}` in `text`, the last possibly unclosed (its body runs to the
    end), found by string search."""
    at = text.find(opening)
    while at != -1:
        name_end = text.find(">", at)
        if name_end == -1:
            return
        end = text.find(closing, name_end)
        yield text[at + len(opening) : name_end].strip(), text[name_end + 1 : end if end != -1 else len(text)]
        at = -1 if end == -1 else text.find(opening, end)


def xml_calls(text: str, parameters: dict[str, Any] | None = None) -> list[RawCall]:
    """Each `<function=NAME>` block in `text` (the last possibly unclosed), its `<parameter=KEY>` values typed by
    `parameters` (tool name -> its JSON schema)."""
    calls: list[RawCall] = []
    for name, body in _named_blocks(text, FUNCTION_OPEN, FUNCTION_CLOSE):
        properties = ((parameters or {}).get(name) or {}).get("properties") or {}
        arguments = {key: typed_value(value.removeprefix("\n").removesuffix("\n"), properties.get(key))
                     for key, value in _named_blocks(body, PARAMETER_OPEN, PARAMETER_CLOSE)}
        calls.append((name, arguments, ""))
    return calls


def _first_json(text: str) -> Any:
    try:
        return json.JSONDecoder().raw_decode(text.lstrip())[0]
    except (json.JSONDecodeError, RecursionError):
        return None


def mistral_calls(text: str) -> list[RawCall] | None:
    """The calls after `[TOOL_CALLS]` markers (`text` starts at the first); None where one does not read."""
    calls: list[RawCall] = []
    for segment in text.split(MISTRAL_CALLS)[1:]:
        segment = segment.strip()
        if MISTRAL_ARGS in segment:  # NAME[CALL_ID]ID[ARGS]{...} or NAME[ARGS]{...}
            head, args = segment.split(MISTRAL_ARGS, 1)
            name, _, call_id = head.partition(MISTRAL_CALL_ID)
            arguments = _first_json(args)
            if not isinstance(arguments, dict):
                return None
            calls.append((name.strip(), arguments, call_id.strip()))
            continue
        value = _first_json(segment)  # [{"name": ..., "arguments": ..., "id": ...}, ...]
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            arguments = item.get("arguments", item.get("parameters", {}))
            if isinstance(arguments, str):
                arguments = _first_json(arguments)
            if not isinstance(arguments, dict):
                return None
            calls.append((item["name"], arguments, str(item.get("id") or "")))
    return calls or None


def pythonic_calls(text: str) -> list[RawCall] | None:
    """`[f(a=1), g(b="x")]` as calls, or None where `text` is not exactly such a list of keyword-only calls with
    literal arguments (parsed, never evaluated: each value is a literal or it is refused)."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls: list[RawCall] = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None:  # **kwargs
                return None
            try:
                arguments[keyword.arg] = ast.literal_eval(keyword.value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
        calls.append((node.func.id, arguments, ""))
    return calls


class Gemma4Arguments:
    """A Gemma 4 call's arguments, `{key:value,...}` with bare keys and `<|"|>`-quoted strings, read into JSON text as
    they are written: `feed` takes the text so far and gives the JSON for what is certain, holding back a tail that
    may be the start of a quote mark. Fed whole or in any pieces, the JSON is the same. `broken`: not the notation
    (the call is then read whole at the end, or not at all)."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # open containers: "{" or "["
        self.state = "value"  # "value" (a value may start), "key" (a dict key may start), "bare_key", "string",
        # "scalar" (a number, true, false, null), "after" (after a value or key: a separator or closing next)
        self.string_is_key = False
        self.broken = False
        self.done = False

    def feed(self, text: str, at: int) -> tuple[str, int, bool]:
        """(JSON text to send, how far `text` is read, whether the arguments are complete) from position `at` on."""
        out = []
        while at < len(text) and not self.done and not self.broken:
            ch = text[at]
            if self.state == "string":
                end = text.find(GEMMA4_QUOTE, at)
                if end == -1:
                    ready = text[at : len(text) - _partial_quote(text, at)]
                    out.append(json.dumps(ready, ensure_ascii=False)[1:-1])
                    at += len(ready)
                    break
                out.append(json.dumps(text[at:end], ensure_ascii=False)[1:-1] + '"')
                at = end + len(GEMMA4_QUOTE)
                self.state = "colon" if self.string_is_key else "after"
                continue
            if self.state == "bare_key":
                if ch == ":":
                    out.append('":')
                    self.state = "value"
                elif ch in "{}[],\n" or ch == "<":
                    self.broken = True
                else:
                    out.append(json.dumps(ch, ensure_ascii=False)[1:-1])
                at += 1
                continue
            if self.state == "scalar":
                if ch.isalnum() or ch in "+-.":
                    out.append(ch)
                    at += 1
                    continue
                self.state = "after"
            if ch in " \t\r\n":
                at += 1
                continue
            if ch == "<":  # a quote mark, or the start of one
                if not text.startswith(GEMMA4_QUOTE, at):
                    if GEMMA4_QUOTE.startswith(text[at:]):
                        break  # wait for the rest
                    self.broken = True
                    break
                if self.state not in ("value", "key"):
                    self.broken = True
                    break
                self.string_is_key = self.state == "key"
                out.append('"')
                at += len(GEMMA4_QUOTE)
                self.state = "string"
                continue
            if self.state == "colon":
                if ch != ":":
                    self.broken = True
                    break
                out.append(":")
                self.state = "value"
            elif ch in "{[" and self.state == "value":
                self.stack.append(ch)
                out.append(ch)
                self.state = "key" if ch == "{" else "value"
            elif ch in "}]" and self.stack and self.stack[-1] == "{[}]"[["}", "]"].index(ch)]:
                if self.state == "value" and self.stack[-1] == "{":
                    self.broken = True  # `{a:}`
                    break
                self.stack.pop()
                out.append(ch)
                self.state = "after"
                self.done = not self.stack
            elif ch == "," and self.state == "after" and self.stack:
                out.append(",")
                self.state = "key" if self.stack[-1] == "{" else "value"
            elif self.state == "key" and ch not in ":{}[],":
                out.append('"' + json.dumps(ch, ensure_ascii=False)[1:-1])
                self.state = "bare_key"
            elif self.state == "value" and self.stack and (ch.isalnum() or ch in "+-."):
                out.append(ch)
                self.state = "scalar"
            else:
                self.broken = True
                break
            at += 1
        return "".join(out), at, self.done


def _partial_quote(text: str, at: int) -> int:
    """How many characters at the end of text[at:] may be the start of a quote mark."""
    for n in range(min(len(GEMMA4_QUOTE) - 1, len(text) - at), 0, -1):
        if GEMMA4_QUOTE.startswith(text[len(text) - n :]):
            return n
    return 0


def gemma4_calls(text: str) -> list[RawCall] | None:
    """The calls of the `<|tool_call>call:NAME{...}<tool_call|>` blocks in `text` (which starts at the first); None
    where one does not read."""
    calls: list[RawCall] = []
    for block in text.split(GEMMA4_CALL_OPEN)[1:]:
        block = block.split(GEMMA4_CALL_CLOSE, 1)[0].strip()
        name, brace, _ = block.partition("{")
        if not name.startswith(GEMMA4_CALL_HEAD) or not brace:
            return None
        reader = Gemma4Arguments()
        start = len(name)
        arguments, end, complete = reader.feed(block, start)
        if not complete or block[end:].strip():
            return None
        try:
            parsed = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return None
        if not isinstance(parsed, dict):
            return None
        calls.append((name[len(GEMMA4_CALL_HEAD):].strip(), parsed, ""))
    return calls or None


PYTHONIC_HEAD = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.]{0,255})\s*\(")  # a pythonic call's name and its "("
_KEYWORD = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=(?!=)")
_KEYWORD_SO_FAR = re.compile(r"\s*(?:[A-Za-z_][A-Za-z0-9_]*\s*)?")


class PythonicArguments:
    """A pythonic call's `key=value, ...)` read into the JSON object pythonic_calls makes of it, as it is written: each
    value once it ends (a comma or the closing parenthesis outside brackets and strings), given to Python's literal
    parser, never run. The scan is incremental, so a long value costs its length once. `broken`: not keywords with
    literal values (the call is then read whole at the end, or not at all)."""

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.key: str | None = None  # the keyword whose value is being read
        self.start = self.pos = 0  # the value's start, and how far it was scanned
        self.depth = 0
        self.quote = ""  # the open string's quote (', ", \'\'\' or \"\"\"), or none
        self.escaped = False
        self.broken = False

    def feed(self, text: str, at: int) -> tuple[str, int, bool]:
        """(JSON text to send, how far `text` is read, whether the call is complete) from position `at` on."""
        out = ""
        while not self.broken:
            if self.key is None:
                rest = text[at:]
                body = rest.lstrip()
                if self.keys and body.startswith(","):
                    at += len(rest) - len(body) + 1
                    continue
                if body.startswith(")"):
                    return out + ("}" if self.keys else "{}"), at + len(rest) - len(body) + 1, True
                keyword = _KEYWORD.match(rest)
                if keyword is None:
                    self.broken = _KEYWORD_SO_FAR.fullmatch(rest) is None
                    return out, at, False
                self.key = keyword.group(1)
                if self.key in self.keys:
                    self.broken = True  # a keyword given twice: Python itself refuses that call
                    break
                at += keyword.end()
                self.start = self.pos = at
            end = self._value_end(text)
            if end == -1:
                return out, at, False
            try:
                value = json.dumps(ast.literal_eval(text[self.start:end].strip()), ensure_ascii=False)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                self.broken = True
                break
            out += ("{" if not self.keys else ", ") + json.dumps(self.key, ensure_ascii=False) + ": " + value
            self.keys.add(self.key)
            self.key, at = None, end
        return out, at, False

    def _value_end(self, text: str) -> int:
        """Where the value being read ends (its comma or closing parenthesis), or -1 while it has not."""
        i = self.pos
        while i < len(text):
            ch = text[i]
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif text.startswith(self.quote, i):
                    i += len(self.quote)
                    self.quote = ""
                    continue
                elif len(self.quote) == 3 and ch == self.quote[0] and len(text) - i < 3:
                    break  # perhaps the closing quotes, not all here yet
                i += 1
                continue
            if ch in "'\"":
                if text.startswith(ch * 3, i):
                    self.quote = ch * 3
                    i += 3
                    continue
                if len(text) - i < 3 and text[i:] == ch * (len(text) - i):
                    break  # perhaps a triple quote, not all here yet
                self.quote = ch
            elif ch in "([{":
                self.depth += 1
            elif ch in ")]}":
                if self.depth == 0:
                    self.pos = i
                    if ch != ")":
                        self.broken = True
                    return -1 if ch != ")" else i
                self.depth -= 1
            elif ch == "," and self.depth == 0:
                self.pos = i
                return i
            i += 1
        self.pos = i
        return -1
