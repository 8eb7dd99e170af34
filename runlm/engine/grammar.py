"""Grammar-guided sampling through llguidance: JSON schemas become a token mask per step.

llguidance (a maintained Rust library with CPU wheels and no torch pin) compiles a JSON schema into a
grammar and, given the vocabulary as bytes, tells which tokens may come next. We build its tokenizer
from the runlm Tokenizer's own byte spelling of each token, so any family's vocabulary works.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any

import numpy as np

from runlm.engine.tool_formats import GEMMA4_CALL_CLOSE, GEMMA4_CALL_OPEN, PARAMETER_CLOSE, textual
from runlm.engine.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, tool_call_schema
from runlm.errors import InvalidInputError, RunlmError


class GrammarUnavailableError(RunlmError):
    """Constrained output was asked for but llguidance is not installed."""


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise GrammarUnavailableError(
            "structured output needs the llguidance package (pip install llguidance)"
        ) from exc
    return llguidance


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


class _VocabAdapter:
    """What llguidance.TokenizerWrapper reads: bytes per token, special tokens marked with 0xFF."""

    def __init__(self, tokenizer: Any, n_vocab: int, eos_ids: list[int]):
        special = set(getattr(tokenizer, "special_ids", ()) or ())
        tokens: list[bytes] = []
        for i in range(n_vocab):
            if i >= tokenizer.vocab_size:
                tokens.append(b"")
            elif i in special:
                tokens.append(b"\xff" + tokenizer.token_str(i).encode("utf-8"))
            else:
                tokens.append(tokenizer.token_to_bytes(i))
        self.tokens = tokens
        self.eos_token_id = eos_ids[0] if eos_ids else 0
        self.bos_token_id = getattr(tokenizer, "bos_id", None)
        self.special_token_ids = sorted(special)
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_bos=False)


def ll_tokenizer(tokenizer: Any, n_vocab: int, eos_ids: list[int]):
    """The llguidance tokenizer for a runlm Tokenizer (built once: it walks the whole vocabulary)."""
    llg = _llguidance()
    key = (n_vocab, tuple(eos_ids))
    with _TOKENIZERS_LOCK:
        per_tok = _TOKENIZERS.setdefault(tokenizer, {})
        if key not in per_tok:
            wrapper = llg.TokenizerWrapper(_VocabAdapter(tokenizer, n_vocab, eos_ids))
            per_tok[key] = llg.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=eos_ids or None)
        return per_tok[key]


def grammar_for_json_schema(schema: dict[str, Any] | bool | None) -> str:
    """An llguidance grammar for a JSON schema (None: any JSON object). Compact separators keep small
    models from wandering off into whitespace."""
    llg = _llguidance()
    if schema is None:
        schema = {"type": "object"}
    elif schema is True:
        schema = {}
    elif schema is False:
        raise InvalidInputError("response_format: the schema `false` accepts no value at all")
    try:
        return llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False, "item_separator": ", ",
                                          "key_separator": ": "}
        )
    except (ValueError, TypeError) as exc:
        raise InvalidInputError(f"response_format: invalid JSON schema ({exc})") from exc


def _json_options(schema: dict[str, Any] | bool) -> dict[str, Any] | bool:
    """`schema` with the compact separators grammar_for_json_schema uses, for a JSON schema inside a Lark grammar."""
    if not isinstance(schema, dict):
        return schema
    return {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


# what ends a Qwen3-Coder parameter's value
PARAMETER_END = "\n" + PARAMETER_CLOSE


def _marker(text: str, specials: set[str]) -> str:
    """A format's marker in a Lark grammar: the special token where the vocabulary has it as one, else its text."""
    return text if text in specials else json.dumps(text)


def _functions(tools: list[dict[str, Any]], name: str | None) -> list[tuple[str, dict[str, Any] | bool]]:
    """(name, arguments schema) of `name`, or of every tool."""
    found = [(fn.get("name"), fn.get("parameters") or {"type": "object"})
             for fn in (tool.get("function", {}) for tool in tools) if name is None or fn.get("name") == name]
    if not found:
        raise InvalidInputError("a forced tool call needs a function to call")
    return found


def _lark(alternatives: list[str], rules: str = "") -> str:
    """A Lark grammar whose start is one of `alternatives` (rule bodies; `rules`: the rules they use), compiled by
    llguidance."""
    lark = "start: " + " | ".join(f"call_{i}" for i in range(len(alternatives))) + "\n"
    lark += "".join(f"call_{i}: {body}\n" for i, body in enumerate(alternatives)) + rules
    return _llguidance().LLMatcher.grammar_from_lark(lark)


def grammar_for_harmony_call(tools: list[dict[str, Any]], specials: set[str], name: str | None = None) -> str:
    """An llguidance grammar for the rest of a harmony call whose header the prompt wrote up to `to=functions.`:
    a function's name (`name`, or any of `tools`), the JSON content type, and its arguments under its schema.
    `specials`: the marker texts that are special tokens in the vocabulary (referenced as tokens; any other is
    spelled as text)."""
    return _lark([f"{json.dumps(fn)} \" \" {_marker('<|constrain|>', specials)} \"json\" "
                  f"{_marker('<|message|>', specials)} %json {json.dumps(_json_options(schema))}"
                  for fn, schema in _functions(tools, name)])


def _xml_call(index: int, function: str, schema: dict[str, Any] | bool, specials: set[str]) -> tuple[str, str]:
    """One Qwen3-Coder call as Lark: (its rule body, the rules it uses). `<tool_call>\\n<function=NAME>\\n`, then each
    of the schema's parameters in its order (the required ones always) as `<parameter=KEY>\\nVALUE\\n</parameter>\\n`,
    a string's value any text up to the closing tag, any other value JSON under its schema; then the closings."""
    properties = (schema.get("properties") or {}) if isinstance(schema, dict) else {}
    required = set(schema.get("required") or ()) if isinstance(schema, dict) else set()
    body = [_marker(TOOL_CALL_OPEN, specials), json.dumps(f"\n<function={function}>\n")]
    rules = ""
    for k, (key, prop) in enumerate(properties.items()):
        head = json.dumps(f"<parameter={key}>\n")
        if textual(prop):
            rule = f"text_{index}_{k}"  # any text, ended by the closing tag (which it takes)
            rules += f'{rule}[stop={json.dumps(PARAMETER_END)}]: /(?s:.*)/\n'
            value = rule
        else:
            value = f"%json {json.dumps(_json_options(prop))} {json.dumps(PARAMETER_END)}"
        body.append(f"({head} {value} \"\\n\")" + ("" if key in required else "?"))
    body += [json.dumps("</function>\n"), _marker(TOOL_CALL_CLOSE, specials)]
    return " ".join(body), rules


# Gemma 4's notation of JSON values (engine.tool_formats.Gemma4Arguments reads it): strings between quote marks (no
# `<|` inside: one lexeme, so a token may run past the closing mark), dicts with bare keys
_GEMMA4_VALUES = """
g4_value: g4_string | g4_number | "true" | "false" | "null" | g4_dict | g4_array
g4_string: /<\\|"\\|>(?:[^<]|<[^|])*<\\|"\\|>/
g4_number: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][-+]?[0-9]+)?/
g4_dict: "{" (g4_pair ("," g4_pair)*)? "}"
g4_pair: /[A-Za-z_][A-Za-z0-9_]*/ ":" g4_value
g4_array: "[" (g4_value ("," g4_value)*)? "]"
g4_integer: /-?(0|[1-9][0-9]*)/
"""


def _keyword_rules(index: int, keys: list[str], required: set[str], pair: Any, separator: str) -> tuple[str, str]:
    """Lark rules for keyword arguments written in the order of `keys`, the required ones always, `separator` between
    them: (the body of the whole list, the rules it uses). `pair(j)` is key j and its value as Lark.
    first_k: the arguments from key k on, the first of them written (each key skipped optional); rest_k: after a
    written key, the next ones (the separator and first_k: required while a required key is left)."""
    rules = ""
    for k in range(len(keys)):
        starts = []
        for j in range(k, len(keys)):
            starts.append(pair(j) + (f" rest_{index}_{j + 1}" if j + 1 < len(keys) else ""))
            if keys[j] in required:
                break
        rules += f"first_{index}_{k}: {' | '.join(starts)}\n"
        if k:
            more = f"{json.dumps(separator)} first_{index}_{k}"
            rules += f"rest_{index}_{k}: {more if required & set(keys[k:]) else f'({more})?'}\n"
    return f"first_{index}_0{'' if required else '?'}", rules


def _typed(schema: Any) -> str | None:
    """A property's JSON schema type where it names one."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    return kind if isinstance(kind, str) else None


def _gemma4_call(index: int, function: str, schema: dict[str, Any] | bool) -> tuple[str, str]:
    """One Gemma 4 call as Lark: (its rule body, the rules it uses). `<|tool_call>call:NAME{...}<tool_call|>`, the
    schema's parameters in its template's (sorted) order, the required ones always, each value typed by its schema's
    type (a string, number, integer or boolean; any value otherwise). A schema without properties takes any dict.
    The markers are spelled as text: Gemma 4's vocabulary holds them as plain added tokens, which match it."""
    properties = (schema.get("properties") or {}) if isinstance(schema, dict) else {}
    required = set(schema.get("required") or ()) if isinstance(schema, dict) else set()
    head = f"{json.dumps(GEMMA4_CALL_OPEN)} {json.dumps(f'call:{function}')}"
    tail = json.dumps(GEMMA4_CALL_CLOSE)
    if not properties:
        return f"{head} g4_dict {tail}", ""
    keys = sorted(properties)
    kinds = {"string": "g4_string", "number": "g4_number", "integer": "g4_integer", "boolean": '("true" | "false")'}

    def pair(j: int) -> str:
        return f"{json.dumps(keys[j] + ':')} {kinds.get(_typed(properties[keys[j]]), 'g4_value')}"

    body, rules = _keyword_rules(index, keys, required, pair, ",")
    return f"{head} \"{{\" {body} \"}}\" {tail}", rules


def _pythonic_call(index: int, function: str, schema: dict[str, Any] | bool) -> tuple[str, str]:
    """One pythonic call as Lark, `[NAME(key=value, ...)]`: the schema's parameters in its order, the required ones
    always; strings and numbers as JSON writes them (Python reads them the same), booleans as Python's True / False,
    other values JSON under their schema."""
    properties = (schema.get("properties") or {}) if isinstance(schema, dict) else {}
    required = set(schema.get("required") or ()) if isinstance(schema, dict) else set()
    keys = list(properties)

    def pair(j: int) -> str:
        prop = properties[keys[j]]
        value = ('("True" | "False")' if _typed(prop) == "boolean"
                 else f"%json {json.dumps(_json_options(prop if isinstance(prop, dict) else {}))}")
        return f"{json.dumps(keys[j] + '=')} {value}"

    body, rules = _keyword_rules(index, keys, required, pair, ", ") if keys else ("", "")
    return f"\"[\" {json.dumps(function + '(')} {body} \")]\"", rules


def grammar_for_forced_call(call_format: str, tools: list[dict[str, Any]], specials: set[str],
                            name: str | None = None) -> str:
    """An llguidance grammar for one call to `name` (or any of `tools`) in `call_format` (engine.tools'
    FORCED_CALL_FORMATS): Hermes / Qwen `<tool_call>` JSON, Mistral's `[TOOL_CALLS]NAME[ARGS]{...}` or its older
    `[TOOL_CALLS][{...}]`, Gemma 4's `<|tool_call>call:NAME{...}`, a pythonic `[NAME(key=value)]`, or a bare JSON
    call."""
    if call_format in ("gemma4", "pythonic"):
        write = _gemma4_call if call_format == "gemma4" else _pythonic_call
        calls = [write(i, fn, schema) for i, (fn, schema) in enumerate(_functions(tools, name))]
        values = _GEMMA4_VALUES if call_format == "gemma4" else ""
        return _lark([body for body, _ in calls], "".join(rules for _, rules in calls) + values)
    if call_format == "mistral-args":
        return _lark([f"{_marker('[TOOL_CALLS]', specials)} {json.dumps(fn)} {_marker('[ARGS]', specials)} "
                      f"%json {json.dumps(_json_options(schema))}" for fn, schema in _functions(tools, name)])
    if call_format == "qwen3-coder":
        calls = [_xml_call(i, fn, schema, specials) for i, (fn, schema) in enumerate(_functions(tools, name))]
        return _lark([body for body, _ in calls], "".join(rules for _, rules in calls))
    call = tool_call_schema(tools, name)
    if call_format == "hermes":
        return _lark([f"{_marker('<tool_call>', specials)} \"\\n\" %json {json.dumps(_json_options(call))} "
                      f"\"\\n\" {_marker('</tool_call>', specials)}"])
    if call_format == "mistral":
        listed = {"type": "array", "items": call, "minItems": 1, "maxItems": 1}
        return _lark([f"{_marker('[TOOL_CALLS]', specials)} %json {json.dumps(_json_options(listed))}"])
    return grammar_for_json_schema(call)


class GrammarConstraint:
    """One request's matcher: the allowed-token mask before each draw, advanced by each drawn token."""

    def __init__(self, grammar: str, tokenizer: Any, n_vocab: int, eos_ids: list[int]):
        llg = _llguidance()
        self.grammar = grammar  # the text, so the constraint can be rebuilt in another process (cluster)
        self.n_vocab = n_vocab
        self.matcher = llg.LLMatcher(ll_tokenizer(tokenizer, n_vocab, eos_ids), grammar, log_level=0)
        if self.matcher.is_error():
            raise InvalidInputError(f"response_format: the schema cannot be used ({self.matcher.get_error()})")
        self.eos_ids = list(eos_ids)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | None, tokenizer: Any, n_vocab: int,
                    eos_ids: list[int]) -> GrammarConstraint:
        return cls(grammar_for_json_schema(schema), tokenizer, n_vocab, eos_ids)

    def copy(self) -> GrammarConstraint:
        """An independent matcher in the same state (each of a request's n choices advances its own)."""
        twin = object.__new__(GrammarConstraint)
        twin.grammar, twin.n_vocab, twin.eos_ids = self.grammar, self.n_vocab, list(self.eos_ids)
        twin.matcher = self.matcher.deep_copy()
        return twin

    def allowed(self) -> np.ndarray:
        """Bool mask [n_vocab] of tokens the grammar accepts next (EOS only once the value is complete)."""
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(words, bitorder="little")[: self.n_vocab].astype(bool)
        if not mask.any():  # the grammar is finished or broken: let the request end
            mask[self.eos_ids] = True
        return mask

    def accept(self, token: int) -> bool:
        """Advance by the drawn token; False if the grammar rejected it (then the request should end)."""
        if self.matcher.is_stopped():
            return token in self.eos_ids
        return bool(self.matcher.consume_token(token))

    @property
    def done(self) -> bool:
        """The grammar cannot take more text (a complete value was produced)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""


_WHITESPACE_TOKENS: weakref.WeakKeyDictionary[Any, np.ndarray] = weakref.WeakKeyDictionary()


def whitespace_tokens(tokenizer: Any, n_vocab: int) -> np.ndarray:
    """Bool mask [n_vocab] of the tokens that are whitespace and nothing else (made once per tokenizer): what may
    stand between a reply's thinking and the answer a grammar holds."""
    mask = _WHITESPACE_TOKENS.get(tokenizer)
    if mask is None or len(mask) != n_vocab:
        mask = np.zeros(n_vocab, dtype=bool)
        special = getattr(tokenizer, "special_ids", frozenset())
        for token_id in range(min(n_vocab, tokenizer.vocab_size)):
            piece = tokenizer.token_to_bytes(token_id)
            mask[token_id] = bool(piece) and not piece.strip() and token_id not in special
        _WHITESPACE_TOKENS[tokenizer] = mask
    return mask
