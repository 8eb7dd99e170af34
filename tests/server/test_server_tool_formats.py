"""Tool calls written in each family's format reach clients as OpenAI tool_calls, Anthropic tool_use blocks and
Ollama tool_calls, streamed or not (a scripted model on the real SmolLM2 tokenizer, a live server)."""

from __future__ import annotations

import json

import anthropic
import pytest
from server_harness import last_user_text, openai_client, scripted_server

REPLIES = {
    "qwen3-coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
                   "</parameter>\n</function>\n</tool_call>",
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}',
    "pythonic": '[get_weather(city="Paris", days=2)]',
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
    "gemma4": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>',
}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
EXPECTED = ("get_weather", {"city": "Paris", "days": 2})
# the formats whose arguments stream in pieces as they are written
STREAMED = {"hermes", "mistral", "qwen3-coder", "gemma4", "pythonic"}


@pytest.fixture(scope="module")
def server(smollm2_loaded):
    live = scripted_server(smollm2_loaded, lambda prompt, n: REPLIES[last_user_text(prompt)], api_key="")
    yield live
    live.stop()


@pytest.mark.parametrize("fmt", sorted(REPLIES))
def test_each_format_is_a_tool_call_on_every_api(server, fmt):
    client = openai_client(server.base_url)
    messages = [{"role": "user", "content": fmt}]
    reply = client.chat.completions.create(model="scripted-model", messages=messages, tools=[TOOL])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [EXPECTED]

    pieces = list(client.chat.completions.create(model="scripted-model", messages=messages, tools=[TOOL],
                                                 stream=True))
    assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices) == ""
    deltas = [c for p in pieces if p.choices for c in p.choices[0].delta.tool_calls or []]
    streamed: dict[int, dict] = {}
    for d in deltas:  # as OpenAI's clients put a call together: its id and name first, then argument pieces
        entry = streamed.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
        entry["arguments"] += d.function.arguments or ""
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == [EXPECTED]
    assert all(c["id"] for c in streamed.values())
    if fmt in STREAMED:  # arguments written as JSON stream in pieces, which add up to the whole reply's
        assert len(deltas) > 2
        assert streamed[0]["arguments"] == choice.message.tool_calls[0].function.arguments
    else:
        assert len(deltas) == 1

    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused")
    message = claude.messages.create(model="scripted-model", max_tokens=200, messages=messages,
                                     tools=[{"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}])
    assert message.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in message.content if b.type == "tool_use"] == [EXPECTED]

    with claude.messages.stream(model="scripted-model", max_tokens=200, messages=messages,
                                tools=[{"name": "get_weather",
                                        "input_schema": TOOL["function"]["parameters"]}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [EXPECTED]
    pieces = [e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert (len(pieces) > 1) == (fmt in STREAMED)  # a JSON call's input streams as it is written

    events = list(client.responses.create(model="scripted-model", input=fmt, tools=[{
        "type": "function", "name": "get_weather", "parameters": TOOL["function"]["parameters"]}], stream=True))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (item,) = [o for o in events[-1].response.output if o.type == "function_call"]
    assert (item.name, json.loads(item.arguments)) == EXPECTED and "".join(deltas) == item.arguments
    assert (len(deltas) > 1) == (fmt in STREAMED)


# Tool-aware templates that write calls in each format (the markers where a real template writes them), and the
# call the model completes once the grammar has begun it.
CHATML_TURNS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{# tools and tool_calls are written as: MARKERS #}{{ '<|im_start|>assistant\\n' }}")
FORCED = {
    "hermes": ("<tool_call> </tool_call>",
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'),
    "mistral-args": ("[TOOL_CALLS] [ARGS]", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}'),
    "mistral": ("[TOOL_CALLS]", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]'),
    "qwen3-coder": ("<tool_call> <function= </function>", REPLIES["qwen3-coder"]),
    "gemma4": ("<|tool_call>call: <tool_call|>", REPLIES["gemma4"]),
    "pythonic": ("[func_name1(params_name1=params_value1...)]", '[get_weather(city="Paris", days=2)]'),
}


@pytest.mark.parametrize("call_format", sorted(FORCED))
def test_a_forced_call_is_written_in_the_templates_format(smollm2_loaded, call_format):
    """The model would answer in prose; the grammar begins the call in the template's format, and what the model
    writes from there is held to it."""
    from runlm.engine.tools import forced_call_format
    from runlm.text.chat import ChatTemplate

    markers, call = FORCED[call_format]
    template = CHATML_TURNS.replace("MARKERS", markers)
    assert forced_call_format(template) == call_format

    def reply(text: str, n: int) -> str:
        done = text.rsplit("<|im_start|>assistant\n", 1)[1]
        return call[len(done):] if done and call.startswith(done) else "It is sunny."

    live = scripted_server(smollm2_loaded, reply, api_key="", chat_template=ChatTemplate(template))
    try:
        client = openai_client(live.base_url)
        messages = [{"role": "user", "content": "Weather?"}]
        free = client.chat.completions.create(model="scripted-model", messages=messages, tools=[TOOL])
        assert free.choices[0].message.content == "It is sunny." and not free.choices[0].message.tool_calls
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            forced = client.chat.completions.create(model="scripted-model", messages=messages, tools=[TOOL],
                                                    tool_choice=choice).choices[0]
            assert forced.finish_reason == "tool_calls" and not forced.message.content
            assert [(c.function.name, json.loads(c.function.arguments))
                    for c in forced.message.tool_calls] == [EXPECTED]
    finally:
        live.stop()
