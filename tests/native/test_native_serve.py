"""`runlm serve` on the native runtime: the whole server (OpenAI routes, scheduler, prompt cache) over runlm.native's
runner, in a process where `import torch` is made to fail, answering what the PyTorch backend's server (`--torch`)
answers, through the official openai client on loopback."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from server_harness import openai_client, serve_cli

from runlm.pytorch import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="runlm's C++ kernels are not built")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def servers(smollm2_gguf, tmp_path_factory):
    """(native, PyTorch backend) base URLs, both serving SmolLM2."""
    blocker = tmp_path_factory.mktemp("blocker")
    (blocker / "torch").mkdir()
    (blocker / "torch" / "__init__.py").write_text("raise ImportError('torch is blocked in this test')\n")
    with serve_cli("-m", str(smollm2_gguf), "--native", env={"PYTHONPATH": str(blocker)}) as native, \
            serve_cli("-m", str(smollm2_gguf), "--torch") as default:
        yield native, default


def answers(base_url: str) -> dict:
    client = openai_client(base_url)
    model = client.models.list().data[0].id
    greedy = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, stream=True, seed=4,
                                            temperature=0.9, top_p=0.95, logprobs=True, top_logprobs=2)
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    n2 = client.completions.create(model=model, prompt="Once upon a time", max_tokens=10, n=2, temperature=1, seed=1)
    return {"greedy": greedy.choices[0].message.content,
            "sampled": "".join(c.delta.content or "" for c in chunks),
            "logprobs": [(t.token, round(t.logprob, 4)) for c in chunks if c.logprobs for t in c.logprobs.content],
            "n2": [choice.text for choice in n2.choices]}


def test_the_native_server_answers_as_the_pytorch_backends(servers):
    native, default = servers
    got = answers(native)
    assert got == answers(default)
    assert got["greedy"].strip() and got["sampled"] and len(got["logprobs"]) > 4 and got["n2"][0] != got["n2"][1]


def test_prompt_cache_and_requests_in_flight_together(servers):
    native, _ = servers
    client = openai_client(native)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Tell me a fact about the moon, please, in one sentence."}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    again = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 1

    def ask(topic: str) -> str:
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Name a {topic}."}],
                                               max_tokens=10, temperature=0, extra_body={"cache_prompt": False})
        return reply.choices[0].message.content

    topics = ["color", "fruit", "river", "planet"]
    alone = [ask(topic) for topic in topics]
    with ThreadPoolExecutor(len(topics)) as pool:
        assert list(pool.map(ask, topics)) == alone


def test_embeddings_are_the_pytorch_backends(servers):
    """Mean-pooled final-norm states: the native model's hidden states are the PyTorch backend's (the same blocks and
    norm), so the vectors match to float rounding of the pooling."""
    native, default = servers
    texts = ["The quick brown fox", "Grüße aus München!", "def add(a, b): return a + b"]
    vectors = []
    for base in (native, default):
        client = openai_client(base)
        reply = client.embeddings.create(model=client.models.list().data[0].id, input=texts, dimensions=64)
        vectors.append(np.array([item.embedding for item in reply.data]))
    assert vectors[0].shape == (3, 64)
    np.testing.assert_allclose(vectors[0], vectors[1], rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(vectors[0], axis=1), 1, atol=1e-5)


def test_what_it_cannot_do_is_a_4xx_and_it_keeps_serving(servers):
    native, _ = servers
    client = openai_client(native)
    model = client.models.list().data[0].id
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])
    assert httpx.get(f"{native}/health").json()["status"] == "ok"
