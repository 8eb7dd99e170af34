"""Speculative decoding by prompt lookup: draft the tokens that followed the last n-gram where it occurred before.

A generation's context (prompt and reply) often repeats itself: code being rewritten, a quoted document, a list
that follows a pattern. `PromptLookup` indexes every n-gram of the context as it grows and, at each decode step,
drafts the tokens that followed the latest earlier occurrence of the context's last n tokens (the longest n that
has one). The engine runs the draft with the step's token in one forward and keeps the drafted tokens the model
itself samples, in order: each position's token is drawn from that position's logits as a plain decode step would
draw it, and the draft goes on only while the drawn token is the drafted one. The logits of a row do not depend
on the rows run beside it, so the reply is token for token the reply without speculation, greedy or sampled (the
sampler draws once per token, in the same order); only the number of forwards changes.

Drafting pays where the context repeats and costs rows that are thrown away where it does not: a lookup that
finds nothing drafts nothing (no cost but the lookup), and a generation whose drafts keep failing drafts less
often (`DraftPacer`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from runlm.errors import InvalidInputError

if TYPE_CHECKING:
    from runlm.runner import LmRunner, Session

SPECULATIVE_MODES = ("off", "ngram", "draft")
DEFAULT_DRAFT_MAX = 3  # a row costs a fifth to a quarter of a one-row step on 2 cores: short drafts pay best
NGRAM_MAX = 4  # the longest n-gram looked up
NGRAM_MIN = 2  # the shortest: a lone token repeats too often to predict what follows it


@dataclass(frozen=True)
class Speculation:
    """How generations draft: `mode` "ngram" (prompt lookup), "draft" (the greedy tokens of `draft`, a small model
    with the same vocabulary) or "off", at most `draft_max` tokens a step."""

    mode: str = "ngram"
    draft_max: int = DEFAULT_DRAFT_MAX
    draft: LmRunner | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in SPECULATIVE_MODES:
            raise InvalidInputError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {self.mode!r}")
        if self.mode == "draft" and self.draft is None:
            raise InvalidInputError("speculative 'draft' needs a draft model (--draft-model)")
        if isinstance(self.draft_max, bool) or not isinstance(self.draft_max, int) or not 0 <= self.draft_max <= 64:
            raise InvalidInputError(f"draft_max must be an integer in 0..64, got {self.draft_max!r}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off" and self.draft_max > 0


class PromptLookup:
    """An index of a growing token sequence's n-grams (n in NGRAM_MIN..NGRAM_MAX): for each, the position just
    after its latest occurrence. Appending a token costs a few dict updates; a lookup, a few dict reads."""

    def __init__(self, tokens: list[int] | None = None):
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}
        for token in tokens or []:
            self.append(token)

    def append(self, token: int) -> None:
        """Add `token`; the n-grams ending just before it now point at it. (An n-gram ending at the last token is
        indexed only once a token follows it: the lookup must find an earlier occurrence, not the context's end.)"""
        tokens = self.tokens
        end = len(tokens)
        for n in range(NGRAM_MIN, NGRAM_MAX + 1):
            if end >= n:
                self._after[tuple(tokens[end - n : end])] = end
        tokens.append(int(token))

    def draft(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest suffix found."""
        tokens = self.tokens
        if limit <= 0:
            return []
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            if len(tokens) <= n:
                continue
            start = self._after.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + limit]
        return []


class ModelDrafter:
    """A generation's drafts from a small model: greedy tokens from its own session on the draft runner, which holds
    the generation's context (caught up at each draft) followed by the last draft's tokens (cut off at the next)."""

    def __init__(self, runner: LmRunner):
        self.runner = runner
        self.session: Session | None = None
        self.synced = 0  # the session's first `synced` tokens are the context's (it only grows)

    def draft(self, context: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens the draft model would write after `context` (fewer where its session could not
        take them back)."""
        runner = self.runner
        if self.session is None:
            self.session = runner.new_session()
        held = self.session.tokens
        common = min(self.synced, len(held))
        while common < min(len(held), len(context)) and held[common] == context[common]:
            common += 1
        common = min(common, len(context) - 1)  # the last context token runs: its logits give the first draft
        if common < len(held):
            runner.truncate(self.session, common)  # the last draft's tokens, which were checked rewindable
        logits = runner.extend(self.session, context[common:])
        self.synced = len(context)
        drafted: list[int] = []
        while True:
            drafted.append(int(np.argmax(logits)))
            if len(drafted) >= limit or not runner.can_rewind(self.session, 1):
                return drafted
            logits = runner.decode(self.session, drafted[-1])


class DraftPacer:
    """How many tokens a generation drafts next: drafts that the model keeps whole double the length (up to the
    limit), a draft cut short is followed by one as long as what was kept plus one, and a draft refused at its
    first token makes the generation skip drafting for a while (1, 2, 4, ... 16 steps). Where the context repeats,
    drafts grow long fast; where it does not, a failed draft costs one or two rows now and then."""

    MAX_SKIP = 16

    def __init__(self, start: int = 2) -> None:
        self.length = start
        self._skip = 0
        self._wait = 0

    def next_length(self, limit: int) -> int:
        """The length of this step's draft (0: skip drafting this step)."""
        if self._wait > 0:
            self._wait -= 1
            return 0
        return min(self.length, limit)

    def stop(self) -> None:
        """No more drafts for this generation."""
        self._wait = 1 << 62

    def record(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if accepted == drafted:
            self.length, self._skip = 2 * drafted, 0
        elif accepted:
            self.length, self._skip = accepted + 1, 0
        else:
            self.length = 1
            self._skip = min(self.MAX_SKIP, max(1, 2 * self._skip))
            self._wait = self._skip


__all__ = ["DEFAULT_DRAFT_MAX", "SPECULATIVE_MODES", "DraftPacer", "ModelDrafter", "PromptLookup", "Speculation"]
