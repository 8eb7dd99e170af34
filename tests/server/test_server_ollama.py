"""Ollama's API on a real loopback server, driven by the official `ollama` client.

Greedy answers are compared with the OpenAI routes' greedy answers for the same messages or prompt (the f32
SmolLM2, so routes agree exactly); embeddings with /v1/embeddings'. Token counts are kept tiny.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import ollama
import openai
import pytest
from reference.tiny import build_qwen3_embedding
from server_harness import LiveServer

from runlm import load
from runlm.server import create_app

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "Name a color."}]
GREEDY = {"temperature": 0, "num_predict": 6}


@pytest.fixture(scope="module")
def live(smollm2_loaded):
    server = LiveServer(create_app(smollm2_loaded, model_name=MODEL, api_key="", max_queue=4, prompt_cache_mb=64))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    return ollama.Client(host=live.base_url, timeout=120)


@pytest.fixture(scope="module")
def oai(live):
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def openai_chat(oai, messages, max_tokens=6):
    return oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)


def test_chat_equals_the_openai_route(client, oai):
    r = client.chat(model=MODEL, messages=QUESTION, stream=False, options=GREEDY)
    want = openai_chat(oai, QUESTION)
    assert r.message.role == "assistant" and r.message.content == want.choices[0].message.content
    assert r.done and r.done_reason in ("stop", "length") and r.model == MODEL
    assert r.prompt_eval_count == want.usage.prompt_tokens and r.eval_count == want.usage.completion_tokens
    assert r.total_duration > 0 and r.created_at


def test_chat_streams_by_default_and_equals_whole(client):
    whole = client.chat(model=MODEL, messages=QUESTION, stream=False, options=GREEDY)
    parts = list(client.chat(model=MODEL, messages=QUESTION, stream=True, options=GREEDY))
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    assert [p.done for p in parts][-1] is True and not any(p.done for p in parts[:-1])
    assert parts[-1].eval_count == whole.eval_count and parts[-1].done_reason == whole.done_reason


def test_raw_ndjson_stream(live):
    body = {"model": MODEL, "prompt": "Name a color.", "options": {"temperature": 0, "num_predict": 3}}
    with httpx.stream("POST", live.base_url + "/api/generate", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        objects = [json.loads(line) for line in r.iter_lines() if line]
    assert objects[-1]["done"] is True and objects[-1]["eval_count"] == 3
    assert all(o["done"] is False and o["response"] for o in objects[:-1])


def test_generate_streamed_equals_the_chat_route(client, oai):
    """Without raw, the prompt (and system) go through the chat template, as Ollama does."""
    parts = list(client.generate(model=MODEL, prompt="Name a color.", system="Answer briefly.", stream=True,
                                 options=GREEDY))
    want = openai_chat(oai, [{"role": "system", "content": "Answer briefly."}, *QUESTION])
    assert "".join(p.response for p in parts) == want.choices[0].message.content
    assert parts[-1].done and parts[-1].prompt_eval_count == want.usage.prompt_tokens


def test_raw_generate_equals_text_completion(client, oai):
    r = client.generate(model=MODEL, prompt="The capital of France is", raw=True, stream=False,
                        options={"temperature": 0, "num_predict": 4})
    want = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert r.response == want.choices[0].text and r.done_reason == "length"


def test_stop_option_and_latest_tag(client):
    whole = client.chat(model=MODEL, messages=QUESTION, stream=False, options=GREEDY).message.content
    stop = whole.strip()[:3]
    r = client.chat(model=MODEL + ":latest", messages=QUESTION, stream=False, options={**GREEDY, "stop": [stop]})
    assert r.done_reason == "stop" and stop not in r.message.content and whole.startswith(r.message.content)


def test_tool_call_and_result_messages_equal_the_openai_route(client, oai):
    """Ollama's tool_calls (arguments as an object) and tool messages (tool_name) mean OpenAI's."""
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}
    ask = {"role": "user", "content": "Weather in Paris?"}
    ollama_messages = [ask, {"role": "assistant", "content": "",
                             "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                       {"role": "tool", "content": "Sunny", "tool_name": "get_weather"}]
    openai_messages = [ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "Sunny", "tool_call_id": "call_1_0", "name": "get_weather"}]
    r = client.chat(model=MODEL, messages=ollama_messages, tools=[tool], stream=False, options=GREEDY)
    want = oai.chat.completions.create(model=MODEL, messages=openai_messages, tools=[tool], max_tokens=6,
                                       temperature=0)
    assert r.prompt_eval_count == want.usage.prompt_tokens
    assert r.message.content == (want.choices[0].message.content or "")


def test_format_schema_gives_json(client):
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "blue", "green"]}},
              "required": ["color"], "additionalProperties": False}
    r = client.chat(model=MODEL, messages=QUESTION, format=schema, stream=False,
                    options={"temperature": 0, "num_predict": 20})
    assert json.loads(r.message.content)["color"] in ("red", "blue", "green")


def test_embed_equals_openai_embeddings(client, oai):
    texts = ["The cat sat on the mat.", "Markets fell."]
    r = client.embed(model=MODEL, input=texts)
    want = oai.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert np.abs(np.array(r.embeddings) - np.array([d.embedding for d in want.data])).max() < 1e-6
    assert r.prompt_eval_count == want.usage.prompt_tokens
    short = client.embed(model=MODEL, input="The cat sat on the mat.", dimensions=32)
    assert len(short.embeddings[0]) == 32 and abs(np.linalg.norm(short.embeddings[0]) - 1) < 1e-5


def test_embed_on_an_embedding_model_truncates_by_default(tmp_path):
    """A tiny Qwen3-Embedding-style model (256-token context): /api/embed equals sentence-transformers, cuts
    an input longer than the context unless told not to."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    directory = tmp_path / "qwen3-embedding"
    build_qwen3_embedding(directory)
    server = LiveServer(create_app(load(directory, dtype="f32"), model_name="tiny-embed", api_key=""))
    try:
        tiny = ollama.Client(host=server.base_url, timeout=120)
        texts = ["The quick brown fox", "Grüße aus München!"]
        want = sentence_transformers.SentenceTransformer(str(directory), device="cpu").encode(texts, batch_size=1)
        assert np.abs(np.array(tiny.embed(model="tiny-embed", input=texts).embeddings) - want).max() <= 1e-4
        long_text = "The quick brown fox jumps over the lazy dog. " * 60  # > 256 tokens
        r = tiny.embed(model="tiny-embed", input=long_text)
        assert len(r.embeddings[0]) == 64 and r.prompt_eval_count == 256
        with pytest.raises(ollama.ResponseError) as caught:
            tiny.embed(model="tiny-embed", input=long_text, truncate=False)
        assert caught.value.status_code == 400 and "context" in caught.value.error
    finally:
        server.stop()


def test_list_show_ps_version(client, live, smollm2_loaded):
    [model] = client.list().models
    assert model.model == MODEL and model.size == smollm2_loaded.path.stat().st_size and model.digest
    assert model.details.family == "llama32" and model.details.format == "gguf"
    assert model.details.parameter_size == "135M" and model.details.quantization_level == smollm2_loaded.quantization
    shown = client.show(MODEL)
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == smollm2_loaded.context_length
    assert "completion" in shown.capabilities and shown.template and shown.details.family == "llama32"
    [running] = client.ps().models
    assert running.model == MODEL and running.context_length == smollm2_loaded.context_length
    assert httpx.get(live.base_url + "/api/version").json()["version"]


def test_empty_requests_load_the_model(client):
    r = client.generate(model=MODEL, prompt="", stream=False)
    assert r.done and r.done_reason == "load" and r.response == ""
    assert client.chat(model=MODEL, messages=[], stream=False).done_reason == "load"


@pytest.mark.parametrize("path, body, status, text", [
    ("/api/chat", {"model": "nope", "messages": QUESTION}, 404, "not served here"),
    ("/api/generate", {"model": "nope", "prompt": ""}, 404, "not served here"),
    ("/api/chat", {"model": MODEL, "messages": QUESTION, "options": {"temperature": "hot"}}, 400, "temperature"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "x", "images": ["AAAA"]}]}, 400,
     "cannot take images"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "template": "{{ .Prompt }}"}, 400, "template"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "format": "yaml"}, 400, "format"),
    ("/api/embed", {"model": MODEL, "input": ""}, 400, "empty"),
    ("/api/show", {}, 400, "model"),
    ("/api/pull", {"model": "llama3.2"}, 400, "runlm cannot pull 'llama3.2'"),
])
def test_bad_input_gets_ollama_errors(live, path, body, status, text):
    r = httpx.post(live.base_url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    assert list(r.json()) == ["error"] and text in r.json()["error"]


def test_pull_on_a_server_of_one_model_stores_into_the_cache(client, smollm2_gguf):
    """The model is in the cache already (the tests' copy): the pull checks it is there and says so."""
    assert client.pull(MODEL, stream=False).status == "success"


def test_client_raises_response_error(client):
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model="nope", messages=QUESTION)
    assert caught.value.status_code == 404
