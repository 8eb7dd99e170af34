"""Chat templates: the model's own Jinja template turns messages into the prompt text.

Templates come from model files (GGUF metadata, Hugging Face directories), so they are untrusted
code: they run in Jinja's immutable sandbox, with the helpers transformers gives templates so that
the same template renders the same text here.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from runlm.errors import TokenizerError
from runlm.text.tokenizer import token_text

MAX_RENDER_CHARS = 16 * 1024 * 1024  # a rendered prompt past this cannot fit any context anyway
MAX_RENDER_S = 2.0  # a normal render takes milliseconds; nested loops over a long message list take forever
MAX_POWER_EXPONENT = 1024  # `10 ** 10 ** 10` would run in C, where no deadline can stop it
LOOP_FILTER = "__runlm_counted_loop"  # the filter _StrictSandbox wraps every loop's items in


class _RenderBudget(threading.local):
    """The running render's deadline, per thread (renders run in a server's worker threads side by side)."""

    deadline: float = float("inf")

    def check(self) -> None:
        if time.monotonic() > self.deadline:
            raise TokenizerError(f"the chat template ran longer than {MAX_RENDER_S:g} s (nested loops over the "
                                 "messages?): the prompt is refused")


_budget = _RenderBudget()


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but reaching for an unsafe attribute (`__class__`, `__globals__`...)
    fails at once instead of quietly rendering as an empty string; and bounded: every attribute, item and
    call checks the render's deadline (a loop that does anything does one of these), and `*` / `**` refuse
    results past the output bound; every loop checks the deadline on each iteration too (see `_parse`)."""

    intercepted_binops = frozenset({"*", "**"})

    def _parse(self, source: str, name: str | None, filename: str | None) -> jinja2.nodes.Template:
        """The parsed template, with every `for` loop's items passed through `_counted_loop`, so a loop whose
        body touches nothing (`{% set r = range(100000) %}{% for a in r %}{% for b in r %}{% endfor %}...`)
        still meets the deadline on every iteration."""
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(jinja2.nodes.For):
            loop.iter = jinja2.nodes.Filter(loop.iter, LOOP_FILTER, [], [], None, None).set_lineno(loop.lineno)
        return tree

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget.check()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget.check()
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's)
        _budget.check()
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _budget.check()
        if operator == "**":
            if isinstance(right, int) and abs(right) > MAX_POWER_EXPONENT:
                raise SecurityError(f"the chat template raises a number to the power {right}: too large")
            return left**right
        sizes = [len(x) for x in (left, right) if isinstance(x, str | list | tuple)]
        counts = [x for x in (left, right) if isinstance(x, int)]
        if sizes and counts and sizes[0] * counts[0] > MAX_RENDER_CHARS:
            raise SecurityError("the chat template repeats a value past the output bound")
        return left * right


def _counted_loop(items: Any) -> Any:
    """A loop's items, each after a check of the render's deadline."""
    for item in items:
        _budget.check()
        yield item


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks): render the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, so templates cannot shadow internals."""

    def __init__(*args: Any, **kwargs: Any):  # same signature trick as jinja2.utils.Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot set underscore attribute {name!r} on a namespace")


def _plain_failure(exc: Exception) -> str:
    """What went wrong in a template's own code, in words a client can act on (Python's message names
    internals: "can only concatenate str (not \"list\") to str")."""
    if isinstance(exc, TypeError):
        return ("a value has a type the template does not handle (a content list where it expects text, or "
                "a number where it expects a string?)")
    if isinstance(exc, (KeyError, IndexError, AttributeError)):
        return "the template looks up a field or an item the messages do not have"
    if isinstance(exc, (ValueError, ArithmeticError)):
        return "the template computes with a value it cannot use"
    return "the template's own code raised an error on these messages"


def _raise_exception(message: str) -> None:
    raise TokenizerError(f"chat template error: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON (as transformers renders it).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> _StrictSandbox:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.filters[LOOP_FILTER] = _counted_loop
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


def _plain(value: Any) -> Any:
    """A deep copy in plain dicts/lists, so the template sees data only, never the caller's objects."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class ChatTemplate:
    """One chat template, compiled once; `render` turns messages into the prompt text."""

    def __init__(
        self, source: str, *, bos_token: str | None = None, eos_token: str | None = None, name: str | None = None
    ):
        if not isinstance(source, str) or not source.strip():
            raise TokenizerError("a chat template must be a non-empty string")
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.name = name
        try:
            self._template = _environment().from_string(source)
        except TemplateError as exc:
            raise TokenizerError(f"malformed chat template: {exc}") from exc
        except RecursionError:  # Jinja's parser recurses once per nested block
            raise TokenizerError("malformed chat template: its blocks nest too deeply") from None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]).

        `tools` are JSON-schema dicts; `extra` reaches the template as variables (e.g. `enable_thinking`,
        `documents`) and may override `bos_token`/`eos_token`.
        """
        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
            raise TokenizerError("messages must be a list of {'role': ..., 'content': ...} dicts")
        for message in messages:
            if not isinstance(message, Mapping) or "role" not in message:
                raise TokenizerError(f"each message must be a dict with a 'role', got {message!r}")
        variables: dict[str, Any] = {"documents": None}
        if self.bos_token is not None:
            variables["bos_token"] = self.bos_token
        if self.eos_token is not None:
            variables["eos_token"] = self.eos_token
        variables.update(_plain(extra))
        variables.update(
            messages=_plain(list(messages)),
            tools=_plain(tools) if tools is not None else None,
            add_generation_prompt=bool(add_generation_prompt),
        )
        _budget.deadline = time.monotonic() + MAX_RENDER_S
        try:
            pieces, size = [], 0
            for piece in self._template.generate(**variables):
                size += len(piece)
                if size > MAX_RENDER_CHARS:
                    raise TokenizerError(f"the chat template's output passed {MAX_RENDER_CHARS} characters: "
                                         "the prompt is refused")
                _budget.check()
                pieces.append(piece)
            return "".join(pieces)
        except TokenizerError:
            raise
        except TemplateError as exc:
            raise TokenizerError(f"chat template failed: {exc}") from exc
        except RecursionError:  # a macro or a recursive loop that calls itself without end
            raise TokenizerError("chat template failed: it recursed too deeply") from None
        except Exception as exc:  # a template can raise anything (TypeError on bad concatenation, ...)
            raise TokenizerError(f"chat template failed: {_plain_failure(exc)}") from exc
        finally:
            _budget.deadline = float("inf")

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], name: str | None = None) -> ChatTemplate | None:
        """The template a GGUF carries (`tokenizer.chat_template`, or `tokenizer.chat_template.<name>`);
        None when it has none."""
        key = "tokenizer.chat_template" if name is None else f"tokenizer.chat_template.{name}"
        source = metadata.get(key)
        if not isinstance(source, str) or not source.strip():
            return None
        tokens = metadata.get("tokenizer.ggml.tokens")

        def token(key: str) -> str | None:
            index = metadata.get(f"tokenizer.ggml.{key}")
            if isinstance(tokens, list) and isinstance(index, int) and 0 <= index < len(tokens):
                return tokens[index]
            return None

        return cls(source, bos_token=token("bos_token_id"), eos_token=token("eos_token_id"), name=name)

    @classmethod
    def from_hf_dir(cls, path: str | Path, name: str | None = None) -> ChatTemplate | None:
        """The template of a Hugging Face directory: chat_template.jinja, tokenizer_config.json's
        `chat_template` (a string, or a list of {name, template}), or chat_template.json; None if none."""
        root = Path(path)
        config = _read_json(root / "tokenizer_config.json")
        bos, eos = token_text(config.get("bos_token")), token_text(config.get("eos_token"))
        candidates: list[Any] = []
        if name is not None:
            named = root / "additional_chat_templates" / f"{name}.jinja"
            if named.is_file():
                candidates.append(named.read_text(encoding="utf-8"))
        jinja_file = root / "chat_template.jinja"
        if name is None and jinja_file.is_file():
            candidates.append(jinja_file.read_text(encoding="utf-8"))
        candidates.append(config.get("chat_template"))
        candidates.append(_read_json(root / "chat_template.json").get("chat_template"))
        for candidate in candidates:
            source = _pick(candidate, name)
            if source is not None:
                return cls(source, bos_token=bos, eos_token=eos, name=name)
        return None

    @classmethod
    def builtin(cls, name: str, bos_token: str | None = None, eos_token: str | None = None) -> ChatTemplate:
        """A chat format runlm knows for files that carry no template (see BUILTIN_TEMPLATES)."""
        source = BUILTIN_TEMPLATES.get(name)
        if source is None:
            raise TokenizerError(f"no built-in chat format {name!r}; known: {', '.join(sorted(BUILTIN_TEMPLATES))}")
        return cls(source, bos_token=bos_token, eos_token=eos_token, name=name)

    def __repr__(self) -> str:
        return f"ChatTemplate(name={self.name!r}, {len(self.source)} chars)"


def _pick(candidate: Any, name: str | None) -> str | None:
    """A template source from a config value: a string, or the named/default entry of a list."""
    if isinstance(candidate, str) and candidate.strip():
        return candidate if name is None else None
    if isinstance(candidate, list):
        wanted = name or "default"
        for entry in candidate:
            if isinstance(entry, Mapping) and entry.get("name") == wanted and isinstance(entry.get("template"), str):
                return entry["template"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path}: cannot read ({exc})") from exc
    return data if isinstance(data, dict) else {}


# Gemma's turn format (Gemma 1-3 model cards): turns are `<start_of_turn>{user|model}\n{text}<end_of_turn>\n`,
# the whole prompt starts with BOS, there is no system role (its text opens the first user turn,
# followed by a blank line), and the prompt for a reply ends with an open model turn.
_GEMMA = r"""
{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part is mapping and part.get('type') == 'text' -%}{{- part.get('text', '') -}}
            {%- elif part is mapping and part.get('type') == 'image' -%}{{- '<start_of_image>' -}}
            {%- endif -%}
        {%- endfor -%}
    {%- elif content is not none -%}
        {{- raise_exception('message content must be a string or a list of parts') -}}
    {%- endif -%}
{%- endmacro -%}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set system = text_of(messages[0]['content']) -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set system = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{{- bos_token -}}
{%- if system and (not turns or turns[0]['role'] != 'user') -%}
    {{- '<start_of_turn>user\n' + system + '<end_of_turn>\n' -}}
{%- endif -%}
{%- for message in turns -%}
    {%- if message['role'] == 'user' -%}
        {%- set role = 'user' -%}
    {%- elif message['role'] in ['assistant', 'model'] -%}
        {%- set role = 'model' -%}
    {%- else -%}
        {{- raise_exception('the gemma chat format has no role ' ~ message['role'] ~ ' (system only first)') -}}
    {%- endif -%}
    {{- '<start_of_turn>' + role + '\n' -}}
    {%- if loop.first and system and role == 'user' -%}{{- system + '\n\n' -}}{%- endif -%}
    {{- text_of(message['content']) | trim -}}
    {{- '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<start_of_turn>model\n' -}}
{%- endif -%}
"""

# Gemma 4's turn format (its model card), without tools: `<|turn>{system|user|model}\n{text}<turn|>\n` after BOS; a
# reply's prompt opens a model turn with an empty thought channel (thinking off, as its template writes it).
_GEMMA4 = r"""
{{- bos_token -}}
{%- for message in messages -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {%- if role not in ['system', 'user', 'model'] -%}
        {{- raise_exception('the gemma4 chat format has no role ' ~ message['role']) -}}
    {%- endif -%}
    {%- set content = message['content'] -%}
    {%- if content is not string -%}
        {%- set content = content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}
    {%- endif -%}
    {{- '<|turn>' + role + '\n' + content | trim + '<turn|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|turn>model\n<|channel>thought\n<channel|>' -}}
{%- endif -%}
"""

BUILTIN_TEMPLATES: dict[str, str] = {"gemma": _GEMMA, "gemma4": _GEMMA4}
