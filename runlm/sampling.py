"""The sampler chain: logit bias, penalties, top-k, typical-p, top-p, min-p, temperature, then a draw.

The order is llama.cpp's default chain (`logit-bias -> penalties -> top-k -> typical -> top-p -> min-p ->
temperature -> dist`), so the same settings give the same distribution as there: the truncation samplers
look at the temperature-1 distribution and temperature only reshapes what survives. Temperature 0 is
greedy (argmax after bias and penalties). Log-probs are taken from the raw model distribution, before any
of this, because that is what OpenAI reports.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from runlm.errors import InvalidInputError

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


def make_generator(seed: int | None) -> torch.Generator:
    """A private generator per request, so one client's seed is not disturbed by another's draws."""
    gen = torch.Generator()
    gen.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    return gen


def apply_logit_bias(logits: torch.Tensor, bias: Mapping[int, float]) -> None:
    if bias:
        ids = torch.tensor(list(bias.keys()), dtype=torch.long)
        logits.index_add_(0, ids, torch.tensor(list(bias.values()), dtype=logits.dtype))


def penalties_apply(params: SamplingParams, history: Sequence[int]) -> bool:
    if params.penalty_last_n == 0 or not history:
        return False
    return params.repeat_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def apply_penalties(logits: torch.Tensor, history: Sequence[int], params: SamplingParams) -> None:
    """llama.cpp's penalties over the last-n window: repeat divides (or multiplies negatives), then
    frequency subtracts per occurrence and presence once."""
    if not penalties_apply(params, history):
        return
    window = history if params.penalty_last_n < 0 else history[-params.penalty_last_n:]
    counts = Counter(t for t in window if 0 <= t < logits.shape[0])
    if not counts:
        return
    ids = torch.tensor(list(counts.keys()), dtype=torch.long)
    n = torch.tensor(list(counts.values()), dtype=logits.dtype)
    vals = logits[ids]
    if params.repeat_penalty != 1.0:
        vals = torch.where(vals <= 0, vals * params.repeat_penalty, vals / params.repeat_penalty)
    vals = vals - n * params.frequency_penalty - params.presence_penalty
    logits[ids] = vals


def _top_k(logits: torch.Tensor, k: int) -> None:
    if 0 < k < logits.shape[0]:
        kth = torch.topk(logits, k).values[-1]
        logits.masked_fill_(logits < kth, -math.inf)


def _typical(logits: torch.Tensor, p: float) -> None:
    """Locally typical sampling: keep tokens whose surprisal is closest to the entropy, up to mass p."""
    if p >= 1.0:
        return
    logp = torch.log_softmax(logits, dim=-1)
    probs = logp.exp()
    finite = torch.isfinite(logp)
    entropy = -(probs[finite] * logp[finite]).sum()
    shifted = torch.where(finite, (-logp - entropy).abs(), torch.full_like(logp, math.inf))
    order = torch.argsort(shifted)
    cum = torch.cumsum(probs[order], dim=0)
    # Keep the smallest prefix whose mass reaches p (at least one token).
    keep = int(torch.searchsorted(cum, torch.tensor(p, dtype=cum.dtype)).item()) + 1
    drop = order[keep:]
    logits[drop] = -math.inf


def _top_p(logits: torch.Tensor, p: float) -> None:
    if p >= 1.0:
        return
    sorted_logits, order = torch.sort(logits, descending=True)
    cum = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=0)
    keep = int(torch.searchsorted(cum, torch.tensor(p, dtype=cum.dtype)).item()) + 1
    logits[order[keep:]] = -math.inf


def _min_p(logits: torch.Tensor, p: float) -> None:
    if p <= 0.0:
        return
    # p_i >= p * p_max  <=>  logit_i >= logit_max + log(p)
    threshold = logits.max() + math.log(p)
    logits.masked_fill_(logits < threshold, -math.inf)


def filter_logits(logits: torch.Tensor, params: SamplingParams, history: Sequence[int] = ()) -> torch.Tensor:
    """The chain up to (and including) temperature; returns new scaled logits, -inf where cut."""
    out = logits.detach().to(torch.float32).clone()
    apply_logit_bias(out, params.logit_bias)
    apply_penalties(out, history, params)
    if params.greedy:
        return out
    _top_k(out, params.top_k)
    _typical(out, params.typical_p)
    _top_p(out, params.top_p)
    _min_p(out, params.min_p)
    return out / params.temperature


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    history: Sequence[int] = (),
    allowed: torch.Tensor | None = None,
) -> int:
    """Draw one token id. `allowed` is a bool mask [vocab] (a grammar's), applied before the chain."""
    if params.greedy and allowed is None and not params.logit_bias and not penalties_apply(params, history):
        return int(torch.argmax(logits))  # nothing to change in the scores: no copy of a vocabulary's worth
    if allowed is not None:
        logits = logits.masked_fill(~allowed, -math.inf)
    scores = filter_logits(logits, params, history)
    if params.greedy:
        return int(torch.argmax(scores))
    if not torch.isfinite(scores).any():
        # Every token was cut (e.g. a -100 bias on all survivors): fall back to the best raw score.
        return int(torch.argmax(logits))
    return _draw(torch.softmax(scores, dim=-1), generator)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Inverse-CDF draw: one uniform number and a binary search (torch.multinomial is far slower on a
    large vocabulary). Right-sided search never lands on a zero-probability token."""
    cdf = torch.cumsum(probs.to(torch.float64), dim=0)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    index = int(torch.searchsorted(cdf, u, right=True).item())
    if index >= probs.shape[0] or probs[index] <= 0:
        index = int(torch.argmax(probs))
    return index


def token_logprob(logits: torch.Tensor, token: int, top_n: int = 0) -> TokenLogprob:
    """Log-softmax of the raw model logits: the chosen token and the `top_n` most likely ones."""
    logp = torch.log_softmax(logits.detach().to(torch.float32), dim=-1)
    top: list[TopLogprob] = []
    if top_n > 0:
        values, ids = torch.topk(logp, min(top_n, logp.shape[0]))
        top = [TopLogprob(int(i), float(v)) for v, i in zip(values.tolist(), ids.tolist(), strict=True)]
    return TokenLogprob(token_id=token, logprob=float(logp[token]), top=top)


class Sampler:
    """One request's sampler: its parameters, its own seeded generator, the tokens seen so far."""

    def __init__(self, params: SamplingParams, vocab_size: int, history: Sequence[int] = ()):
        self.params = params.validate(vocab_size)
        self.generator = make_generator(params.seed)
        self.history: list[int] = list(history)

    def __call__(self, logits: torch.Tensor, allowed: torch.Tensor | None = None) -> int:
        token = sample(logits, self.params, self.generator, self.history, allowed)
        self.history.append(token)
        return token

    def logprob(self, logits: torch.Tensor, token: int) -> TokenLogprob | None:
        if not self.params.logprobs:
            return None
        return token_logprob(logits, token, self.params.top_logprobs)
