"""`n` choices and `best_of` on the real SmolLM2 through the official `openai` client: one prefill, n in one batch.

Greedy choices must agree with each other and with a single request; sampled choices (seed + index each)
must differ from each other and come back the same for the same seed.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from server_harness import LiveServer

from runlm.server import create_app

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def live(smollm2_loaded):
    server = LiveServer(create_app(smollm2_loaded, model_name=MODEL, max_queue=4, prompt_cache_mb=64))
    yield server
    server.stop()


def chat(client, content: str, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 4)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def counters(live) -> dict[str, float]:
    text = httpx.get(live.base_url + "/metrics").text
    return {name: float(line.split()[-1]) for line in text.splitlines()
            for name in ("runlm_prompt_tokens_total", "runlm_completion_tokens_total") if line.startswith(name + " ")}


def test_greedy_chat_n3_gives_three_identical_choices_and_counts_the_prompt_once(client, live):
    one = chat(client, "Name a color.")
    before = counters(live)
    three = chat(client, "Name a color.", n=3)
    after = counters(live)
    assert after["runlm_prompt_tokens_total"] - before["runlm_prompt_tokens_total"] == three.usage.prompt_tokens
    assert (after["runlm_completion_tokens_total"] - before["runlm_completion_tokens_total"]
            == three.usage.completion_tokens)
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.message.content for c in three.choices]
    assert texts == [one.choices[0].message.content] * 3
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.total_tokens == three.usage.prompt_tokens + three.usage.completion_tokens


def test_sampled_chat_n3_differs_per_choice_and_reproduces_with_a_seed(client):
    def sample():
        r = chat(client, "Tell me a story about a dragon.", n=3, temperature=1.5, seed=99, max_tokens=8)
        return [c.message.content for c in r.choices]

    first = sample()
    assert len(set(first)) == 3, first  # choice i samples with seed + i
    assert sample() == first
    # Choice 0 is exactly what the same request with n=1 gives.
    alone = chat(client, "Tell me a story about a dragon.", temperature=1.5, seed=99, max_tokens=8)
    assert alone.choices[0].message.content == first[0]


def test_streamed_chat_n3_interleaves_choices_tagged_by_index(client):
    plain = chat(client, "Tell me a story about a dragon.", n=3, temperature=1.5, seed=5, max_tokens=6)
    stream = chat(client, "Tell me a story about a dragon.", n=3, temperature=1.5, seed=5, max_tokens=6,
                  stream=True, stream_options={"include_usage": True})
    parts: dict[int, list[str]] = {0: [], 1: [], 2: []}
    finishes: dict[int, str] = {}
    order, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                parts[c.index].append(c.delta.content)
                order.append(c.index)
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert ["".join(parts[i]) for i in range(3)] == [c.message.content for c in plain.choices]
    assert set(finishes) == {0, 1, 2} and finishes[0] == plain.choices[0].finish_reason
    # Interleaved as the batch makes them, not one choice after another.
    assert order[:3] != [order[0]] * 3, order
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens


def test_completions_n3_plain_and_streamed(client):
    prompt = "The capital of France is"
    one = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    three = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.text for c in three.choices] == [one.choices[0].text] * 3
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    texts: dict[int, str] = {0: "", 1: "", 2: ""}
    finishes = set()
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, n=3,
                                           stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes.add(c.index)
    assert texts == {i: one.choices[0].text for i in range(3)}
    assert finishes == {0, 1, 2}


def test_best_of_returns_the_candidates_most_likely_per_token(client):
    """best_of=3 runs the same three candidates n=3 would (seed + index) and keeps the best mean log-prob."""
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.5, "seed": 11}
    all_three = client.completions.create(n=3, logprobs=0, **kw)

    def mean(choice) -> float:
        values = choice.logprobs.token_logprobs
        return sum(values) / len(values)

    ranked = sorted(all_three.choices, key=mean, reverse=True)
    assert len({c.text for c in ranked}) == 3
    best = client.completions.create(best_of=3, **kw)
    assert [c.text for c in best.choices] == [ranked[0].text]
    assert best.choices[0].index == 0 and best.choices[0].logprobs is None  # ranked by, not returned
    assert best.usage.completion_tokens == all_three.usage.completion_tokens  # every candidate counts
    two = client.completions.create(best_of=3, n=2, **kw)
    assert [c.text for c in two.choices] == [c.text for c in ranked[:2]]


def test_n_out_of_range_and_bad_best_of_are_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, "Hi", n=17)
    assert err.value.body["param"] == "n"
    for bad in ({"best_of": 1, "n": 2}, {"best_of": 2, "stream": True}, {"best_of": 17}):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, **bad)
        assert err.value.body["param"] == "best_of"
