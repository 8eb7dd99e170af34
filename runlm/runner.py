"""The runner contract every model family implements (see shared/seed/LmRunner.txt).

The seed's calls (`prefill_logits`, `decode_logits`, `export_session`, ...) act on the runner's own
session, as the seed describes. Everything above the runner (engine, scheduler, server, bench) uses
the explicit form instead: a `Session` object is made by `new_session()` and passed to every call, so
a batcher can hold many at once and no call depends on which session was used last. Only three
methods are required; every other one has a default that stays correct for a minimal runner
(it re-runs `predict_logits` on the whole context, one sequence at a time).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from runlm.errors import ContextOverflowError, InvalidInputError, RunlmError, UnsupportedOperationError

if TYPE_CHECKING:
    from runlm.families.config import ModelConfig
    from runlm.text import ChatTemplate, Tokenizer

OnToken = Callable[[int], bool]
DEFAULT_MAX_CONTEXT = 4096


@dataclass
class Session:
    """One sequence's decode state: the token ids it holds and the runner-private state behind them."""

    tokens: list[int] = field(default_factory=list)
    state: Any = None


class PartialBatchError(RunlmError):
    """extend_batch failed part-way: the first len(rows) sessions advanced (these are their logits), the
    next one raised `cause`, and the rest were not touched."""

    def __init__(self, rows: list[np.ndarray], cause: BaseException):
        super().__init__(f"extend_batch failed at session {len(rows)}: {cause}")
        self.rows, self.cause = rows, cause


def as_numpy(rows: Any) -> np.ndarray:
    """Logits or hidden states as the contract returns them, float32 numpy: an array as it is, a torch tensor (what
    the PyTorch backend computes) without a copy where it is float32 on the CPU already (duck-typed: torch is not
    imported here)."""
    if hasattr(rows, "detach"):
        rows = rows.detach().cpu()
        rows = rows.numpy() if str(rows.dtype) == "torch.float32" else rows.float().numpy()
    return np.asarray(rows, dtype=np.float32)


@dataclass
class SessionSnapshot:
    """The filled part of a session's KV cache plus the token ids that produced it.

    `cache` is runner-private (each runner knows how to restore its own); the prompt cache and the
    batcher only read `token_ids` and `nbytes`.
    """

    token_ids: list[int]
    cache: Any
    nbytes: int = 0
    family: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


MAX_IMAGE_SIDE = 16384


@dataclass(frozen=True)
class ImageInput:
    """One image as raw RGB bytes, row-major, width * height * 3 long (checked on construction)."""

    rgb: bytes
    width: int
    height: int

    def __post_init__(self) -> None:
        for name, value in (("width", self.width), ("height", self.height)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidInputError(f"image {name} must be an integer, got {value!r}")
            if not 0 < value <= MAX_IMAGE_SIDE:
                raise InvalidInputError(f"image {name} must be in 1..{MAX_IMAGE_SIDE}, got {value}")
        rgb = self.rgb
        if hasattr(rgb, "dtype") and str(rgb.dtype) != "uint8":  # a numpy array
            raise InvalidInputError(f"rgb must hold bytes (uint8), got {rgb.dtype}")
        if hasattr(rgb, "tobytes"):
            rgb = rgb.tobytes()
        if not isinstance(rgb, bytes | bytearray | memoryview):
            raise InvalidInputError(f"rgb must be bytes, got {type(rgb).__name__}")
        rgb = bytes(rgb)
        expected = self.width * self.height * 3
        if len(rgb) != expected:
            raise InvalidInputError(
                f"rgb has {len(rgb)} bytes; a {self.width}x{self.height} RGB image needs {expected} "
                "(row-major, 3 bytes a pixel)"
            )
        object.__setattr__(self, "rgb", rgb)


class LmRunner(ABC):
    """One model family behind one small contract.

    A runner may be handed to another thread (the server runs inference on a worker) but is never
    used from two threads at once. Logits and hidden states are float32 numpy arrays on every runtime.
    """

    # -- required -----------------------------------------------------------------------
    @abstractmethod
    def family(self) -> str:
        """Short family identifier: "llama32", "qwen3" or "gemma"."""

    @abstractmethod
    def vocab_size(self) -> int:
        """Size of the LM head's vocabulary."""

    @abstractmethod
    def predict_logits(self, prompt_ids: Sequence[int]) -> np.ndarray:
        """Run prefill on `prompt_ids` and return the last position's logits [vocab]."""

    # -- sessions: what the engine runs on -----------------------------------------------
    def max_context(self) -> int:
        """The most tokens a session may hold."""
        return DEFAULT_MAX_CONTEXT

    def new_session(self, positions: int | None = None) -> Session:
        """An empty session; the runner-private state is made on first use. `positions`, when given, is the most
        the session will hold (prompt + max_tokens): a runner may size its state for it once."""
        return Session()

    def kv_bytes(self, positions: int) -> int | None:
        """Bytes of state a session of `positions` positions holds at most (its KV caches), or None when this
        runner does not know (then no server-wide KV budget applies to it)."""
        return None

    def reset_session(self, session: Session) -> None:
        """Forget what `session` holds: its next extend starts at position 0."""
        session.tokens = []
        session.state = None

    def extend(self, session: Session, ids: Sequence[int], all_positions: bool = False) -> np.ndarray:
        """Append `ids` to `session`; the last position's logits [vocab], or every new one's [T, vocab].

        The default re-runs the whole context for each position it reports.
        """
        if len(ids) == 0:
            raise InvalidInputError("nothing to extend: no token ids")
        self.check_tokens(ids)
        self.check_fits(len(session.tokens) + len(ids))
        context = list(session.tokens)
        rows = []
        for i, token in enumerate(ids):
            context.append(int(token))
            if all_positions or i == len(ids) - 1:
                rows.append(as_numpy(self.predict_logits(context)))
        session.tokens = context
        return np.stack(rows) if all_positions else rows[-1]

    def prefill(self, session: Session, prompt_ids: Sequence[int]) -> np.ndarray:
        """Make `session` hold exactly `prompt_ids`; the last position's logits [vocab]."""
        self.check_prompt(prompt_ids)
        self.reset_session(session)
        return self.extend(session, prompt_ids)

    def decode(self, session: Session, token: int) -> np.ndarray:
        """Feed one token to a prefilled session; the next position's logits [vocab]."""
        if not session.tokens:
            raise InvalidInputError("decode needs a prefilled session: call prefill first")
        return self.extend(session, [token])

    def extend_batch(self, sessions: Sequence[Session], ids_lists: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Append ids_lists[i] to sessions[i] for every i as one step; the last new position's logits of each.

        Decode steps (one token) and prefill chunks (many) of different sequences share a step this way. An
        error either leaves every session as it was, or is a PartialBatchError that says which sessions
        advanced (and their logits). The default extends the sessions one after another; cached runners run
        one batched forward.
        """
        if len(sessions) != len(ids_lists) or not sessions:
            raise InvalidInputError("extend_batch needs one token list per session, and at least one session")
        rows: list[np.ndarray] = []
        for session, ids in zip(sessions, ids_lists):
            try:
                rows.append(self.extend(session, ids))
            except Exception as exc:
                if not rows:
                    raise
                raise PartialBatchError(rows, exc) from exc
        return rows

    def extend_batch_rows(self, sessions: Sequence[Session], ids_lists: Sequence[Sequence[int]],
                          every_row: Sequence[bool]) -> list[np.ndarray]:
        """extend_batch, where a session marked in `every_row` gets every new position's logits [T, vocab] (what a
        speculative step verifies its draft with). The default extends the sessions one after another."""
        self.check_batch(sessions, ids_lists)
        return [self.extend(session, ids, all_positions=bool(every))
                for session, ids, every in zip(sessions, ids_lists, every_row)]

    def can_rewind(self, session: Session, positions: int) -> bool:
        """Whether `session`, extended by `positions` more tokens, can be cut back to what it holds now
        (`truncate`): a speculative step's refused draft is cut so. False unless a runner says otherwise."""
        return False

    def truncate(self, session: Session, length: int) -> None:
        """Keep the session's first `length` positions; only after `can_rewind` said yes for what was added."""
        raise UnsupportedOperationError(f"{type(self).__name__} cannot cut a session short")

    def decode_batch(self, sessions: Sequence[Session], tokens: Sequence[int]) -> np.ndarray:
        """One token for each prefilled session, each at its own position: logits [B, vocab] (see extend_batch)."""
        if any(not session.tokens for session in sessions):
            raise InvalidInputError("decode_batch needs prefilled sessions: call prefill first")
        return np.stack(self.extend_batch(sessions, [[token] for token in tokens]))

    def export(self, session: Session) -> SessionSnapshot | None:
        """Snapshot `session` for prompt-cache reuse; None if this runner cannot."""
        return None

    def restore(self, session: Session, snap: SessionSnapshot, length: int | None = None) -> bool:
        """Make `session` hold the first `length` tokens of `snap` (all when None); True if applied."""
        return False

    def prefill_reusing(
        self, session: Session, prompt: Sequence[int], snap: SessionSnapshot, reuse_len: int
    ) -> tuple[np.ndarray, int]:
        """Prefill `prompt` whose first `reuse_len` tokens `snap` covers: (last logits, tokens really reused).

        Reuse can fall short of `reuse_len` (at least one token must run to give logits) or fail
        altogether (a sliding-window cache no longer holds the prefix); the count says what happened.
        """
        self.check_prompt(prompt)
        if not 0 <= reuse_len <= len(snap.token_ids):
            raise InvalidInputError(f"reuse_len {reuse_len} is outside the snapshot's {len(snap.token_ids)} tokens")
        if list(prompt[:reuse_len]) != snap.token_ids[:reuse_len]:
            raise InvalidInputError("the prompt does not start with the snapshot's first reuse_len tokens")
        reuse = min(reuse_len, len(prompt) - 1)
        if reuse > 0 and self.restore(session, snap, reuse):
            return self.extend(session, prompt[reuse:]), reuse
        return self.prefill(session, prompt), 0

    # -- images --------------------------------------------------------------------------
    def supports_multimodal(self) -> bool:
        return False

    def image_marker(self) -> str | None:
        """The text that marks where an image goes in a prompt (None: this runner takes no images)."""
        return None

    def multimodal_prompt_ids(
        self, prompt: str, tokenizer: Any = None, encode: Callable[[str], list[int]] | None = None
    ) -> list[int]:
        """The token ids a prompt with one image marker runs as (the image expanded to its soft tokens).

        `tokenizer` (a path or tokenizer) replaces the one the runner was loaded with. `encode` (text -> ids, BOS
        as the model wants it), when given, tokenizes the expanded prompt instead: the server passes one that
        reads only the chat template's markers and the image's tokens as special (`runlm.text.literal`)."""
        raise UnsupportedOperationError(f"{self.family()} runner has no vision tower: this model cannot take images")

    def prefill_multimodal(
        self,
        session: Session,
        prompt: str,
        image: ImageInput,
        on_phase: Callable[[str], None] | None = None,
        tokenizer: Any = None,
        all_positions: bool = False,
        ids: Sequence[int] | None = None,
    ) -> np.ndarray:
        """Prefill `prompt` with `image` spliced in at its marker; `session` then holds
        `multimodal_prompt_ids(prompt)`, or `ids` when given (what `multimodal_prompt_ids` returned, used as they
        are rather than tokenizing `prompt` again). `on_phase` hears "vision" and "prefill" as they start.
        Returns the last position's logits [vocab], or every position's [T, vocab]."""
        raise UnsupportedOperationError(f"{self.family()} runner has no vision tower: this model cannot take images")

    # -- embeddings ------------------------------------------------------------------------
    def hidden_states(self, ids: Sequence[int]) -> np.ndarray:
        """The final norm's output at every position of `ids`, before the LM head: [T, hidden] float32.

        What embeddings are pooled from. Logits cannot give it back, so a runner with only the three
        required calls cannot embed."""
        raise UnsupportedOperationError(f"{self.family()} runner does not expose hidden states: it cannot embed")

    # -- the seed's calls, on the runner's own session --------------------------------------
    @property
    def own_session(self) -> Session:
        """The session the seed's session-less calls act on."""
        session = self.__dict__.get("_own_session")
        if session is None:
            session = self.__dict__["_own_session"] = self.new_session()
        return session

    def generate(self, prompt_ids: Sequence[int], n_new: int, on_token: OnToken | None = None) -> list[int]:
        """Greedy generation of up to `n_new` tokens; `on_token` returns False to stop."""
        check_n_new(n_new)
        self.check_prompt(prompt_ids)
        self.check_fits(len(prompt_ids) + n_new)
        if n_new == 0:
            return []
        return self.greedy_continue(self.own_session, self.prefill(self.own_session, prompt_ids), n_new, on_token)

    def greedy_continue(
        self, session: Session, logits: np.ndarray, n_new: int, on_token: OnToken | None
    ) -> list[int]:
        """Greedy tokens from a prefilled session's `logits` on."""
        produced: list[int] = []
        while True:
            token = int(logits.argmax())
            produced.append(token)
            if on_token is not None and not on_token(token):
                return produced
            if len(produced) >= n_new:
                return produced
            logits = self.decode(session, token)

    def prefill_logits(self, prompt_ids: Sequence[int]) -> np.ndarray:
        return self.prefill(self.own_session, prompt_ids)

    def decode_logits(self, token: int) -> np.ndarray:
        return self.decode(self.own_session, token)

    def prefill_logits_reusing(self, prompt: Sequence[int], snap: SessionSnapshot, reuse_len: int) -> np.ndarray:
        return self.prefill_reusing(self.own_session, prompt, snap, reuse_len)[0]

    def export_session(self) -> SessionSnapshot | None:
        return self.export(self.own_session)

    def restore_session(self, snap: SessionSnapshot) -> bool:
        return self.restore(self.own_session, snap)

    def generate_multimodal(
        self,
        prompt: str,
        rgb: bytes,
        img_w: int,
        img_h: int,
        tokenizer: Path | Any | None,
        n_new: int,
        on_token: OnToken | None = None,
        on_phase: Callable[[str], None] | None = None,
    ) -> list[int]:
        """Greedy generation from a prompt whose image marker is spliced with the image's embeddings.

        `rgb` is img_w * img_h * 3 bytes, row-major. `tokenizer` (a path or tokenizer; None: the
        runner's own) encodes the prompt.
        """
        check_n_new(n_new)
        if not self.supports_multimodal():
            raise UnsupportedOperationError(
                f"{self.family()} runner has no vision tower: this model cannot take images")
        image = ImageInput(rgb, img_w, img_h)
        if n_new == 0:
            return []
        self.check_fits(len(self.multimodal_prompt_ids(prompt, tokenizer)) + n_new)
        logits = self.prefill_multimodal(self.own_session, prompt, image, on_phase, tokenizer)
        return self.greedy_continue(self.own_session, logits, n_new, on_token)

    # -- shared input checks --------------------------------------------------------------
    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Reject prompts that no model could run."""
        if len(prompt_ids) == 0:
            raise InvalidInputError("prompt is empty: at least one token id is needed")
        self.check_tokens(prompt_ids)

    def check_tokens(self, ids: Sequence[int]) -> None:
        vocab = self.vocab_size()
        for token in ids:
            check_token(token, vocab)

    def check_fits(self, total: int) -> None:
        if total > self.max_context():
            raise ContextOverflowError(f"{total} tokens do not fit the context of {self.max_context()} tokens")

    def check_batch(self, sessions: Sequence[Session], ids_lists: Sequence[Sequence[int]]) -> None:
        """What a batched extend_batch checks before any work, so that an error leaves every session as it was."""
        if len(sessions) != len(ids_lists) or not sessions:
            raise InvalidInputError("extend_batch needs one token list per session, and at least one session")
        for session, ids in zip(sessions, ids_lists):
            if len(ids) == 0:
                raise InvalidInputError("extend_batch needs at least one token for every session")
            self.check_tokens(ids)
            self.check_fits(len(session.tokens) + len(ids))


@dataclass(kw_only=True)
class ServedModel:
    """A loaded model as the CLI, the engine and the server read it: the runner and what surrounds it. Each runtime
    returns one (runlm.native.runner.NativeLoaded, runlm.pytorch.loading.LoadedModel)."""

    runner: LmRunner
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    path: Path
    format: str  # "gguf" or "safetensors"
    quantization: str  # the file's type ("Q4_K_M", ...) or the PyTorch dtype of a safetensors model
    config: ModelConfig
    metadata: dict[str, Any] = field(default_factory=dict)  # the file's keys, without the tokenizer's arrays
    runtime: str = "native"  # "native" or "torch"

    @property
    def family(self) -> str:
        """The runner's family identifier ("llama32", "qwen3", "gemma")."""
        return self.runner.family()

    @property
    def context_length(self) -> int:
        return self.runner.max_context()


def check_token(token: int, vocab: int) -> None:
    if isinstance(token, bool) or not hasattr(token, "__index__"):
        raise InvalidInputError(f"token id {token!r} is not an integer")
    if not 0 <= int(token) < vocab:
        raise InvalidInputError(f"token id {int(token)} is outside the vocabulary [0, {vocab})")


def check_n_new(n_new: int) -> None:
    if not isinstance(n_new, int) or n_new < 0:
        raise InvalidInputError(f"n_new must be a non-negative integer, got {n_new!r}")
