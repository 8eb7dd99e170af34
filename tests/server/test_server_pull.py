"""Ollama's /api/pull (server.pulls) through the official `ollama` client, against a loopback server speaking the
Hugging Face Hub's HTTP API (hub_harness, HF_ENDPOINT): progress lines as bytes arrive, /health answering while a
pull is held partway, two pulls of one model at once, the pulled model served by the name it was pulled as, a
catalog name, each failure as an `ollama.ResponseError`, and the API key.

The server runs on an empty models directory and a runlm cache made for the module (its catalog part holds SmolLM2,
its hub part starts empty). Waits are for what the servers report, never for time.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import ollama
import pytest
from hub_harness import FakeHub
from server_harness import LiveServer, pulled_models_cache

from runlm import catalog, hub
from runlm.server import create_app

REPO, GATED, BROKEN = "loopback/SmolLM2-135M-Instruct-GGUF", "loopback/gated-GGUF", "loopback/broken-GGUF"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PULLED_AS = f"hf.co/{REPO}:Q4_1"


@pytest.fixture(scope="module")
def fake_hub(smollm2_gguf) -> Iterator[FakeHub]:
    server = FakeHub({REPO: {FILE: smollm2_gguf}, GATED: {"gated-Q4_1.gguf": smollm2_gguf},
                      BROKEN: {"broken-Q4_1.gguf": smollm2_gguf}}, gated={GATED})
    server.corrupt.add("broken-Q4_1.gguf")
    yield server
    server.close()


@pytest.fixture(scope="module")
def cache(smollm2_gguf, fake_hub, tmp_path_factory) -> Iterator[Path]:
    """runlm's cache for the module (only where pulled models live moves: runlm's home, its built kernels, stays),
    and the loopback hub as HF_ENDPOINT without a token."""
    root = tmp_path_factory.mktemp("runlm-cache")
    with pulled_models_cache(root, smollm2_gguf) as patch:
        patch.setenv("HF_ENDPOINT", fake_hub.url)
        patch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        patch.delenv("HF_TOKEN", raising=False)
        yield root


@pytest.fixture(scope="module")
def live(cache, tmp_path_factory) -> Iterator[LiveServer]:
    server = LiveServer(create_app(None, models_dir=tmp_path_factory.mktemp("models"), api_key=""))
    yield server
    server.stop()


def client_of(server: LiveServer) -> ollama.Client:
    return ollama.Client(host=server.base_url, timeout=60)


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_progress(parts: list[ollama.ProgressResponse], digest: str, size: int, verified: bool = True) -> list[int]:
    """Ollama's order (manifest, the file's progress, verifying where `verified`, success), `completed` never going
    back and ending at the file's size: the `completed` values seen."""
    statuses = [p.status for p in parts]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success", statuses
    progress = [p for p in parts if p.total]
    assert progress and all(p.digest == f"sha256:{digest}" and p.total == size for p in progress), progress
    assert all(p.status == f"pulling {digest[:12]}" for p in progress)
    completed = [p.completed for p in progress]
    assert completed == sorted(completed) and completed[-1] == size, completed
    if verified:
        assert statuses.index("verifying sha256 digest") > statuses.index(progress[-1].status)
    return completed


def test_progress_as_bytes_arrive_while_health_answers_and_two_pulls_take_turns(live, fake_hub, smollm2_gguf):
    """The hub holds the file after 24 MB: the pull shows a line partway and waits there, /health answers
    meanwhile, and a second pull of the model waits for the first, then downloads nothing."""
    digest, size = sha256(smollm2_gguf), smollm2_gguf.stat().st_size
    fake_hub.gets.clear()
    fake_hub.hold_after[FILE] = 24 << 20
    fake_hub.holding.clear()
    fake_hub.release.clear()
    seen: list[list[ollama.ProgressResponse]] = [[], []]
    failures: list[BaseException] = []

    def pull(index: int) -> None:
        try:
            for part in client_of(live).pull(PULLED_AS, stream=True):
                seen[index].append(part)
        except BaseException as exc:  # reported by the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=pull, args=(i,), daemon=True) for i in range(2)]
    try:
        for thread in threads:
            thread.start()
        wait_until(lambda: any(p.total and 0 < p.completed < p.total for p in seen[0] + seen[1]) or failures,
                   "a progress line partway through the file")
        # a progress line may come before the hub reaches the byte it holds at: wait for that too
        wait_until(lambda: fake_hub.holding.is_set() or failures, "the hub holding the file at 24 MB")
        assert not failures, failures
        health = httpx.get(live.base_url + "/health", timeout=5)
        assert health.status_code == 200
        assert not any(p.status == "success" for p in seen[0] + seen[1])
    finally:
        fake_hub.release.set()
        fake_hub.hold_after.clear()
    for thread in threads:
        thread.join(60)
    assert not failures, failures
    completed = [check_progress(parts, digest, size) for parts in seen]
    assert any(0 < c < size for c in completed[0] + completed[1])  # the one that downloaded
    assert fake_hub.gets[FILE] == 1  # the second found the file in place
    assert sha256(hub.pulled_file(hub.parse_ref(PULLED_AS))[1]) == digest


def test_the_pulled_model_answers_by_the_name_it_was_pulled_as(live):
    client = client_of(live)
    assert client.pull(PULLED_AS, stream=False).status == "success"
    assert f"hf.co/{REPO}:{FILE}" in {m.model for m in client.list().models}
    for name in (PULLED_AS, f"hf.co/{REPO}"):  # the default quantization: the one pulled
        reply = client.generate(model=name, prompt="Once upon a time", options={"temperature": 0, "num_predict": 2})
        assert reply.done and reply.response and reply.model == name


def test_a_catalog_name_pulls_from_the_catalog(live, smollm2_gguf):
    """Pulled already (into the module's cache): its one line says so; a catalog pull checks what it unpacks."""
    parts = list(client_of(live).pull("smollm2-135m:latest", stream=True))
    check_progress(parts, catalog.lookup("smollm2-135m").sha256, smollm2_gguf.stat().st_size, verified=False)


@pytest.mark.parametrize("name, status, message", [
    ("hf.co/loopback/no-such-repo", 404, "hf.co/loopback/no-such-repo: no such repo on the Hub"),
    (f"hf.co/{REPO}:Q8_0", 404, "no GGUF with 'Q8_0' in its name (the repo has: Q4_1)"),
    (f"hf.co/{GATED}", 403, "the repo is gated: accept its terms on the Hub and set HF_TOKEN"),
    ("llama3.2", 400, "runlm cannot pull 'llama3.2'; it pulls hf.co/<user>/<repo>[:<quantization>]"),
    ("hf.co/not-a-repo", 400, "expected hf.co/<user>/<repo>[:<quantization>]"),
])
def test_a_name_that_cannot_be_pulled_is_an_error_before_the_stream(live, name, status, message):
    with pytest.raises(ollama.ResponseError) as caught:
        list(client_of(live).pull(name, stream=True))
    assert caught.value.status_code == status and message in caught.value.error, caught.value
    reply = httpx.post(live.base_url + "/api/pull", json={"model": name, "stream": False}, timeout=30)
    assert reply.status_code == status and message in reply.json()["error"]


def test_a_file_that_fails_its_sha256_ends_the_stream_with_an_error(live, cache):
    parts: list[ollama.ProgressResponse] = []
    with pytest.raises(ollama.ResponseError) as caught:
        for part in client_of(live).pull(f"hf.co/{BROKEN}", stream=True):
            parts.append(part)
    assert "broken-Q4_1.gguf does not match the sha256 the Hub lists for it" in caught.value.error
    assert [p.status for p in parts][-1] == "verifying sha256 digest"
    assert not [p for p in (cache / "hub").rglob("broken-Q4_1.gguf") if p.exists()]


def test_pull_takes_the_api_key_and_the_older_name_field(cache, tmp_path):
    server = LiveServer(create_app(None, models_dir=tmp_path, api_key="secret"))
    try:
        url = server.base_url + "/api/pull"
        body = {"name": "smollm2-135m", "stream": False}
        assert httpx.post(url, json=body, timeout=30).status_code == 401
        reply = httpx.post(url, json=body, headers={"Authorization": "Bearer secret"}, timeout=30)
        assert reply.status_code == 200 and reply.json() == {"status": "success"}
    finally:
        server.stop()
