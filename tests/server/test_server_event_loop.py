"""CPU-heavy request work stays off the event loop and is bounded: /health answers while a chat template with
nested loops, megabyte /tokenize bodies, 2-7 MB chat bodies and 200 concurrent requests run, and the template is
refused with a 400 instead of rendering forever. On the real SmolLM2 behind `runlm serve` in its own process, as
users run it, each attack sent at once from a process of its own (runlm.bench.health, which `runlm bench
--health` runs too)."""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter

import httpx
import pytest
from server_harness import serve_cli

from runlm.bench.health import ATTACKS, probe_attack
from runlm.server.schemas import MAX_TOKENIZE_CHARS
from runlm.server.workers import JSON_IN_PARTS_BYTES

MODEL = "smollm2-135m"
# The bound is 100 ms for every probe. Asserted: 99% of probes within it, and every probe within
# WORST_HEALTH_S, a margin for a shared 2-core machine where the OS may deschedule the server's event loop for
# other processes (the test's own among them). Measured here, 15 runs of this file: the worst probe of any
# attack 69 ms (README's security model has each attack's figure, from `runlm bench --health`).
TYPICAL_HEALTH_S = 0.1
WORST_HEALTH_S = 0.25
NESTED_LOOPS = ("{% for m in messages %}{% for a in range(100000) %}{% for b in range(100000) %}"
                "{% if b < 0 %}{{ m.role }}{% endif %}{% endfor %}{% endfor %}{% endfor %}")


@pytest.fixture(scope="module")
def base_url(smollm2_gguf, tmp_path_factory):
    template = tmp_path_factory.mktemp("templates") / "nested.jinja"
    template.write_text(NESTED_LOOPS)
    with serve_cli("-m", str(smollm2_gguf), "--chat-template-file", str(template), "--max-queue", "4",
                   "--prompt-cache-mb", "0", "--threads", "2") as url:
        yield url


def assert_health_answered(latencies: list[float]) -> None:
    """At most 1% of the probes (at least one may) past TYPICAL_HEALTH_S, none past WORST_HEALTH_S."""
    latencies = sorted(latencies)
    assert latencies and latencies[-1] < WORST_HEALTH_S, latencies[-5:]
    slow = sum(latency >= TYPICAL_HEALTH_S for latency in latencies)
    assert slow <= math.ceil(len(latencies) / 100), (len(latencies), statistics.median(latencies), latencies[-5:])


def test_nested_loop_template_is_a_400_and_health_answers_meanwhile(base_url):
    latencies, replies = probe_attack(base_url, "chat-4", MODEL)
    assert_health_answered(latencies)
    for reply in replies:
        assert reply.status == 400 and "chat template" in reply.error["message"]


def test_megabyte_tokenize_runs_off_the_loop_and_larger_is_refused(base_url):
    latencies, replies = probe_attack(base_url, "tokenize-1mb", MODEL)
    assert_health_answered(latencies)
    assert all(r.status == 200 and r.size > 10 * MAX_TOKENIZE_CHARS // 5 for r in replies)  # 200,000 pieces
    too_long = httpx.post(base_url + "/tokenize", json={"content": "x" * (MAX_TOKENIZE_CHARS + 1)}, timeout=60)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "content"


def test_large_bodies_are_parsed_off_the_loop(base_url):
    """Three 2 MB bodies of 8,001 messages, each invalid only at its end: read and validated in the pool,
    in parts."""
    assert len(json.dumps(ATTACKS["messages-8k"].body(MODEL))) > JSON_IN_PARTS_BYTES
    latencies, replies = probe_attack(base_url, "messages-8k", MODEL)
    assert_health_answered(latencies)
    assert all(r.status == 400 and r.error["param"] == "messages.8000.role" for r in replies)


def test_more_messages_than_the_context_are_refused_unvalidated(base_url):
    """Three 7 MB bodies of 200,000 valid messages: more than SmolLM2's 8,192-token context can hold, refused
    before they are validated or rendered."""
    latencies, replies = probe_attack(base_url, "messages-200k", MODEL)
    assert_health_answered(latencies)
    for reply in replies:
        assert reply.status == 400 and reply.error["param"] == "messages"
        assert "has 200000 items; at most 8192 fit" in reply.error["message"]


def test_two_hundred_requests_at_once(base_url):
    """200 completions at once: the queue takes what it holds (each is planned with its place held), the rest
    get 429 at the door, and /health answers throughout."""
    latencies, replies = probe_attack(base_url, "completions-200", MODEL)
    assert_health_answered(latencies)
    statuses = Counter(r.status for r in replies)
    assert set(statuses) <= {200, 429} and statuses[200] >= 5 and statuses[429] > 0, statuses

