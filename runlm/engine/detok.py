"""Incremental detokenization for tokenizers that bring no streaming detokenizer of their own."""

from __future__ import annotations

from typing import Any


class DiffDetokenizer:
    """Decodes a sliding window and emits only the new, complete text (vLLM's incremental scheme).

    Decoding a window rather than single tokens keeps word-boundary spacing right; text ending in
    U+FFFD is held until the rest of the character arrives.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):] if full.startswith(prefix) else ""


def make_detokenizer(tokenizer: Any):
    """The text package's StreamingDetokenizer where it handles this tokenizer, else DiffDetokenizer."""
    try:
        from runlm.text import StreamingDetokenizer
    except ImportError:
        return DiffDetokenizer(tokenizer)
    try:
        return StreamingDetokenizer(tokenizer)
    except (TypeError, AttributeError):
        return DiffDetokenizer(tokenizer)
