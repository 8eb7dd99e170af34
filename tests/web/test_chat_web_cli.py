"""`runlm chat --web`: serve on loopback and open the page only once the server listens."""

from __future__ import annotations

import socket
import threading

import pytest

from runlm.bench.common import free_port
from runlm.cli import commands as cli


def test_chat_web_opens_the_page_once_the_server_listens(monkeypatch):
    port = free_port()
    opened: list[str] = []
    browser_opened = threading.Event()
    refusals: list[OSError] = []
    refused_twice = threading.Event()
    connect = socket.create_connection

    def probe(address, *args, **kwargs):  # the opener's check that the server listens, watched
        try:
            return connect(address, *args, **kwargs)
        except OSError as exc:
            if address == ("127.0.0.1", port):
                refusals.append(exc)
                if len(refusals) >= 2:
                    refused_twice.set()
            raise

    def open_browser(url):
        opened.append(url)
        browser_opened.set()
        return True

    monkeypatch.setattr(socket, "create_connection", probe)
    monkeypatch.setattr("webbrowser.open", open_browser)
    seen = {}

    def fake_serve(args):  # stands in for loading the model and running uvicorn
        seen.update(host=args.host, port=args.port, api_key=args.api_key, model=args.model)
        # "Loading the model": the opener finds nothing listening, and tries again rather than opening the page
        # (a second refusal means the first one was answered by a retry).
        assert refused_twice.wait(20), "the opener never checked whether the server listens"
        assert not opened, "the browser was opened before the server listened"
        with socket.socket() as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1", port))
            server.listen()  # the kernel completes the probe's handshake from the backlog
            browser_opened.wait(20)
        return 0

    monkeypatch.setattr(cli, "cmd_serve", fake_serve)
    assert cli.main(["chat", "--web", "--port", str(port), "-m", "some-model"]) == 0
    assert opened == [f"http://127.0.0.1:{port}/"]
    assert seen == {"host": "127.0.0.1", "port": port, "api_key": None, "model": "some-model"}


def test_chat_web_fails_fast_when_the_port_is_taken(monkeypatch, capsys):
    monkeypatch.setattr(cli, "cmd_serve", lambda args: pytest.fail("loaded the model anyway"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.main(["chat", "--web", "--port", str(port)]) == 1
    assert f"port {port} is not free" in capsys.readouterr().err


def test_chat_web_native_serves_the_page_from_the_native_server(monkeypatch):
    """`runlm chat --web --native`: the same page, served by `serve --native` on loopback."""
    port = free_port()
    opened = threading.Event()
    monkeypatch.setattr("webbrowser.open", lambda url: opened.set() or True)
    seen = {}

    def fake_serve(args):  # stands in for loading the lean model and running uvicorn
        seen.update(native=args.native, web=args.web, host=args.host, port=args.port, replicas=args.replicas)
        with socket.socket() as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1", port))
            server.listen()
            assert opened.wait(20), "the page was not opened once the server listened"
        return 0

    monkeypatch.setattr(cli, "cmd_serve", fake_serve)
    assert cli.main(["chat", "--web", "--native", "--port", str(port), "-m", "some-model"]) == 0
    assert seen == {"native": True, "web": False, "host": "127.0.0.1", "port": port, "replicas": None}
