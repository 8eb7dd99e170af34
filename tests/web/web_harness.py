"""Helpers for the chat page's browser tests: finding Chromium, watching a page for errors, and a scripted
runner that says exactly what a test needs (HTML in the answer, a slow answer to stop, one reply per request).

The page changes asynchronously (streams, fetches, timers, the clipboard): the tests wait for whatever they check
with Playwright's `expect` (exported here), which retries until the condition holds, up to the same 20 s as every
other page action, or with `page.wait_for_function` for a condition only JavaScript can see; never with pauses.
Only the server's own state (/health, /metrics) is polled, by `server_until`.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from server_harness import LiveServer  # noqa: E402

from runlm.runner import LmRunner, Session  # noqa: E402
from runlm.server import create_app  # noqa: E402

try:
    from playwright.sync_api import expect
except ImportError:  # then the `browser` fixture skips the browser tests (or fails them, in CI) with the reason
    expect = None
else:
    expect.set_options(timeout=20_000)

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
REPO = Path(__file__).resolve().parents[2]


def find_chromium() -> str | None:
    for candidate in (os.environ.get("RUNLM_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


def exactly(text: str) -> re.Pattern:
    """A pattern for Playwright's `expect(...).to_have_text` that matches `text` exactly: a plain string there is
    compared after collapsing whitespace, a pattern is not."""
    return re.compile("^" + re.escape(text) + "$")


def server_until(check: Callable[[], bool], message: str, *, timeout: float = 20.0,
                 deadline: float | None = None) -> None:
    """Poll a condition on the server itself (its /health, its /metrics), which Playwright's `expect` cannot see,
    until it holds; fail with `message` once `deadline` (time.monotonic()) or `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout if deadline is None else deadline
    while not check():
        assert time.monotonic() < deadline, message
        time.sleep(0.02)


class PageProblems:
    """JavaScript errors and console errors seen by a page; a test ends with none it did not expect."""

    def __init__(self, page, allow: Sequence[str] = ()):
        self.errors: list[str] = []
        self.allow = list(allow)
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))
        page.on("console", lambda msg: self.errors.append(f"console: {msg.text}") if msg.type == "error" else None)

    def unexpected(self) -> list[str]:
        return [e for e in self.errors if not any(a in e for a in self.allow)]


def last_user_text(prompt: str) -> str:
    turns = re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", prompt, flags=re.S)
    return turns[-1] if turns else ""


class ScriptedRunner(LmRunner):
    """Greedy-certain logits that spell `reply(prompt_text, n)` for the n-th request, then end the turn."""

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

    def predict_logits(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        return self.prefill(self.new_session(), prompt_ids)

    def extend(self, session: Session, ids: Sequence[int], all_positions: bool = False) -> torch.Tensor:
        """session.state: [the scripted reply's ids, how far it has gone, the request's number]. One token on a
        session that has its reply is a decode step; anything else is (a chunk of) the prompt."""
        self.check_tokens(ids)
        if session.state is not None and session.state[0] and len(ids) == 1:
            if self.delay_s:
                time.sleep(self.delay_s)
            session.tokens.append(int(ids[0]))
            session.state[1] += 1
            return self._logits(session)
        if not session.tokens:  # a new prompt (its first chunk)
            self.calls += 1
            session.state = [[], 0, self.calls]
        session.tokens = session.tokens + [int(t) for t in ids]
        text = self.reply(self.tok.decode(session.tokens), session.state[2])
        session.state[0], session.state[1] = self.tok.encode(text, add_bos=False) + [self.end], 0
        return self._logits(session)

    def _logits(self, session: Session) -> torch.Tensor:
        script, pos, _ = session.state
        logits = torch.zeros(self.vocab)
        logits[script[min(pos, len(script) - 1)]] = 60.0
        return logits


def scripted_server(real, reply: Callable[[str, int], str], *, name: str = "scripted-model", **kw) -> LiveServer:
    runner_kw = {k: kw.pop(k) for k in ("delay_s", "multimodal") if k in kw}
    runner = ScriptedRunner(real.tokenizer, reply, **runner_kw)
    loaded = SimpleNamespace(runner=runner, tokenizer=real.tokenizer, chat_template=real.chat_template,
                             path=real.path, quantization=real.quantization, format="gguf",
                             context_length=4096)
    server = LiveServer(create_app(loaded, model_name=name, **kw))
    server.runner = runner
    return server


