"""Browser-origin attacks against a keyless server on loopback, with httpx against a real uvicorn.

DNS rebinding: a page at http://evil.example:PORT rebinds its name to 127.0.0.1 and then talks to the server as
its own origin; every request it sends still says `Host: evil.example:PORT`. Cross-site requests: any page
the user visits can POST to http://127.0.0.1:PORT; the browser marks it with `Origin: <that page>`.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from server_harness import LiveServer, serve_cli

from runlm.errors import InvalidInputError
from runlm.server import create_app
from runlm.server.middleware import HostList, split_authority

MODEL = "smollm2-135m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}


@pytest.fixture(scope="module")
def live(smollm2_loaded):
    server = LiveServer(create_app(smollm2_loaded, model_name=MODEL, prompt_cache_mb=0))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def extended(smollm2_loaded):
    server = LiveServer(create_app(smollm2_loaded, model_name=MODEL, prompt_cache_mb=0, api_docs=True,
                                   allowed_hosts=["box.lan", ".example.org", "api.example.com:443"]))
    yield server
    server.stop()


def test_rebinding_host_is_refused_on_every_route(live, http):
    """POST /v1/chat/completions with Host evil.example was a 200 before: now 403 before any route runs."""
    host = {"Host": f"evil.example:{live.port}"}
    reply = http.post("/v1/chat/completions", json=CHAT, headers=host)
    assert reply.status_code == 403
    error = reply.json()["error"]
    assert error["code"] == "forbidden_origin" and "'evil.example'" in error["message"]
    assert "--allowed-hosts" in error["message"]
    for method, path in [("GET", "/"), ("GET", "/v1/models"), ("GET", "/health"), ("GET", "/web/app.js"),
                         ("POST", "/tokenize"), ("GET", "/metrics")]:
        assert http.request(method, path, headers=host).status_code == 403, path
    # each API answers in its own error shape
    anthropic = http.post("/v1/messages", json={}, headers=host)
    assert anthropic.status_code == 403 and anthropic.json()["type"] == "error"
    ollama = http.get("/api/tags", headers=host)
    assert ollama.status_code == 403 and isinstance(ollama.json()["error"], str)


@pytest.mark.parametrize("name", ["evil.example", "127.0.0.1.nip.io", "localhost.evil.example", "LOCALHOST.evil",
                                  "xn--80ak6aa92e.com", "evil.example."])
def test_names_that_resolve_anywhere_are_refused(live, http, name):
    assert http.get("/v1/models", headers={"Host": f"{name}:{live.port}"}).status_code == 403


@pytest.mark.parametrize("host", ["localhost", "LocalHost.", "127.0.0.1", "[::1]", "10.1.2.3", "[fe80::1]"])
def test_loopback_names_and_ip_addresses_are_answered(live, http, host):
    """A rebinding needs a name: IP addresses (the LAN address of a server bound to 0.0.0.0) stay allowed."""
    for value in (host, f"{host}:{live.port}"):
        assert http.get("/v1/models", headers={"Host": value}).status_code == 200, value


@pytest.mark.parametrize("value", ["evil.example:99999", "evil.example:x", "[not-ip]:80", "a b", "ex@mple.com"])
def test_malformed_host_header_is_refused(live, http, value):
    reply = http.get("/v1/models", headers={"Host": value})
    assert reply.status_code == 403 and "Host" in reply.json()["error"]["message"]


def test_cross_site_posts_are_refused_and_same_origin_ones_answered(live, http):
    """The chat page (same origin) and loopback tools post; any other site's page may not, nor sandboxed ones."""
    for origin in ("http://evil.example", f"http://evil.example:{live.port}", "null", "https://127.0.0.1.nip.io",
                   "http://192.168.1.7:3000", "file://"):
        reply = http.post("/v1/chat/completions", json=CHAT, headers={"Origin": origin})
        assert reply.status_code == 403, origin
        assert "web origin" in reply.json()["error"]["message"]
    for origin in (live.base_url, f"http://localhost:{live.port}", "http://localhost:3000", "http://[::1]:5173"):
        reply = http.post("/v1/chat/completions", json=CHAT, headers={"Origin": origin})
        assert reply.status_code == 200, (origin, reply.text)
    # reads are not state-changing: a page's GET with an Origin header is answered (CORS still hides the body)
    assert http.get("/v1/models", headers={"Origin": "http://evil.example"}).status_code == 200
    # the same origin under another port of the same address is another origin
    headers = {"Origin": f"http://10.0.0.5:{live.port + 1}", "Host": f"10.0.0.5:{live.port}"}
    reply = http.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert reply.status_code == 403


def test_official_client_is_unaffected(live):
    client = openai.OpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert reply.choices[0].message.content is not None


def test_docs_are_off_by_default(live, http):
    """FastAPI's docs pages load scripts from a CDN: not served unless asked for."""
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert http.get(path).status_code == 404, path


def test_allowed_hosts_extend_the_defaults(extended):
    with httpx.Client(base_url=extended.base_url, timeout=120) as http:
        def status(host: str, **headers: str) -> int:
            return http.get("/v1/models", headers={"Host": host, **headers}).status_code

        assert status("box.lan") == status(f"box.lan:{extended.port}") == 200
        assert status("example.org") == status("deep.sub.example.org:8080") == 200
        assert status("api.example.com:443") == 200
        assert status("api.example.com:80") == status("api.example.com") == 403  # that entry names its port
        assert status("notexample.org") == status("evil.example") == 403
        assert status("localhost") == 200  # the defaults stay
        post = http.post("/v1/chat/completions", json=CHAT, headers={"Origin": "https://box.lan"})
        assert post.status_code == 200
        assert http.get("/openapi.json").status_code == 200  # api_docs=True


def test_host_list_entries():
    with pytest.raises(InvalidInputError, match="'exa mple' is not a host name"):
        HostList(["exa mple"])
    everything = HostList(["*"])
    assert everything.allows("evil.example", 80) and everything.allows("anything", None)
    assert split_authority("[::1]:8000") == ("[::1]", 8000)
    assert split_authority("Example.COM.") == ("example.com", None)
    assert split_authority("host:0") is None


def test_serve_flag_allowed_hosts(smollm2_gguf):
    """`runlm serve --allowed-hosts` as a user runs it: comma-separated and repeatable."""
    flags = ("--allowed-hosts", "box.lan,other.lan", "--allowed-hosts", "third.lan")
    with serve_cli("-m", str(smollm2_gguf), *flags) as base:
        with httpx.Client(base_url=base, timeout=60) as http:
            for host, want in (("box.lan", 200), ("other.lan", 200), ("third.lan", 200), ("evil.example", 403)):
                assert http.get("/v1/models", headers={"Host": host}).status_code == want, host
