"""Anthropic's Messages API on a real loopback server, driven by the official `anthropic` client.

Greedy answers are compared with the OpenAI chat route's greedy answer for the same messages (the f32
SmolLM2, so routes agree exactly). Token counts are kept tiny: every generated token costs real time.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from reference.tiny_vision import build_gemma3_vision
from server_harness import LiveServer
from test_server_images import png_data_url

from runlm import load
from runlm.server import create_app

MODEL = "smollm2-135m"
KEY = "test-key"
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]}},
                     "required": ["city"], "additionalProperties": False},
}
QUESTION = [{"role": "user", "content": "Name a color."}]
# The newest SDK dropped temperature from its signature; runlm still takes it (older clients send it).
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def live(smollm2_loaded):
    server = LiveServer(create_app(smollm2_loaded, model_name=MODEL, api_key=KEY, max_queue=4, prompt_cache_mb=64))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    return anthropic.Anthropic(base_url=live.base_url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(live):
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def openai_answer(oai, messages, max_tokens=6) -> str:
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_plain_message_equals_the_chat_route(client, oai):
    r = client.messages.create(model=MODEL, max_tokens=6, **GREEDY, messages=QUESTION)
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL and r.id.startswith("msg_")
    assert r.content[0].type == "text" and text_of(r)
    assert text_of(r) == openai_answer(oai, QUESTION)
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    assert r.usage.output_tokens <= 6
    counted = client.messages.count_tokens(model=MODEL, messages=QUESTION)
    assert counted.input_tokens == r.usage.input_tokens > 0


def test_system_as_string_or_blocks_equals_the_chat_route(client, oai):
    system = "You answer in one word."
    as_string = client.messages.create(model=MODEL, max_tokens=5, **GREEDY, system=system, messages=QUESTION)
    as_blocks = client.messages.create(model=MODEL, max_tokens=5, **GREEDY,
                                       system=[{"type": "text", "text": system}], messages=QUESTION)
    want = openai_answer(oai, [{"role": "system", "content": system}, *QUESTION], max_tokens=5)
    assert text_of(as_string) == text_of(as_blocks) == want


def test_streamed_text_equals_plain(client):
    plain = client.messages.create(model=MODEL, max_tokens=6, **GREEDY, messages=QUESTION)
    with client.messages.stream(model=MODEL, max_tokens=6, **GREEDY, messages=QUESTION) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(plain) == text_of(final)
    assert final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_raw_stream_event_sequence(live):
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, "stream": True, "messages": QUESTION}
    with httpx.stream("POST", live.base_url + "/v1/messages", json=body, headers={"x-api-key": KEY},
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in datas]  # every event: line names its data
    assert names[:2] == ["message_start", "content_block_start"]
    assert set(names[2:-3]) <= {"content_block_delta"} and names[-3:] == ["content_block_stop", "message_delta",
                                                                            "message_stop"]
    assert datas[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens") and datas[-2]["usage"]["output_tokens"]
    assert "[DONE]" not in "".join(lines)


def test_stop_sequence_is_reported(client):
    plain = text_of(client.messages.create(model=MODEL, max_tokens=6, **GREEDY, messages=QUESTION))
    stop = plain.strip()[:3]
    r = client.messages.create(model=MODEL, max_tokens=6, **GREEDY, messages=QUESTION, stop_sequences=[stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert stop not in text_of(r) and plain.startswith(text_of(r))


def test_forced_tool_use_round_trip(client, oai):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "tool", "name": "get_weather"}
    r = client.messages.create(model=MODEL, max_tokens=40, **GREEDY, messages=ask, tools=[WEATHER],
                               tool_choice=forced)
    assert r.stop_reason == "tool_use"
    [call] = [b for b in r.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input["city"] in ("Paris", "Tokyo", "Lima")
    assert call.id.startswith("toolu_")
    # The same call through the chat route with the same forced choice.
    chat = oai.chat.completions.create(model=MODEL, messages=ask, max_tokens=40, temperature=0,
                                       tools=[{"type": "function", "function": {
                                           "name": WEATHER["name"], "description": WEATHER["description"],
                                           "parameters": WEATHER["input_schema"]}}],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(chat.choices[0].message.tool_calls[0].function.arguments) == call.input
    # Streamed, the call arrives as a tool_use block with one input_json_delta.
    with client.messages.stream(model=MODEL, max_tokens=40, **GREEDY, messages=ask, tools=[WEATHER],
                                tool_choice=forced) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.input for b in final.content if b.type == "tool_use"] == [call.input]
    # The round trip: the call and its result go back; the model answers in text.
    follow = [*ask, {"role": "assistant", "content": r.content},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                            "content": "Sunny, 24 C"}]}]
    answer = client.messages.create(model=MODEL, max_tokens=6, **GREEDY, messages=follow, tools=[WEATHER])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
    counted = client.messages.count_tokens(model=MODEL, messages=follow, tools=[WEATHER])
    assert counted.input_tokens == answer.usage.input_tokens


def test_output_config_json_schema(client):
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "blue", "green"]}},
              "required": ["color"], "additionalProperties": False}
    r = client.messages.create(model=MODEL, max_tokens=20, **GREEDY, messages=QUESTION,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert json.loads(text_of(r))["color"] in ("red", "blue", "green")


@pytest.mark.parametrize("body, status, kind", [
    ({"messages": QUESTION}, 400, "invalid_request_error"),  # max_tokens is required
    ({"max_tokens": 4, "messages": []}, 400, "invalid_request_error"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400,
     "invalid_request_error"),
    ({"max_tokens": 4, "messages": QUESTION, "temperature": 1.5}, 400, "invalid_request_error"),
    ({"max_tokens": 4, "messages": QUESTION, "tool_choice": {"type": "tool"}, "tools": [WEATHER]}, 400,
     "invalid_request_error"),
    ({"max_tokens": 4, "messages": QUESTION, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "invalid_request_error"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, 400,
     "invalid_request_error"),  # SmolLM2 has no vision tower
    ({"model": "claude-nope", "max_tokens": 4, "messages": QUESTION}, 404, "not_found_error"),
])
def test_bad_input_gets_anthropic_errors(live, body, status, kind):
    r = httpx.post(live.base_url + "/v1/messages", json={"model": MODEL, **body}, headers={"x-api-key": KEY},
                   timeout=60)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and error["error"]["message"]


def test_sdk_raises_typed_errors(client, live):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=4, messages=QUESTION)
    with pytest.raises(anthropic.BadRequestError, match="no vision tower|cannot take images"):
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    wrong = anthropic.Anthropic(base_url=live.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model=MODEL, max_tokens=4, messages=QUESTION)
    assert caught.value.body["error"]["type"] == "authentication_error"
    # A bearer key works on these routes too, and x-api-key works on OpenAI's.
    headers = {"authorization": f"Bearer {KEY}"}
    assert httpx.post(live.base_url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": QUESTION},
                      headers=headers).status_code == 200
    assert httpx.get(live.base_url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200


def test_image_block_equals_the_chat_routes_image_url(tmp_path):
    directory = tmp_path / "vision"
    build_gemma3_vision(directory)
    server = LiveServer(create_app(load(directory / "hf", dtype="f32"), model_name="tiny-vl", api_key=""))
    try:
        url, _ = png_data_url()
        media_type, data = url.removeprefix("data:").split(";base64,")
        client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
        r = client.messages.create(model="tiny-vl", max_tokens=6, **GREEDY, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}},
            {"type": "text", "text": "hello"}]}])
        chat = httpx.post(server.base_url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny-vl", "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hello"}]}]}).json()
        assert text_of(r) == chat["choices"][0]["message"]["content"]
        assert r.usage.input_tokens == chat["usage"]["prompt_tokens"] > 16
    finally:
        server.stop()
