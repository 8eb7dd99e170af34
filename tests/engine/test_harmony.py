"""gpt-oss's harmony replies split into reasoning, answer and tool calls, the same whole or in any pieces; the
harmony vocabulary's end tokens."""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken, models
from tokenizers import Tokenizer as Backend

from runlm.engine.harmony import HARMONY_CLOSE, HarmonySplitter, harmony_effort
from runlm.engine.reasoning import ThinkingBudget, ThinkingPlan, ThinkingWatch
from runlm.text.tokenizer import Tokenizer

ANALYSIS = "<|channel|>analysis<|message|>The user wants 2 + 2.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 4."
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris", "nested": {"days": [1, 2]}}')


def split(text: str, cut: int | None = None, tools: set[str] | None = frozenset({"get_weather"})):
    """(reasoning, content, [(name, arguments)], the arguments' streamed pieces joined) of `text`, pushed in two
    pieces at `cut` (whole where None)."""
    splitter = HarmonySplitter(set(tools) if tools is not None else None)
    pieces = [text] if cut is None else [text[:cut], text[cut:]]
    reasoning = content = ""
    for piece in pieces:
        r, c = splitter.push(piece)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    streamed = "".join(d.arguments for d in splitter.calls.take_deltas())
    _, calls = splitter.calls.finish()
    return reasoning + r, content + c, [(call.name, json.loads(call.arguments)) for call in calls], streamed


@pytest.mark.parametrize(("text", "expected"), [
    (ANALYSIS + FINAL, ("The user wants 2 + 2.", "It is 4.", [])),
    (ANALYSIS + CALL, ("The user wants 2 + 2.", "", [("get_weather", {"city": "Paris", "nested": {"days": [1, 2]}})])),
    # a preamble on the commentary channel is for the user; a second analysis joins the first on a new line
    (ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
     "<|start|>assistant<|channel|>analysis<|message|>Then answer.<|end|>" + FINAL,
     ("The user wants 2 + 2.\nThen answer.", "Let me check.\nIt is 4.", [])),
    # the recipient may come before the channel
    (' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}',
     ("", "", [("get_weather", {"city": "Oslo"})])),
    ("Plain text, no channels.", ("", "Plain text, no channels.", [])),
])
def test_a_reply_splits_the_same_whole_and_cut_anywhere(text, expected):
    whole = split(text)
    assert whole[:3] == expected
    for cut in range(len(text) + 1):
        assert split(text, cut) == whole, cut


def test_the_arguments_stream_as_written_and_add_up_to_the_call():
    splitter = HarmonySplitter({"get_weather"})
    for ch in ANALYSIS + CALL:
        splitter.push(ch)
    deltas = splitter.calls.take_deltas()
    assert (deltas[0].name, deltas[0].arguments) == ("get_weather", "") and deltas[0].id
    assert len(deltas) > 10 and {d.index for d in deltas} == {0}
    (call,) = splitter.calls.finish()[1]
    assert "".join(d.arguments for d in deltas) == call.arguments and call.id == deltas[0].id


def test_calls_to_no_offered_function_and_bodies_that_are_no_object_are_answer_text():
    body = '{"city": "Paris", "nested": {"days": [1, 2]}}'
    assert split(ANALYSIS + CALL, tools=None)[1:3] == (body, [])
    assert split(ANALYSIS + CALL, tools={"get_time"})[1:3] == (body, [])
    assert split(CALL.replace(body, "Paris please"))[1:3] == ("Paris please", [])
    broken = split(CALL.replace(body, '{"city": "Par'))  # cut off: its pieces went out, but it is no call
    assert broken[2] == [] and broken[3] == '{"city": "Par'


def test_a_spent_budget_writes_the_end_of_the_analysis_and_the_final_header():
    plan = ThinkingPlan("harmony")
    assert plan.close_text == HARMONY_CLOSE
    watch = ThinkingWatch(ThinkingBudget(2, (7, 8), plan))
    for piece in ("<|channel|>", "analysis", "<|message|>"):
        assert watch.forced_token() is None and watch.waiting
        watch.advance(piece)
    for piece in ("The", " user"):
        assert watch.thinking and watch.forced_token() is None
        watch.advance(piece)
    assert [watch.forced_token(), watch.forced_token(), watch.forced_token()] == [7, 8, None]
    watch.advance(HARMONY_CLOSE)
    assert not watch.thinking and not watch.waiting  # the final answer: a grammar holds it from here


def test_efforts_map_to_gpt_oss_levels():
    assert [harmony_effort(e) for e in ("none", "minimal", "low", "medium", "high")] == [
        "low", "low", "low", "medium", "high"]


def _tokenizer(specials: list[str], eos: str) -> Tokenizer:
    backend = Backend(models.WordLevel({"a": 0}, unk_token="a"))
    backend.add_special_tokens([AddedToken(text, special=True) for text in specials])
    return Tokenizer(backend, bos_id=None, eos_id=backend.token_to_id(eos), add_bos=False)


def test_in_a_harmony_vocabulary_end_closes_a_message_and_return_and_call_end_the_turn():
    harmony = _tokenizer(["<|start|>", "<|end|>", "<|return|>", "<|call|>"], "<|end|>")
    ids = {text: harmony.token_to_id(text) for text in ("<|end|>", "<|return|>", "<|call|>")}
    assert harmony.stop_ids == {ids["<|return|>"], ids["<|call|>"]}
    phi = _tokenizer(["<|end|>", "<|user|>"], "<|user|>")  # elsewhere <|end|> ends the turn
    assert phi.backend.token_to_id("<|end|>") in phi.stop_ids
