"""The ways families write tool calls, each read into `(name, arguments)` pairs (engine.tools checks the names
and builds the calls):

* Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and Llama 3's bare JSON with
  "parameters" (engine.tools reads the JSON values);
* Qwen3-Coder: `<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>`, the values
  typed by the tool's JSON schema;
* Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}]`, or one `[TOOL_CALLS]NAME[ARGS]{...}` per call
  (with `[CALL_ID]ID` after the name in the newest templates);
* pythonic (Llama 3.2 and 4): `[get_weather(city="Paris"), get_time()]`, read by Python's parser, never run.

Every reader is a linear scan (string search, no backtracking regex), so a hostile reply costs its length.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator
from typing import Any

FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
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
