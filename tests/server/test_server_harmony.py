"""gpt-oss's harmony replies on every API, through the official clients: a scripted model (real SmolLM2 tokenizer,
a live server) under a harmony chat template writes its analysis channel, then a final answer or a call on the
commentary channel. The analysis is the reasoning, the final channel the answer, the call a tool call."""

from __future__ import annotations

import json

import anthropic
import ollama
import pytest
from server_harness import openai_client, scripted_server

from runlm.engine.harmony import FORCED_CALL_HEAD
from runlm.text.chat import ChatTemplate

# the shape of gpt-oss's template: a system message with the reasoning effort, tools in a developer message, the
# calls and results on the commentary channel, and a reply opened at `<|start|>assistant`
HARMONY = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{% if tools %}<|start|>developer<|message|># Tools\n{{ tools | tojson }}<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<|start|>assistant to=functions.{{ c.function.name }}"
    "<|channel|>commentary json<|message|>{{ c.function.arguments | tojson }}<|call|>{% endfor %}"
    "{% elif m.role == 'tool' %}<|start|>functions.tool to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% endfor %}<|start|>assistant"
)
ANALYSIS, FINAL, OPEN = "<|channel|>analysis<|message|>", "<|channel|>final<|message|>", "<|start|>assistant"
ANSWER, JSON_ANSWER = "It is 4.", '{"answer": 4}'
CALL = 'get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}'
TIME_CALL = "get_time <|constrain|>json<|message|>{}"
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
EXPECTED = ("get_weather", {"city": "Paris", "days": 2})
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
WEATHER = [{"role": "user", "content": "Weather in Paris?"}]


def thought(prompt: str) -> str:
    effort = prompt.split("Reasoning: ", 1)[1].split("<|end|>", 1)[0]
    return f"Thinking at {effort} effort, and at length about it."


def harmony_reply(text: str, n: int) -> str:
    """What the model writes on from `text`: its analysis, then a call where the user asked for the weather, else
    the final answer (JSON where JSON was asked for). After a call's header in the prompt it calls get_time, or
    goes on with get_weather where that was begun."""
    last = text.rsplit(OPEN, 1)[1]  # the message being written
    answer = JSON_ANSWER if "JSON" in text else ANSWER
    if last.startswith(FINAL):
        done = last[len(FINAL):]
        return answer[len(done):] if answer.startswith(done) else ""
    if last.startswith(FORCED_CALL_HEAD):
        done = last[len(FORCED_CALL_HEAD):]
        return next((call[len(done):] for call in (TIME_CALL, CALL) if call.startswith(done)), "")
    full = thought(text)
    done = last[len(ANALYSIS):] if last.startswith(ANALYSIS) else ""
    end = (f" to=functions.{CALL.replace(' <|constrain|>', '<|channel|>commentary <|constrain|>', 1)}"
           if "Weather" in text and "tool to=assistant" not in text else f"{FINAL}{answer}")
    return ("" if last.startswith(ANALYSIS) else ANALYSIS) + full[len(done):] + f"<|end|>{OPEN}" + end


@pytest.fixture(scope="module")
def server(smollm2_loaded):
    live = scripted_server(smollm2_loaded, harmony_reply, name="oss", api_key="",
                           chat_template=ChatTemplate(HARMONY))
    yield live
    live.stop()


def chat(server, **extra):
    return openai_client(server.base_url).chat.completions.create(**{"model": "oss", "messages": MESSAGES, **extra})


def test_the_analysis_is_reasoning_content_and_the_final_channel_the_answer(server):
    message = chat(server).choices[0].message
    assert (message.reasoning_content, message.content) == (thought("Reasoning: medium<|end|>"), ANSWER)
    kinds, reasoning, content = [], "", ""
    for chunk in chat(server, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None and getattr(delta, "reasoning_content", None):
            kinds.append("reasoning")
            reasoning += delta.reasoning_content
        if delta is not None and delta.content:
            kinds.append("content")
            content += delta.content
    assert (reasoning, content) == (message.reasoning_content, ANSWER)
    assert kinds.count("reasoning") > 1 and kinds.index("content") > max(
        i for i, kind in enumerate(kinds) if kind == "reasoning")


def test_reasoning_effort_reaches_the_template_as_gpt_oss_takes_it(server):
    """gpt-oss has no off switch: "none" and "minimal" are its lowest effort."""
    assert chat(server, reasoning_effort="high").choices[0].message.reasoning_content == thought(
        "Reasoning: high<|end|>")
    assert chat(server, reasoning_effort="none").choices[0].message.reasoning_content == thought(
        "Reasoning: low<|end|>")


def test_reasoning_format_none_leaves_the_channels_in_the_answer(server):
    message = chat(server, extra_body={"reasoning_format": "none"}).choices[0].message
    assert message.content.startswith(ANALYSIS) and message.content.endswith(f"{FINAL}{ANSWER}")


def test_a_commentary_call_is_a_tool_call_on_every_api(server):
    client = openai_client(server.base_url)
    choice = chat(server, messages=WEATHER, tools=[TOOL]).choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.reasoning_content == thought("Reasoning: medium<|end|>")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [EXPECTED]

    pieces = list(client.chat.completions.create(model="oss", messages=WEATHER, tools=[TOOL], stream=True))
    deltas = [c for p in pieces if p.choices for c in p.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and len(deltas) > 2  # in pieces
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(arguments) == EXPECTED[1] and {d.index for d in deltas} == {0}
    assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices) == ""

    # the call and its result go back through the template, and the model answers
    call = choice.message.tool_calls[0]
    followed = chat(server, tools=[TOOL], messages=[
        *WEATHER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny"}]).choices[0].message
    assert followed.content == ANSWER and not followed.tool_calls

    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused")
    message = claude.messages.create(model="oss", max_tokens=200, messages=WEATHER, tools=[
        {"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}])
    assert message.stop_reason == "tool_use" and [b.type for b in message.content] == ["thinking", "tool_use"]
    assert (message.content[1].name, message.content[1].input) == EXPECTED

    reply = ollama.Client(host=server.base_url).chat(model="oss", messages=WEATHER, tools=[TOOL])
    assert [(c.function.name, dict(c.function.arguments)) for c in reply.message.tool_calls] == [EXPECTED]
    assert reply.message.thinking == thought("Reasoning: medium<|end|>")


@pytest.mark.parametrize(("choice", "expected"), [
    ("required", ("get_time", {})),
    ({"type": "function", "function": {"name": "get_weather"}}, EXPECTED),
])
def test_a_forced_call_is_written_in_harmony_under_a_grammar(server, choice, expected):
    """The prompt writes the call's header; the grammar holds the name and the JSON arguments after it. The model,
    asked no weather question, would answer if it were free, and calls get_time where it may choose; named,
    get_weather is what the grammar lets it write."""
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    choice_ = chat(server, tools=[other, TOOL], tool_choice=choice).choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice_.message.tool_calls] == [expected]
    assert not choice_.message.content and getattr(choice_.message, "reasoning_content", None) is None


def test_a_json_answer_is_the_final_channel_and_only_it_is_held_to_the_grammar(server):
    asked = [{"role": "user", "content": "Answer in JSON: what is 2 + 2?"}]
    message = chat(server, messages=asked, response_format={"type": "json_object"}).choices[0].message
    assert (message.reasoning_content, message.content) == (thought("Reasoning: medium<|end|>"), JSON_ANSWER)


def test_a_spent_thinking_budget_ends_the_analysis_and_the_final_answer_follows(server, smollm2_loaded):
    message = chat(server, extra_body={"reasoning_budget": 6}).choices[0].message
    full = thought("Reasoning: medium<|end|>")
    assert message.content == ANSWER and full.startswith(message.reasoning_content)
    assert 4 <= len(smollm2_loaded.tokenizer.encode(message.reasoning_content, add_bos=False)) <= 6
    none = chat(server, extra_body={"reasoning_budget": 0}).choices[0].message
    assert none.content == ANSWER and getattr(none, "reasoning_content", None) is None


def test_anthropic_ollama_and_responses_get_the_analysis_as_thinking(server):
    expected = thought("Reasoning: medium<|end|>")
    message = anthropic.Anthropic(base_url=server.base_url, api_key="unused").messages.create(
        model="oss", max_tokens=200, messages=MESSAGES)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", expected), ("text", ANSWER)]
    client = ollama.Client(host=server.base_url)
    reply = client.chat(model="oss", messages=MESSAGES).message
    assert (reply.thinking, reply.content) == (expected, ANSWER)
    assert "thinking" in client.show("oss").capabilities
    response = openai_client(server.base_url).responses.create(model="oss", input="What is 2 + 2?", store=False)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == expected and response.output_text == ANSWER
