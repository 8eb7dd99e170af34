"""CPU-heavy request work stays off the event loop and is bounded: /health answers while a chat template with
nested loops, megabyte /tokenize bodies and 7 MB chat bodies run, and the template is refused with a 400 instead
of rendering forever. On the real SmolLM2 tokenizer behind a real server."""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_harness import LiveServer

from runlm.server import create_app
from runlm.server.schemas import MAX_TOKENIZE_CHARS
from runlm.text import ChatTemplate

MODEL = "smollm2-135m"
# Every probe within HEALTH_BOUND_S, and the median within the 100 ms. The bound on every probe stays loose:
# this is a shared 2-core machine (load averages of 4-5 while these ran) and one process holds server and clients,
# so a C call that keeps the GIL (json.loads of a 7 MB body: ~70 ms), a garbage collection or another process
# adds to a probe now and then. Measured with the worker pool: the worst probe 0.05-0.6 s, the median under 10 ms;
# before it, one 200k-message body held the loop ~1 s and a megabyte /tokenize with pieces 15 s.
HEALTH_BOUND_S = 1.0
TYPICAL_HEALTH_S = 0.1
NESTED_LOOPS = ("{% for m in messages %}{% for a in range(100000) %}{% for b in range(100000) %}"
                "{% if b < 0 %}{{ m.role }}{% endif %}{% endfor %}{% endfor %}{% endfor %}")


@pytest.fixture(scope="module")
def live(smollm2_loaded):
    hostile = dataclasses.replace(smollm2_loaded, chat_template=ChatTemplate(NESTED_LOOPS))
    server = LiveServer(create_app(hostile, model_name=MODEL, max_queue=4, prompt_cache_mb=0))
    yield server
    server.stop()


def health_latencies_while(attacks: list, base_url: str) -> list[float]:
    """Probe /health over and over until every attack has its answer; each probe's latency."""
    latencies = []
    with httpx.Client(base_url=base_url, timeout=60) as probe:
        while not all(a.done() for a in attacks):
            started = time.perf_counter()
            assert probe.get("/health").status_code == 200
            latencies.append(time.perf_counter() - started)
    return latencies


def assert_health_answered(latencies: list[float]) -> None:
    assert latencies and max(latencies) < HEALTH_BOUND_S, sorted(latencies)[-5:]
    assert statistics.median(latencies) < TYPICAL_HEALTH_S, statistics.median(latencies)


def test_nested_loop_template_is_a_400_and_health_answers_meanwhile(live):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with ThreadPoolExecutor(4) as pool, httpx.Client(base_url=live.base_url, timeout=120) as http:
        attacks = [pool.submit(http.post, "/v1/chat/completions", json=body) for _ in range(4)]
        latencies = health_latencies_while(attacks, live.base_url)
        replies = [a.result() for a in attacks]
    assert_health_answered(latencies)
    for reply in replies:
        assert reply.status_code == 400
        assert "chat template" in reply.json()["error"]["message"]


def test_megabyte_tokenize_runs_off_the_loop_and_larger_is_refused(live):
    content = "word " * (MAX_TOKENIZE_CHARS // 5)
    with ThreadPoolExecutor(2) as pool, httpx.Client(base_url=live.base_url, timeout=120) as http:
        attacks = [pool.submit(http.post, "/tokenize", json={"content": content, "with_pieces": True})
                   for _ in range(2)]
        latencies = health_latencies_while(attacks, live.base_url)
        replies = [a.result() for a in attacks]
        too_long = http.post("/tokenize", json={"content": content + "x"})
    assert_health_answered(latencies)
    assert all(r.status_code == 200 and len(r.json()["tokens"]) >= MAX_TOKENIZE_CHARS // 5 for r in replies)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "content"


def test_large_bodies_are_parsed_off_the_loop(live):
    """Three 7 MB bodies of 200,001 messages, each invalid only at its end: parsed and validated in the pool."""
    messages = [{"role": "user", "content": "hi"}] * 200_000 + [{"role": "wizard", "content": "hi"}]
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 1}).encode()
    headers = {"content-type": "application/json"}
    with ThreadPoolExecutor(3) as pool, httpx.Client(base_url=live.base_url, timeout=120) as http:
        attacks = [pool.submit(http.post, "/v1/chat/completions", content=body, headers=headers) for _ in range(3)]
        latencies = health_latencies_while(attacks, live.base_url)
        replies = [a.result() for a in attacks]
    assert_health_answered(latencies)
    assert all(r.status_code == 400 and r.json()["error"]["param"] == "messages.200000.role" for r in replies)
