"""CPU-heavy request work stays off the event loop and is bounded: /health answers while a chat template with
nested loops, megabyte /tokenize bodies, 7 MB chat bodies and 200 concurrent requests run, and the template is
refused with a 400 instead of rendering forever. On the real SmolLM2 behind `runlm serve` in its own process,
as users run it (a server in the test's process would share the GIL with the clients)."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest
from server_harness import serve_cli

from runlm.server.schemas import MAX_TOKENIZE_CHARS
from runlm.server.workers import JSON_IN_PARTS_BYTES

MODEL = "smollm2-135m"
# The bound is 100 ms for every probe. Asserted: 99% of probes within it, and every probe within
# WORST_HEALTH_S, a margin for a shared 2-core machine where the OS may deschedule the server's event loop for
# other processes (the test's own among them). Measured here, 15 runs of this file: the worst probe of any
# attack 69 ms (README's security model has each attack's figure).
TYPICAL_HEALTH_S = 0.1
WORST_HEALTH_S = 0.25
NESTED_LOOPS = ("{% for m in messages %}{% for a in range(100000) %}{% for b in range(100000) %}"
                "{% if b < 0 %}{{ m.role }}{% endif %}{% endfor %}{% endfor %}{% endfor %}")
JSON_HEADERS = {"content-type": "application/json"}
# argv: base URL, how many; prints {status: count} of that many /v1/completions sent at once
AT_ONCE = """
import asyncio, collections, json, sys
import httpx
async def at_once(base_url, n):
    body = {"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 2}
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=httpx.Limits(max_connections=None)) as http:
        return await asyncio.gather(*[http.post("/v1/completions", json=body) for _ in range(n)])
replies = asyncio.run(at_once(sys.argv[1], int(sys.argv[2])))
print(json.dumps(collections.Counter(r.status_code for r in replies)))
"""


@pytest.fixture(scope="module")
def base_url(smollm2_gguf, tmp_path_factory):
    template = tmp_path_factory.mktemp("templates") / "nested.jinja"
    template.write_text(NESTED_LOOPS)
    with serve_cli("-m", str(smollm2_gguf), "--chat-template-file", str(template), "--max-queue", "4",
                   "--prompt-cache-mb", "0", "--threads", "2") as url:
        yield url


@pytest.fixture(autouse=True)
def short_switch_interval():
    """The probe's own process hands the GIL back quickly too (its attack threads send megabytes)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    yield
    sys.setswitchinterval(before)


def health_latencies_while(attacks: list[Future], base_url: str) -> list[float]:
    """Probe /health over and over until every attack has its answer; each probe's latency."""
    latencies = []
    with httpx.Client(base_url=base_url, timeout=60) as probe:
        while not all(a.done() for a in attacks):
            started = time.perf_counter()
            assert probe.get("/health").status_code == 200
            latencies.append(time.perf_counter() - started)
    return latencies


def assert_health_answered(latencies: list[float]) -> None:
    """At most 1% of the probes (at least one may) past TYPICAL_HEALTH_S, none past WORST_HEALTH_S."""
    latencies = sorted(latencies)
    assert latencies and latencies[-1] < WORST_HEALTH_S, latencies[-5:]
    slow = sum(latency >= TYPICAL_HEALTH_S for latency in latencies)
    assert slow <= math.ceil(len(latencies) / 100), (len(latencies), statistics.median(latencies), latencies[-5:])


def post_all(base_url: str, path: str, bodies: list[bytes]) -> tuple[list[httpx.Response], list[float]]:
    """POST every body at once from a thread each, probing /health until all are answered."""
    with ThreadPoolExecutor(len(bodies)) as pool, httpx.Client(base_url=base_url, timeout=120,
                                                               limits=httpx.Limits(max_connections=None)) as http:
        attacks = [pool.submit(http.post, path, content=body, headers=JSON_HEADERS) for body in bodies]
        latencies = health_latencies_while(attacks, base_url)
        return [a.result() for a in attacks], latencies


def test_nested_loop_template_is_a_400_and_health_answers_meanwhile(base_url):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    replies, latencies = post_all(base_url, "/v1/chat/completions", [body] * 4)
    assert_health_answered(latencies)
    for reply in replies:
        assert reply.status_code == 400
        assert "chat template" in reply.json()["error"]["message"]


def test_megabyte_tokenize_runs_off_the_loop_and_larger_is_refused(base_url):
    content = "word " * (MAX_TOKENIZE_CHARS // 5)
    body = json.dumps({"content": content, "with_pieces": True}).encode()
    replies, latencies = post_all(base_url, "/tokenize", [body] * 2)
    assert_health_answered(latencies)
    assert all(r.status_code == 200 and len(r.json()["tokens"]) >= MAX_TOKENIZE_CHARS // 5 for r in replies)
    too_long = httpx.post(base_url + "/tokenize", json={"content": content + "x"}, timeout=60)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "content"


def test_large_bodies_are_parsed_off_the_loop(base_url):
    """Three 2 MB bodies of 8,001 messages, each invalid only at its end: read and validated in the pool,
    in parts."""
    messages = [{"role": "user", "content": "hi " * 80}] * 8_000 + [{"role": "wizard", "content": "hi"}]
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 1}).encode()
    assert len(body) > JSON_IN_PARTS_BYTES
    replies, latencies = post_all(base_url, "/v1/chat/completions", [body] * 3)
    assert_health_answered(latencies)
    assert all(r.status_code == 400 and r.json()["error"]["param"] == "messages.8000.role" for r in replies)


def test_more_messages_than_the_context_are_refused_unvalidated(base_url):
    """Three 7 MB bodies of 200,000 valid messages: more than SmolLM2's 8,192-token context can hold, refused
    before they are validated or rendered."""
    messages = [{"role": "user", "content": "hi"}] * 200_000
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": 1}).encode()
    replies, latencies = post_all(base_url, "/v1/chat/completions", [body] * 3)
    assert_health_answered(latencies)
    for reply in replies:
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"
        assert "has 200000 items; at most 8192 fit" in reply.json()["error"]["message"]


def test_two_hundred_requests_at_once(base_url):
    """200 completions at once: the queue takes what it holds (each is planned with its place held), the rest
    get 429 at the door, and /health answers throughout. Sent by one asyncio client in its own process, as a
    remote attacker's connections arrive: 200 client threads on this machine's 2 cores would keep the
    server's event loop waiting for a core (measured: 110-225 ms in the kernel's run queue), and a client in
    the probe's process would hold the probe's GIL."""
    with ThreadPoolExecutor(1) as pool:
        attack = pool.submit(subprocess.run, [sys.executable, "-c", AT_ONCE, base_url, "200"], capture_output=True,
                             text=True, timeout=300)
        latencies = health_latencies_while([attack], base_url)
        done = attack.result()
    assert done.returncode == 0, done.stderr
    assert_health_answered(latencies)
    statuses = Counter({int(code): count for code, count in json.loads(done.stdout).items()})
    assert set(statuses) <= {200, 429} and statuses[200] >= 5 and statuses[429] > 0, statuses
