"""The sampler chain: logit bias, penalties, top-k, typical-p, top-p, min-p, temperature, then a draw.

The order is llama.cpp's default chain (`logit-bias -> penalties -> top-k -> typical -> top-p -> min-p ->
temperature -> dist`), so the same settings give the same distribution as there: the truncation samplers
look at the temperature-1 distribution and temperature only reshapes what survives. Temperature 0 is
greedy (argmax after bias and penalties). Log-probs are taken from the raw model distribution, before any
of this, because that is what OpenAI reports.

It runs on numpy, so the native runtime (no torch) and the PyTorch backend share it: their logits are the same bits,
so a seeded reply is the same tokens on both.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from runlm.errors import InvalidInputError
from runlm.runner import as_numpy

MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    """Per-request sampling settings; defaults are OpenAI's (temperature 1, nothing truncated)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 or less: off
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64  # 0: penalties off, -1: whole history
    seed: int | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self, vocab_size: int) -> SamplingParams:
        """Reject settings no sampler could honour, with a message naming the parameter."""

        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise InvalidInputError(f"{name}: {message}")

        for name in ("temperature", "top_p", "min_p", "typical_p", "repeat_penalty", "frequency_penalty",
                     "presence_penalty"):
            value = getattr(self, name)
            check(isinstance(value, int | float) and math.isfinite(value), name, f"must be a finite number, "
                  f"got {value!r}")
        check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        check(0 <= self.top_p <= 1, "top_p", f"must be in [0, 1], got {self.top_p}")
        check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        check(0 <= self.typical_p <= 1, "typical_p", f"must be in [0, 1], got {self.typical_p}")
        check(self.repeat_penalty > 0, "repeat_penalty", f"must be > 0, got {self.repeat_penalty}")
        check(isinstance(self.top_k, int), "top_k", f"must be an integer, got {self.top_k!r}")
        check(isinstance(self.penalty_last_n, int) and self.penalty_last_n >= -1, "penalty_last_n",
              f"must be an integer >= -1, got {self.penalty_last_n!r}")
        check(isinstance(self.top_logprobs, int) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs",
              f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        check(self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        for token, bias in self.logit_bias.items():
            check(isinstance(token, int) and 0 <= token < vocab_size, "logit_bias",
                  f"token id {token!r} is outside the vocabulary [0, {vocab_size})")
            check(isinstance(bias, int | float) and not math.isnan(bias), "logit_bias",
                  f"bias for token {token} must be a number, got {bias!r}")
        return self


@dataclass
class TopLogprob:
    token_id: int
    logprob: float


@dataclass
class TokenLogprob:
    """The chosen token's log-prob and the most likely alternatives, from the raw model distribution."""

    token_id: int
    logprob: float
    top: list[TopLogprob]


SEED_SPAN = 2**64  # seeds are taken mod this (numpy's generators take no negative seed)


def make_generator(seed: int | None) -> np.random.Generator:
    """A private generator per request, so one client's seed is not disturbed by another's draws."""
    return np.random.default_rng(seed % SEED_SPAN if seed is not None else int.from_bytes(os.urandom(8), "little"))


def as_mask(allowed) -> np.ndarray | None:
    if allowed is None:
        return None
    return allowed.detach().cpu().numpy() if hasattr(allowed, "detach") else np.asarray(allowed, dtype=bool)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def softmax(logits: np.ndarray) -> np.ndarray:
    weights = np.exp(logits - logits.max())
    return weights / weights.sum()


def apply_logit_bias(logits: np.ndarray, bias: Mapping[int, float]) -> None:
    if bias:
        np.add.at(logits, np.fromiter(bias.keys(), dtype=np.int64), np.fromiter(bias.values(), dtype=logits.dtype))


def penalties_apply(params: SamplingParams, history: Sequence[int]) -> bool:
    if params.penalty_last_n == 0 or not history:
        return False
    return params.repeat_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def apply_penalties(logits: np.ndarray, history: Sequence[int], params: SamplingParams) -> None:
    """llama.cpp's penalties over the last-n window: repeat divides (or multiplies negatives), then
    frequency subtracts per occurrence and presence once."""
    if not penalties_apply(params, history):
        return
    window = history if params.penalty_last_n < 0 else history[-params.penalty_last_n:]
    counts = Counter(t for t in window if 0 <= t < logits.shape[0])
    if not counts:
        return
    ids = np.fromiter(counts.keys(), dtype=np.int64)
    n = np.fromiter(counts.values(), dtype=logits.dtype)
    vals = logits[ids]
    if params.repeat_penalty != 1.0:
        vals = np.where(vals <= 0, vals * np.float32(params.repeat_penalty), vals / np.float32(params.repeat_penalty))
    logits[ids] = vals - n * np.float32(params.frequency_penalty) - np.float32(params.presence_penalty)


def _top_k(logits: np.ndarray, k: int) -> None:
    if 0 < k < logits.shape[0]:
        kth = np.partition(logits, -k)[-k]
        logits[logits < kth] = -np.inf


def _typical(logits: np.ndarray, p: float) -> None:
    """Locally typical sampling: keep tokens whose surprisal is closest to the entropy, up to mass p."""
    if p >= 1.0:
        return
    logp = log_softmax(logits)
    probs = np.exp(logp)
    finite = np.isfinite(logp)
    entropy = -(probs[finite] * logp[finite]).sum()
    shifted = np.where(finite, np.abs(-logp - entropy), np.inf)
    order = np.argsort(shifted, kind="stable")
    cum = np.cumsum(probs[order])
    # Keep the smallest prefix whose mass reaches p (at least one token).
    logits[order[int(np.searchsorted(cum, p)) + 1:]] = -np.inf


def _top_p(logits: np.ndarray, p: float) -> None:
    """Keep the smallest set of most likely tokens whose mass reaches p. Only candidates are sorted: the tokens still
    in (after top-k), the k best of them (found in linear time), k grown until they hold p; not the whole vocabulary
    per token."""
    if p >= 1.0:
        return
    probs = softmax(logits)
    alive = np.flatnonzero(np.isfinite(logits))
    k = min(64, len(alive))
    while True:
        best = alive[np.argpartition(probs[alive], -k)[-k:]] if k < len(alive) else alive
        best = best[np.argsort(-probs[best], kind="stable")]
        cum = np.cumsum(probs[best])
        if cum[-1] >= p or k == len(alive):
            break
        k = min(4 * k, len(alive))
    keep = np.zeros(len(probs), dtype=bool)
    keep[best[: int(np.searchsorted(cum, p)) + 1]] = True
    logits[~keep] = -np.inf


def _min_p(logits: np.ndarray, p: float) -> None:
    if p <= 0.0:
        return
    # p_i >= p * p_max  <=>  logit_i >= logit_max + log(p)
    logits[logits < logits.max() + math.log(p)] = -np.inf


def filter_logits(logits, params: SamplingParams, history: Sequence[int] = ()) -> np.ndarray:
    """The chain up to (and including) temperature; returns new scaled logits, -inf where cut."""
    out = as_numpy(logits).copy()
    apply_logit_bias(out, params.logit_bias)
    apply_penalties(out, history, params)
    if params.greedy:
        return out
    _top_k(out, params.top_k)
    _typical(out, params.typical_p)
    _top_p(out, params.top_p)
    _min_p(out, params.min_p)
    return out / np.float32(params.temperature)


def sample(
    logits,
    params: SamplingParams,
    generator: np.random.Generator | None = None,
    history: Sequence[int] = (),
    allowed=None,
) -> int:
    """Draw one token id from [vocab] logits. `allowed` is a bool mask [vocab] (a grammar's),
    applied before the chain."""
    scores, mask = as_numpy(logits), as_mask(allowed)
    if params.greedy and mask is None and not params.logit_bias and not penalties_apply(params, history):
        return int(np.argmax(scores))  # nothing to change in the scores: no copy of a vocabulary's worth
    if mask is not None:
        scores = np.where(mask, scores, np.float32(-np.inf))
    filtered = filter_logits(scores, params, history)
    if params.greedy:
        return int(np.argmax(filtered))
    if not np.isfinite(filtered).any():
        # Every token was cut (e.g. a -100 bias on all survivors): fall back to the best raw score.
        return int(np.argmax(scores))
    return _draw(softmax(filtered), generator or make_generator(None))


# The draw's first level: blocks of this many probabilities (a running sum over a whole vocabulary is a sequential loop
# in numpy, ~2.5 ms at Gemma's 262k entries; block sums and one block's running sum take ~0.2 ms).
DRAW_BLOCK = 1024


def _draw(probs: np.ndarray, generator: np.random.Generator) -> int:
    """Inverse-CDF draw, in two levels: the running sum of block sums finds the block the uniform number falls in,
    the running sum within that block the token. Right-sided search never lands on a zero-probability token."""
    n = probs.shape[0]
    padded = np.zeros(-(-n // DRAW_BLOCK) * DRAW_BLOCK, dtype=np.float64)
    padded[:n] = probs
    blocks = padded.reshape(-1, DRAW_BLOCK)
    block_cdf = np.cumsum(blocks.sum(axis=1))
    u = generator.random() * block_cdf[-1]
    block = min(int(np.searchsorted(block_cdf, u, side="right")), len(block_cdf) - 1)
    within = np.cumsum(blocks[block])
    offset = u - (block_cdf[block - 1] if block else 0.0)
    index = block * DRAW_BLOCK + min(int(np.searchsorted(within, offset, side="right")), DRAW_BLOCK - 1)
    if index >= n or probs[index] <= 0:  # rounding between the two levels' sums (an ulp's worth of mass)
        index = int(np.argmax(probs))
    return index


def token_logprob(logits, token: int, top_n: int = 0) -> TokenLogprob:
    """Log-softmax of the raw model logits: the chosen token and the `top_n` most likely ones."""
    logp = log_softmax(as_numpy(logits))
    top: list[TopLogprob] = []
    if top_n > 0:
        n = min(top_n, logp.shape[0])
        best = np.argpartition(logp, -n)[-n:]
        best = best[np.argsort(-logp[best], kind="stable")]
        top = [TopLogprob(int(i), float(logp[i])) for i in best]
    return TokenLogprob(token_id=token, logprob=float(logp[token]), top=top)


class Sampler:
    """One request's sampler: its parameters, its own seeded generator, the tokens seen so far."""

    def __init__(self, params: SamplingParams, vocab_size: int, history: Sequence[int] = ()):
        self.params = params.validate(vocab_size)
        self.generator = make_generator(params.seed)
        self.history: list[int] = list(history)

    def __call__(self, logits, allowed=None) -> int:
        token = sample(logits, self.params, self.generator, self.history, allowed)
        self.history.append(token)
        return token

    def logprob(self, logits, token: int) -> TokenLogprob | None:
        if not self.params.logprobs:
            return None
        return token_logprob(logits, token, self.params.top_logprobs)
