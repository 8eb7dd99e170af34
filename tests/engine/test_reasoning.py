"""The thinking phase split from the answer (runlm.engine.reasoning): whole replies, and the same replies streamed
in every two-piece split and one character at a time."""

from __future__ import annotations

import pytest

from runlm.engine.reasoning import ThinkingPlan, ThinkSplitter, check_reasoning_format
from runlm.errors import InvalidInputError

# (reply, the prompt opened the thinking, expected (reasoning, content))
CASES = [
    ("<think>\nTwo and two.\n</think>\n\nFour.", False, ("Two and two.", "Four.")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("Two and two.\n</think>\n\nFour.", True, ("Two and two.", "Four.")),
    ("\n\n</think>\n\nFour.", True, ("", "Four.")),
    ("<think>\n\n</think>\n\nFour.", False, ("", "Four.")),
    ("Still thinking when the tokens ran out ", True, ("Still thinking when the tokens ran out", "")),
    ("<think>unclosed", False, ("unclosed", "")),
    ("Four, no thinking.", False, ("", "Four, no thinking.")),
    ("  Four.", False, ("", "  Four.")),
    ("<thinking> is not the tag", False, ("", "<thinking> is not the tag")),
    ("<th", False, ("", "<th")),
    ("<think>a < b and </thin is not the end</think>c", False, ("a < b and </thin is not the end", "c")),
    ("<think>x</think>y <think>z</think>", False, ("x", "y <think>z</think>")),
    ("", False, ("", "")),
    ("", True, ("", "")),
]


# Gemma 4's thought channel: (reply, opened, expected)
GEMMA4_CASES = [
    ("<|channel>thought\nTwo and two.<channel|>Four.", False, ("Two and two.", "Four.")),
    ("Two and two.<channel|>Four.", True, ("Two and two.", "Four.")),
    ("<|channel>thought\n<channel|>Four.", False, ("", "Four.")),
    ("<|channel>thoughtless", False, ("less", "")),
    ("<|channel>final", False, ("", "<|channel>final")),
    ("<think>x</think>y", False, ("", "<think>x</think>y")),
    ("Four.", False, ("", "Four.")),
]


def streamed(pieces: list[str], opened: bool, parser: str = "think") -> tuple[str, str]:
    splitter = ThinkingPlan(parser, opened).splitter()
    reasoning = content = ""
    for piece in pieces:
        r, c = splitter.push(piece)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("reply, opened, expected", CASES)
def test_every_split_of_a_reply_gives_the_whole_replys_parts(reply, opened, expected):
    assert streamed([reply], opened) == expected
    assert streamed(list(reply), opened) == expected
    for cut in range(len(reply) + 1):
        assert streamed([reply[:cut], reply[cut:]], opened) == expected, cut


@pytest.mark.parametrize("reply, opened, expected", GEMMA4_CASES)
def test_gemma4s_thought_channel_splits_in_every_split(reply, opened, expected):
    for cut in range(len(reply) + 1):
        assert streamed([reply[:cut], reply[cut:]], opened, "gemma4") == expected, cut


def test_thinking_streams_before_the_reply_ends():
    """The thinking goes out as it comes; only what could be the closing tag, or whitespace before it, waits."""
    splitter = ThinkSplitter(True)
    assert splitter.push("<think>\nLet me") == ("Let me", "")
    assert splitter.push(" see. </th") == (" see.", "")
    assert splitter.push("ink>\n\nIt is") == ("", "It is")
    assert splitter.push(" four.") == ("", " four.")


def test_off_everything_is_the_answer():
    splitter = ThinkSplitter(False)
    assert splitter.push("<think>a</think>b") == ("", "<think>a</think>b")
    assert splitter.finish() == ("", "")


def test_the_plan_follows_the_format_the_template_and_the_prompt():
    thinking_template = "{{ '<think>' }}"
    harmony_template = "{{ '<|start|>assistant<|channel|>final<|message|>' }}"
    assert ThinkingPlan.for_prompt("auto", thinking_template, "<|im_start|>assistant\n") == ThinkingPlan("think")
    assert ThinkingPlan.for_prompt("auto", thinking_template, "Assistant: <think>\n") == ThinkingPlan("think", True)
    assert ThinkingPlan.for_prompt("auto", "{{ messages }}", "Assistant: <think>\n") == ThinkingPlan()
    assert ThinkingPlan.for_prompt("none", thinking_template, "<think>\n") == ThinkingPlan()
    assert ThinkingPlan.for_prompt("auto", harmony_template, "<|start|>assistant") == ThinkingPlan("harmony")
    assert ThinkingPlan.for_prompt("none", harmony_template, "<|start|>assistant") == ThinkingPlan()
    for fmt in ("think", "deepseek"):
        assert ThinkingPlan.for_prompt(fmt, "", "x") == ThinkingPlan("think")
    assert ThinkingPlan.for_prompt("harmony", "", "x") == ThinkingPlan("harmony")
    gemma4 = "{{ '<|turn>model\\n<|channel>thought\\n<channel|>' }}"
    assert ThinkingPlan.for_prompt("auto", gemma4, "<|turn>model\n<|channel>thought\n<channel|>") == ThinkingPlan()
    assert ThinkingPlan.for_prompt("auto", gemma4, "<|turn>model\n") == ThinkingPlan("gemma4")
    assert ThinkingPlan.for_prompt("auto", thinking_template, "<think>\n\n</think>\n\n") == ThinkingPlan()
    assert ThinkingPlan.for_prompt("auto", gemma4, "<|turn>model\n<|channel>thought\n") == ThinkingPlan("gemma4",
                                                                                                       True)
    assert ThinkingPlan("gemma4").close_text == "<channel|>"
    with pytest.raises(InvalidInputError, match="reasoning_format must be one of"):
        check_reasoning_format("channels")
