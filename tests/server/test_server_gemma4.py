"""Gemma 4's chat format on every API, through the official clients: a scripted model on the tokenizer of a converted
Gemma 4 (its own tokenizer, the markers as added tokens) under Gemma 4's real chat template (llama.cpp's copy of
google/gemma-4-31B-it's). Its thought channel is the reasoning, `<|tool_call>call:NAME{...}` a tool call."""

from __future__ import annotations

import json

import anthropic
import ollama
import pytest
from reference.converted import build
from server_harness import openai_client, scripted_server

from runlm import load

TURN = "<|turn>model\n"
THOUGHT, CLOSE, RESULT = "<|channel>thought\n", "<channel|>", "<tool_response|>"
THINKING = "Two and two make four."
ANSWER, JSON_ANSWER = "It is 4.", '{"answer": 4}'
CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>'
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}
EXPECTED = ("get_weather", {"city": "Paris", "days": 2})
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
WEATHER = [{"role": "user", "content": "Weather in Paris?"}]


def gemma4_reply(text: str, n: int) -> str:
    """What the model writes on from `text`: a thought where the system turn switched thinking on (the template
    wrote an empty one otherwise), then a call where the user asked for the weather and no result came back, else
    the answer. A call ends its turn with `<|tool_response>`, an answer with `<turn|>`. Past the thought (closed by
    the model, the template or a spent budget) or the calls' results (the template leaves the turn open after them)
    it goes on with whichever of the two was begun (a forced call's)."""
    last = text.rsplit(TURN, 1)[1] if TURN in text else ""
    call = CALL + "<|tool_response>"
    if "Weather" in text and "<|tool_response>response" not in text:
        body = call
    else:
        body = (JSON_ANSWER if "JSON" in text else ANSWER) + "<turn|>"
    if CLOSE in last or RESULT in last:  # after the thought, or the results of calls (the turn goes on)
        after = last.rsplit(RESULT if RESULT in last else CLOSE, 1)[1]
        return next((done[len(after):] for done in (body, call) if done.startswith(after)), "")
    full = THOUGHT + (THINKING if "<|think|>" in text else "") + CLOSE + body
    return full[len(last):] if full.startswith(last) else ""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    gemma4 = load(str(build("gemma4", tmp_path_factory.mktemp("gemma4"))))
    assert gemma4.chat_template is not None and "<|tool_call>" in gemma4.chat_template.source
    live = scripted_server(gemma4, gemma4_reply, name="gemma4", api_key="")
    yield live
    live.stop()


def chat(server, **extra):
    return openai_client(server.base_url).chat.completions.create(**{"model": "gemma4", "messages": MESSAGES,
                                                                      **extra})


def test_the_thought_channel_is_reasoning_when_thinking_is_on(server):
    off = chat(server).choices[0].message
    assert (getattr(off, "reasoning_content", None), off.content) == (None, ANSWER)
    message = chat(server, reasoning_effort="high").choices[0].message
    assert (message.reasoning_content, message.content) == (THINKING, ANSWER)
    on = {"chat_template_kwargs": {"enable_thinking": True}}
    reasoning = content = ""
    for chunk in chat(server, stream=True, extra_body=on):
        delta = chunk.choices[0].delta if chunk.choices else None
        reasoning += getattr(delta, "reasoning_content", None) or "" if delta else ""
        content += (delta.content or "") if delta else ""
    assert (reasoning, content) == (THINKING, ANSWER)

    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused")
    reply = claude.messages.create(model="gemma4", max_tokens=200, messages=MESSAGES,
                                   thinking={"type": "enabled", "budget_tokens": 1024})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in reply.content] == [
        ("thinking", THINKING), ("text", ANSWER)]
    answer = ollama.Client(host=server.base_url).chat(model="gemma4", messages=MESSAGES, think=True)
    assert (answer.message.thinking, answer.message.content) == (THINKING, ANSWER)


def test_a_thinking_budget_closes_the_channel_and_the_answer_follows(server):
    budget = {"chat_template_kwargs": {"enable_thinking": True}, "reasoning_budget": 2}
    message = chat(server, extra_body=budget).choices[0].message
    assert message.content == ANSWER and THINKING.startswith(message.reasoning_content)
    assert 0 < len(message.reasoning_content) < len(THINKING)


def test_json_mode_holds_the_answer_only(server):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    message = chat(server, messages=[{"role": "user", "content": "2 + 2 in JSON"}], reasoning_effort="high",
                   response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
                   ).choices[0].message
    assert (message.reasoning_content, json.loads(message.content)) == (THINKING, {"answer": 4})


def test_a_call_is_a_tool_call_on_every_api_and_its_result_goes_back(server):
    client = openai_client(server.base_url)
    choice = chat(server, messages=WEATHER, tools=[TOOL]).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [EXPECTED]

    pieces = list(client.chat.completions.create(model="gemma4", messages=WEATHER, tools=[TOOL], stream=True))
    deltas = [c for p in pieces if p.choices for c in p.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and len(deltas) > 2  # in pieces
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == EXPECTED[1]
    assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices) == ""

    call = choice.message.tool_calls[0]
    followed = chat(server, tools=[TOOL], messages=[
        *WEATHER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny"}]).choices[0].message
    assert followed.content == ANSWER and not followed.tool_calls

    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused")
    message = claude.messages.create(model="gemma4", max_tokens=200, messages=WEATHER, tools=[
        {"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}])
    assert message.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in message.content if b.type == "tool_use"] == [EXPECTED]
    reply = ollama.Client(host=server.base_url).chat(model="gemma4", messages=WEATHER, tools=[TOOL])
    assert [(c.function.name, dict(c.function.arguments)) for c in reply.message.tool_calls] == [EXPECTED]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_is_written_in_gemma4s_format(server, choice):
    """The model would answer in prose; the grammar writes `<|tool_call>call:get_weather{` and holds the rest."""
    forced = chat(server, tools=[TOOL], tool_choice=choice).choices[0]
    assert forced.finish_reason == "tool_calls" and not forced.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in forced.message.tool_calls] == [EXPECTED]
