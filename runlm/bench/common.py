"""What the benchmarks share: the English text, the tokenizer, the machine's line, `runlm serve` in a process of
its own on a free port, and a streamed request's token arrival times."""

from __future__ import annotations

import http.client
import json
import os
import platform
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from urllib.parse import urlsplit

from runlm.errors import InvalidInputError, RunlmError
from runlm.formats.gguf import GGUFFile
from runlm.native import build
from runlm.system import cpu_name, python_command
from runlm.text import Tokenizer


def english_text() -> str:
    """The GNU GPL v3: real English prose that no one here wrote, shipped with the package."""
    return resources.files("runlm").joinpath("data/GPL-3.txt").read_text()


def load_tokenizer(path: Path):
    if path.is_dir():
        return Tokenizer.from_hf_dir(path)
    return Tokenizer.from_gguf(GGUFFile(path).metadata)


def machine() -> str:
    """The CPU, its cores, the kernels' instruction set (the native library's, which the PyTorch extension shares)
    and its decode walk, Python's version: the line every benchmark prints."""
    from runlm.native import library

    try:
        isa = library.isa()
    except RunlmError:
        isa = "off"
    walk = f" (decode walk {build.decode_walk_name(isa)})" if build.walks_weights(isa) else ""
    return f"{cpu_name()}, {os.cpu_count()} cores, kernels {isa}{walk}, Python {platform.python_version()}"


def streamed_token_times(base_url: str, body: dict) -> list[float]:
    """Arrival time of each token of a streamed /v1/completions request (events with text).

    Read with the standard library's HTTP client, event by event: on a 2-core machine the client's CPU is
    taken from the model's threads, and httpx's line iterator cost ~420 us a token here (this loop ~110)."""
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise InvalidInputError(f"the server answered {response.status}: {response.read()[:500]!r}")
        arrivals: list[float] = []
        tail = b""
        while data := response.read1(1 << 16):
            now = time.perf_counter()
            *events, tail = (tail + data).split(b"\n\n")
            arrivals += [now for event in events if event.startswith(b"data: {") and b'"text": ""' not in event]
        return arrivals
    finally:
        conn.close()


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def served_process(*serve_args: str, start_timeout_s: float = 600, env: dict[str, str] | None = None) -> Iterator[str]:
    """`runlm serve SERVE_ARGS` on a free port in a process of its own, as users run it: yields its base URL
    once it listens (raises with the server's log if it dies or stays silent first), stops it afterwards. `env`:
    variables set for it on top of this process's."""
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(python_command("-m", "runlm", "serve", *serve_args, "--port", str(port)),
                                  stdout=subprocess.DEVNULL, stderr=log, text=True, env={**os.environ, **(env or {})})
        try:
            deadline = time.monotonic() + start_timeout_s
            while True:
                log.seek(0)
                text = log.read()
                if "Uvicorn running on" in text:
                    break
                if server.poll() is not None or time.monotonic() > deadline:
                    raise InvalidInputError(f"`runlm serve` did not start: {text.strip()[-2000:]}")
                time.sleep(0.05)
            yield f"http://127.0.0.1:{port}"
        finally:
            server.terminate()
            server.wait(timeout=30)


def best_ms(fn: Callable[[], object], budget_s: float = 0.25) -> float:
    """The fastest of repeated calls (at least 3, for up to budget_s), in ms."""
    fn()
    times: list[float] = []
    stop = time.perf_counter() + budget_s
    while len(times) < 3 or (time.perf_counter() < stop and len(times) < 200):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3
