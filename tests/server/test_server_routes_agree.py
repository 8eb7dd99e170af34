"""One answer per request on the served default (packed) path: plain, streamed, prompt-cache hit and miss, alone
or among 8 concurrent requests, the same greedy text; the same seed, the same sampled text whatever the cache."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from server_harness import LiveServer, openai_client

from runlm.server import create_app

MODEL = "smollm2-135m"
MESSAGES = [{"role": "user", "content": "Name three animals that live in the sea."}]


@pytest.fixture(scope="module")
def client(smollm2_loaded):
    server = LiveServer(create_app(smollm2_loaded, model_name=MODEL, api_key="", max_queue=16, max_batch=8))
    yield openai_client(server.base_url, timeout=300)
    server.stop()


def chat(client, messages=MESSAGES, **kw) -> tuple[str, int]:
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, **kw)
    return reply.choices[0].message.content, reply.usage.prompt_tokens_details.cached_tokens


def streamed(client, **kw) -> str:
    chunks = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, stream=True, **kw)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_greedy_answer_is_the_same_on_every_route(client, smollm2_loaded):
    first, cached_first = chat(client, temperature=0)
    again, cached_again = chat(client, temperature=0)  # the prompt cache now holds the whole exchange
    assert cached_again > 0
    assert streamed(client, temperature=0) == first == again
    others = [[{"role": "user", "content": f"Count from {i} to {i + 5}."}] for i in range(7)]
    with ThreadPoolExecutor(8) as pool:
        crowd = [pool.submit(chat, client, m, temperature=0) for m in others[:4]]
        ours = pool.submit(chat, client, temperature=0, extra_body={"cache_prompt": False})
        crowd += [pool.submit(chat, client, m, temperature=0) for m in others[4:]]
        assert ours.result()[0] == first
        assert all(f.result()[0] for f in crowd)
    tok = smollm2_loaded.tokenizer
    ids = tok.encode_prompt(smollm2_loaded.chat_template.render(MESSAGES))
    direct = smollm2_loaded.runner.generate(ids, 16)
    stop = next((i for i, t in enumerate(direct) if t in tok.stop_ids), len(direct))
    assert first == tok.decode(direct[:stop])


def test_same_seed_same_text_whatever_the_cache_state(client):
    texts = [chat(client, temperature=0.9, seed=1234)[0] for _ in range(2)]
    texts.append(chat(client, temperature=0.9, seed=1234, extra_body={"cache_prompt": False})[0])
    texts.append(streamed(client, temperature=0.9, seed=1234))
    assert len(set(texts)) == 1 and texts[0]
