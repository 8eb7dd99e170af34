"""Start real uvicorn servers on free loopback ports, in background threads, for the server tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from runlm.bench import free_port, served_process

__all__ = ["LiveServer", "free_port", "openai_client", "serve_cli"]


class LiveServer:
    """A uvicorn server for `app` on 127.0.0.1:<free port> (`options`: more uvicorn.Config keywords, such as
    runlm.server.timeouts.uvicorn_options()); `stop()` shuts it down."""

    def __init__(self, app: Any, **options: Any):
        self.app = app
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", **options))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@contextmanager
def serve_cli(*args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """`python -m runlm serve ARGS` on a free port, in a subprocess as a user runs it (runlm.bench's
    served_process): yields its base URL once uvicorn says it listens, and stops it afterwards."""
    with served_process(*args, env=env) as base_url:
        yield base_url


def openai_client(base_url: str, api_key: str = "unused", timeout: float = 120) -> Any:
    """The official OpenAI client of a runlm server at `base_url`, without retries (a test sees every error)."""
    import openai

    return openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)
