"""Images in chat messages: `data:` URLs (and, when the server allows it, http(s) URLs) to RGB pixels."""

from __future__ import annotations

import base64
import binascii

import httpx

from runlm.errors import InvalidInputError
from runlm.models.vision import image_bytes_to_rgb
from runlm.runner import ImageInput
from runlm.server.errors import APIError

MAX_IMAGE_BYTES = 20 * 1024 * 1024


def fetch_image(url: str, where: str, allow_remote: bool) -> ImageInput:
    """Pixels of a base64 `data:` URL, or of an http(s) URL when `allow_remote`; bad input is a 400."""
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
        if not allow_remote:
            raise APIError(400, f"{where}: remote image URLs are disabled on this server (send a base64 data: URL, "
                                "or start the server with --allow-remote-images)", param=where, code="invalid_value")
        data = download_image(url, where)
    else:
        raise APIError(400, f"{where}: image_url must be a data: URL or http(s) URL", param=where,
                       code="invalid_value")
    try:
        return ImageInput(*image_bytes_to_rgb(data, where))
    except InvalidInputError as exc:
        raise APIError(400, str(exc), param=where, code="invalid_value") from exc


def download_image(url: str, where: str) -> bytes:
    try:
        with httpx.stream("GET", url, timeout=10.0, follow_redirects=True) as response:
            response.raise_for_status()
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > MAX_IMAGE_BYTES:
                    raise APIError(400, f"{where}: the image is larger than {MAX_IMAGE_BYTES} bytes", param=where,
                                   code="invalid_value")
                chunks.append(chunk)
    except httpx.HTTPError as exc:
        raise APIError(400, f"{where}: could not fetch the image ({exc})", param=where, code="invalid_value") from exc
    return b"".join(chunks)
