"""A scripted runner and a tiny byte tokenizer: exact, fast stand-ins for a model in engine tests."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from runlm.runner import LmRunner, Session, SessionSnapshot

PIECES: list[bytes] = [
    b"<eos>", b"<eot>", b"Hello", b" world", b"!", b"<", b"|", b"end", b"|>", b" ", b"a", b"b", b"c",
    b"\xe2\x82", b"\xac", b"{", b"}", b"\"", b":", b"1", b"2", b"x", b"\n", b"STOP", b"ST", b"OP",
]
PIECES += [f"t{i}".encode() for i in range(len(PIECES), 64)]
ID = {p.decode("utf-8", "replace"): i for i, p in enumerate(PIECES)}


class MockTokenizer:
    """Pieces are bytes; decode joins them (so a character may span tokens); encode is greedy."""

    vocab_size = len(PIECES)
    bos_id = None
    eos_id = 0
    stop_ids = frozenset({0, 1})
    special_ids = frozenset({0, 1})
    strip_mode = ("none", 0)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        data, out = text.encode(), []
        while data:
            best = max((i for i, p in enumerate(PIECES) if p and data.startswith(p) and i > 1),
                       key=lambda i: len(PIECES[i]), default=None)
            if best is None:
                raise ValueError(f"cannot encode {data!r}")
            out.append(best)
            data = data[len(PIECES[best]):]
        return out

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return b"".join(PIECES[i] for i in ids if not (skip_special and i in self.special_ids)).decode(
            "utf-8", "replace")

    def token_str(self, token_id: int) -> str:
        return PIECES[token_id].decode("latin-1")

    def token_to_bytes(self, token_id: int) -> bytes:
        return PIECES[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids


class ScriptedRunner(LmRunner):
    """After any prompt it 'wants' script[0], script[1], ...: that token gets a big logit on top of
    fixed noise, so greedy follows the script and sampling has a real distribution to draw from.

    Each session remembers where its prompt ended (`session.state`; None while its prompt is still to run).
    An extend of one token on a session whose prompt has run is a decode step; anything else is prompt (the
    engine never leaves a one-token tail chunk, and a restored prefix continues its prompt, while a whole
    restored snapshot — a forked choice — decodes next). The runner counts the prompt tokens it actually
    ran, so tests can see prompt-cache reuse.
    """

    def __init__(self, script: Sequence[int], vocab: int = len(PIECES), margin: float = 8.0,
                 delay_s: float = 0.0, max_context: int = 256):
        self.script = list(script)
        self.vocab = vocab
        self.margin = margin
        self.delay_s = delay_s
        self.context = max_context
        self.prefilled_tokens = 0  # tokens run through prefill, all calls together
        self.decode_calls = 0
        noise = torch.Generator().manual_seed(1234)
        self.noise = torch.randn(512, vocab, generator=noise)

    def family(self) -> str:
        return "mock"

    def vocab_size(self) -> int:
        return self.vocab

    def max_context(self) -> int:
        return self.context

    def _logits(self, session: Session) -> np.ndarray:
        step = len(session.tokens) - session.state
        logits = self.noise[len(session.tokens) % 512].clone()
        if step < len(self.script):
            logits[self.script[step]] += self.margin
        else:
            logits[0] += self.margin
        if self.delay_s:
            time.sleep(self.delay_s)
        return logits.numpy()

    def predict_logits(self, prompt_ids: Sequence[int]) -> np.ndarray:
        return self.prefill(self.new_session(), prompt_ids)

    def extend(self, session: Session, ids: Sequence[int], all_positions: bool = False) -> np.ndarray:
        self.check_tokens(ids)
        session.tokens = session.tokens + [int(t) for t in ids]
        if session.state is not None and len(ids) == 1:
            self.decode_calls += 1
        else:
            self.prefilled_tokens += len(ids)
            session.state = len(session.tokens)  # the prompt ends here
        return self._logits(session)

    def export(self, session: Session) -> SessionSnapshot:
        return SessionSnapshot(token_ids=list(session.tokens), cache=None, nbytes=100 * len(session.tokens),
                               family="mock")

    def restore(self, session: Session, snap: SessionSnapshot, length: int | None = None) -> bool:
        session.tokens = list(snap.token_ids[:length])
        whole = length is None or length == len(snap.token_ids)
        session.state = len(session.tokens) if whole else None  # a prefix continues its prompt
        return True


def ids(*pieces: str) -> list[int]:
    return [ID[p] for p in pieces]
