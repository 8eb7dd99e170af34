"""gpt-oss's harmony format read back into thinking, answer and tool calls.

A harmony reply is a run of messages, each a header then a body: `<|channel|>analysis<|message|>...<|end|>`, then
`<|start|>assistant<|channel|>final<|message|>...` (the prompt ends at `<|start|>assistant`, so the first header
starts the reply). The analysis channel is the thinking, the final channel the answer, and a commentary message
addressed `to=functions.NAME` is a call whose body is its JSON arguments (`<|call|>` ends it and the turn). A
commentary message with no recipient is a preamble the user may see: it is answer text.

HarmonySplitter streams a reply as (reasoning, content) pieces, as ThinkSplitter does, and gathers its calls in
`calls`, which stand where engine.tools' stream filter stands for the other formats: the name once the header is
read, then the arguments' JSON text piece by piece. Every scan is a string search, linear in the reply.
"""

from __future__ import annotations

import json
import uuid

from runlm.engine.stops import partial_suffix
from runlm.engine.tools import CallDelta, JsonObjectEnd, ToolCall

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
RETURN, CALL = "<|return|>", "<|call|>"
# what ends a message's body (the model's end tokens stop generation, but a reply spelled in text has them too)
BODY_ENDS = (END, RETURN, CALL, START)
FUNCTIONS = "functions."
# how a harmony reply begins: a header's marker, or a recipient before the channel
HEADER_OPENINGS = ("<|", "to=")
# a header is a few words: past this many characters without <|message|> the reply is not harmony
HEADER_LIMIT = 512
# written for a reply whose thinking budget is spent: the analysis ends and the final answer begins
HARMONY_CLOSE = f"{END}{START}assistant{CHANNEL}final{MESSAGE}"
# written in the prompt for a forced call: the commentary header up to the function's name
FORCED_CALL_HEAD = f"{CHANNEL}commentary to={FUNCTIONS}"


def harmony_effort(effort: str) -> str:
    """A reasoning effort as gpt-oss's template takes it: low, medium or high (it has no off switch)."""
    return "low" if effort in ("none", "minimal") else effort


def _header_word(header: str, key: str) -> str:
    """The word after `key` in a header (up to whitespace or the next marker), or ""."""
    at = header.find(key)
    if at == -1:
        return ""
    word = header[at + len(key) :].lstrip()
    for i, ch in enumerate(word):
        if ch.isspace() or word.startswith("<|", i):
            return word[:i]
    return word


class HarmonyCalls:
    """The calls a HarmonySplitter found, with the interface of engine.tools' ToolCallStreamFilter: content passes
    through untouched (the splitter already took the calls out of it)."""

    def __init__(self) -> None:
        self.streamed: list[tuple[str, str]] = []  # (id, name) of each call whose pieces went out, in order
        self.arguments: list[str] = []  # each streamed call's JSON text as written
        self._deltas: list[CallDelta] = []

    def push(self, content: str) -> str:
        return content

    def open(self, name: str) -> None:
        self.streamed.append(("call_" + uuid.uuid4().hex[:24], name))
        self.arguments.append("")
        self._deltas.append(CallDelta(len(self.streamed) - 1, "", self.streamed[-1][0], name))

    def add(self, piece: str) -> None:
        self.arguments[-1] += piece
        self._deltas.append(CallDelta(len(self.streamed) - 1, piece))

    def take_deltas(self) -> list[CallDelta]:
        deltas, self._deltas = self._deltas, []
        return deltas

    def finish(self) -> tuple[str, list[ToolCall]]:
        """("", the calls whose arguments are a JSON object, in order)."""
        calls = []
        for (call_id, name), text in zip(self.streamed, self.arguments):
            try:
                valid = isinstance(json.loads(text), dict)
            except (json.JSONDecodeError, RecursionError):
                valid = False
            if valid:
                calls.append(ToolCall(name=name, arguments=text, id=call_id))
        return "", calls


class HarmonySplitter:
    """`push` a harmony reply's text as it comes, get back (reasoning, content) to send now; `finish` gives the rest.

    `tools`: the names of the functions a call may go to (None: no tools were offered, and a call's body is
    answer text). `written`: the part of the reply the prompt already wrote (a forced call's header).
    """

    def __init__(self, tools: set[str] | None = None, written: str = ""):
        self.tools = tools
        self.calls = HarmonyCalls()
        self.text = written
        self.at = 0  # text before this is decided
        self.state = "header" if written else "start"
        self.kind = ""  # the open body's: "reasoning", "content", "call" or "ignore" (a call's text past its JSON)
        self.channel = ""
        self.name = ""  # the open call's function
        self.fresh = False  # the open body has sent nothing yet
        self.sent = {"reasoning": False, "content": False}  # each kind sent something (later messages join on "\n")
        self._json: JsonObjectEnd | None = None

    @property
    def thinking(self) -> bool:
        """Inside an analysis message's body (what a thinking budget counts)."""
        return self.state == "body" and self.kind == "reasoning"

    @property
    def waiting(self) -> bool:
        """Whether the final message's body, which a grammar holds, is still to come."""
        return not (self.state in ("body", "plain") and self.channel == "final")

    def push(self, delta: str) -> tuple[str, str]:
        self.text += delta
        out = {"reasoning": "", "content": ""}
        while True:
            rest = self.text[self.at :]
            if self.state == "plain":  # not a harmony reply: all of it is the answer
                self.at = len(self.text)
                out["content"] += rest
                return out["reasoning"], out["content"]
            if self.state == "start":
                body = rest.lstrip()
                if any(opening.startswith(body) for opening in HEADER_OPENINGS):  # whitespace, or part of one: wait
                    return out["reasoning"], out["content"]
                harmony = body.startswith(HEADER_OPENINGS)
                self.state, self.channel = ("header", "") if harmony else ("plain", "final")
                continue
            if self.state == "header":
                end = rest.find(MESSAGE)
                if end == -1:
                    if len(rest) > HEADER_LIMIT:  # never closed: the text is the answer
                        self.state, self.channel = "plain", "final"
                        continue
                    return out["reasoning"], out["content"]
                self._open(rest[:end])
                self.at += end + len(MESSAGE)
                self.state = "body"
                continue
            # "body"
            ends = [i for i in (rest.find(marker) for marker in BODY_ENDS) if i != -1]
            stop = min(ends, default=-1)
            ready = rest[:stop] if stop != -1 else rest[: len(rest) - partial_suffix(rest, BODY_ENDS)]
            self._emit(ready, out)
            self.at += len(ready)
            if stop == -1:
                return out["reasoning"], out["content"]
            marker = next(m for m in BODY_ENDS if rest.startswith(m, stop))
            self.at += len(marker) if marker != START else 0  # a start stays: the next header begins with it
            self.state, self.kind, self.channel = "header", "", ""

    def _open(self, header: str) -> None:
        """Read a message's header: where its body goes."""
        self.channel = _header_word(header, CHANNEL)
        recipient = _header_word(header, "to=")
        name = recipient.removeprefix(FUNCTIONS) if recipient.startswith(FUNCTIONS) else ""
        if name and self.tools is not None and name in self.tools:
            self.kind, self.name, self._json = "call", name, None
        else:  # a call to no function offered is text, as the other formats leave it
            self.kind = "reasoning" if self.channel == "analysis" and not recipient else "content"
        self.fresh = True

    def _emit(self, text: str, out: dict[str, str]) -> None:
        """A piece of the open body, to where the body goes."""
        if not text or self.kind == "ignore":
            return
        if self.kind == "call":
            if self._json is None:  # the call opens at its object's first brace; a body that is no object is text
                body = text.lstrip()
                if not body:
                    return
                if not body.startswith("{"):
                    self.kind = "content"
                    self._emit(text, out)
                    return
                self.calls.open(self.name)
                self._json, text = JsonObjectEnd(), body
            taken = self._json.feed(text)
            self.calls.add(text[:taken])
            if self._json.depth == 0:
                self.kind = "ignore"
            return
        if self.fresh and self.sent[self.kind]:  # a second message of the same kind starts on a new line
            text = "\n" + text
        out[self.kind] += text
        self.fresh, self.sent[self.kind] = False, True

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) not yet sent: an unfinished body's held tail; an unfinished header is dropped."""
        rest = self.text[self.at :]
        self.at = len(self.text)
        out = {"reasoning": "", "content": ""}
        if self.state == "plain" or (self.state == "start" and rest.strip()):
            out["content"] = rest
        elif self.state == "body":
            self._emit(rest, out)
        return out["reasoning"], out["content"]
