"""Tool-call parsing (Hermes blocks, bare JSON), its streaming filter, and grammar-constrained decoding."""

from __future__ import annotations

import json
import re
import time

import pytest
from engine_mocks import MockTokenizer, ScriptedRunner
from hypothesis import given
from hypothesis import strategies as st

from runlm.engine import Engine, GenerationRequest, parse_tool_calls
from runlm.engine.grammar import GrammarConstraint
from runlm.engine.tools import ToolCallStreamFilter, tool_call_bodies, tool_call_schema
from runlm.errors import InvalidInputError
from runlm.sampling import SamplingParams


def test_hermes_blocks_are_parsed_with_leading_content():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(text, {"get_weather", "get_time"})
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                   ("get_time", {})]
    assert calls[0].id != calls[1].id


def test_bare_json_call_and_string_arguments():
    _, calls = parse_tool_calls(' {"name": "f", "arguments": "{\\"a\\": 1}"}', {"f"})
    assert calls[0].name == "f" and json.loads(calls[0].arguments) == {"a": 1}
    _, calls = parse_tool_calls('[{"name": "f", "parameters": {"a": 2}}]', {"f"})
    assert json.loads(calls[0].arguments) == {"a": 2}


def test_things_that_are_not_calls_stay_content():
    for text in ('{"answer": 42}', '{"name": "unknown", "arguments": {}}', "<tool_call>not json</tool_call>",
                 "Plain text", '{"name": "f", "arguments": {} trailing'):
        content, calls = parse_tool_calls(text, {"f"})
        assert calls == [] and content == text


def test_stream_filter_releases_plain_text_and_holds_calls():
    f = ToolCallStreamFilter(active=True, known_names={"f"})
    pieces = ["Sure", ", calling", " <tool", "_call>", '{"name": "f", "arguments": {}}', "</tool_call>"]
    out = [f.push(t) for t in pieces]
    assert "".join(out) == "Sure, calling "
    rest, calls = f.finish()
    assert rest == "" and calls[0].name == "f"

    g = ToolCallStreamFilter(active=True, known_names={"f"})
    assert g.push("  {") == "" and g.push('"x": 1}') == ""
    assert g.finish() == ('  {"x": 1}', [])  # not a call after all: released whole

    h = ToolCallStreamFilter(active=False)
    assert h.push('{"name": "f", "arguments": {}}') == '{"name": "f", "arguments": {}}'


def test_tool_call_schema_pins_the_name():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g"}}]
    assert tool_call_schema(tools, "g")["properties"]["name"] == {"const": "g"}
    assert len(tool_call_schema(tools)["anyOf"]) == 2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grammar_forces_valid_json_from_a_random_model(seed):
    pytest.importorskip("llguidance")
    tok = MockTokenizer()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    # margin 0: the "model" is pure noise, so only the grammar makes the output JSON.
    engine = Engine(ScriptedRunner([], margin=0.0, max_context=256), tok, prompt_cache_mb=0)
    grammar = GrammarConstraint.json_schema(schema, tok, tok.vocab_size, sorted(tok.stop_ids))
    req = GenerationRequest(prompt_ids=tok.encode("abc"), max_tokens=60, grammar=grammar,
                            sampling=SamplingParams(temperature=1.0, seed=seed))
    out = engine.complete(req)
    assert out.finish_reason == "stop"
    value = json.loads(out.text)
    assert set(value) == {"a"} and isinstance(value["a"], int)


@pytest.mark.parametrize(("call_format", "good", "bad"), [
    ("pythonic", '[f(n=3, on=True, s="ab")]', ['[f(n=3, on=true)]', '[f(on=True)]', '[f(n="3")]', '[g(n=3)]']),
    ("gemma4", '<|tool_call>call:f{n:3,on:true,s:<|"|>ab<|"|>}<tool_call|>',
     ['<|tool_call>call:f{on:true}<tool_call|>', '<|tool_call>call:f{n:<|"|>3<|"|>}<tool_call|>',
      '<|tool_call>call:f{s:<|"|>ab<|"|>,n:3}<tool_call|>']),
])
def test_a_forced_calls_grammar_in_a_notation_that_is_not_json(smollm2_gguf, call_format, good, bad):
    """The grammar of a forced call written pythonic or in Gemma 4's notation takes the call (its required argument
    there, each argument of its schema's type, in the template's order) and nothing else; what it takes reads back
    as that call."""
    pytest.importorskip("llguidance")
    from runlm.engine.grammar import grammar_for_forced_call
    from runlm.text import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_gguf)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "on": {"type": "boolean"}, "s": {"type": "string"}}, "required": ["n"]}}}]
    grammar = grammar_for_forced_call(call_format, tools, set())

    def takes(text: str) -> bool:
        matcher = GrammarConstraint(grammar, tok, tok.vocab_size, sorted(tok.stop_ids))
        return all(matcher.accept(t) for t in tok.encode(text, add_bos=False)) and matcher.done

    assert takes(good)
    content, calls = parse_tool_calls(good, {"f"})
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"n": 3, "on": True,
                                                                                            "s": "ab"})]
    for text in bad:
        assert not takes(text), text


def test_broken_schema_is_invalid_input():
    pytest.importorskip("llguidance")
    tok = MockTokenizer()
    with pytest.raises(InvalidInputError):
        GrammarConstraint.json_schema({"$ref": "#/nowhere"}, tok, tok.vocab_size, [0])


QUADRATIC_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)  # the old parser


@given(st.lists(st.sampled_from(["<tool_call>", "</tool_call>", " ", "\n", "{}", "a", "\t "]), max_size=12))
def test_tool_call_bodies_split_as_the_old_regex_did(pieces):
    text = "".join(pieces)
    assert tool_call_bodies(text) == QUADRATIC_BLOCK.findall(text)


def test_tool_call_parsing_is_linear_on_long_whitespace_runs():
    text = "<tool_call>" + " " * 200_000 + "x"  # the old regex took 6 s at 32k characters, minutes here
    started = time.perf_counter()
    assert parse_tool_calls(text, {"f"}) == (text, [])
    assert time.perf_counter() - started < 2.0


def streamed_calls(text: str, step: int, known: set[str] | None,
                   parameters: dict | None = None) -> tuple[str, dict[int, dict], list]:
    """`text` pushed `step` characters at a time: (content, the calls put together from their pieces, finish's)."""
    stream = ToolCallStreamFilter(True, known, parameters)
    content, calls = "", {}
    for i in range(0, len(text), step):
        content += stream.push(text[i : i + step])
        for piece in stream.take_deltas():
            entry = calls.setdefault(piece.index, {"id": piece.id, "name": piece.name, "arguments": "", "pieces": 0})
            entry["arguments"] += piece.arguments
            entry["pieces"] += 1
    rest, final = stream.finish()
    return content + rest, calls, final


@pytest.mark.parametrize("step", [1, 2, 5, 64])
def test_hermes_calls_stream_their_arguments_in_pieces_that_add_up(step):
    text = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris {x}", "days": [1, '
            '{"a": "]"}]}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls, final = streamed_calls(text, step, {"get_weather", "get_time"})
    assert content.strip() == "Checking."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": 'Pa"ris {x}', "days": [1, {"a": "]"}]}), ("get_time", {})]
    assert [(c.id, c.arguments) for c in final] == [(c["id"], c["arguments"]) for c in calls.values()]
    if step == 1:
        assert calls[0]["pieces"] > 20


@pytest.mark.parametrize("step", [1, 2, 5, 64])
def test_mistral_calls_stream_their_arguments_and_keep_their_ids(step):
    text = ('[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Pa\\"ris", "days": [1, {"a": "]"}]}'
            '[TOOL_CALLS]get_time[ARGS]{}')
    content, calls, final = streamed_calls(text, step, {"get_weather", "get_time"})
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": 'Pa"ris', "days": [1, {"a": "]"}]}), ("get_time", {})]
    assert calls[0]["id"] == "a1b2c3d4e" and calls[1]["id"].startswith("call_")
    assert [(c.id, c.arguments) for c in final] == [(c["id"], c["arguments"]) for c in calls.values()]
    listed = '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]'  # the older JSON list goes out whole
    _, calls, final = streamed_calls(listed, step, {"get_time"})
    assert calls == {} and [c.name for c in final] == ["get_time"]


WEATHER_SCHEMAS = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": ["string", "null"]}}}}


@pytest.mark.parametrize("step", [1, 2, 5, 64])
def test_qwen3_coder_calls_stream_as_the_json_they_read_as(step):
    """String values stream as they are written, typed ones once closed; the pieces are the JSON object the whole
    reply parses into, call by call, with or without the <tool_call> wrapper."""
    text = ('Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan "Fran"\ncisco </b>\n'
            '</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n'
            '<tool_call>\n<function=get_time>\n</function>\n</tool_call>')
    content, calls, final = streamed_calls(text, step, {"get_weather", "get_time"}, WEATHER_SCHEMAS)
    assert content.strip() == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": 'San "Fran"\ncisco </b>', "days": 3}), ("get_time", {})]
    assert [(c.name, c.id, c.arguments) for c in final] == [
        (c["name"], c["id"], c["arguments"]) for c in calls.values()]
    if step == 1:
        assert calls[0]["pieces"] > 10  # the string came in pieces
    alone = "<function=get_weather>\n<parameter=units>\nC\n</parameter>\n</function>"
    _, calls, final = streamed_calls(alone, step, {"get_weather"}, WEATHER_SCHEMAS)
    assert [json.loads(c["arguments"]) for c in calls.values()] == [{"units": "C"}] == [
        json.loads(c.arguments) for c in final]


def test_calls_that_do_not_stream_go_out_whole_at_the_end():
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {"path": "/"}}</tool_call>'
    assert streamed_calls(unknown, 3, {"get_time"})[1] == {}
    named_last = '<tool_call>{"arguments": {"tz": "CET"}, "name": "get_time"}</tool_call>'
    _, calls, final = streamed_calls(named_last, 3, {"get_time"})
    assert calls == {} and [c.name for c in final] == ["get_time"]
    cut = '<tool_call>{"name": "get_time", "arguments": {"tz": "CE'  # cut by max_tokens: the pieces sent stay
    _, calls, final = streamed_calls(cut, 4, {"get_time"})
    assert calls[0]["arguments"] == '{"tz": "CE' and final == []
