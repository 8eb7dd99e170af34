"""The decode loop on the real SmolLM2: greedy output is the runner's own greedy output."""

from __future__ import annotations

import pytest

from runlm.engine import Engine, GenerationRequest
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
