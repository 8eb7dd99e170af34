"""The runner contract every model family implements (see shared/seed/LmRunner.txt)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runlm.errors import InvalidInputError, UnsupportedOperationError

OnToken = Callable[[int], bool]


@dataclass
class SessionSnapshot:
    """The filled part of a runner's KV cache plus the token ids that produced it.

    `cache` is family-private (each runner knows how to restore its own); the
    prompt cache and the batcher only read `token_ids` and `nbytes`.
    """

    token_ids: list[int]
    cache: Any
    nbytes: int = 0
    family: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class LmRunner(ABC):
    """One model family behind one small contract.

    A runner may be handed to another thread (the server runs inference on a
    worker pool) but is never used from two threads at once.
    """

    # -- required -----------------------------------------------------------
    @abstractmethod
    def family(self) -> str:
        """Short family identifier: "llama32", "qwen3" or "gemma"."""

    @abstractmethod
    def vocab_size(self) -> int:
        """Size of the LM head's vocabulary."""

    @abstractmethod
    def predict_logits(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        """Run prefill on `prompt_ids` and return the last position's logits [vocab]."""

    # -- provided -----------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], n_new: int, on_token: OnToken | None = None) -> list[int]:
        """Greedy generation of up to `n_new` tokens; `on_token` returns False to stop.

        This default re-runs the whole context each step; families override it
        with their cached decode path.
        """
        self.check_prompt(prompt_ids)
        check_n_new(n_new)
        context = list(prompt_ids)
        produced: list[int] = []
        for _ in range(n_new):
            token = int(torch.argmax(self.predict_logits(context)))
            produced.append(token)
            context.append(token)
            if on_token is not None and not on_token(token):
                break
        return produced

    def prefill_logits(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        """Prefill, seed the decode cache, return the last position's logits [vocab]."""
        raise UnsupportedOperationError(f"{self.family()} runner has no host-driven decode (prefill_logits)")

    def decode_logits(self, token: int) -> torch.Tensor:
        """Feed one token, advance the cache, return the next position's logits [vocab]."""
        raise UnsupportedOperationError(f"{self.family()} runner has no host-driven decode (decode_logits)")

    def prefill_logits_reusing(self, prompt: Sequence[int], snap: SessionSnapshot, reuse_len: int) -> torch.Tensor:
        """Prefill `prompt` whose first `reuse_len` tokens `snap` already covers.

        The default ignores the snapshot and prefills everything, so callers get
        correct logits from every runner.
        """
        return self.prefill_logits(prompt)

    def export_session(self) -> SessionSnapshot | None:
        """Snapshot the decode session for prompt-cache reuse; None if unsupported."""
        return None

    def restore_session(self, snap: SessionSnapshot) -> bool:
        """Restore an exported session; True if it was applied."""
        return False

    def supports_multimodal(self) -> bool:
        return False

    def generate_multimodal(
        self,
        prompt: str,
        rgb: bytes,
        img_w: int,
        img_h: int,
        tokenizer: Path | None,
        n_new: int,
        on_token: OnToken | None = None,
        on_phase: Callable[[str], None] | None = None,
    ) -> list[int]:
        """Generate from a prompt whose image markers are spliced with vision embeddings.

        `rgb` is img_w * img_h * 3 bytes, row-major; `on_phase` hears "vision" before the image
        is encoded and "prefill" before the language model's prefill.
        """
        raise UnsupportedOperationError(f"{self.family()} runner has no vision tower: this model cannot take images")

    # -- shared input checks --------------------------------------------------
    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Reject prompts that no model could run."""
        if len(prompt_ids) == 0:
            raise InvalidInputError("prompt is empty: at least one token id is needed")
        vocab = self.vocab_size()
        for token in prompt_ids:
            check_token(token, vocab)


def check_token(token: int, vocab: int) -> None:
    if isinstance(token, bool) or not hasattr(token, "__index__"):
        raise InvalidInputError(f"token id {token!r} is not an integer")
    if not 0 <= int(token) < vocab:
        raise InvalidInputError(f"token id {int(token)} is outside the vocabulary [0, {vocab})")


def check_n_new(n_new: int) -> None:
    if not isinstance(n_new, int) or n_new < 0:
        raise InvalidInputError(f"n_new must be a non-negative integer, got {n_new!r}")
