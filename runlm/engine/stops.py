"""Stop strings that may span tokens, without ever showing the client part of one."""

from __future__ import annotations

from collections.abc import Sequence


def partial_suffix(text: str, strings: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `strings` (what a stream holds back
    while the next piece may complete it)."""
    best = 0
    for string in strings:
        for n in range(min(len(string) - 1, len(text)), best, -1):
            if text.endswith(string[:n]):
                best = n
                break
    return best


class StopStringFilter:
    """Feeds decoded text through, holding back any tail that could still grow into a stop string.

    Text is released only once it can no longer be the start of a stop string, so a client never sees
    "<|" of a "<|end|>" that the model then completes.
    """

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self.pending = ""
        self.matched: str | None = None

    def _holdback(self, text: str) -> int:
        return partial_suffix(text, self.stops)

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; returns (text safe to emit now, whether a stop string was hit)."""
        if self.matched is not None:
            return "", True
        if not self.stops:
            return text, False
        self.pending += text
        first = -1
        for stop in self.stops:
            i = self.pending.find(stop)
            if i != -1 and (first == -1 or i < first):
                first, self.matched = i, stop
        if first != -1:
            out, self.pending = self.pending[:first], ""
            return out, True
        keep = self._holdback(self.pending)
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        """Generation ended without a match: what was held back is ordinary text after all."""
        out, self.pending = ("" if self.matched is not None else self.pending), ""
        return out
