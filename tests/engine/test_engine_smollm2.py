"""The decode loop on the real SmolLM2: greedy output is the runner's own greedy output."""

from __future__ import annotations

import pytest

from runlm.bench.common import english_text
from runlm.engine import Engine, GenerationRequest, Scheduler
from runlm.engine.scheduler import StepPacer
from runlm.pytorch import kernels
from runlm.sampling import SamplingParams


@pytest.fixture(scope="module")
def smollm2(smollm2_loaded):
    return smollm2_loaded


def test_greedy_matches_runner_generate_and_prompt_cache_keeps_it(smollm2):
    tok, runner = smollm2.tokenizer, smollm2.runner
    prompt = tok.encode("The capital of France is")
    expected = runner.generate(prompt, 6)
    engine = Engine(runner, tok, context_length=smollm2.context_length, prompt_cache_mb=64)
    req = GenerationRequest(prompt_ids=prompt, max_tokens=6, sampling=SamplingParams(temperature=0.0),
                            ignore_eos=True)
    first = engine.complete(req)
    assert first.token_ids == expected
    assert first.text == tok.decode(expected)
    assert first.usage.cached_tokens == 0
    # Same prompt again: the cached session covers all but the last prompt token, output unchanged.
    second = engine.complete(req)
    assert second.usage.cached_tokens == len(prompt) - 1
    assert second.token_ids == expected


def test_every_route_gives_the_same_greedy_tokens_on_the_packed_path(smollm2):
    """Direct runner, engine (cache miss, cache hit, streamed), scheduler alone and among 8 concurrent requests."""
    tok, runner = smollm2.tokenizer, smollm2.runner
    prompt = tok.encode_prompt(smollm2.chat_template.render([{"role": "user", "content": "Name three colors."}]))
    expected = runner.generate(prompt, 12)

    def request(ids: list[int]) -> GenerationRequest:
        return GenerationRequest(prompt_ids=ids, max_tokens=12, sampling=SamplingParams(temperature=0.0),
                                 ignore_eos=True)

    engine = Engine(runner, tok, context_length=smollm2.context_length, prompt_cache_mb=64)
    miss = engine.complete(request(prompt))
    hit = engine.complete(request(prompt))
    streamed = [r.token_id for r in engine.generate(request(prompt)) if r.token_id is not None]
    assert hit.usage.cached_tokens == len(prompt) - 1
    assert miss.token_ids == hit.token_ids == streamed == expected
    others = [tok.encode(f"Tell me about the number {i}.") for i in range(7)]
    scheduler = Scheduler(Engine(runner, tok, context_length=smollm2.context_length, prompt_cache_mb=0),
                          max_queue=16, max_batch=8)
    try:
        alone = scheduler.submit(request(prompt)).result()
        crowd = [scheduler.submit(request(ids)) for ids in others[:3]]
        among = scheduler.submit(request(prompt))
        crowd += [scheduler.submit(request(ids)) for ids in others[3:]]
        results = [h.result() for h in crowd]
        assert among.result().token_ids == alone.token_ids == expected
        assert [r.token_ids for r in results] == [runner.generate(ids, 12) for ids in others]
    finally:
        scheduler.close()


def test_same_seed_same_text_whatever_the_cache_state(smollm2):
    tok, runner = smollm2.tokenizer, smollm2.runner
    prompt = tok.encode_prompt(smollm2.chat_template.render([{"role": "user", "content": "Write a short poem."}]))
    sampled = SamplingParams(temperature=0.8, seed=42)
    engine = Engine(runner, tok, context_length=smollm2.context_length, prompt_cache_mb=64)
    texts = [engine.complete(GenerationRequest(prompt_ids=prompt, max_tokens=24, sampling=sampled)).text
             for _ in range(2)]  # cache miss, then hit
    cold = Engine(runner, tok, context_length=smollm2.context_length, prompt_cache_mb=0)
    texts.append(cold.complete(GenerationRequest(prompt_ids=prompt, max_tokens=24, sampling=sampled)).text)
    assert texts[0] == texts[2] and texts[0]  # the same route twice
    if smollm2.runtime == "native" or kernels.available():  # the kernels' blocks: every route gives the same bits
        assert texts[1] == texts[0]
    other = engine.complete(GenerationRequest(prompt_ids=prompt, max_tokens=24,
                                              sampling=SamplingParams(temperature=0.8, seed=7)))
    assert other.text != texts[0]  # the seed matters


class FixedRowsPacer(StepPacer):
    """Four prompt rows in every step, whatever the steps' times (so the test does not depend on them), and a
    record of each step: (streams in it, prompt rows it carried)."""

    def __init__(self):
        super().__init__(most_rows=512)
        self.steps: list[tuple[int, int]] = []

    def plain_due(self, streams: int) -> bool:
        return False

    def prompt_rows(self, streams: int) -> int:
        return 4

    def observe(self, streams: int, prompt_rows: int, elapsed_s: float) -> None:
        self.steps.append((streams, prompt_rows))


def test_a_long_prompt_is_admitted_in_chunks_beside_running_streams(smollm2):
    """While a long prompt comes in, the running stream keeps getting tokens (the prompt runs in chunks mixed
    into the decode steps), and the long request's answer is the one it gets alone."""
    tok, runner = smollm2.tokenizer, smollm2.runner
    long_prompt = tok.encode(english_text())[:600]
    short = tok.encode("Count slowly from one to one hundred:")
    greedy = SamplingParams(temperature=0.0)
    scheduler = Scheduler(Engine(runner, tok, context_length=smollm2.context_length, prompt_cache_mb=0),
                          max_queue=4, max_batch=4)
    scheduler.pacer = pacer = FixedRowsPacer()
    try:
        running = scheduler.submit(GenerationRequest(prompt_ids=short, max_tokens=500, sampling=greedy,
                                                     ignore_eos=True))
        stream = iter(running)
        next(stream)  # the short request is decoding
        long_handle = scheduler.submit(GenerationRequest(prompt_ids=long_prompt, max_tokens=4, sampling=greedy,
                                                         ignore_eos=True))
        records = iter(long_handle)
        first = next(records)
        with_prompt_rows = [step for step in pacer.steps if step[1]]
        # the short prompt alone (up to 512 rows), then the long one in 4-row chunks (150: the last one 4 too),
        # each in a step that also decoded the running stream
        assert with_prompt_rows == [(0, 512)] + [(1, 4)] * 150
        answer = [first.token_id] + [r.token_id for r in records if r.token_id is not None]
        assert answer == runner.generate(long_prompt, 4)
        running.cancel()
        list(stream)
    finally:
        scheduler.close()
