"""The chat page's files as the server serves them (no browser needed): open even behind an API key, a
strict Content-Security-Policy, revalidation by ETag, and nothing but the packaged files."""

from __future__ import annotations

import re

import httpx
import pytest
from web_harness import scripted_server

from runlm.server.web import load_assets


@pytest.fixture(scope="module")
def keyed(smollm2_loaded):
    server = scripted_server(smollm2_loaded, lambda prompt, n: "ok", name="keyed-assets", api_key="k3y")
    yield server
    server.stop()


def test_page_and_assets_load_without_the_key_and_the_api_still_needs_it(keyed):
    with httpx.Client(base_url=keyed.base_url, timeout=10) as c:
        page = c.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe" not in csp and "connect-src 'self'" in csp
        assert page.headers["x-content-type-options"] == "nosniff"
        assets = re.findall(r'(?:src|href)="(/web/[^"]+)"', page.text)
        assert sorted(assets) == ["/web/chat.css", "/web/chat.js", "/web/favicon.svg", "/web/markdown.js"]
        for path in assets:
            r = c.get(path)
            assert r.status_code == 200 and r.content, path
            again = c.get(path, headers={"If-None-Match": r.headers["etag"]})
            assert again.status_code == 304 and not again.content
        assert c.get("/web/chat.js").headers["content-type"].startswith("text/javascript")
        assert c.head("/").status_code == 200
        assert c.get("/web/nope.js").status_code == 404
        assert c.get("/web/%2e%2e/app.py").status_code == 404  # only the packaged files, by exact name
        assert c.get("/props").status_code == 401
        assert c.get("/props", headers={"Authorization": "Bearer k3y"}).json()["multimodal"] is False
        assert c.post("/", json={}).status_code == 401  # only GET/HEAD of the page are open
        assert 'runlm_requests_total{route="/",status="200"}' in c.get(
            "/metrics", headers={"Authorization": "Bearer k3y"}).text


def test_assets_ship_inside_the_package_and_reach_nothing_outside():
    assets = load_assets()
    assert {"/", "/web/index.html", "/web/chat.js", "/web/markdown.js", "/web/chat.css"} <= set(assets)
    for path, (body, _, _) in assets.items():
        text = body.decode("utf-8")
        assert not re.search(r"(?:src|href)=\"(?:https?:)?//", text), path  # no CDN, nothing fetched from afar
        # Model text never goes into the page as HTML.
        assert not re.search(r"(?:inner|outer)HTML\s*[+]?=|insertAdjacentHTML|document\.write|\beval\(", text), path
