"""Many models behind one server (create_app's models_dir, `runlm serve --models-dir`): each loaded on the first
request that names it, by the official openai and ollama clients; keep_alive, --max-loaded eviction, one load per
model, and /health while a model loads.

The models are SmolLM2's GGUF under three names: two files of a models directory ("alpha", "beta") and the pulled
catalog model of a runlm cache made for the module ("smollm2-135m"). Waits poll /api/ps or /v1/models for the
state they need, never sleep for it.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from server_harness import LiveServer, openai_client, pulled_models_cache, serve_cli

from runlm import catalog, load
from runlm.cli.commands import main
from runlm.server import create_app
from runlm.server.pool import FOREVER, parse_keep_alive

QUESTION = [{"role": "user", "content": "Name a color."}]
FEW = {"temperature": 0, "num_predict": 2}


@pytest.fixture(scope="module")
def pulled_cache(smollm2_gguf, gemma3_gguf, tmp_path_factory) -> Iterator[Path]:
    """A model cache holding SmolLM2 as pulled (a link to the session's copy), so the pulled models listed are
    known. Only where pulled models are looked for moves: runlm's home (its built kernels) stays. Gemma 3 is pulled
    first, into the real cache: pulled by a test's fixture while this cache is in place, it would be listed here."""
    cache = tmp_path_factory.mktemp("runlm-cache")
    with pulled_models_cache(cache, smollm2_gguf):
        yield cache


@pytest.fixture(scope="module")
def models_dir(smollm2_gguf, pulled_cache, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("models")
    for name in ("alpha", "beta"):
        (directory / f"{name}.gguf").symlink_to(smollm2_gguf)
    return directory


class CountingLoader:
    """runlm.load, counting the loads of each model (by file stem or catalog name); a model in `held` waits for
    `gate` before it loads."""

    def __init__(self):
        self.calls: Counter[str] = Counter()
        self.held: set[str] = set()
        self.gate = threading.Event()

    def __call__(self, ref: str):
        name = Path(ref).stem
        self.calls[name] += 1
        if name in self.held:
            assert self.gate.wait(60), "the test never opened the gate"
        return load(ref)


def start(models_dir: Path, **options) -> LiveServer:
    loader = options.pop("loader", None) or CountingLoader()
    server = LiveServer(create_app(None, models_dir=models_dir, api_key="", loader=loader, **options))
    server.loader = loader
    return server


@pytest.fixture(scope="module")
def two(models_dir) -> Iterator[LiveServer]:
    """Up to two models loaded at once."""
    server = start(models_dir, max_loaded=2)
    yield server
    server.stop()


def loaded_names(server: LiveServer) -> list[str]:
    return sorted(m["name"] for m in httpx.get(server.base_url + "/api/ps", timeout=30).json()["models"])


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def model_states(server: LiveServer) -> dict[str, str]:
    data = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"]
    return {card["id"]: card["state"] for card in data}


def test_two_models_by_name_to_the_openai_and_ollama_clients(two):
    assert model_states(two) == {"alpha": "unloaded", "beta": "unloaded", "smollm2-135m": "unloaded"}
    oai = openai_client(two.base_url)
    for name in ("alpha", "beta"):
        reply = oai.chat.completions.create(model=name, messages=QUESTION, max_tokens=2, temperature=0)
        assert reply.model == name and reply.choices[0].message.content
    assert loaded_names(two) == ["alpha", "beta"]
    client = ollama.Client(host=two.base_url, timeout=60)
    for name in ("alpha:latest", "beta"):
        reply = client.chat(model=name, messages=QUESTION, stream=False, options=FEW)
        assert reply.model == name and reply.done
    assert model_states(two) == {"alpha": "loaded", "beta": "loaded", "smollm2-135m": "unloaded"}
    assert two.loader.calls == {"alpha": 1, "beta": 1}
    assert {m.model for m in client.list().models} == {"alpha", "beta", "smollm2-135m"}
    running = {m.model: m for m in client.ps().models}
    assert set(running) == {"alpha", "beta"} and running["alpha"].size > 0 and running["alpha"].expires_at


def test_unknown_model_is_a_404_listing_the_names(two):
    with pytest.raises(openai.NotFoundError) as caught:
        openai_client(two.base_url).chat.completions.create(model="nope", messages=QUESTION, max_tokens=1)
    message = caught.value.body["message"]
    assert "'nope'" in message and all(f"'{name}'" in message for name in ("alpha", "beta", "smollm2-135m"))
    with pytest.raises(ollama.ResponseError) as caught:
        ollama.Client(host=two.base_url, timeout=30).generate(model="nope", prompt="hi")
    assert caught.value.status_code == 404 and "'alpha'" in caught.value.error
    assert httpx.get(two.base_url + "/v1/models/nope", timeout=30).status_code == 404


def test_show_reads_a_model_that_is_not_loaded_without_loading_it(two):
    shown = ollama.Client(host=two.base_url, timeout=30).show("smollm2-135m")
    assert shown.modelinfo["general.architecture"] == "llama" and shown.template
    assert shown.details.family == "llama32" and shown.details.parameter_size == "135M"
    assert "smollm2-135m" not in loaded_names(two)


def test_keep_alive_zero_unloads_after_the_request(two):
    client = ollama.Client(host=two.base_url, timeout=60)
    client.generate(model="alpha", prompt="Hi", options=FEW, keep_alive="1h")
    [alpha] = [m for m in client.ps().models if m.model == "alpha"]
    assert alpha.expires_at.timestamp() > time.time() + 3000  # an hour from the request's end
    client.generate(model="alpha", prompt="Hi", options=FEW, keep_alive=0)
    wait_until(lambda: "alpha" not in loaded_names(two), "alpha is unloaded")
    client.generate(model="beta", prompt="Hi", options=FEW)  # beta is loaded (still, or again)
    reply = client.generate(model="beta", prompt="", keep_alive=0)  # Ollama's way to unload a model
    assert reply.done_reason == "unload"
    wait_until(lambda: "beta" not in loaded_names(two), "beta is unloaded")


def test_max_loaded_one_evicts_the_least_recently_used_and_reloads(models_dir):
    server = start(models_dir, max_loaded=1)
    try:
        client = ollama.Client(host=server.base_url, timeout=60)
        for name in ("alpha", "beta", "alpha"):
            assert client.generate(model=name, prompt="Hi", options=FEW).done
            assert loaded_names(server) == [name]
        assert server.loader.calls == {"alpha": 2, "beta": 1}
    finally:
        server.stop()


@pytest.mark.parametrize("max_loaded", [1, 2])
def test_concurrent_requests_for_both_models_all_succeed(models_dir, max_loaded):
    """With room for one model, requests for the other wait until the first model is free to unload."""
    server = start(models_dir, max_loaded=max_loaded)
    oai, client = openai_client(server.base_url), ollama.Client(host=server.base_url, timeout=60)

    def ask(i: int) -> str:
        name = ("alpha", "beta")[i % 2]
        if i % 4 < 2:
            return oai.completions.create(model=name, prompt="Once upon a time", max_tokens=3).model
        return client.generate(model=name, prompt="Once upon a time", raw=True, options=FEW).model

    try:
        with concurrent.futures.ThreadPoolExecutor(8) as threads:
            assert list(threads.map(ask, range(8))) == ["alpha", "beta"] * 4
        assert len(loaded_names(server)) == max_loaded
    finally:
        server.stop()


def resident_mb() -> float:
    """This process's resident memory (the live server runs in it)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_smollm2_and_gemma3_by_name_and_keep_alive_zero_gives_the_memory_back(smollm2_gguf, gemma3_gguf,
                                                                                 pulled_cache, tmp_path):
    """Two families from one models directory, to both clients at once; Gemma unloaded by keep_alive 0 leaves
    /api/ps and gives its memory back (its regrouped weights are most of its ~250 MB)."""
    (tmp_path / "smol.gguf").symlink_to(smollm2_gguf)
    (tmp_path / "gemma.gguf").symlink_to(gemma3_gguf)
    server = start(tmp_path, max_loaded=2)
    try:
        client, oai = ollama.Client(host=server.base_url, timeout=120), openai_client(server.base_url)
        asks = [lambda: oai.chat.completions.create(model="smol", messages=QUESTION, max_tokens=2, temperature=0),
                lambda: client.chat(model="gemma", messages=QUESTION, stream=False, options=FEW)] * 2
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            replies = [future.result() for future in [pool.submit(ask) for ask in asks]]
        assert [reply.model for reply in replies] == ["smol", "gemma"] * 2
        assert loaded_names(server) == ["gemma", "smol"] and server.loader.calls == {"smol": 1, "gemma": 1}
        with_gemma = resident_mb()
        assert client.generate(model="gemma", prompt="Hi", options=FEW, keep_alive=0).done
        wait_until(lambda: loaded_names(server) == ["smol"], "gemma is unloaded")
        wait_until(lambda: resident_mb() < with_gemma - 100, "gemma's memory is given back")
        assert client.chat(model="smol", messages=QUESTION, stream=False, options=FEW).done
    finally:
        server.stop()


def test_health_answers_while_a_model_loads_and_it_loads_once(models_dir):
    loader = CountingLoader()
    loader.held.add("beta")
    server = start(models_dir, max_loaded=2, loader=loader)
    oai = openai_client(server.base_url)

    def ask_beta(_: int) -> str:
        return oai.completions.create(model="beta", prompt="Hi", max_tokens=2).model

    try:
        with concurrent.futures.ThreadPoolExecutor(2) as threads:
            waiting = [threads.submit(ask_beta, i) for i in range(2)]
            wait_until(lambda: model_states(server)["beta"] == "loading", "beta is loading")
            health = httpx.get(server.base_url + "/health", timeout=5)
            assert health.status_code == 200 and health.json()["models_loaded"] == []
            assert oai.completions.create(model="alpha", prompt="Hi", max_tokens=2).model == "alpha"
            assert not any(future.done() for future in waiting)
            loader.gate.set()
            assert [future.result(timeout=60) for future in waiting] == ["beta", "beta"]
        assert loader.calls == {"alpha": 1, "beta": 1}
    finally:
        loader.gate.set()
        server.stop()


def test_copy_and_delete_act_on_files_of_the_models_dir(two, models_dir):
    client = ollama.Client(host=two.base_url, timeout=60)
    client.copy("alpha", "gamma")
    assert (models_dir / "gamma.gguf").is_file() and "gamma" in {m.model for m in client.list().models}
    assert client.generate(model="gamma", prompt="Hi", options=FEW).model == "gamma"
    client.delete("gamma")
    assert not (models_dir / "gamma.gguf").exists()
    wait_until(lambda: "gamma" not in loaded_names(two), "gamma is unloaded")
    for bad in (lambda: client.delete("smollm2-135m"), lambda: client.copy("alpha", "../elsewhere"),
                lambda: client.copy("alpha", "beta")):
        with pytest.raises(ollama.ResponseError) as caught:
            bad()
        assert caught.value.status_code in (400, 409)


def test_a_model_that_cannot_load_is_a_json_error_and_the_others_serve_on(smollm2_gguf, pulled_cache, tmp_path):
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + bytes(64))
    (tmp_path / "alpha.gguf").symlink_to(smollm2_gguf)
    server = start(tmp_path, max_loaded=1)
    try:
        client = ollama.Client(host=server.base_url, timeout=60)
        listed = {m.model: m for m in client.list().models}
        assert set(listed) == {"alpha", "broken", "smollm2-135m"} and listed["broken"].details.family == ""
        with pytest.raises(ollama.ResponseError) as caught:
            client.generate(model="broken", prompt="Hi")
        assert caught.value.status_code == 422 and "could not be loaded" in caught.value.error
        assert client.generate(model="alpha", prompt="Hi", options=FEW).done
        assert loaded_names(server) == ["alpha"]
    finally:
        server.stop()


@pytest.mark.parametrize("value, seconds", [
    ("5m", 300.0), ("1h30m", 5400.0), ("90s", 90.0), ("500ms", 0.5), (0, 0.0), ("0", 0.0), (12.5, 12.5),
    (-1, FOREVER), ("-1m", FOREVER),
])
def test_keep_alive_durations(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["5 minutes", "m", "", "1d"])
def test_keep_alive_bad_durations_are_a_400(two, value):
    r = httpx.post(two.base_url + "/api/generate", json={"model": "alpha", "prompt": "Hi", "keep_alive": value},
                   timeout=30)
    assert r.status_code == 400 and "keep_alive" in r.json()["error"]


def test_serve_models_dir_from_the_command_line(models_dir):
    with serve_cli("--models-dir", str(models_dir), "-m", "beta", "--keep-alive", "10m") as base:
        running = httpx.get(base + "/api/ps", timeout=30).json()["models"]
        assert [m["name"] for m in running] == ["beta"]
        cards = {card["id"]: card["state"] for card in httpx.get(base + "/v1/models", timeout=30).json()["data"]}
        assert cards["beta"] == "loaded" and cards["alpha"] == "unloaded"
        assert cards.get(catalog.DEFAULT_MODEL) == "unloaded"  # pulled into the cache (by the session's fixture)
        reply = httpx.post(base + "/v1/completions", json={"model": "alpha", "prompt": "Hi", "max_tokens": 2},
                           timeout=60)
        assert reply.status_code == 200
        running = httpx.get(base + "/api/ps", timeout=30).json()["models"]
        assert [m["name"] for m in running] == ["alpha"]  # --max-loaded 1 by default: beta made room


@pytest.mark.parametrize("argv, message", [
    (["serve", "--keep-alive", "5m"], "--keep-alive applies with --models-dir"),
    (["serve", "--models-dir", "/nonexistent-models"], "no such directory"),
    (["serve", "--models-dir", ".", "--max-loaded", "0"], "--max-loaded must be at least 1"),
    (["serve", "--models-dir", ".", "--keep-alive", "soon"], "--keep-alive"),
])
def test_serve_flags_are_checked_before_any_load(argv, message, capsys):
    assert main(argv) == 1
    assert message in capsys.readouterr().err
