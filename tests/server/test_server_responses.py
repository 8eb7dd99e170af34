"""OpenAI's Responses API on the real SmolLM2, driven by the official `openai` client.

The Responses route plans through chat completions, so with greedy decoding a response must say exactly
what the chat route says for the same conversation: that is the reference these tests hold it to.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel
from server_harness import LiveServer

from runlm.engine import GenerationRequest, StreamRecord, Usage
from runlm.server import create_app
from runlm.server.openai_shapes import ChatPlan
from runlm.server.responses_shapes import (
    ResponseEvents,
    ResponsesPlan,
    ResponsesRequest,
    ResponseStore,
    StoredResponse,
)
from runlm.server.sse import event_stream
from runlm.server.tools import ToolPlan

MODEL = "smollm2-135m"
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added"]
STREAM_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def live(smollm2_loaded):
    server = LiveServer(create_app(smollm2_loaded, model_name=MODEL, max_queue=4, prompt_cache_mb=64))
    yield server
    server.stop()


def respond(client, input, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_output_tokens", 6)
    return client.responses.create(model=MODEL, input=input, **kw)


def chat_text(client, messages, max_tokens=6) -> str:
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content


def test_plain_response_says_what_chat_says(client):
    r = respond(client, "Name a color.", instructions="Answer in one word.")
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status in ("completed", "incomplete")
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert r.output_text == chat_text(client, [{"role": "system", "content": "Answer in one word."},
                                               {"role": "user", "content": "Name a color."}])
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 6
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    # Items as a list (input_text parts) are the same conversation as the plain string.
    items = respond(client, [{"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]}],
                    instructions="Answer in one word.")
    assert items.output_text == r.output_text


def test_streamed_response_events_in_order_and_deltas_add_up(client):
    plain = respond(client, "Say hi.")
    events = list(respond(client, "Say hi.", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == STREAM_ORDER
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas):-1] == STREAM_END
    assert kinds[-1] == ("response.completed" if plain.status == "completed" else "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(d.delta for d in deltas)
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert text == done.text == final.output_text == plain.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_raw_stream_names_each_event_and_has_no_done_marker(http):
    body = {"model": MODEL, "input": "Say hi.", "max_output_tokens": 2, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert "data: [DONE]" not in lines
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    payloads = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert names == [p["type"] for p in payloads] and len(names) == len(lines) // 2


def test_stream_helper_gives_the_final_response(client):
    # max_output_tokens large enough for the model to end its answer: the helper wants response.completed.
    with client.responses.stream(model=MODEL, input="Say hello.", max_output_tokens=48, temperature=0) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == text and text


def test_tool_round_trip_with_function_call_output(client):
    first = respond(client, "What's the weather in Paris?", tools=[WEATHER_TOOL],
                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=32)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"}
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "22 C and sunny"}
    # Client-side history: the first input, the output items as they came, the tool's result.
    manual = respond(client, [{"role": "user", "content": "What's the weather in Paris?"},
                              *[item.model_dump(exclude_none=True) for item in first.output], result],
                     tools=[WEATHER_TOOL], tool_choice="none", max_output_tokens=12)
    # Server-side history: the same conversation through previous_response_id.
    chained = respond(client, [result], previous_response_id=first.id, tools=[WEATHER_TOOL], tool_choice="none",
                      max_output_tokens=12)
    assert manual.output[0].type == "message" and manual.output_text
    assert chained.output_text == manual.output_text
    assert chained.usage.input_tokens == manual.usage.input_tokens
    # The chat route, given the same turns, answers the same.
    assert manual.output_text == chat_text(client, [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "name": "get_weather", "content": "22 C and sunny"},
    ], max_tokens=12)


def test_streamed_forced_tool_call_is_a_function_call_item(client):
    events = list(respond(client, "Weather in Tokyo?", tools=[WEATHER_TOOL], tool_choice="required",
                          max_output_tokens=32, stream=True))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert deltas  # one for a bare JSON call (whole at the end), several for a <tool_call> block
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *[d.type for d in deltas], "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    done = events[-3]
    assert done.name == "get_weather" and json.loads(done.arguments)["city"] in ("Paris", "Tokyo", "Lima")
    assert events[-1].response.output[0].arguments == done.arguments == "".join(d.delta for d in deltas)


def test_previous_response_id_continues_the_conversation(client):
    first = respond(client, "My name is Ada.", max_output_tokens=8)
    second = respond(client, "What is my name?", previous_response_id=first.id, max_output_tokens=8)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.output_text == chat_text(client, [
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}], max_tokens=8)
    # Instructions do not carry over (as on OpenAI): a chain of three still sees both earlier turns.
    third = respond(client, "Thanks.", previous_response_id=second.id, max_output_tokens=2)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_json_schema_text_format_through_parse(client):
    class Weather(BaseModel):
        city: Literal["Paris", "Tokyo", "Lima"]
        sunny: bool

    r = client.responses.parse(model=MODEL, input="Is it sunny in Paris? Answer as JSON.", text_format=Weather,
                               temperature=0, max_output_tokens=40)
    assert r.status == "completed" and isinstance(r.output_parsed, Weather)
    assert Weather.model_validate_json(r.output_text) == r.output_parsed


def test_get_and_delete_a_stored_response(client):
    created = respond(client, "Say yes.", max_output_tokens=2)
    got = client.responses.retrieve(created.id)
    assert got.id == created.id and got.output_text == created.output_text and got.usage == created.usage
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError) as err:
        respond(client, "Hi", previous_response_id=created.id)
    assert err.value.body["param"] == "previous_response_id"
    unstored = respond(client, "Say no.", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_store_keeps_the_most_recently_used():
    store = ResponseStore(capacity=2)
    for rid in ("a", "b"):
        store.put(StoredResponse({"id": rid}, []))
    assert store.get("a") is not None  # "a" is now the most recently used
    store.put(StoredResponse({"id": "c"}, []))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert store.usage() == (2, store.usage()[1]) and store.delete("a") and not store.delete("a")


def test_one_key_never_evicts_anothers_and_bytes_count_against_its_own_quota():
    store = ResponseStore(capacity=3, max_bytes=2000)
    mine, theirs = store.scoped("key-a"), store.scoped("key-b")
    mine.put(StoredResponse({"id": "kept"}, [{"role": "user", "content": "hi"}]))
    for i in range(50):  # another key fills its own quota many times over
        theirs.put(StoredResponse({"id": f"r{i}"}, [{"role": "user", "content": "x" * 400}]))
    assert mine.get("kept") is not None and theirs.get("kept") is None
    count, size = store.usage("key-b")
    assert count <= 3 and size <= 2000 and theirs.get("r49") is not None and theirs.get("r0") is None
    assert not theirs.put(StoredResponse({"id": "huge"}, [{"role": "user", "content": "x" * 5000}]))
    assert theirs.get("huge") is None and theirs.get("r49") is not None  # refused whole, evicting nothing


BAD = [
    ({"model": MODEL, "input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata"),
    ({"model": MODEL, "input": "x", "metadata": {"k" * 65: "v"}}, 400, "metadata." + "k" * 65),
    ({"model": MODEL, "input": "x", "metadata": {"k": "v" * 513}}, 400, "metadata.k"),
    ({"model": MODEL, "input": "x", "user": "u" * 513}, 400, "user"),
    ({"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    ({"model": MODEL, "input": "x", "tools": [{"type": "function"}]}, 400, "tools.0.name"),
    ({"model": MODEL, "input": "x", "background": True}, 400, "background"),
    ({"model": MODEL, "input": "x", "tool_choice": {"type": "web_search_preview"}}, 400, "tool_choice"),
    ({"model": MODEL, "input": "x", "tool_choice": "required"}, 400, "tool_choice"),
    ({"model": MODEL, "input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"model": MODEL, "input": [{"type": "file_search_call", "id": "x"}]}, 400, "input.0.type"),
    ({"model": MODEL, "input": [{"type": "function_call_output", "output": "x"}]}, 400, "input.0.call_id"),
    ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, 400,
     "input.0.content.0.type"),
    ({"model": MODEL, "input": [{"role": "robot", "content": "x"}]}, 400, "input.0.role"),
    ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     400, "input"),  # SmolLM2 has no vision tower
    ({"model": MODEL, "input": []}, 400, "input"),
    ({"model": MODEL, "input": "x", "temperature": 3}, 400, "temperature"),
    ({"model": MODEL, "input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"model": MODEL, "input": "x", "text": {"format": {"type": "yaml"}}}, 400, "text.format.type"),
    ({"model": "gpt-5", "input": "x"}, 404, "model"),
    ({"input": "x"}, 400, "model"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD)
def test_bad_requests_are_openai_shaped_4xx(http, body, status, param):
    r = http.post("/v1/responses", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["message"]


def test_unknown_stored_response_is_404_in_openai_shape(http):
    for method in ("GET", "DELETE"):
        r = http.request(method, "/v1/responses/resp_missing")
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"


def test_a_mid_stream_failure_ends_with_error_and_failed_events():
    """The stream reports a failure after its status line in the Responses API's own events."""
    plan = ResponsesPlan(GenerationRequest([1]), ChatPlan(GenerationRequest([1]), ToolPlan()),
                         ResponsesRequest(model=MODEL, input="x"), [])

    class Failing:
        usage = Usage()
        cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

        async def __aiter__(self):
            yield StreamRecord(text="Hel")
            raise RuntimeError("the kernel fell over")

    source = Failing()

    async def frames() -> list[str]:
        events = ResponseEvents(plan, ResponseStore())
        return [f async for f in event_stream(source, events, typed=True, failure=events.failure)]

    payloads = [json.loads(f.split("data: ", 1)[1]) for f in asyncio.run(frames())]
    kinds = [p["type"] for p in payloads]
    assert kinds == STREAM_ORDER + ["response.output_text.delta", "error", "response.failed"]
    assert payloads[-2]["message"].endswith("the kernel fell over") and payloads[-2]["code"] == "internal_error"
    assert payloads[-1]["response"]["status"] == "failed"
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    assert source.cancelled
