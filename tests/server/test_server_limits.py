"""Connection and request limits: a request whose headers or body trickle in is cut off (slowloris), and the
server-wide defaults `runlm serve` takes (--max-tokens, --ctx-size)."""

from __future__ import annotations

import socket

import httpx
import pytest
from server_harness import LiveServer

from runlm.cli.commands import build_parser, main
from runlm.server import create_app
from runlm.server.timeouts import uvicorn_options

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def live(smollm2_loaded):
    server = LiveServer(create_app(smollm2_loaded, model_name=MODEL, body_timeout_s=0.5),
                        **uvicorn_options(header_timeout_s=0.5))
    yield server
    server.stop()


def connect(live: LiveServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=30)  # the timeout only guards the test
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length body, leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head = data.split(b"\r\n\r\n", 1)[0]
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(data) < len(head) + 4 + length:
        data += sock.recv(65536)
    return data


def test_partial_headers_are_cut_off(live):
    with connect(live) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl")
        assert read_until_closed(sock) == b""  # closed by the server, without an answer


def test_a_kept_alive_connection_gets_a_new_header_deadline(live):
    with connect(live) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")  # then nothing more
        assert read_until_closed(sock) == b""


def test_a_trickling_body_is_a_408(live):
    with connect(live) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply


def test_serve_takes_max_tokens_and_ctx_size():
    args = build_parser().parse_args(["serve", "--max-tokens", "64", "--ctx-size", "512"])
    assert (args.max_tokens, args.ctx) == (64, 512)
    assert build_parser().parse_args(["serve"]).max_tokens == 2048  # a default bound (tests/test_cli.py)
    assert main(["serve", "--max-tokens", "0"]) == 1  # refused before loading anything


def test_a_request_past_the_kv_budget_is_a_400_naming_max_tokens(smollm2_loaded):
    server = LiveServer(create_app(smollm2_loaded, model_name=MODEL, kv_budget_mb=16, prompt_cache_mb=0))
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            fits = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            too_big = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4000})
    finally:
        server.stop()
    assert fits.status_code == 200
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "max_tokens"
    assert "KV-cache budget of 16 MiB" in too_big.json()["error"]["message"]


def test_a_header_block_past_the_bound_is_a_400_and_one_within_it_is_served(live):
    """MAX_HEADER_BYTES bounds a request's target and headers together; the server keeps serving."""
    from runlm.server.timeouts import MAX_HEADER_BYTES

    filler = b"x" * (MAX_HEADER_BYTES // 2)
    with connect(live) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: " + filler + b"\r\nX-B: " + filler + b"\r\n\r\n")
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 400")
    with connect(live) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: " + filler + b"\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200")
