"""Images in chat messages: `data:` URLs (and, when the server allows it, http(s) URLs) to RGB pixels.

Decoding is bounded before it starts: PNG, JPEG, WebP and GIF only (no Pillow plugin that runs tools, such as
EPS), and the size the header declares is checked before any pixel is decoded. Remote fetching
(`--allow-remote-images`) refuses addresses inside the server's networks (loopback, private, link-local:
server-side request forgery) unless allowed, connects to the address it checked (no DNS rebinding between
check and connect), follows at most a few redirects and checks each, caps bytes and total time, and answers
the client with a generic error (the details go to the server's log).
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

import httpx

from runlm.errors import InvalidInputError, RunlmError
from runlm.pixels import image_bytes_to_rgb
from runlm.runner import ImageInput
from runlm.server.errors import APIError

log = logging.getLogger("runlm.server")

MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 32 * 1024 * 1024  # ~ 96 MiB of RGB; vision towers resize to well under a megapixel
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MAX_REDIRECTS = 3
FETCH_TIME_S = 15.0  # the whole fetch, every redirect and chunk included
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def public_address(ip: IpAddress) -> bool:
    """Whether `ip` is on the open internet: not loopback, private, link-local, multicast, reserved or unspecified
    (an IPv4-mapped IPv6 address is judged as its IPv4 address)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


@dataclass(frozen=True)
class RemoteImages:
    """How a server fetches http(s) image URLs: `enabled` at all, and which addresses it may connect to."""

    enabled: bool = False
    address_allowed: Callable[[IpAddress], bool] = public_address


def _refused(where: str) -> APIError:
    return APIError(400, f"{where}: could not fetch the image (the URL is refused or unreachable, or the image is "
                         "too large or too slow)", param=where, code="invalid_value")


def fetch_image(url: str, where: str, remote: RemoteImages) -> ImageInput:
    """Pixels of a base64 `data:` URL, or of an http(s) URL when `remote.enabled`; bad input is a 400."""
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if ";base64" not in header:
            raise APIError(400, f"{where}: only base64 data: URLs are supported", param=where, code="invalid_value")
        if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
            raise APIError(400, f"{where}: the image is larger than {MAX_IMAGE_BYTES} bytes", param=where,
                           code="invalid_value")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise APIError(400, f"{where}: invalid base64 image data", param=where, code="invalid_value") from exc
    elif url.startswith(("http://", "https://")):
        if not remote.enabled:
            raise APIError(400, f"{where}: remote image URLs are disabled on this server (send a base64 data: URL, "
                                "or start the server with --allow-remote-images)", param=where, code="invalid_value")
        data = download_image(url, where, remote.address_allowed)
    else:
        raise APIError(400, f"{where}: image_url must be a data: URL or http(s) URL", param=where,
                       code="invalid_value")
    try:
        return ImageInput(*image_bytes_to_rgb(data, where, IMAGE_FORMATS, MAX_IMAGE_PIXELS))
    except InvalidInputError as exc:
        # runlm's own words are kept; a decoder's ("cannot identify image file <_io.BytesIO object at 0x...>") not
        cause = exc.__cause__
        if cause is None or isinstance(cause, RunlmError):
            message = str(cause or exc)
        else:
            message = f"{where}: cannot read the image"
        raise APIError(400, message, param=where, code="invalid_value") from exc


def download_image(url: str, where: str, address_allowed: Callable[[IpAddress], bool] = public_address) -> bytes:
    """The body at `url`, following redirects by hand so that every hop's address is checked, connecting to the
    checked address itself; any failure is one generic 400 (what went wrong is logged, not echoed)."""
    deadline = time.monotonic() + FETCH_TIME_S
    try:
        with httpx.Client(timeout=5.0, follow_redirects=False, trust_env=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                if time.monotonic() > deadline:
                    raise ValueError(f"the fetch took longer than {FETCH_TIME_S:g} s")
                request = _pinned_request(client, url, address_allowed)
                response = client.send(request, stream=True)
                try:
                    if response.is_redirect:
                        url = urljoin(url, response.headers.get("location", ""))
                        continue
                    response.raise_for_status()
                    return _read_capped(response, where, deadline)
                finally:
                    response.close()
            raise ValueError(f"more than {MAX_REDIRECTS} redirects")
    except APIError:
        raise
    except (httpx.HTTPError, OSError, ValueError, UnicodeError) as exc:
        log.info("image fetch for %s failed: %s", where, exc)
        raise _refused(where) from None


def _pinned_request(client: httpx.Client, url: str, address_allowed: Callable[[IpAddress], bool]) -> httpx.Request:
    """A GET of `url` sent to an address of its host that `address_allowed` accepts (the Host header and TLS name
    stay the host's), or ValueError."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url[:200]!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    addresses = {ipaddress.ip_address(info[4][0].split("%")[0])
                 for info in socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)}
    if not addresses or not all(address_allowed(ip) for ip in addresses):
        raise ValueError(f"{parts.hostname} resolves to an address that is not allowed ({sorted(map(str, addresses))})")
    pinned = httpx.URL(url).copy_with(host=str(min(addresses, key=str)))
    headers = {"Host": parts.netloc.rpartition("@")[2]}
    return client.build_request("GET", pinned, headers=headers, extensions={"sni_hostname": parts.hostname})


def _read_capped(response: httpx.Response, where: str, deadline: float) -> bytes:
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_IMAGE_BYTES:
        raise _too_large(where)
    chunks, size = [], 0
    for chunk in response.iter_bytes():
        size += len(chunk)
        if size > MAX_IMAGE_BYTES:
            raise _too_large(where)
        if time.monotonic() > deadline:
            raise ValueError(f"the fetch took longer than {FETCH_TIME_S:g} s")
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(where: str) -> APIError:
    return APIError(400, f"{where}: the image is larger than {MAX_IMAGE_BYTES} bytes", param=where,
                    code="invalid_value")
