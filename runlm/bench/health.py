"""`runlm bench --health`: how fast `/health` answers while hostile requests run against `runlm serve`.

The server, the attacker and the prober each run in a process of their own. The attacker is one asyncio client
sending an attack's requests all at once (`ATTACKER`, with nothing of runlm loaded): on a 2-core machine, 200
client threads would keep the server's event loop waiting for a core, which says nothing of the server, and a
remote attacker's threads do not run on its cores. The prober asks for `/health` over one keep-alive
connection, back to back, until the attacker is done.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runlm.server.schemas import MAX_TOKENIZE_CHARS
from runlm.system import python_command


@dataclass(frozen=True)
class Attack:
    """`count` copies of one request, sent at once."""

    title: str
    path: str
    body: Callable[[str], dict[str, Any]]  # the model's served name -> the JSON body
    count: int


ATTACKS = {
    "messages-200k": Attack("three 7 MB bodies of 200,000 messages (more than the context)", "/v1/chat/completions",
                            lambda model: {"model": model, "messages": [{"role": "user", "content": "hi"}] * 200_000,
                                           "max_tokens": 1}, 3),
    "messages-8k": Attack("three 2 MB bodies of 8,001 messages, the last invalid", "/v1/chat/completions",
                          lambda model: {"model": model, "messages": [{"role": "user", "content": "hi " * 80}] * 8_000
                                         + [{"role": "wizard", "content": "hi"}], "max_tokens": 1}, 3),
    "tokenize-1mb": Attack("two 1 MB /tokenize calls with pieces", "/tokenize",
                           lambda model: {"content": "word " * (MAX_TOKENIZE_CHARS // 5), "with_pieces": True}, 2),
    "completions-200": Attack("200 completions at once", "/v1/completions",
                              lambda model: {"model": model, "prompt": "Hi", "max_tokens": 2}, 200),
    "tool-whitespace": Attack("a 32k-space tool-call turn", "/v1/chat/completions",
                              lambda model: {"model": model, "max_tokens": 1, "messages": [
                                  {"role": "user", "content": "hi"},
                                  {"role": "assistant", "content": "<tool_call>" + " " * 32_000},
                                  {"role": "user", "content": "x"}]}, 1),
    "chat-4": Attack("four chat requests (with a nested-loop chat template: four renders that must be cut short)",
                     "/v1/chat/completions",
                     lambda model: {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                    "max_tokens": 1}, 4),
}
BENCH_ATTACKS = ("messages-200k", "messages-8k", "tokenize-1mb", "completions-200", "tool-whitespace")


@dataclass
class Reply:
    status: int
    size: int  # bytes of the reply's body
    error: dict[str, Any] | None  # the error object of a 4xx / 5xx reply


def start_attack(base_url: str, name: str, model: str) -> subprocess.Popen:
    """The attack `name` in a process of its own (Python with httpx, nothing of runlm's loaded); its stdout is
    one JSON line per reply (`replies_of`)."""
    attack = ATTACKS[name]
    attacker = subprocess.Popen(python_command("-c", ATTACKER, base_url, attack.path, str(attack.count)),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert attacker.stdin is not None
    attacker.stdin.write(json.dumps(attack.body(model)).encode())
    attacker.stdin.close()
    attacker.stdin = None  # sent: communicate() has nothing more to write
    return attacker


def replies_of(attacker: subprocess.Popen, timeout_s: float = 600) -> list[Reply]:
    out, err = attacker.communicate(timeout=timeout_s)
    if attacker.returncode != 0:
        raise RuntimeError(f"the attacker failed: {err.decode(errors='replace').strip()[-2000:]}")
    return [Reply(**json.loads(line)) for line in out.decode().splitlines()]


def health_latencies_until(base_url: str, done: Callable[[], bool]) -> list[float]:
    """Seconds each `/health` took, asked back to back on one keep-alive connection until `done()`."""
    host, port = base_url.split("://", 1)[1].rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    latencies = []
    try:
        while not done():
            started = time.perf_counter()
            connection.request("GET", "/health")
            response = connection.getresponse()
            response.read()
            if response.status != 200:
                raise RuntimeError(f"/health answered {response.status}")
            latencies.append(time.perf_counter() - started)
    finally:
        connection.close()
    return latencies


def probe_attack(base_url: str, name: str, model: str) -> tuple[list[float], list[Reply]]:
    """(/health latencies while the attack ran, the attack's replies)."""
    attacker = start_attack(base_url, name, model)
    latencies = health_latencies_until(base_url, lambda: attacker.poll() is not None)
    return latencies, replies_of(attacker)


def run_health_bench(args: Any) -> int:
    from runlm.bench.common import machine, served_process
    from runlm.catalog import resolve_model
    from runlm.cluster.simulate import percentile

    path = resolve_model(args.model)
    threads = args.threads or 2
    print(f"model: {path.name}   threads: {threads}   machine: {machine()}")
    print("| attack | probes | /health p50 ms | p99 ms | worst ms | replies |")
    print("|---|---|---|---|---|---|")
    with served_process("-m", str(path), "--threads", str(threads)) as url:
        for name in BENCH_ATTACKS:
            for _ in range(max(1, args.repeat)):  # every run shown: a latency tail is not a best-of figure
                latencies, replies = probe_attack(url, name, path.name)
                p50, p99 = (percentile(latencies, q) * 1e3 for q in (0.5, 0.99))
                statuses = ", ".join(f"{count} x {status}" for status, count in
                                     sorted(Counter(r.status for r in replies).items()))
                print(f"| {ATTACKS[name].title} | {len(latencies)} | {p50:.1f} | {p99:.1f} | "
                      f"{max(latencies) * 1e3:.1f} | {statuses} |", flush=True)
    return 0


# argv: base URL, path, how many; stdin: the JSON body. Sends them all at once, prints each reply's status, body
# size and error object (of a 4xx / 5xx) as a JSON line.
ATTACKER = """
import asyncio, json, sys
import httpx
async def send_all(base_url, path, count, content):
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=httpx.Limits(max_connections=None)) as http:
        return await asyncio.gather(*[http.post(path, content=content, headers=headers) for _ in range(count)])
for r in asyncio.run(send_all(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.stdin.buffer.read())):
    error = r.json().get("error") if r.status_code >= 400 else None
    print(json.dumps({"status": r.status_code, "size": len(r.content), "error": error}))
"""
