"""server.workers: replies written in parts are the same bytes as one json.dumps, and bodies parsed in the pool
fail as FastAPI's parsing does (a 400 that names the field), with no Python internals in the message."""

from __future__ import annotations

import json

import pytest
from fastapi.exceptions import RequestValidationError

from runlm.server.schemas import ChatCompletionRequest, CompletionRequest
from runlm.server.workers import (
    JSON_IN_PARTS_BYTES,
    JSON_PART_VALUES,
    VALIDATE_PART_ITEMS,
    collector_paused,
    json_text,
    load_json,
    parse_body,
    release_in_parts,
)

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


def large_body(messages: list, **extra) -> bytes:
    """A chat body past JSON_IN_PARTS_BYTES (so it is read in parts), with JSON's odd corners inside."""
    body = json.dumps({"model": "m", "messages": messages, "stop": ["\u00e9", "\\n"], "max_tokens": 1, **extra},
                      indent=1)
    assert len(body) > JSON_IN_PARTS_BYTES
    return body.encode()


MESSAGES = [{"role": "user", "content": f"hi \u2603 {i}"} for i in range(40_000)]


def test_large_bodies_read_in_parts_are_what_one_json_loads_reads():
    raw = large_body(MESSAGES, logit_bias={"1": 2}, tools=[], n=1)
    assert load_json(raw) == json.loads(raw)
    assert load_json(b" [1, 2] ") == [1, 2]
    parsed = parse_body(ChatCompletionRequest, raw, "application/json")
    assert parsed == ChatCompletionRequest.model_validate(json.loads(raw))
    assert len(parsed.messages) > VALIDATE_PART_ITEMS


@pytest.mark.parametrize("damage", [
    lambda raw: raw[:-2],                                # cut short
    lambda raw: raw + b" {}",                            # extra data
    lambda raw: raw.replace(b'"max_tokens":', b'"max_tokens" 1', 1),   # no colon
    lambda raw: raw.replace(b'"n"', b"n", 1),            # a bare key
    lambda raw: raw.replace(b"},\n  {", b"}\n  {", 1),   # no comma between items
])
def test_large_broken_bodies_are_json_errors_as_json_loads_finds(damage):
    raw = damage(large_body(MESSAGES[:30_000], n=1))
    with pytest.raises(json.JSONDecodeError):
        json.loads(raw)
    assert first_error(raw)["type"] == "json_invalid"


def test_long_lists_validated_in_parts_name_the_failing_item():
    messages = [*MESSAGES, {"role": "wizard", "content": "hi"}]
    assert first_error(large_body(messages))["loc"] == ("body", "messages", len(MESSAGES), "role")
    ids = json.dumps({"model": "m", "prompt": list(range(3 * VALIDATE_PART_ITEMS)), "max_tokens": 1}).encode()
    assert parse_body(CompletionRequest, ids, "application/json").prompt == list(range(3 * VALIDATE_PART_ITEMS))


def test_lists_of_objects_longer_than_the_cap_are_refused_and_scalar_lists_are_not():
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}] * 5}).encode()
    with pytest.raises(RequestValidationError) as caught:
        parse_body(ChatCompletionRequest, raw, "application/json", max_object_items=4)
    error = caught.value.errors()[0]
    assert error["loc"] == ("body", "messages") and error["type"] == "too_long"
    assert "has 5 items; at most 4 fit" in error["msg"]
    assert len(parse_body(ChatCompletionRequest, raw, "application/json", max_object_items=5).messages) == 5
    ids = json.dumps({"model": "m", "prompt": list(range(10)), "max_tokens": 1}).encode()
    assert parse_body(CompletionRequest, ids, "application/json", max_object_items=4).prompt == list(range(10))


def test_release_in_parts_empties_the_list():
    items = [{"n": n} for n in range(3 * VALIDATE_PART_ITEMS + 7)]
    release_in_parts(items)
    assert items == []


def test_the_collector_is_paused_while_large_bodies_are_read_and_left_as_it_was():
    import gc

    with collector_paused(), collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # a collector someone else turned off stays off
    finally:
        gc.enable()
