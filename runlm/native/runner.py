"""The runner contract over a native model, so the engine, the scheduler and the HTTP server run in a process without
PyTorch. Logits are float32 numpy arrays; the sampler (runlm.sampling) takes them as they are.

Sessions hold a NativeSession; the prompt cache's snapshots are copies of its filled KV rows. A batch step (decode
tokens and prompt chunks of several sequences) is one forward over all their rows, as on the PyTorch path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from runlm.errors import InvalidInputError
from runlm.native.model import NativeModel, NativeSession
from runlm.runner import LmRunner, ServedModel, Session, SessionSnapshot

# positions a session made without a size starts with (it grows, doubling, up to the context)
INITIAL_POSITIONS = 256


class NativeRunner(LmRunner):
    def __init__(self, model: NativeModel):
        self.model = model
        self.rings = [block.ring for block in model.blocks]
        self.windows = [block.window for block in model.blocks]
        # the shortest sliding-window ring (None: every cache is full): how far a session can be cut back
        self.ring_window = min((w for ring, w in zip(self.rings, self.windows) if ring), default=None)

    def family(self) -> str:
        return self.model.family

    def vocab_size(self) -> int:
        return self.model.vocab_size

    def max_context(self) -> int:
        return self.model.context

    def predict_logits(self, prompt_ids: Sequence[int]) -> np.ndarray:
        self.check_prompt(prompt_ids)
        return self.extend(self.new_session(len(prompt_ids)), prompt_ids)

    def new_session(self, positions: int | None = None) -> Session:
        """The KV arrays are made for `positions` at once; a session made without a size starts small and grows as
        it fills, up to the context (NativeModel.reserve)."""
        if positions is None:  # sized as it fills, up to the context
            native = self.model.new_session(min(INITIAL_POSITIONS, self.model.context), limit=self.model.context)
        else:
            native = self.model.new_session(positions)
        return Session(tokens=native.tokens, state=native)  # one list: the session's tokens are the native one's

    def kv_bytes(self, positions: int) -> int:
        return self.model.kv_bytes(positions)

    def reset_session(self, session: Session) -> None:
        session.tokens.clear()

    def extend(self, session: Session, ids: Sequence[int], all_positions: bool = False) -> np.ndarray:
        if len(ids) == 0:
            raise InvalidInputError("nothing to extend: no token ids")
        self.check_tokens(ids)
        self.check_fits(len(session.tokens) + len(ids))
        return self.model.extend(session.state, [int(t) for t in ids], all_positions)

    def extend_batch(self, sessions: Sequence[Session], ids_lists: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """One forward for every session's new tokens; checked whole first, so an error leaves every session as it
        was."""
        self.check_batch(sessions, ids_lists)
        return self.model.extend_batch([session.state for session in sessions],
                                       [[int(t) for t in ids] for ids in ids_lists])

    def extend_batch_rows(self, sessions: Sequence[Session], ids_lists: Sequence[Sequence[int]],
                          every_row: Sequence[bool]) -> list[np.ndarray]:
        self.check_batch(sessions, ids_lists)
        return self.model.extend_batch([session.state for session in sessions],
                                       [[int(t) for t in ids] for ids in ids_lists], every_row=list(every_row))

    def can_rewind(self, session: Session, positions: int) -> bool:
        """Full caches can always be cut back (later positions are written over); a sliding-window ring only while
        the session with `positions` more still fits its window (past it, new positions overwrite kept ones)."""
        return self.ring_window is None or len(session.tokens) + positions <= self.ring_window

    def truncate(self, session: Session, length: int) -> None:
        if not 0 <= length <= len(session.tokens):
            raise InvalidInputError(f"cannot cut a session of {len(session.tokens)} tokens to {length}")
        del session.tokens[length:]  # the native session's own list

    def hidden_states(self, ids: Sequence[int]) -> np.ndarray:
        self.check_prompt(ids)
        self.check_fits(len(ids))
        return self.model.hidden_states([int(t) for t in ids])

    def export(self, session: Session) -> SessionSnapshot:
        """The filled rows of every full cache and each ring whole (a ring's slots are positions mod its window)."""
        native: NativeSession = session.state
        n = len(native.tokens)
        keys = [k.copy() if ring else k[:, :, :n].copy() for k, ring in zip(native.keys, self.rings)]
        values = [v.copy() if ring else v[:, :, :n].copy() for v, ring in zip(native.values, self.rings)]
        nbytes = sum(a.nbytes for a in keys + values)
        return SessionSnapshot(token_ids=list(native.tokens), cache=(keys, values), nbytes=nbytes, family=self.family())

    def restore(self, session: Session, snap: SessionSnapshot, length: int | None = None) -> bool:
        """False where the snapshot cannot give the first `length` positions: another runner's, more positions than
        the session holds, or a prefix cut short of a ring that has wrapped (its slots hold later positions)."""
        held = len(snap.token_ids)
        length = held if length is None else length
        native: NativeSession = session.state
        if snap.family != self.family() or not isinstance(snap.cache, tuple) or not 0 <= length <= held:
            return False
        if length > native.limit or any(ring and held > window and length < held
                                         for ring, window in zip(self.rings, self.windows)):
            return False
        self.model.reserve(native, length)
        for target, source, ring in zip(native.keys + native.values, snap.cache[0] + snap.cache[1], self.rings * 2):
            if target.shape[:2] != source.shape[:2] or target.dtype != source.dtype:
                return False
            if ring:
                target[...] = source
            else:
                target[:, :, :length] = source[:, :, :length]
        native.tokens[:] = snap.token_ids[:length]
        return True


@dataclass(kw_only=True)
class NativeLoaded(ServedModel):
    """A model on the native runtime (no PyTorch)."""

    runner: NativeRunner
    format: str = "gguf"


__all__ = ["NativeLoaded", "NativeRunner"]
