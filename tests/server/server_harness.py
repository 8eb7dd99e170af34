"""Start real uvicorn servers on free loopback ports, in background threads, for the server tests."""

from __future__ import annotations

import socket
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import uvicorn


def shared_loaded(path: Path) -> Any:
    """Load SmolLM2 once per test process, whichever test directory asks first.

    (Engine and server tests both need it and loading takes a while; a session fixture in
    tests/conftest.py would be the tidy home for this.)
    """
    store = sys.modules.setdefault("_runlm_shared_test_models", types.ModuleType("_runlm_shared_test_models"))
    key = str(path)
    if not hasattr(store, "loaded"):
        store.loaded = {}
    if key not in store.loaded:
        from runlm import load

        store.loaded[key] = load(path)
    return store.loaded[key]


class LiveServer:
    """A uvicorn server for `app` on 127.0.0.1:<free port>; `stop()` shuts it down."""

    def __init__(self, app: Any):
        self.app = app
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
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
