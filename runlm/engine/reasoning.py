"""The thinking phase of a reply kept apart from its answer: `<think>...</think>` (Qwen3, SmolLM3, the DeepSeek-R1
distills), including templates that open the tag in the prompt so the reply starts inside it, Gemma 4's
`<|channel>thought ... <channel|>`, and gpt-oss's harmony channels (engine.harmony).

ThinkSplitter streams a reply as (reasoning, content) pieces; a whole reply split in one push gives what the pieces
of any split add up to. Whitespace around the thinking is dropped, as llama-server drops it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runlm.engine.harmony import CHANNEL, HARMONY_CLOSE, HarmonySplitter
from runlm.engine.stops import partial_suffix
from runlm.errors import InvalidInputError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
GEMMA4_THINK_OPEN, GEMMA4_THINK_CLOSE = "<|channel>thought", "<channel|>"
# each tag parser's (opening, closing) tags
THINK_TAGS = {"think": (THINK_OPEN, THINK_CLOSE), "gemma4": (GEMMA4_THINK_OPEN, GEMMA4_THINK_CLOSE)}
# --reasoning-format and a request's reasoning_format: "auto" reads harmony where the chat template writes its
# channels, Gemma 4's thought channel where it writes that, and splits at <think> where it writes that; "deepseek" is
# llama-server's name for the <think> parser.
REASONING_FORMATS = ("auto", "none", "think", "deepseek", "gemma4", "harmony")


def check_reasoning_format(fmt: str) -> str:
    if fmt not in REASONING_FORMATS:
        raise InvalidInputError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, got {fmt!r}")
    return fmt


def check_reasoning_budget(tokens: int) -> int:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < -1:
        raise InvalidInputError(f"the reasoning budget must be -1 (no bound), 0 (no thinking) or more, got {tokens!r}")
    return tokens


class ThinkSplitter:
    """`push` a reply's text as it comes, get back (reasoning, content) to send now; `finish` gives the rest.

    Off (`active` False) everything is content. A reply that opens with the opening tag (`<think>`, after
    whitespace), or whose prompt already opened it (`opened`), is reasoning up to the closing tag; a thinking phase
    never closed (the reply ran out of tokens) is reasoning to the end. `tags`: (opening, closing).
    """

    def __init__(self, active: bool, opened: bool = False, tags: tuple[str, str] = (THINK_OPEN, THINK_CLOSE)):
        self.open_tag, self.close_tag = tags
        self.state = ("thinking" if opened else "start") if active else "content"
        self.text = ""  # the reply so far
        self.at = 0  # text before this is decided (sent, or a tag / whitespace dropped)
        self.begun = False  # some thinking text was sent

    @property
    def thinking(self) -> bool:
        """Inside the thinking now (what a thinking budget counts)."""
        return self.state == "thinking"

    @property
    def waiting(self) -> bool:
        """Whether the answer, which a grammar holds, is still to come: the thinking is not over."""
        return self.state == "thinking"

    def push(self, delta: str) -> tuple[str, str]:
        self.text += delta
        reasoning = content = ""
        while True:
            rest = self.text[self.at :]
            if self.state == "content":
                self.at = len(self.text)
                return reasoning, content + rest
            if self.state == "start":
                body = rest.lstrip()
                if body.startswith(self.open_tag):
                    self.at += len(rest) - len(body) + len(self.open_tag)
                    self.state = "thinking"
                    continue
                if self.open_tag.startswith(body):  # whitespace, or part of the tag: wait
                    return reasoning, content
                self.state = "content"
                continue
            if self.state == "thinking":
                if not self.begun:  # the thinking starts at its first non-whitespace character
                    self.at += len(rest) - len(rest.lstrip())
                    rest = rest.lstrip()
                close = rest.find(self.close_tag)
                if close != -1:
                    reasoning += rest[:close].rstrip()
                    self.at += close + len(self.close_tag)
                    self.state = "after"
                    continue
                ready = rest[: len(rest) - partial_suffix(rest, (self.close_tag,))]
                ready = ready[: len(ready.rstrip())]  # trailing whitespace waits: it may end the thinking
                self.at += len(ready)
                self.begun = self.begun or bool(ready)
                return reasoning + ready, content
            # "after": the answer starts at its first non-whitespace character
            body = rest.lstrip()
            self.at += len(rest) - len(body)
            if not body:
                return reasoning, content
            self.state = "content"

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) not yet sent."""
        rest = self.text[self.at :]
        self.at = len(self.text)
        if self.state == "thinking":
            return (rest if self.begun else rest.lstrip()).rstrip(), ""
        if self.state == "after":
            return "", ""
        return "", rest


@dataclass(frozen=True)
class ThinkingPlan:
    """How one request's replies split: `parser` "think" (`<think>` tags), "gemma4" (its thought channel) or
    "harmony", None where they are not split; `opened` where the prompt ends inside the thinking phase; `written`, a
    harmony reply's start the prompt wrote (a forced call's header)."""

    parser: str | None = None
    opened: bool = False
    written: str = ""

    @property
    def active(self) -> bool:
        return self.parser is not None

    @classmethod
    def for_prompt(cls, fmt: str, template_source: str, prompt: str) -> ThinkingPlan:
        """`fmt` from --reasoning-format or the request: "auto" reads harmony where the chat template writes its
        channels, Gemma 4's thought channel or <think> where it writes that. A prompt that ends with the closing tag
        (the template's way of turning thinking off) has no thinking to split."""
        if fmt == "harmony" or (fmt == "auto" and CHANNEL in template_source):
            return cls("harmony")
        parser = None
        if fmt == "gemma4" or (fmt == "auto" and GEMMA4_THINK_OPEN in template_source):
            parser = "gemma4"
        elif fmt in ("think", "deepseek") or (fmt == "auto" and THINK_OPEN in template_source):
            parser = "think"
        if parser is None:
            return cls()
        opening, closing = THINK_TAGS[parser]
        if prompt.rstrip().endswith(closing):  # the template wrote an empty thinking phase: thinking is off
            return cls()
        return cls(parser, prompt.rstrip().endswith(opening))

    @property
    def open_text(self) -> str:
        """What opens a thinking phase, as the model writes it (a tag parser's)."""
        return f"{GEMMA4_THINK_OPEN}\n" if self.parser == "gemma4" else f"{THINK_OPEN}\n"

    @property
    def close_text(self) -> str:
        """What ends a thinking phase whose budget is spent, and starts the answer."""
        if self.parser == "harmony":
            return HARMONY_CLOSE
        return GEMMA4_THINK_CLOSE if self.parser == "gemma4" else f"\n{THINK_CLOSE}\n\n"

    def splitter(self, tools: set[str] | None = None) -> ThinkSplitter | HarmonySplitter:
        """A reply's splitter; `tools`, the functions a harmony call may go to (other formats' calls are read from
        the answer by engine.tools)."""
        if self.parser == "harmony":
            return HarmonySplitter(tools, self.written)
        return ThinkSplitter(self.active, self.opened, THINK_TAGS.get(self.parser or "think", THINK_TAGS["think"]))


def thinking_switch(effort: Any) -> bool | None:
    """A reasoning effort (OpenAI's `reasoning_effort`, Ollama's `think` level) as the templates' enable_thinking:
    None where the request leaves it to the template."""
    if effort is None:
        return None
    if isinstance(effort, bool):
        return effort
    return effort not in ("none", "minimal")


@dataclass(frozen=True)
class ThinkingBudget:
    """A reply's thinking as the engine watches it. At most `tokens` tokens of it: then the model is made to write
    `close_ids` (the plan's `close_text` in its own tokens) and goes on to its answer. A grammar holds only what
    follows the thinking. `plan`: how the reply splits."""

    tokens: int | None  # None: no bound (the thinking is watched for a grammar that holds the answer after it)
    close_ids: tuple[int, ...]
    plan: ThinkingPlan = ThinkingPlan("think")


class ThinkingWatch:
    """One generation's thinking, followed token by token: where the reply is (inside the thinking, between it and
    the answer), how many tokens the thinking spent and, once they reach the budget, the closing tokens to write in
    place of sampled ones."""

    def __init__(self, budget: ThinkingBudget):
        self.budget = budget
        self.splitter = budget.plan.splitter()
        self.spent = 0
        self.forced: list[int] = []
        self.closed = False

    def forced_token(self) -> int | None:
        """The token to write next whatever the logits say, or None to sample."""
        if (self.budget.tokens is not None and not self.closed and self.thinking
                and self.spent >= self.budget.tokens):
            self.forced, self.closed = list(self.budget.close_ids), True
        return self.forced.pop(0) if self.forced else None

    @property
    def thinking(self) -> bool:
        """Whether the reply is inside its thinking now."""
        return self.splitter.thinking

    @property
    def waiting(self) -> bool:
        """Whether the answer a grammar holds is still to come."""
        return self.splitter.waiting

    @property
    def between(self) -> bool:
        """Whether the thinking has ended and the answer has not begun (only whitespace since)."""
        return self.splitter.state == "after"

    def advance(self, text: str) -> None:
        """After each token: the text it added."""
        if self.splitter.thinking:
            self.spent += 1
        self.splitter.push(text)
