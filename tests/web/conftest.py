"""Fixtures for the chat page's end-to-end tests: a headless Chromium (Debian's, driven by playwright) and
live runlm servers on loopback ports, over the real SmolLM2 or over a scripted runner (see web_harness).

Locally the browser tests skip when playwright or Chromium is missing; CI sets RUNLM_REQUIRE_BROWSER=1
(and installs both), so there they fail instead.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest
from web_harness import CHROMIUM_ARGS, LiveServer, PageProblems, expect, find_chromium

from runlm.server import create_app


def _unavailable(reason: str):
    if os.environ.get("RUNLM_REQUIRE_BROWSER") == "1":
        pytest.fail(reason + " (RUNLM_REQUIRE_BROWSER=1)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    """A browser per test module: playwright's sync API runs an event loop on this thread while it is open, and
    a test after it that calls asyncio.run (tests/cluster) would find that loop running."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (pip install playwright)")
    executable = find_chromium()
    if executable is None:
        _unavailable("no Chromium at /usr/bin/chromium (apt-get install -y chromium)")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def open_page(browser):
    """open_page(base_url, viewport=..., allow_console=(...)) -> a fresh page (own storage) on the chat page."""
    contexts, watchers, offsite = [], [], []

    def make(base_url: str, *, viewport=None, allow_console: Sequence[str] = (), wait_model: bool = True, **ctx):
        context = browser.new_context(viewport=viewport or {"width": 1200, "height": 800}, base_url=base_url, **ctx)
        context.set_default_timeout(20_000)
        contexts.append(context)
        page = context.new_page()
        page.problems = PageProblems(page, allow_console)
        watchers.append(page.problems)
        page.on("request", lambda r: offsite.append(r.url) if not r.url.startswith((base_url + "/", "data:", "blob:"))
                else None)
        page.goto("/")
        if wait_model:
            expect(page.locator("#model-meta")).not_to_be_empty()
        return page

    yield make
    for context in contexts:  # every event a page sent before it closed has been delivered once close returns
        context.close()
    problems = [p for w in watchers for p in w.unexpected()]
    assert not problems, problems
    assert not offsite, f"the page reached beyond its server: {offsite}"


@pytest.fixture(scope="module")
def real_server(smollm2_loaded):
    server = LiveServer(create_app(smollm2_loaded, model_name="smollm2-135m", prompt_cache_mb=64, max_queue=4))
    yield server
    server.stop()
