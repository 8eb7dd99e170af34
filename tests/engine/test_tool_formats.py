"""Each family's tool-call format read into calls (runlm.engine.tool_formats through parse_tool_calls), whole and
streamed in every two-piece split; replies that only look like calls stay the answer."""

from __future__ import annotations

import json

import pytest

from runlm.engine.tools import ToolCallStreamFilter, parse_tool_calls

KNOWN = {"get_weather", "get_time"}
PARAMETERS = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "zip": {"type": "string"}, "hours": {"type": "array"}}}}

# (reply, the answer before the calls, [(name, arguments, id or None for a generated one)])
CASES = {
    "hermes": ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
               "Let me look.", [("get_weather", {"city": "Paris"}, None)]),
    "llama3 json": ('{"name": "get_time", "parameters": {"zone": "UTC"}}', "", [("get_time", {"zone": "UTC"}, None)]),
    "qwen3-coder xml": (
        "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=zip>\n10001\n"
        "</parameter>\n<parameter=hours>\n[9, 17]\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        "I will check.",
        [("get_weather", {"city": "New York", "days": 3, "metric": True, "zip": "10001", "hours": [9, 17]}, None),
         ("get_time", {}, None)]),
    "qwen3-coder xml, no wrapper": ("<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>", "",
                                    [("get_time", {"zone": "UTC"}, None)]),
    "mistral list": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}, '
                     '{"name": "get_time", "arguments": {}, "id": "f5g6h7i8j"}]', "",
                     [("get_weather", {"city": "Paris"}, "a1b2c3d4e"), ("get_time", {}, "f5g6h7i8j")]),
    "mistral args": ('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
                     "Checking.", [("get_weather", {"city": "Paris"}, None), ("get_time", {}, None)]),
    "mistral call ids": ('[TOOL_CALLS]get_weather[CALL_ID]x9y8z7w6v[ARGS]{"city": "Oslo"}', "",
                         [("get_weather", {"city": "Oslo"}, "x9y8z7w6v")]),
    "pythonic": ('[get_weather(city="Paris", days=2), get_time()]', "",
                 [("get_weather", {"city": "Paris", "days": 2}, None), ("get_time", {}, None)]),
    "gemma4": ('Checking.<|tool_call>call:get_weather{city:<|"|>Paris, "FR" <|<|"|>,days:3,metric:true,zip:null,'
               'hours:[9,-1.5e1,{at:<|"|>x\ny<|"|>}]}<tool_call|><|tool_call>call:get_time{}<tool_call|>', "Checking.",
               [("get_weather", {"city": 'Paris, "FR" <|', "days": 3, "metric": True, "zip": None,
                                 "hours": [9, -15.0, {"at": "x\ny"}]}, None), ("get_time", {}, None)]),
}


def check(calls, expected) -> None:
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(name, args) for name, args, _ in expected]
    for call, (_, _, call_id) in zip(calls, expected, strict=True):
        assert call.id == call_id if call_id else call.id.startswith("call_")


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_format_reads_into_calls(case):
    reply, answer, expected = CASES[case]
    content, calls = parse_tool_calls(reply, KNOWN, PARAMETERS)
    assert content == answer
    check(calls, expected)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_streamed_reply_gives_the_same_calls_in_every_split(case):
    """The answer before the calls streams; no piece of a marker or a call reaches the client as text."""
    reply, answer, expected = CASES[case]
    for cut in range(len(reply) + 1):
        stream = ToolCallStreamFilter(True, KNOWN, PARAMETERS)
        sent = stream.push(reply[:cut]) + stream.push(reply[cut:])
        rest, calls = stream.finish()
        assert (sent + rest).strip() == answer, cut
        check(calls, expected)


@pytest.mark.parametrize("reply", [
    "[get_weather(city=__import__('os').system('true'))]",  # not a literal: refused, never evaluated
    "[get_weather(*cities)]",
    "[get_weather(**options)]",
    "[get_weather('Paris')]",  # positional
    "[os.system(cmd='true')]",
    "[get_weather(city={1, 2})]",  # a set has no JSON spelling
    "[unknown_tool(a=1)]",
    "[1, 2, 3]",
    "[" * 5000 + "]" * 5000,
    "[TOOL_CALLS]get_weather[ARGS]not json",
    "[TOOL_CALLS] nothing here",
    "<function=unknown_tool>\n</function>",
    '<|tool_call>call:unknown_tool{a:1}<tool_call|>',
    '<|tool_call>call:get_weather{city:Paris}<tool_call|>',  # a bare word is no value
    '<|tool_call>call:get_weather{city:}<tool_call|>',
    '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}} trailing<tool_call|>',
    '<|tool_call>get_weather{}<tool_call|>',
])
def test_what_only_looks_like_a_call_stays_the_answer(reply):
    assert parse_tool_calls(reply, KNOWN, PARAMETERS) == (reply, [])
    stream = ToolCallStreamFilter(True, KNOWN, PARAMETERS)
    sent = stream.push(reply)
    rest, calls = stream.finish()
    assert (sent + rest, calls) == (reply, [])
    if reply.startswith("["):  # a pythonic call that does not read never began to stream
        assert stream.take_deltas() == []


def test_a_pythonic_call_streams_an_argument_at_a_time():
    """Each argument goes out once its value has read as a literal (strings with commas, quotes and brackets inside,
    triple-quoted ones, nested lists and tuples), the name with the first; the pieces add up to the arguments."""
    reply = ('[get_weather(city="Paris, \\"FR\\" (1]", days=2, hours=[9, (17, 18)], zip=\'\'\'7" \'5\'\'\'), '
             'get_time()]')
    stream = ToolCallStreamFilter(True, KNOWN, PARAMETERS)
    pieces = []
    for ch in reply:
        stream.push(ch)
        pieces += stream.take_deltas()
    _, calls = stream.finish()
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'Paris, "FR" (1]', "days": 2, "hours": [9, [17, 18]], "zip": "7\" '5"}),
        ("get_time", {})]
    assert [(p.index, p.name) for p in pieces if p.name] == [(0, "get_weather"), (1, "get_time")]
    assert len([p for p in pieces if p.index == 0 and p.arguments]) == 4  # the last one with the closing brace
    for call in calls:
        assert "".join(p.arguments for p in pieces if p.index == calls.index(call)) == call.arguments


def test_an_unclosed_xml_call_cut_by_the_token_budget_still_reads():
    content, calls = parse_tool_calls("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome", KNOWN, PARAMETERS)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Rome"})]


def test_a_long_run_of_unclosed_markers_is_one_call_holding_the_rest():
    """150 kB of unclosed markers (a long reply's worth), streamed a few characters at a time as tokens come: the
    first parameter never closes, so the rest is its value (each reader is a string scan, never a backtracking
    regex)."""
    opening = "<function=get_weather><parameter=city>"
    reply = opening * 4_000
    stream = ToolCallStreamFilter(True, KNOWN, PARAMETERS)
    sent = "".join(stream.push(reply[i : i + 7]) for i in range(0, len(reply), 7))
    rest, calls = stream.finish()
    assert (sent, rest) == ("", "")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": reply[len(opening):]})]
