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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from server_harness import LiveServer, ScriptedRunner, last_user_text, scripted_server  # noqa: E402, F401 - the tests' imports

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




