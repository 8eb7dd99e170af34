"""Images are bounded before they are decoded, and remote fetching cannot be turned against the server's own
networks. Remote fetches here go only to HTTP servers this test starts on loopback addresses."""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from runlm.server import create_app, images
from runlm.server.errors import APIError
from runlm.server.images import RemoteImages, fetch_image
from runlm.server.openai_shapes import plan_chat
from runlm.server.schemas import ChatCompletionRequest


def encoded(image: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


PNG = encoded(Image.new("RGB", (3, 2), (200, 10, 30)), "PNG")


class Site:
    """A loopback HTTP server: /cat.png, /to?url=... (302 there), /loop (302 to itself); counts its hits."""

    def __init__(self, host: str):
        site = self
        self.hits: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                site.hits.append(self.path)
                if self.path.startswith("/to?url="):
                    self.send_response(302)
                    self.send_header("Location", self.path.removeprefix("/to?url="))
                elif self.path == "/loop":
                    self.send_response(302)
                    self.send_header("Location", "/loop")
                else:
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(len(PNG)))
                self.end_headers()
                if self.path == "/cat.png":
                    self.wfile.write(PNG)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def sites() -> Iterator[tuple[Site, Site]]:
    first, second = Site("127.0.0.1"), Site("127.0.0.2")
    yield first, second
    first.stop()
    second.stop()


def only(*allowed: str) -> RemoteImages:
    return RemoteImages(True, lambda ip: str(ip) in allowed)


def refused(url: str, remote: RemoteImages) -> str:
    with pytest.raises(APIError) as caught:
        fetch_image(url, "messages.0.content.0", remote)
    assert caught.value.status == 400
    return caught.value.message


def test_loopback_and_private_targets_are_refused_by_default(sites):
    first, _ = sites
    message = refused(first.url + "/cat.png", RemoteImages(enabled=True))
    assert "could not fetch the image" in message and "127.0.0.1" not in message  # generic: nothing echoed
    assert first.hits == []  # refused before connecting
    for ip in ("10.0.0.1", "192.168.1.1", "169.254.169.254", "::1", "::ffff:127.0.0.1", "fe80::1", "0.0.0.0"):
        assert not images.public_address(images.ipaddress.ip_address(ip)), ip
    assert images.public_address(images.ipaddress.ip_address("93.184.216.34"))


def test_an_allowed_address_is_fetched(sites):
    first, _ = sites
    image = fetch_image(first.url + "/cat.png", "x", only("127.0.0.1"))
    assert (image.width, image.height) == (3, 2) and image.rgb[:3] == bytes([200, 10, 30])


def test_every_redirect_is_checked_again(sites):
    first, second = sites
    redirect = f"{first.url}/to?url={second.url}/cat.png"
    refused(redirect, only("127.0.0.1"))
    assert second.hits == []  # the second address was refused before any connection to it
    assert fetch_image(redirect, "x", only("127.0.0.1", "127.0.0.2")).width == 3  # allowed: the redirect works
    assert second.hits == ["/cat.png"]
    refused(first.url + "/loop", only("127.0.0.1"))  # a redirect loop ends after a few hops


def test_fetched_bytes_are_capped(sites, monkeypatch):
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", len(PNG) - 1)
    assert "larger than" in refused(sites[0].url + "/cat.png", only("127.0.0.1"))


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_declared_size_and_format_are_checked_before_decoding():
    huge = encoded(Image.new("1", (7000, 7000)), "PNG")  # a few KB that would decode to 49 megapixels
    assert len(huge) < 200_000
    assert "more than" in refused(data_url(huge), RemoteImages())
    bmp = encoded(Image.new("RGB", (3, 2)), "BMP")  # a format Pillow reads, but not one of the four allowed
    assert "cannot read the image" in refused(data_url(bmp), RemoteImages())
    for fmt in ("PNG", "JPEG", "WEBP", "GIF"):
        assert fetch_image(data_url(encoded(Image.new("RGB", (3, 2)), fmt)), "x", RemoteImages()).width == 3


def test_image_parts_are_counted_before_any_is_decoded(smollm2_loaded):
    app = create_app(smollm2_loaded, model_name="smol")
    state = app.state.runlm
    try:
        part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!not-even-base64"}}
        body = ChatCompletionRequest(model="smol", messages=[{"role": "user", "content": [part, part]}])
        with pytest.raises(APIError, match="only one image"):
            plan_chat(state, body)
    finally:
        state.scheduler.close()
