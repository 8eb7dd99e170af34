"""The host-driven decode loop over any LmRunner: sampling, stops, streaming records, the prompt cache.

A request becomes a `Generation`: a small state machine over its own runner session, prefilled once
(`Engine.start`) and then fed one row of logits per step (`on_logits`), returning the records to
stream and the next token to feed. `Engine.step` is the one decode step: it gathers the pending
tokens of every generation given, runs one batched forward, and hands each its row. The scheduler
calls it for many generations at once, `Engine.generate` for one; a failure fails only the
generation it belongs to.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from runlm.engine.grammar import GrammarConstraint, whitespace_tokens
from runlm.engine.prompt_cache import PromptCache
from runlm.engine.reasoning import ThinkingBudget, ThinkingWatch
from runlm.engine.speculative import DraftPacer, ModelDrafter, PromptLookup, Speculation
from runlm.engine.stops import StopStringFilter
from runlm.errors import ContextOverflowError, InvalidInputError, RunlmError
from runlm.runner import ImageInput, LmRunner, PartialBatchError, Session
from runlm.sampling import SEED_SPAN, Sampler, SamplingParams, TokenLogprob
from runlm.text import StreamingDetokenizer


@dataclass
class GenerationRequest:
    """What to generate: prompt ids plus the knobs of one OpenAI request.

    With `image`, `prompt_text` holds the prompt (the runner's image marker shows where the image
    goes) and `prompt_ids` its expansion with the image's soft tokens, which is what runs; see Engine.with_image.
    """

    prompt_ids: list[int]
    max_tokens: int | None = None  # None: up to the context's end
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    stop_ids: frozenset[int] | None = None  # None: the tokenizer's EOS / end-of-turn ids
    ignore_eos: bool = False
    grammar: GrammarConstraint | None = None
    use_prompt_cache: bool = True
    image: ImageInput | None = None
    prompt_text: str | None = None
    cache_scope: str = ""  # whose prompt-cache entries it may reuse: the server's tenant, never the request body
    thinking_budget: ThinkingBudget | None = None  # closes a thinking phase once it has spent so many tokens
    speculation: Speculation | None = None  # None: the engine's (runlm.engine.speculative)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queued_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ttft_s: float = 0.0
    draft_tokens: int = 0  # tokens drafted by speculation, and of them the ones the model kept
    accepted_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def decode_tokens_per_s(self) -> float:
        steps = max(0, self.completion_tokens - 1)
        return steps / self.decode_s if self.decode_s > 0 and steps else 0.0


@dataclass
class StreamRecord:
    """One step's worth of output: text released to the client, the token, its log-prob.

    `text` may be empty while text is held back (a possible stop string, an incomplete character); the
    last record carries `finish_reason` and `usage`.
    """

    text: str = ""
    token_id: int | None = None
    logprob: TokenLogprob | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    index: int = 0  # which of a request's n choices this record belongs to


@dataclass
class Completion:
    """A whole generation, for callers that do not stream."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str
    usage: Usage


class Generation:
    """One request in flight: its runner session, sampler, detokenizer, stop filter and counters."""

    def __init__(self, request: GenerationRequest, tokenizer: Any, vocab_size: int, max_new: int,
                 submitted_at: float | None = None):
        self.request = request
        self.tokenizer = tokenizer
        self.sampler = Sampler(request.sampling, vocab_size, history=request.prompt_ids)
        self.detok = StreamingDetokenizer(tokenizer, continuation=True)
        self.stops = StopStringFilter(request.stop)
        self.thinking = ThinkingWatch(request.thinking_budget) if request.thinking_budget is not None else None
        ids = request.stop_ids if request.stop_ids is not None else getattr(tokenizer, "stop_ids", frozenset())
        self.stop_ids = frozenset() if request.ignore_eos else frozenset(ids)
        self.max_new = max_new
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.next_token: int | None = None
        self.usage = Usage(prompt_tokens=len(request.prompt_ids))
        self.submitted_at = submitted_at if submitted_at is not None else time.perf_counter()
        self._started_at = 0.0
        self._first_token_at = 0.0
        self.session: Session | None = None  # made by Engine.start / Engine.begin
        self.pending: list[int] = []  # prompt tokens still to run (Engine.begin, then Engine.step's prefill chunks)
        self.reused = 0  # prompt tokens the session took from the prompt cache
        self.prefilled = False
        self.index = 0  # the choice this generation is, when a request asks for n of them
        self.lookup: PromptLookup | None = None  # its context's n-grams, from its first speculative step
        self.drafter: ModelDrafter | None = None  # its session on a draft model, from its first draft
        self.pacer = DraftPacer()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def mark_started(self) -> None:
        self._started_at = time.perf_counter()
        self.usage.queued_s = self._started_at - self.submitted_at

    def mark_prefilled(self, cached_tokens: int) -> None:
        now = time.perf_counter()
        self.usage.cached_tokens = cached_tokens
        self.usage.prefill_s = now - self._started_at
        self.prefilled = True

    def on_logits(self, logits: np.ndarray) -> StreamRecord:
        """Sample from this step's logits and advance; sets `next_token` unless the sequence finished."""
        grammar = self.request.grammar
        whitespace = None  # between the thinking and the answer: whitespace may come before what the grammar holds
        if grammar is not None and self.thinking is not None:
            if self.thinking.waiting:
                grammar = None  # the grammar holds the answer, which starts where the thinking ends
            elif self.thinking.between:
                whitespace = whitespace_tokens(self.tokenizer, grammar.n_vocab)
        allowed = grammar.allowed() if grammar is not None else None
        if whitespace is not None:
            allowed = allowed | whitespace
        forced = self.thinking.forced_token() if self.thinking is not None else None
        if forced is None:
            token = self.sampler(logits, allowed)
        else:  # the end of a spent thinking phase: written, not drawn (the penalties still see it)
            token = forced
            self.sampler.history.append(token)
        logprob = self.sampler.logprob(logits, token)
        self.generated.append(token)
        if self.lookup is not None:
            self.lookup.append(token)
        now = time.perf_counter()
        if len(self.generated) == 1:
            self._first_token_at = now
            self.usage.ttft_s = now - self.submitted_at
        self.usage.completion_tokens = len(self.generated)
        self.usage.decode_s = now - self._first_token_at
        record = StreamRecord(token_id=token, logprob=logprob, index=self.index)
        if token in self.stop_ids:
            record.text = self._flush()
            return self._finish(record, "stop")
        piece = self.detok.push(token)
        if self.thinking is not None:
            self.thinking.advance(piece)
        text, hit = self.stops.push(piece)
        record.text = text
        if hit:
            return self._finish(record, "stop")
        if whitespace is not None and whitespace[token]:
            grammar = None  # whitespace before the answer: not the grammar's
        if grammar is not None and (not grammar.accept(token) or grammar.done):
            record.text += self._flush()
            return self._finish(record, "stop")
        if len(self.generated) >= self.max_new:
            record.text += self._flush()
            return self._finish(record, "length")
        self.next_token = token
        return record

    def cancel(self) -> StreamRecord:
        return self._finish(StreamRecord(index=self.index), "cancelled")

    def fail(self) -> None:
        """The request failed (the error goes to its caller); nothing more is generated."""
        self.finish_reason = "error"
        self.next_token = None

    def _flush(self) -> str:
        text, hit = self.stops.push(self.detok.flush())
        return text if hit else text + self.stops.flush()

    def _finish(self, record: StreamRecord, reason: str) -> StreamRecord:
        self.finish_reason = reason
        self.next_token = None
        record.finish_reason = reason
        record.usage = self.usage
        return record


StepResult = tuple[Generation, "StreamRecord | Exception"]


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request seeded with `seed`: seed + index (mod SEED_SPAN), so the n choices
    differ and the same seed gives the same n answers again. None stays None (fresh entropy each)."""
    if seed is None:
        return None
    return (seed + index) % SEED_SPAN


def merged_usage(usages: Sequence[Usage]) -> Usage:
    """One request's usage over its n choices: the prompt counted once, the completion tokens summed."""
    first = usages[0]
    return Usage(prompt_tokens=first.prompt_tokens, completion_tokens=sum(u.completion_tokens for u in usages),
                 cached_tokens=first.cached_tokens, queued_s=first.queued_s, prefill_s=first.prefill_s,
                 decode_s=max(u.decode_s for u in usages), ttft_s=min(u.ttft_s for u in usages),
                 draft_tokens=sum(u.draft_tokens for u in usages),
                 accepted_tokens=sum(u.accepted_tokens for u in usages))


class Engine:
    """Generation over one runner. Not thread-safe (the runner is not): the scheduler owns it."""

    def __init__(self, runner: LmRunner, tokenizer: Any, *, context_length: int | None = None,
                 prompt_cache_mb: float = 256, speculation: Speculation | None = None):
        self.runner = runner
        self.tokenizer = tokenizer
        self.vocab_size = runner.vocab_size()
        self.speculation = speculation if speculation is not None else Speculation()
        draft = self.speculation.draft
        if draft is not None and draft.vocab_size() != self.vocab_size:
            raise InvalidInputError(f"the draft model's vocabulary has {draft.vocab_size()} tokens, the model's "
                                    f"{self.vocab_size}: a draft model must share the model's tokenizer")
        self.context_length = context_length or runner.max_context()
        budget = int(prompt_cache_mb * 1024 * 1024)
        self.prompt_cache: PromptCache | None = PromptCache(budget) if budget > 0 else None

    # -- checks ------------------------------------------------------------------------
    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        if not prompt_ids:
            raise InvalidInputError("the prompt is empty: at least one token is needed")
        for t in prompt_ids:
            if not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise InvalidInputError(f"token id {t!r} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_ids) >= self.context_length:
            raise ContextOverflowError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context is {self.context_length} "
                f"tokens: shorten the prompt (at least one token must be left to generate)"
            )

    def max_new_tokens(self, request: GenerationRequest) -> int:
        """The request's max_tokens capped by what the context has left after the prompt."""
        room = self.context_length - len(request.prompt_ids)
        if request.max_tokens is None:
            return room
        if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise InvalidInputError(f"max_tokens must be a positive integer, got {request.max_tokens!r}")
        return min(request.max_tokens, room)

    def new_generation(self, request: GenerationRequest, submitted_at: float | None = None) -> Generation:
        """Validate a request and make its Generation (cheap; no model work)."""
        self.check_prompt(request.prompt_ids)
        return Generation(request, self.tokenizer, self.vocab_size, self.max_new_tokens(request), submitted_at)

    def new_choices(self, request: GenerationRequest, n: int, submitted_at: float | None = None) -> list[Generation]:
        """`n` generations of one request (OpenAI's `n`), for `start_group`: choice i samples with
        `choice_seed(seed, i)` and follows a grammar of its own (a matcher advances with its tokens)."""
        if not isinstance(n, int) or n < 1:
            raise InvalidInputError(f"n must be a positive integer, got {n!r}")
        gens = []
        for i in range(n):
            choice = request if i == 0 else replace(
                request, sampling=replace(request.sampling, seed=choice_seed(request.sampling.seed, i)),
                grammar=request.grammar.copy() if request.grammar is not None else None)
            gen = self.new_generation(choice, submitted_at)
            gen.index = i
            gens.append(gen)
        return gens

    @staticmethod
    def positions(gen: Generation) -> int:
        """The most positions `gen`'s session holds: its prompt and every token it may generate."""
        return len(gen.request.prompt_ids) + gen.max_new

    def new_session(self, gen: Generation) -> Session:
        """A session sized once for all `gen` may hold, so its KV cache never grows (nor copies) on the way."""
        return self.runner.new_session(self.positions(gen))

    def kv_bytes(self, gen: Generation) -> int:
        """The most KV-cache memory `gen`'s session holds (0 when the runner cannot tell)."""
        return self.runner.kv_bytes(self.positions(gen)) or 0

    def with_image(self, request: GenerationRequest, prompt_text: str, image: ImageInput,
                   encode: Callable[[str], list[int]] | None = None) -> GenerationRequest:
        """Turn a text request into an image + text one (the runner must take images). `encode` tokenizes the
        expanded prompt instead of the runner's tokenizer (see LmRunner.multimodal_prompt_ids); the ids it
        gives are the ones prefilled."""
        request.prompt_ids = self.runner.multimodal_prompt_ids(prompt_text, encode=encode)
        request.prompt_text, request.image = prompt_text, image
        request.use_prompt_cache = False  # a snapshot of soft tokens could not be matched by a later prompt
        return request

    # -- model work ----------------------------------------------------------------------
    def start(self, gen: Generation) -> StreamRecord:
        """Prefill the prompt in a new session, reusing the longest cached prefix; the first record."""
        return gen.on_logits(self._prefill(gen))

    def start_group(self, gens: Sequence[Generation]) -> list[StreamRecord]:
        """Prefill once for the n choices of one request (`new_choices`): the first prefills, the others
        restore a snapshot of its session and draw their own first token from the same logits. A runner
        that cannot export or restore a session prefills each choice instead. One record per generation."""
        first, *rest = gens
        logits = self._prefill(first)
        snap = None
        if rest:
            try:
                snap = self.runner.export(first.session)
            except Exception:  # a runner that cannot snapshot prefills every choice
                snap = None
        rows = [logits]
        for gen in rest:
            gen.mark_started()
            gen.session = self.new_session(gen)
            if snap is not None and self.runner.restore(gen.session, snap):
                gen.mark_prefilled(len(snap.token_ids))
                rows.append(logits)
            else:
                rows.append(self._prefill(gen))
        return [gen.on_logits(row) for gen, row in zip(gens, rows)]

    def begin(self, gen: Generation) -> StreamRecord | None:
        """Open `gen`'s session from the longest cached prefix, leaving the rest of its prompt in `gen.pending`
        for `step` to run in chunks beside other sequences' decode steps (a long prompt then does not stall
        them). An image prompt runs whole here instead: its first record is returned (else None)."""
        if gen.request.image is not None:
            return self.start(gen)
        self._open(gen)
        return None

    def _open(self, gen: Generation) -> None:
        """A new session for a text prompt, restored from the longest cached prefix that really restores;
        `gen.pending` is what of the prompt is left to run."""
        gen.mark_started()
        gen.session = self.new_session(gen)
        prompt = gen.request.prompt_ids
        if self.prompt_cache is not None and gen.request.use_prompt_cache:
            snap, match = self.prompt_cache.lookup(prompt, gen.request.cache_scope)
            reuse = min(match, len(prompt) - 1)  # the last prompt token must run to give logits
            if snap is not None and reuse > 0 and self.runner.restore(gen.session, snap, reuse):
                gen.reused = reuse
                self.prompt_cache.record_hit(reuse)
            elif snap is not None:
                self.runner.reset_session(gen.session)
        gen.pending = list(prompt[gen.reused:])

    def _prefill(self, gen: Generation) -> np.ndarray:
        """Make `gen` a session holding its prompt (from the prompt cache where it can); the last logits."""
        request = gen.request
        if request.image is not None:
            gen.mark_started()
            gen.session = self.new_session(gen)
            logits = self.runner.prefill_multimodal(gen.session, request.prompt_text, request.image,
                                                    ids=request.prompt_ids)
        else:
            self._open(gen)
            logits, gen.pending = self.runner.extend(gen.session, gen.pending), []
        gen.mark_prefilled(gen.reused)
        return logits

    def step(self, gens: Sequence[Generation], prefilling: Sequence[Generation] = (),
             chunk: int | None = None) -> list[StepResult]:
        """One step in one batched forward: a decode step for every generation in `gens` and, for each of
        `prefilling` (opened by `begin`), the next `chunk` tokens of its prompt (all of them when None).
        A record or an error for each generation that produced one (a prefilling generation produces its
        first record with its prompt's last chunk).

        If the batched forward fails, the sequences it did not advance are retried alone, so only the
        failing ones fail.
        """
        members = list(gens) + list(prefilling)
        drafts = [self._draft(g) for g in gens] + [[] for _ in prefilling]
        ids_lists = [[g.next_token, *draft] for g, draft in zip(gens, drafts)]
        for g in prefilling:
            # whole chunks, the last one up to twice as long (and of two tokens at least): no short tail step
            # at the end of a prompt, and a prompt's last chunk is never a lone token, which reads like a decode
            ids_lists.append(g.pending[:chunk] if chunk and len(g.pending) >= chunk + max(chunk, 2) else g.pending)
        rows: list[np.ndarray | Exception]
        drafting = [bool(draft) for draft in drafts]
        try:
            sessions = [g.session for g in members]
            rows = list(self.runner.extend_batch_rows(sessions, ids_lists, drafting) if any(drafting)
                        else self.runner.extend_batch(sessions, ids_lists))
        except Exception as batch_error:
            if isinstance(batch_error, PartialBatchError):
                rows = [*batch_error.rows, batch_error.cause]  # these advanced; the next one failed
            elif len(members) == 1:
                rows = [batch_error]
            else:
                rows = []
            for g, ids, every in zip(members[len(rows):], ids_lists[len(rows):], drafting[len(rows):]):
                try:
                    rows.append(self.runner.extend(g.session, ids, all_positions=every))
                except Exception as exc:
                    rows.append(exc)
        results: list[StepResult] = []
        for g, ids, row, draft in zip(members, ids_lists, rows, drafts):
            if isinstance(row, Exception):
                g.fail()
                results.append((g, row))
                continue
            if draft:
                results.extend(self._verify(g, draft, row))
                continue
            if g.pending:  # a prompt chunk
                g.pending = g.pending[len(ids):]
                if g.pending:
                    continue  # more of the prompt to run: no token yet
                g.mark_prefilled(g.reused)
            try:
                results.append((g, g.on_logits(row)))
            except Exception as exc:  # a sampler or grammar failure ends this request only
                g.fail()
                results.append((g, exc))
        return results

    def _draft(self, gen: Generation) -> list[int]:
        """The tokens `gen` drafts this step after its next one (none where speculation is off for it, its drafts
        have failed lately, or its session could not be cut back)."""
        spec = gen.request.speculation or self.speculation
        if not spec.enabled or gen.pending:
            return []
        length = gen.pacer.next_length(min(spec.draft_max, gen.max_new - len(gen.generated)))
        if length <= 0:
            return []
        if spec.mode == "draft":
            if gen.drafter is None:
                gen.drafter = ModelDrafter(spec.draft)
            try:
                draft = gen.drafter.draft(gen.request.prompt_ids + gen.generated, length)
            except RunlmError:  # the draft model cannot follow (its context is shorter): this generation stops drafting
                gen.pacer.stop()
                return []
        else:
            if gen.lookup is None:
                gen.lookup = PromptLookup(gen.request.prompt_ids + gen.generated)
            draft = gen.lookup.draft(length)
        return draft if draft and self.runner.can_rewind(gen.session, 1 + len(draft)) else []

    def _verify(self, gen: Generation, draft: list[int], rows: np.ndarray) -> list[StepResult]:
        """Draw `gen`'s tokens from the step's rows as plain decode steps would, one after another, while each
        drawn token is the drafted one; cut the session back to the tokens kept. The first refused (or the
        token after the whole draft) is the next step's, as after a plain step."""
        held = len(gen.session.tokens) - len(draft) - 1
        results: list[StepResult] = []
        accepted = 0
        for i, row in enumerate(rows):
            try:
                results.append((gen, gen.on_logits(row)))
            except Exception as exc:  # a sampler or grammar failure ends this request only
                gen.fail()
                results.append((gen, exc))
                break
            if gen.finished or i == len(draft) or gen.next_token != draft[i]:
                break
            accepted += 1
        gen.usage.draft_tokens += len(draft)
        gen.usage.accepted_tokens += accepted
        gen.pacer.record(len(draft), accepted)
        if accepted < len(draft):
            self.runner.truncate(gen.session, held + 1 + accepted)
        return results

    def finish(self, gen: Generation) -> None:
        """Keep the finished session (prompt + reply) for later requests that share its prefix, then drop it."""
        session, gen.session = gen.session, None
        gen.drafter = None  # its draft model's session goes with it
        keep = gen.prefilled and gen.finish_reason != "error" and gen.request.use_prompt_cache
        if session is None or not keep or self.prompt_cache is None:
            return
        try:
            snap = self.runner.export(session)
        except Exception:  # a runner that cannot snapshot just gets no cache
            snap = None
        self.prompt_cache.store(snap, gen.request.cache_scope)

    def generate(self, request: GenerationRequest | Generation,
                 cancelled: Callable[[], bool] = lambda: False) -> Iterator[StreamRecord]:
        """Stream records for one request; the last one has finish_reason and usage."""
        gen = request if isinstance(request, Generation) else self.new_generation(request)
        try:
            if cancelled():
                yield gen.cancel()
                return
            yield self.start(gen)
            while not gen.finished:
                if cancelled():
                    yield gen.cancel()
                    return
                for _, result in self.step([gen]):  # one record a token: several where a draft was kept
                    if isinstance(result, Exception):
                        raise result
                    yield result
        finally:
            self.finish(gen)

    def complete(self, request: GenerationRequest) -> Completion:
        """Run a request to the end and gather its text."""
        parts: list[str] = []
        ids: list[int] = []
        lps: list[TokenLogprob] = []
        last = StreamRecord()
        for last in self.generate(request):
            parts.append(last.text)
            if last.token_id is not None:
                ids.append(last.token_id)
            if last.logprob is not None:
                lps.append(last.logprob)
        return Completion("".join(parts), ids, lps, last.finish_reason or "stop", last.usage or Usage())
