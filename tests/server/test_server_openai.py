"""The OpenAI-compatible server on the real SmolLM2, driven by the official `openai` client.

Token counts are kept tiny: on a shared 2-core machine every generated token costs real time.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from server_harness import LiveServer

from runlm.server import create_app

MODEL = "smollm2-135m"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def smollm2(smollm2_loaded):
    return smollm2_loaded


@pytest.fixture(scope="module")
def live(smollm2):
    server = LiveServer(create_app(smollm2, model_name=MODEL, max_queue=4, default_max_tokens=8,
                                   prompt_cache_mb=64))
    yield server
    server.stop()


def chat(client, content: str, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 4)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def test_chat_completion(client):
    r = chat(client, "Say hello.")
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 4
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model == MODEL


def test_text_completion_stop_and_echo(client):
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    text = plain.choices[0].text
    assert text.strip(), text
    # Stop at the first character the model produced after the leading space: nothing of it leaks.
    first_word = text.strip()[:2]
    stopped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, stop=[first_word])
    assert stopped.choices[0].finish_reason == "stop"
    assert first_word not in stopped.choices[0].text
    assert text.startswith(stopped.choices[0].text)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(prompt)


def test_streaming_chat_equals_plain_and_reports_usage(client):
    plain = chat(client, "Name a color.").choices[0].message.content
    stream = chat(client, "Name a color.", stream=True, stream_options={"include_usage": True})
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                parts.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    assert "".join(parts) == plain
    assert finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens > 0
    # The second identical prompt reused the cached prefix.
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_streaming_completion_raw_sse_ends_with_done(http):
    with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "One, two,", "max_tokens": 2,
                                                      "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_logprobs(client):
    r = chat(client, "Hi", max_tokens=2, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    legacy = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 2


def test_seed_reproducibility(client):
    a = chat(client, "Tell me a story.", temperature=1.0, seed=1234, max_tokens=5).choices[0].message.content
    b = chat(client, "Tell me a story.", temperature=1.0, seed=1234, max_tokens=5).choices[0].message.content
    assert a == b


def test_logit_bias_forces_a_token(client, smollm2):
    token = smollm2.tokenizer.encode(" banana", add_bos=False)[0]
    r = chat(client, "Hi", max_tokens=2, logit_bias={str(token): 100})
    assert r.choices[0].message.content == smollm2.tokenizer.decode([token, token])


def test_forced_tool_call(client):
    r = chat(client, "What is the weather in Paris?", tools=[WEATHER_TOOL],
             tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=24)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Tokyo", "Lima")


def test_json_schema_output_validates(client):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
            "is_capital": {"type": "boolean"},
            "rank": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["city", "is_capital", "rank"],
        "additionalProperties": False,
    }
    r = chat(client, "Describe Paris as JSON.", max_tokens=40,
             response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    data = json.loads(r.choices[0].message.content)
    jsonschema.validate(data, schema)
    r2 = chat(client, "Reply in JSON.", max_tokens=12, response_format={"type": "json_object"})
    if r2.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r2.choices[0].message.content), dict)
    else:
        assert r2.choices[0].message.content.startswith("{")


def test_eight_concurrent_streams_match_their_solo_runs(client, live):
    prompts = ["Count to three.", "Name a fruit.", "What is 2+2?", "Say goodbye.", "Name an animal.",
               "What is the sky's color?", "Say hello.", "Name a country."]
    alone = [chat(client, p, max_tokens=4).choices[0].message.content for p in prompts]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            c = openai.OpenAI(base_url=live.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
            stream = chat(c, prompts[i], max_tokens=4, stream=True)
            results[i] = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert [results[i] for i in range(len(prompts))] == alone


def test_queue_full_gives_429_and_disconnect_frees_the_worker(smollm2):
    # One batch slot, so the long request holds it and the short ones queue behind it.
    live = LiveServer(create_app(smollm2, model_name=MODEL, max_queue=4, max_batch=1))
    http = httpx.Client(base_url=live.base_url, timeout=60)
    try:
        _queue_full_then_disconnect(live, http)
    finally:
        http.close()
        live.stop()


def _queue_full_then_disconnect(live, http):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=live.base_url, timeout=120) as long_client:
        with long_client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line)  # it is running now
            assert first.startswith("data: ")
            # Fill the queue (max_queue=4) with short requests from other threads, then one more.
            statuses: list[int] = []

            def short() -> None:
                res = httpx.post(live.base_url + "/v1/completions", timeout=120,
                                 json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0})
                statuses.append(res.status_code)

            waiting = [threading.Thread(target=short) for _ in range(4)]
            for t in waiting:
                t.start()
            deadline = time.time() + 30
            while http.get("/health").json()["queue_depth"] < 4 and time.time() < deadline:
                time.sleep(0.05)
            over = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
            assert over.status_code == 429
            assert over.headers["retry-after"] == "1"
            err = over.json()["error"]
            assert err["type"] == "rate_limit_error" and "busy" in err["message"]
        # Leaving the `with` closed the stream mid-generation: the worker must drop it and serve the rest.
        for t in waiting:
            t.join(120)
    assert statuses == [200] * 4
    metrics = http.get("/metrics").text
    assert 'runlm_generations_total{finish_reason="cancelled"}' in metrics
    assert 'runlm_requests_total{route="/v1/completions",status="429"} 1' in metrics
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200


def test_models_props_health_tokenize(http, smollm2):
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    props = http.get("/props").json()
    assert props["context_length"] == smollm2.context_length
    assert props["quantization"] == smollm2.quantization and props["family"] == smollm2.family
    assert http.get("/health").json()["status"] == "ok"
    ids = http.post("/tokenize", json={"content": "Hello world"}).json()["tokens"]
    assert ids == smollm2.tokenizer.encode("Hello world", add_bos=False)
    assert http.post("/detokenize", json={"tokens": ids}).json()["content"] == "Hello world"
    metrics = http.get("/metrics").text
    for name in ("runlm_requests_total", "runlm_completion_tokens_total", "runlm_queue_depth",
                 "runlm_time_to_first_token_seconds_bucket", "runlm_decode_tokens_per_second",
                 "runlm_prompt_cache_hits_total"):
        assert name in metrics


BAD_CHAT = [
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ({"model": MODEL, "messages": "hello"}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 3}, 400, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, 400, "top_p"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50}, 400,
     "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logit_bias": {"99999999": 5}}, 400,
     "logit_bias"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logit_bias": {"abc": 5}}, 400, "logit_bias"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 17}, 400, "n"),
    ({"model": MODEL}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400,
     "tool_choice"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_CHAT)
def test_bad_chat_requests_are_openai_shaped_4xx(http, body, status, param):
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["message"]


def test_prompt_longer_than_context_is_400(http, smollm2):
    ids = [smollm2.tokenizer.encode("hi", add_bos=False)[0]] * (smollm2.context_length + 5)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "context" in err["message"]


def test_malformed_json_and_openai_client_errors(http, client):
    r = http.post("/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", temperature=-1)


def test_api_key_guards_everything_but_health(smollm2):
    server = LiveServer(create_app(smollm2, model_name=MODEL, api_key="s3cret", max_queue=1))
    try:
        base = server.base_url
        assert httpx.get(base + "/health").status_code == 200
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/props"),
                             ("POST", "/v1/chat/completions"), ("POST", "/tokenize")):
            r = httpx.request(method, base + path, json={})
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == "invalid_api_key"
        bad = httpx.get(base + "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert bad.status_code == 401
        c = openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0)
        assert c.models.list().data[0].id == MODEL
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        server.stop()


def test_body_size_limit(smollm2):
    server = LiveServer(create_app(smollm2, model_name=MODEL, max_body_bytes=1000))
    try:
        r = httpx.post(server.base_url + "/tokenize", json={"content": "x" * 5000})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert httpx.post(server.base_url + "/tokenize", json={"content": "ok"}).status_code == 200
    finally:
        server.stop()
