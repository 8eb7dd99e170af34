"""Start real uvicorn servers on free loopback ports, in background threads, for the server tests."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvicorn

from runlm import catalog, hub
from runlm.bench.common import free_port, served_process
from runlm.runner import LmRunner, Session
from runlm.server import create_app

__all__ = ["LiveServer", "ScriptedRunner", "free_port", "last_user_text", "openai_client", "scripted_server",
           "serve_cli"]


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
    """`python -m runlm serve ARGS` on a free port, in a subprocess as a user runs it (runlm.bench.common's
    served_process): yields its base URL once uvicorn says it listens, and stops it afterwards."""
    with served_process(*args, env=env) as base_url:
        yield base_url


def openai_client(base_url: str, api_key: str = "unused", timeout: float = 120) -> Any:
    """The official OpenAI client of a runlm server at `base_url`, without retries (a test sees every error)."""
    import openai

    return openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)


def last_user_text(prompt: str) -> str:
    turns = re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", prompt, flags=re.S)
    return turns[-1] if turns else ""


class ScriptedRunner(LmRunner):
    """Greedy-certain logits that spell `reply(prompt_text, n)` for the n-th request, then end the turn. Where the
    engine writes a token the script did not choose, the script starts again from `reply(text so far, n)`."""

    def __init__(self, tokenizer, reply: Callable[[str, int], str], *, delay_s: float = 0.0,
                 multimodal: bool = False, max_context: int = 4096):
        self.tok = tokenizer
        self.vocab = tokenizer.vocab_size
        self.end = tokenizer.eos_id
        self.reply = reply
        self.delay_s = delay_s
        self.multimodal = multimodal
        self.context = max_context
        self.calls = 0

    def family(self) -> str:
        return "scripted"

    def vocab_size(self) -> int:
        return self.vocab

    def max_context(self) -> int:
        return self.context

    def supports_multimodal(self) -> bool:
        return self.multimodal

    def image_marker(self) -> str | None:
        return "<start_of_image>" if self.multimodal else None

    def predict_logits(self, prompt_ids: Sequence[int]) -> np.ndarray:
        return self.prefill(self.new_session(), prompt_ids)

    def extend(self, session: Session, ids: Sequence[int], all_positions: bool = False) -> np.ndarray:
        """session.state: [the scripted reply's ids, how far it has gone, the request's number]. One token on a
        session that has its reply is a decode step; anything else is (a chunk of) the prompt."""
        self.check_tokens(ids)
        if session.state is not None and session.state[0] and len(ids) == 1:
            if self.delay_s:
                time.sleep(self.delay_s)
            session.tokens.append(int(ids[0]))
            session.state[1] += 1
            script, pos, number = session.state
            if int(ids[0]) != script[min(pos, len(script)) - 1]:  # the engine wrote a token of its own: the reply
                text = self.reply(self.tok.decode(session.tokens), number)  # goes on from what is there
                session.state[0], session.state[1] = self.tok.encode(text, add_bos=False) + [self.end], 0
            return self._logits(session)
        if not session.tokens:  # a new prompt (its first chunk)
            self.calls += 1
            session.state = [[], 0, self.calls]
        session.tokens = session.tokens + [int(t) for t in ids]
        text = self.reply(self.tok.decode(session.tokens), session.state[2])
        session.state[0], session.state[1] = self.tok.encode(text, add_bos=False) + [self.end], 0
        return self._logits(session)

    def _logits(self, session: Session) -> np.ndarray:
        script, pos, _ = session.state
        logits = np.zeros(self.vocab, dtype=np.float32)
        logits[script[min(pos, len(script) - 1)]] = 60.0
        return logits


def scripted_server(real, reply: Callable[[str, int], str], *, name: str = "scripted-model",
                    chat_template: Any = None, **kw) -> LiveServer:
    """A live server whose model is a ScriptedRunner on `real`'s tokenizer, with `real`'s chat template or
    `chat_template`; `kw`: the runner's delay_s / multimodal, and create_app's options."""
    runner_kw = {k: kw.pop(k) for k in ("delay_s", "multimodal") if k in kw}
    runner = ScriptedRunner(real.tokenizer, reply, **runner_kw)
    loaded = replace(real, runner=runner, chat_template=chat_template or real.chat_template)
    server = LiveServer(create_app(loaded, model_name=name, **kw))
    server.runner = runner
    return server


@contextmanager
def pulled_models_cache(root: Path, gguf: Path) -> Iterator[pytest.MonkeyPatch]:
    """runlm's model cache moved to `root`, holding `gguf` as pulled (a link), for as long as the context lasts. Only
    where pulled models live moves: runlm's home (its built kernels) stays. Yields the patch, for more settings."""
    (root / "models").mkdir()
    (root / "models" / gguf.name).symlink_to(gguf)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(catalog, "cache_dir", lambda: root / "models")
        patch.setattr(hub, "hub_dir", lambda: root / "hub")
        yield patch
