"""The scheduler's KV-cache budget on the real SmolLM2: sessions are sized once for their prompt and max_tokens
(Engine.kv_bytes is what they hold), requests run only while their KV caches fit the budget together (the
others wait their turn), and a request that could never fit is refused at once."""

from __future__ import annotations

import pytest

from runlm.engine import Engine, GenerationRequest, Scheduler
from runlm.errors import InvalidInputError
from runlm.sampling import SamplingParams

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def smollm2(smollm2_loaded):
    return smollm2_loaded


def request(smollm2, text: str, max_tokens: int = MAX_TOKENS) -> GenerationRequest:
    return GenerationRequest(prompt_ids=smollm2.tokenizer.encode(text), max_tokens=max_tokens,
                             sampling=SamplingParams(temperature=0.0), ignore_eos=True)


def cache_arrays(session) -> list:
    """A session's key and value caches (the native runtime's numpy arrays; the PyTorch backend's layer tensors)."""
    state = session.state
    if hasattr(state, "keys"):
        return state.keys + state.values
    return [t.numpy() for layer in state for t in (layer.k, layer.v)]


def cache_bytes(session) -> int:
    return sum(a.nbytes for a in cache_arrays(session))


def test_a_session_is_sized_once_and_holds_what_kv_bytes_says(smollm2):
    engine = Engine(smollm2.runner, smollm2.tokenizer, context_length=smollm2.context_length, prompt_cache_mb=0)
    gen = engine.new_generation(request(smollm2, "The capital of France is"))
    engine.start(gen)
    buffers = [a.ctypes.data for a in cache_arrays(gen.session)]
    assert cache_bytes(gen.session) == engine.kv_bytes(gen)
    while not gen.finished:
        engine.step([gen])
    assert len(gen.generated) == MAX_TOKENS
    assert [a.ctypes.data for a in cache_arrays(gen.session)] == buffers  # never grown, never copied


def test_requests_wait_for_the_budget_and_one_past_it_is_refused(smollm2):
    engine = Engine(smollm2.runner, smollm2.tokenizer, context_length=smollm2.context_length, prompt_cache_mb=0)
    prompts = ["Tell me about the sea.", "Tell me about the sky.", "Tell me about trees."]
    needs = [engine.kv_bytes(engine.new_generation(request(smollm2, p))) for p in prompts]
    budget = max(needs) * 3 // 2  # room for one request at a time, not two
    scheduler = Scheduler(engine, max_queue=8, max_batch=8, kv_budget_bytes=budget)
    held_at_admission = []
    begin = engine.begin

    def watching_begin(gen):
        held_at_admission.append((scheduler.kv_held, scheduler.in_flight))
        return begin(gen)

    engine.begin = watching_begin
    try:
        handles = [scheduler.submit(request(smollm2, p)) for p in prompts]
        results = [h.result() for h in handles]
        with pytest.raises(InvalidInputError, match="KV-cache budget") as refused:
            scheduler.submit(request(smollm2, "Tell me everything.", max_tokens=smollm2.context_length // 2))
        assert str(refused.value).startswith("max_tokens:")  # the server's 400 names the field
    finally:
        scheduler.close()
    assert all(len(r.token_ids) == MAX_TOKENS for r in results)
    assert len(held_at_admission) == 3
    assert all(held <= budget and in_flight == 0 for held, in_flight in held_at_admission)
    assert scheduler.kv_held == 0
