"""server.workers: replies written in parts are the same bytes as one json.dumps, and bodies parsed in the pool
fail as FastAPI's parsing does (a 400 that names the field), with no Python internals in the message."""

from __future__ import annotations

import json

import pytest
from fastapi.exceptions import RequestValidationError

from runlm.server.schemas import ChatCompletionRequest
from runlm.server.workers import JSON_PART_VALUES, json_text, parse_body

PIECES = {"tokens": [{"id": i, "piece": f"é{i}"} for i in range(3 * JSON_PART_VALUES)]}
LOGPROBS = {"choices": [{"index": k, "logprobs": {"content": [
    {"token": "a", "logprob": -0.5, "top_logprobs": [{"token": "b", "logprob": -1.5}] * 20}] * 900}}
    for k in range(3)]}


@pytest.mark.parametrize("value", [PIECES, LOGPROBS, {"ids": list(range(2 * JSON_PART_VALUES + 3))},
                                   [[1, 2], [3] * (JSON_PART_VALUES + 1)], {"a": [], "b": {}, "c": None},
                                   [list(range(JSON_PART_VALUES))] * 3, ("x",) * (JSON_PART_VALUES * 2)])
def test_json_in_parts_is_the_same_text(value):
    assert json_text(value) == json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def first_error(raw: bytes, content_type: str | None = "application/json") -> dict:
    with pytest.raises(RequestValidationError) as caught:
        parse_body(ChatCompletionRequest, raw, content_type)
    return caught.value.errors()[0]


def test_bodies_fail_as_fastapi_would():
    assert first_error(b"")["type"] == "missing"
    broken = first_error(b'{"model": ')
    assert broken["type"] == "json_invalid" and broken["loc"][0] == "body"
    assert first_error(b'{"model": "m", "messages": [{"role": "wizard"}]}')["loc"] == ("body", "messages", 0, "role")
    assert first_error(b'{"model": "m"}', content_type="text/plain")["loc"] == ("body",)  # not parsed as JSON


def test_undecodable_and_deep_bodies_are_plain_400s():
    assert first_error(b'{"model": "\xff"}')["ctx"]["error"] == "it is not UTF-8"
    deep = b'{"model": "m", "messages": [], "tools": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert first_error(deep)["ctx"]["error"] == "it is nested too deeply"
