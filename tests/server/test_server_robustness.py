"""Hypothesis-generated malformed requests: never a 5xx, and the server still answers afterwards.

The server here runs the real tokenizer and chat template but a fast fake runner, so the thousands
of tokens that valid-by-chance bodies ask for cost nothing; the HTTP layer is what is under test.
The same fast server checks streamed tool calls and a client hanging up on a non-streamed request.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import replace

import httpx
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import LiveServer

from runlm.runner import LmRunner, Session
from runlm.server import create_app

MODEL = "fuzz-model"


class FastRunner(LmRunner):
    """Fixed pseudo-random logits with a bias toward end-of-text after a few tokens."""

    def __init__(self, vocab: int, eos: int, max_context: int = 256):
        self.vocab, self.eos, self.context = vocab, eos, max_context
        self.noise = torch.randn(64, vocab, generator=torch.Generator().manual_seed(0))
        self.delay_s = 0.0

    def family(self) -> str:
        return "fast"

    def vocab_size(self) -> int:
        return self.vocab

    def max_context(self) -> int:
        return self.context

    def predict_logits(self, prompt_ids: Sequence[int]) -> np.ndarray:
        return self.noise[len(prompt_ids) % 64].numpy()

    def extend(self, session: Session, ids: Sequence[int], all_positions: bool = False) -> np.ndarray:
        decoding = bool(session.tokens) and len(ids) == 1  # the engine runs a prompt whole or in chunks of 2+
        session.tokens = session.tokens + list(ids)
        logits = self.noise[len(session.tokens) % 64].clone()
        if decoding:
            if self.delay_s:
                time.sleep(self.delay_s)
            logits[self.eos] += 3.0
        return logits.numpy()


@pytest.fixture(scope="module")
def fuzz_server(smollm2_loaded):
    real = smollm2_loaded
    tok = real.tokenizer
    loaded = replace(real, runner=FastRunner(tok.vocab_size, tok.eos_id))
    server = LiveServer(create_app(loaded, model_name=MODEL, max_queue=8, default_max_tokens=4,
                                   max_body_bytes=64 * 1024))
    server.runner = loaded.runner
    yield server
    server.stop()


# Text that trips naive code: lone surrogates (valid JSON escapes, invalid Unicode), NUL, bidi, emoji.
odd_text = st.sampled_from(["\ud800", "a\udfff", "\x00", "\u202e", "\U0001f600", "<|im_end|>", "</tool_call>"])
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                      st.floats(allow_nan=False), st.text(max_size=20), odd_text)
json_any = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                        max_leaves=12)
unit = st.floats(0, 1)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
    "additionalProperties": False}}}
FORMATS = [
    {"type": "json_object"}, {"type": "text"}, {"type": "json_schema"},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "boolean"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense", "minimum": "a"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(unclosed"}}},
]

# Valid values for each field, so bodies reach the deep code (templates, grammars, sampling) ...
valid_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                       "content": st.one_of(st.text(max_size=30), odd_text)})
valid_common = {
    "max_tokens": st.integers(1, 4), "temperature": st.floats(0, 2), "top_p": unit, "top_k": st.integers(0, 50),
    "min_p": unit, "typical_p": unit, "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repeat_penalty": st.floats(0.5, 2), "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=4)),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=3),
    "stream": st.booleans(), "stream_options": st.just({"include_usage": True}), "n": st.just(1),
    "response_format": st.sampled_from(FORMATS), "ignore_eos": st.booleans(),
}
valid_chat = {**valid_common, "messages": st.lists(valid_message, min_size=1, max_size=3),
              "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5), "tools": st.just([TOOL]),
              "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function",
                                                                            "function": {"name": "f"}}])}
valid_completion = {**valid_common, "prompt": st.one_of(st.text(min_size=1, max_size=30),
                                                        st.lists(st.integers(0, 49151), min_size=1, max_size=6)),
                    "logprobs": st.integers(0, 5), "echo": st.booleans()}
# ... and hostile ones to swap in.
number = st.one_of(st.floats(allow_nan=False), st.integers(-(2**70), 2**70), json_any)
hostile = {
    "model": json_any, "messages": st.one_of(st.lists(st.one_of(json_any, st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["robot", "", "tool", "function"]), json_any),
         "content": st.one_of(st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"])})),
                              json_any)})), max_size=3), json_any),
    "prompt": st.one_of(st.lists(st.integers(-5, 2**40), max_size=4), st.lists(st.text(max_size=3), max_size=3),
                        st.just(""), json_any),
    "max_tokens": st.one_of(st.integers(-2, 10**12), json_any), "logit_bias": st.one_of(st.dictionaries(
        st.one_of(st.integers(-5, 10**7).map(str), st.text(max_size=4)), number, max_size=3), json_any),
    "tools": st.one_of(st.lists(json_any, max_size=2), json_any),
    "tool_choice": st.one_of(st.just({"type": "function", "function": {"name": "g"}}), json_any),
    "stop": st.one_of(st.lists(st.text(max_size=5), max_size=20), json_any),
}


@st.composite
def mutated(draw, valid: dict, required: tuple[str, ...]):
    """A valid body (some optional fields set), then up to three fields deleted, replaced or added."""
    optional = {k: v for k, v in valid.items() if k not in required}
    body = {"model": MODEL, **draw(st.fixed_dictionaries({k: valid[k] for k in required}, optional=optional))}
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(sorted(set(valid) | set(hostile) | {"model"})))
        action = draw(st.sampled_from(["delete", "hostile", "junk"]))
        if action == "delete":
            body.pop(key, None)
        else:
            body[key] = draw(hostile.get(key, number) if action == "hostile" else json_any)
    return body


tokenize_body = st.fixed_dictionaries({}, optional={"content": st.one_of(st.text(max_size=30), json_any),
                                                   "add_special": st.one_of(st.booleans(), json_any),
                                                   "with_pieces": st.one_of(st.booleans(), json_any)})
detokenize_body = st.fixed_dictionaries({}, optional={"tokens": st.one_of(
    st.lists(st.integers(-5, 2**40), max_size=5), st.lists(st.integers(0, 49151), max_size=5), json_any)})

request = st.one_of(
    st.tuples(st.just("/v1/chat/completions"), mutated(valid_chat, ("messages",))),
    st.tuples(st.just("/v1/completions"), mutated(valid_completion, ("prompt",))),
    st.tuples(st.just("/tokenize"), tokenize_body),
    st.tuples(st.just("/detokenize"), detokenize_body),
    st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize"]), json_any),
    st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions"]), st.binary(max_size=40)),
)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(req=request)
def test_fuzzed_bodies_never_give_5xx(fuzz_server, req):
    path, body = req
    with httpx.Client(base_url=fuzz_server.base_url, timeout=60) as c:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = c.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code < 500, (path, body, r.status_code, r.text[:500])
        if r.status_code >= 400:
            err = r.json()["error"]
            assert isinstance(err["message"], str) and err["message"]
        elif r.headers.get("content-type", "").startswith("text/event-stream"):
            assert "data: [DONE]" in r.text
            assert '"error"' not in r.text, r.text[:500]


def test_server_still_answers_after_the_fuzz(fuzz_server):
    with httpx.Client(base_url=fuzz_server.base_url, timeout=60) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
        assert c.get("/v1/models").status_code == 200


def test_non_streaming_client_that_hangs_up_cancels_its_generation(fuzz_server):
    fuzz_server.runner.delay_s = 0.02
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 200, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(fuzz_server.base_url + "/v1/completions", json=body, timeout=0.5)
        with httpx.Client(base_url=fuzz_server.base_url, timeout=60) as c:
            deadline = time.time() + 3  # far less than the 4 s the whole generation would take
            while c.get("/health").json()["busy"] and time.time() < deadline:
                time.sleep(0.05)
            assert not c.get("/health").json()["busy"]
            assert 'runlm_generations_total{finish_reason="cancelled"}' in c.get("/metrics").text
    finally:
        fuzz_server.runner.delay_s = 0.0


def test_streamed_forced_tool_call_arrives_as_tool_call_deltas(fuzz_server):
    import openai

    client = openai.OpenAI(base_url=fuzz_server.base_url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "call f"}], tools=[TOOL], tool_choice="required",
        max_tokens=40, temperature=0.7, seed=5, stream=True)
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": "", "id": d.id})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    (call,) = calls.values()
    assert call["name"] == "f" and call["id"]
    args = json.loads(call["arguments"])
    assert set(args) == {"a"} and isinstance(args["a"], int) and 0 <= args["a"] <= 9
