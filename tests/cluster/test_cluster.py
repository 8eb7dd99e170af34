"""runlm on a local Ray cluster: two SmolLM2 replicas (one CPU each) behind one front.

Shown here: the cluster answers as the single server does (greedy, plain and streamed), follow-up turns
reach the replica that holds their prefix (against round-robin), per-replica gauges, and a replica
killed in the middle of a run: every accepted request ends (answered, or a clean 503 / error event for
the one it was generating), the service keeps answering and Ray brings the replica back.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from server_harness import LiveServer, free_port, openai_client  # noqa: E402

from runlm.cluster.deploy import (  # noqa: E402
    ClusterOptions,
    ReplicaOptions,
    answers_without_token,
    init_ray,
    start,
    stop,
)
from runlm.server import create_app  # noqa: E402

MODEL = "smollm2-135m"
FRONT_MAX_BODY = 200_000
T = TypeVar("T")
SYSTEMS = [
    "You are a ship's navigator on a long voyage across the northern sea. Answer every question in the voice of "
    "a sailor, mention the weather and the stars, and keep each answer to a single short sentence.",
    "You are a patient librarian in a small mountain town. You recommend books, explain where they stand on the "
    "shelves, and always end with a friendly reminder about the return date of the loan.",
]
QUESTIONS = ["What should I do today?", "Why is that?", "Tell me more.", "Anything else?"]


def wait_for(condition: Callable[[], T], what: str, timeout_s: float = 120.0) -> T:
    """The condition's first truthy value (polled: the cluster's state changes in other processes)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
    return value


@pytest.fixture(scope="module")
def cluster_url(smollm2_gguf):
    init_ray(num_cpus=2, log_to_driver=False)  # as `runlm serve --replicas` starts it
    cluster = ClusterOptions(replicas=2, port=free_port(), stats_period_s=0.5, header_timeout_s=2.0)
    url = start(ReplicaOptions(model=str(smollm2_gguf), max_batch=2, max_queue=4), cluster,
                {"max_body_bytes": FRONT_MAX_BODY})
    yield url
    stop()


@pytest.fixture(scope="module")
def single_url(smollm2_loaded):
    server = LiveServer(create_app(smollm2_loaded))
    yield server.base_url
    server.stop()


def client(url: str) -> openai.OpenAI:
    return openai_client(url)


def chat(url: str, messages: list[dict], stream: bool = False, max_tokens: int = 16):
    kwargs = dict(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    if not stream:
        return client(url).chat.completions.create(**kwargs)
    return "".join(c.choices[0].delta.content or "" for c in client(url).chat.completions.create(stream=True, **kwargs)
                   if c.choices)


def test_the_cluster_answers_as_the_single_server(cluster_url, single_url):
    messages = [{"role": "user", "content": "Name three colors of the rainbow."}]
    single = chat(single_url, messages).choices[0].message.content
    assert chat(cluster_url, messages).choices[0].message.content == single
    assert chat(cluster_url, messages, stream=True) == single
    # The same routes as the single server: the chat page, the models list, a 4xx in OpenAI's shape.
    assert "<html" in httpx.get(cluster_url + "/").text.lower()
    assert client(cluster_url).models.list().data[0].id == MODEL
    with pytest.raises(openai.BadRequestError):
        client(cluster_url).chat.completions.create(model=MODEL, messages=[], max_tokens=4)


def conversations_hit_rate(url: str) -> tuple[int, int]:
    """Three conversations over the two system prompts, four turns each, interleaved (an odd count, so
    round-robin does not send a conversation to the same replica every turn by chance); a follow-up turn
    counts as served by the replica that holds its prefix when its cached tokens cover the previous turn's
    prompt."""
    histories = [[{"role": "system", "content": s}] for s in (SYSTEMS[0], SYSTEMS[1], SYSTEMS[0])]
    previous = [0] * len(histories)
    hits = follow_ups = 0
    for turn, question in enumerate(QUESTIONS):
        for i, history in enumerate(histories):
            history.append({"role": "user", "content": f"{question} (conversation {i})"})
            reply = chat(url, history, max_tokens=8)
            history.append({"role": "assistant", "content": reply.choices[0].message.content})
            if turn:
                follow_ups += 1
                hits += reply.usage.prompt_tokens_details.cached_tokens >= previous[i]
            previous[i] = reply.usage.prompt_tokens
    return hits, follow_ups


def replica_gauges(url: str, name: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    prefix = f"runlm_replica_{name}{{replica=\""
    return {line[len(prefix):].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}


def test_replicas_report_on_metrics(cluster_url):
    chat(cluster_url, [{"role": "user", "content": "Hello"}], max_tokens=2)
    wait_for(lambda: len(replica_gauges(cluster_url, "running")) == 2, "both replicas' reports")
    wait_for(lambda: sum(replica_gauges(cluster_url, "requests").values()) >= 1, "a finished request reported")


def live_replica_actors() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::runlm#RunlmReplica#")]


def test_a_replica_killed_mid_run_loses_no_request(cluster_url):
    outcomes: dict[int, str] = {}
    first_token = threading.Event()

    def run(i: int) -> None:
        messages = [{"role": "user", "content": f"Count slowly from one to fifty, request {i}."}]
        try:
            if i % 2:
                text = ""
                for chunk in client(cluster_url).chat.completions.create(
                        model=MODEL, messages=messages, max_tokens=48, temperature=0, stream=True):
                    if chunk.choices and chunk.choices[0].delta.content:
                        first_token.set()
                        text += chunk.choices[0].delta.content
                outcomes[i] = "answered" if text else "empty"
            else:
                reply = chat(cluster_url, messages, max_tokens=48)
                outcomes[i] = "answered" if reply.choices[0].finish_reason else "empty"
        except openai.APIStatusError as exc:  # the one request the killed replica was generating
            outcomes[i] = f"status {exc.status_code}"
        except openai.APIError as exc:  # a stream's in-band error event
            outcomes[i] = f"error event: {exc.message}"

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    assert first_token.wait(120), "no stream started"
    victim = wait_for(lambda: next((r for r, n in replica_gauges(cluster_url, "running").items() if n), None),
                      "a replica that reports a running request")
    name = next(a for a in live_replica_actors() if a.endswith("#" + victim))
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert len(outcomes) == 6
    failed = {i: o for i, o in outcomes.items() if o != "answered"}
    # max_batch=2: at most the two requests the killed replica was generating end in an error; the ones
    # waiting in its queue were sent again to the survivor.
    assert len(failed) <= 2, outcomes
    assert all(o == "status 503" or o.startswith("error event") for o in failed.values()), outcomes
    # The service keeps answering, and Ray brings the replica back.
    assert chat(cluster_url, [{"role": "user", "content": "Still there?"}], max_tokens=4).choices
    wait_for(lambda: len(live_replica_actors()) == 2 and victim not in "".join(live_replica_actors()),
             "Ray to replace the killed replica", timeout_s=180)


def test_the_local_ray_listens_on_loopback_only(cluster_url):
    """Every socket a process of the running cluster listens on (the GCS, the raylet, workers, agents, Serve's proxy)
    is bound to a loopback address: nothing of Ray is reachable from the network."""
    psutil = pytest.importorskip("psutil")
    session = ray.get_runtime_context().gcs_address.split(":")[-1]  # the GCS's port: its process is the cluster's
    ray_pids = {p.pid for p in psutil.process_iter(["cmdline"])
                if any("ray" in part for part in (p.info["cmdline"] or [])[:2]) or p.pid == psutil.Process().pid}
    listening = [(c.laddr.ip, c.laddr.port, c.pid) for c in psutil.net_connections("inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in ray_pids]
    assert any(str(port) == session for _, port, _ in listening)  # the GCS is among them
    exposed = [s for s in listening if s[0] not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    assert not exposed, exposed


def front_socket(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)  # the timeout only guards the test


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_the_front_cuts_off_headers_that_trickle_in(cluster_url):
    """The front is the single server's uvicorn setup: its header deadline (2 s here) closes the connection."""
    started = time.monotonic()
    with front_socket(cluster_url) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl")
        assert read_until_closed(sock) == b""  # closed by the front, without an answer
    assert time.monotonic() - started < 20


def test_the_front_refuses_a_header_block_past_the_bound_and_keeps_serving(cluster_url):
    from runlm.server.timeouts import MAX_HEADER_BYTES

    filler = b"x" * MAX_HEADER_BYTES
    with front_socket(cluster_url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: " + filler + b"\r\n\r\n")
        assert read_until_closed(sock).startswith(b"HTTP/1.1 400")
    assert httpx.get(cluster_url + "/health").status_code == 200


def test_the_front_bounds_request_bodies(cluster_url):
    too_big = httpx.post(cluster_url + "/tokenize", json={"content": "x" * FRONT_MAX_BODY}, timeout=60)
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"
    assert httpx.post(cluster_url + "/tokenize", json={"content": "ok"}).status_code == 200


def test_the_local_ray_requires_a_token(cluster_url):
    """runlm's own Ray runs with Ray's token auth: its GCS refuses a call that carries none."""
    assert answers_without_token(ray.get_runtime_context().gcs_address) is False


def test_follow_up_turns_reach_the_replica_that_holds_their_prefix(cluster_url, smollm2_gguf):
    """Runs last: it redeploys with round-robin routing for the comparison."""
    hits, follow_ups = conversations_hit_rate(cluster_url)
    affinity = hits / follow_ups
    stop()
    init_ray(num_cpus=2, log_to_driver=False)  # as `runlm serve --replicas` starts it
    port = int(cluster_url.rsplit(":", 1)[1])
    start(ReplicaOptions(model=str(smollm2_gguf), max_batch=2, max_queue=4),
          ClusterOptions(replicas=2, port=port, policy="round-robin"), {})
    rr_hits, rr_follow_ups = conversations_hit_rate(cluster_url)
    round_robin = rr_hits / rr_follow_ups
    print(f"follow-up turns served where their prefix is cached: prefix-affinity {affinity:.0%}, "
          f"round-robin {round_robin:.0%} ({follow_ups} turns each)")
    assert affinity >= 0.9
    assert affinity > round_robin
