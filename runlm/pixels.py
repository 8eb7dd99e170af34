"""Image files and encoded bytes to RGB pixels (Pillow only): what the CLI and the server decode before a vision
tower sees an image, kept apart from runlm.pytorch.vision so that the server imports without PyTorch."""

from __future__ import annotations

import io
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from runlm.errors import InvalidInputError


def image_to_rgb(path: str | Path) -> tuple[bytes, int, int]:
    """An image file (PNG, JPEG... anything Pillow reads) as RGB bytes, width, height."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise InvalidInputError(f"{path}: no such image file")
    return image_bytes_to_rgb(path.read_bytes(), str(path))


def image_bytes_to_rgb(data: bytes, what: str = "image", formats: tuple[str, ...] | None = None,
                       max_pixels: int | None = None) -> tuple[bytes, int, int]:
    """Encoded image bytes (PNG, JPEG...) as RGB bytes, width, height; unreadable data is InvalidInputError.
    `formats` (Pillow's names) limits the decoders tried; `max_pixels` refuses a larger image from its header,
    before any pixel is decoded (a small file can declare gigapixels)."""
    try:
        with Image.open(io.BytesIO(data), formats=formats) as image:
            width, height = image.size
            if max_pixels is not None and width * height > max_pixels:
                raise InvalidInputError(f"{what}: the image is {width}x{height}, more than {max_pixels} pixels")
            image.load()
            rgb = image.convert("RGB")
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError, ValueError) as exc:
        raise InvalidInputError(f"{what}: cannot read the image ({' '.join(str(exc).split())})") from exc
    return rgb.tobytes(), rgb.width, rgb.height


__all__ = ["image_bytes_to_rgb", "image_to_rgb"]
