"""A reply's thinking kept apart from its answer on every API, through the official clients: a scripted model (real
SmolLM2 tokenizer, a live server) thinks in <think> tags under a Qwen3-style template, or inside a thinking phase
an R1-style template opens in the prompt."""

from __future__ import annotations

import anthropic
import httpx
import ollama
import pytest
from server_harness import openai_client, scripted_server

from runlm.engine.reasoning import THINK_CLOSE
from runlm.text.chat import ChatTemplate

CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
QWEN3_STYLE = CHATML + ("<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}"
                        "<think>\n\n</think>\n\n{% endif %}")
R1_STYLE = CHATML + "{{ '<|im_start|>assistant\\n<think>\\n' }}"  # as DeepSeek-R1's template ends
THOUGHT, ANSWER = "Two and two make four.", "It is 4."
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


JSON_ANSWER = '{"answer": 4}'


def reply(text: str, n: int) -> str:
    """What the model writes on from `text` (the prompt, and what it wrote so far): thinks unless the thinking is
    closed already, then answers; in JSON where it was asked for JSON (whitespace before it goes where a grammar
    refuses it)."""
    answer = JSON_ANSWER if "JSON" in text else ANSWER
    turn = text.rsplit("<|im_start|>assistant", 1)[-1]
    if THINK_CLOSE in turn:  # the answer has begun: the rest of it
        done = turn.rsplit(THINK_CLOSE, 1)[1].lstrip()
        return answer[len(done):] if answer.startswith(done) else ""
    opened = text.endswith("<think>\n")
    return ("" if opened else "<think>\n") + f"{THOUGHT}\n</think>\n\n{answer}"


def thinker(loaded, template: str, writes=reply, **options):
    """A live server whose scripted model `writes` under the chat `template`."""
    return scripted_server(loaded, writes, name="thinker", api_key="", chat_template=ChatTemplate(template), **options)


@pytest.fixture(scope="module")
def qwen3_style(smollm2_loaded):
    server = thinker(smollm2_loaded, QWEN3_STYLE)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def r1_style(smollm2_loaded):
    server = thinker(smollm2_loaded, R1_STYLE)
    yield server
    server.stop()


def chat(server, **extra):
    return openai_client(server.base_url).chat.completions.create(**{"model": "thinker", "messages": MESSAGES, **extra})


@pytest.mark.parametrize("style", ["qwen3_style", "r1_style"])
def test_chat_completions_give_the_thinking_as_reasoning_content(style, request):
    message = chat(request.getfixturevalue(style)).choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHT, ANSWER)


def test_a_streamed_chat_sends_the_thinking_first_then_the_answer(qwen3_style):
    kinds, reasoning, content = [], "", ""
    for chunk in chat(qwen3_style, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        if getattr(delta, "reasoning_content", None):
            kinds.append("reasoning")
            reasoning += delta.reasoning_content
        if delta.content:
            kinds.append("content")
            content += delta.content
    assert (reasoning, content) == (THOUGHT, ANSWER)
    assert kinds.index("content") > max(i for i, kind in enumerate(kinds) if kind == "reasoning")
    assert kinds.count("reasoning") > 1  # streamed as it came, not once at the end


def test_reasoning_effort_none_turns_the_templates_thinking_off(qwen3_style):
    message = chat(qwen3_style, reasoning_effort="none").choices[0].message
    assert message.content == ANSWER and getattr(message, "reasoning_content", None) is None


def test_reasoning_format_none_leaves_the_thinking_in_the_answer(qwen3_style, smollm2_loaded):
    message = chat(qwen3_style, extra_body={"reasoning_format": "none"}).choices[0].message
    assert message.content == f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
    server = thinker(smollm2_loaded, QWEN3_STYLE, reasoning_format="none")
    try:
        assert chat(server).choices[0].message.content == f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
        bad = httpx.post(server.base_url + "/v1/chat/completions",
                         json={"model": "thinker", "messages": MESSAGES, "reasoning_format": "channels"})
        assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("reasoning_format")
    finally:
        server.stop()


@pytest.mark.parametrize("style", ["qwen3_style", "r1_style"])
def test_a_json_answer_follows_the_thinking_and_only_it_is_held_to_the_grammar(style, request):
    """response_format holds the answer: the thinking runs free before it (a Qwen3-style template has the thinking
    opened for it), the answer after it is the JSON; with the thinking switched off the reply is the JSON alone."""
    server = request.getfixturevalue(style)
    asked = [{"role": "user", "content": "Answer in JSON: what is 2 + 2?"}]
    message = chat(server, response_format={"type": "json_object"}, messages=asked).choices[0].message
    assert (message.reasoning_content, message.content) == (THOUGHT, JSON_ANSWER)
    off = chat(server, response_format={"type": "json_object"}, messages=asked, reasoning_effort="none")
    assert off.choices[0].message.content == JSON_ANSWER
    assert getattr(off.choices[0].message, "reasoning_content", None) is None


def test_anthropic_messages_give_a_thinking_block(qwen3_style):
    client = anthropic.Anthropic(base_url=qwen3_style.base_url, api_key="unused")
    message = client.messages.create(model="thinker", max_tokens=64, messages=MESSAGES)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking, message.content[1].text) == (THOUGHT, ANSWER)
    off = client.messages.create(model="thinker", max_tokens=64, messages=MESSAGES, thinking={"type": "disabled"})
    assert [(b.type, b.text) for b in off.content] == [("text", ANSWER)]
    with client.messages.stream(model="thinker", max_tokens=64, messages=MESSAGES) as stream:
        deltas = [event.delta.type for event in stream if event.type == "content_block_delta"]
        final = stream.get_final_message()
    assert deltas.index("text_delta") > deltas.index("signature_delta") > deltas.index("thinking_delta")
    assert (final.content[0].thinking, final.content[1].text) == (THOUGHT, ANSWER)


def test_ollama_gives_message_thinking(qwen3_style):
    client = ollama.Client(host=qwen3_style.base_url)
    message = client.chat(model="thinker", messages=MESSAGES).message
    assert (message.thinking, message.content) == (THOUGHT, ANSWER)
    off = client.chat(model="thinker", messages=MESSAGES, think=False).message
    assert (off.thinking, off.content) == (None, ANSWER)
    parts = list(client.chat(model="thinker", messages=MESSAGES, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == THOUGHT
    assert "".join(p.message.content or "" for p in parts) == ANSWER
    generated = client.generate(model="thinker", prompt="What is 2 + 2?")
    assert (generated.thinking, generated.response) == (THOUGHT, ANSWER)
    streamed = list(client.generate(model="thinker", prompt="What is 2 + 2?", stream=True))
    assert "".join(p.thinking or "" for p in streamed) == THOUGHT
    assert "".join(p.response or "" for p in streamed) == ANSWER
    assert "thinking" in client.show("thinker").capabilities


def test_responses_give_a_reasoning_item(qwen3_style):
    client = openai_client(qwen3_style.base_url)
    response = client.responses.create(model="thinker", input="What is 2 + 2?", store=False)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == THOUGHT and response.output_text == ANSWER
    off = client.responses.create(model="thinker", input="What is 2 + 2?", reasoning={"effort": "none"}, store=False)
    assert [item.type for item in off.output] == ["message"] and off.output_text == ANSWER
    events = list(client.responses.create(model="thinker", input="What is 2 + 2?", stream=True, store=False))
    kinds = [event.type for event in events]
    assert kinds.index("response.output_text.delta") > kinds.index("response.reasoning_text.done")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]


LONG_THOUGHT = " ".join(["Hmm,"] * 40)


def long_thinker(prompt: str, n: int) -> str:
    if prompt.endswith("</think>\n\n"):
        return ANSWER
    return ("" if prompt.endswith("<think>\n") else "<think>\n") + f"{LONG_THOUGHT}\n</think>\n\n{ANSWER}"


@pytest.mark.parametrize("template", [QWEN3_STYLE, R1_STYLE])
def test_a_spent_thinking_budget_closes_the_thinking_and_the_model_answers(smollm2_loaded, template):
    """A budget of 6 tokens: the thinking stops after 6 of its tokens, the answer follows; the Anthropic budget
    and the server's --reasoning-budget do the same, and 0 answers without thinking."""
    server = thinker(smollm2_loaded, template, long_thinker)
    budgeted = thinker(smollm2_loaded, template, long_thinker, reasoning_budget=6)
    try:
        unbounded = chat(server).choices[0].message
        assert (unbounded.reasoning_content, unbounded.content) == (LONG_THOUGHT, ANSWER)
        tokenizer = smollm2_loaded.tokenizer
        for message in (chat(server, extra_body={"reasoning_budget": 6}).choices[0].message,
                        chat(budgeted).choices[0].message):
            assert message.content == ANSWER
            assert LONG_THOUGHT.startswith(message.reasoning_content)
            assert 4 <= len(tokenizer.encode(message.reasoning_content, add_bos=False)) <= 6
        client = anthropic.Anthropic(base_url=server.base_url, api_key="unused")
        reply_ = client.messages.create(model="thinker", max_tokens=200, messages=MESSAGES,
                                        thinking={"type": "enabled", "budget_tokens": 6})
        assert [block.type for block in reply_.content] == ["thinking", "text"]
        assert reply_.content[1].text == ANSWER and len(reply_.content[0].thinking) < len(LONG_THOUGHT) // 3
        none = chat(server, extra_body={"reasoning_budget": 0}).choices[0].message
        assert none.content == ANSWER and getattr(none, "reasoning_content", None) is None
    finally:
        server.stop()
        budgeted.stop()
