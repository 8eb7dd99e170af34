"""Start real uvicorn servers on free loopback ports, in background threads, for the server tests."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


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
