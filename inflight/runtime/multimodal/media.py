"""Images from chat ``image_url`` parts: where they may come from, how big they may be, decoding.

An ``image_url`` is a ``data:image/...;base64,...`` URL, or a ``file://`` path under the
directory ``allowed_local_media_path`` allows (vLLM's ``--allowed-local-media-path``; none by
default). This server fetches nothing over the network: an ``http(s)`` URL is refused with a
message saying to send a data URL. :class:`MediaLimits` bounds a prompt's image count (vLLM's
``--limit-mm-per-prompt``), an image's encoded bytes and its decoded pixels (checked from the
header before any pixel is decoded, so a decompression bomb costs nothing). Every refusal is a
:class:`MediaError` naming the request field. Decoding is Pillow's. Knows nothing about HTTP
or models.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image

# Where an image part sat in its chat message's text, until the model's placeholder replaces it
# (U+FFFC OBJECT REPLACEMENT CHARACTER: one typed by a client makes the count disagree, a 400)
IMAGE_SLOT = "\ufffc"
DEFAULT_MAX_IMAGES = 4
DEFAULT_MAX_IMAGE_BYTES = 20 << 20
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000


class MediaError(ValueError):
    """An image a request may not send, or that does not decode; ``param`` is the field."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class MediaLimits:
    """What a prompt's images may be (the server's settings)."""

    max_images: int = DEFAULT_MAX_IMAGES  # per prompt (vLLM's --limit-mm-per-prompt '{"image": N}')
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # one image, encoded
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # one image, width x height as decoded
    allowed_local_media_path: str | None = None  # file:// URLs under this directory only (None: none)

    def __post_init__(self) -> None:
        if self.max_images < 0 or self.max_image_bytes < 1 or self.max_image_pixels < 1:
            raise ValueError("media limits must be positive (max_images may be 0: images refused)")
        if self.allowed_local_media_path is not None and not Path(self.allowed_local_media_path).is_dir():
            raise ValueError(f"--allowed-local-media-path {self.allowed_local_media_path!r} is not a directory")


def image_url_of(part: dict[str, object], where: str) -> str:
    """The URL of an ``image_url`` content part (``{"url": ...}`` or, as vLLM takes it, a string)."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise MediaError(f"{where}.image_url must be an object with a 'url' string (a data:image/...;base64 URL)")
    return url


def check_count(num_images: int, limits: MediaLimits) -> None:
    if num_images > limits.max_images:
        raise MediaError(f"this prompt has {num_images} images; at most {limits.max_images} are allowed per "
                         "prompt (--limit-mm-per-prompt)")  # fmt: skip


def load_image(url: str, limits: MediaLimits, where: str) -> Image.Image:
    """The image ``url`` names, decoded (``MediaError`` for anything not allowed or not an image)."""
    if url.startswith("data:"):
        data = _data_url_bytes(url, limits, where)
    elif url.startswith("file://"):
        data = _local_bytes(url.removeprefix("file://"), limits, where)
    elif url.startswith(("http://", "https://")):
        raise MediaError(f"{where}: this server fetches no URLs; send the image inline as a data URL "
                         "(data:image/png;base64,...)")  # fmt: skip
    else:
        raise MediaError(f"{where}: an image URL must be a data:image/...;base64 URL (or file:// under "
                         "--allowed-local-media-path)")  # fmt: skip
    return _decode(data, limits, where)


def _data_url_bytes(url: str, limits: MediaLimits, where: str) -> bytes:
    head, sep, payload = url.partition(",")
    media_type = head.removeprefix("data:").split(";")[0].strip().lower()
    if not sep or not head.endswith(";base64"):
        raise MediaError(f"{where}: a data URL must be base64 (data:image/png;base64,...)")
    if not media_type.startswith("image/"):
        raise MediaError(f"{where}: the data URL's type is {media_type or 'missing'!r}; an image/* type is needed")
    if len(payload) * 3 // 4 > limits.max_image_bytes:
        raise MediaError(f"{where}: the image is over {limits.max_image_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{where}: the data URL's payload is not valid base64") from None


def _local_bytes(path: str, limits: MediaLimits, where: str) -> bytes:
    if limits.allowed_local_media_path is None:
        raise MediaError(f"{where}: file:// images are not allowed on this server (--allowed-local-media-path)")
    root = Path(limits.allowed_local_media_path).resolve()
    target = Path(os.path.abspath(path)).resolve()
    if not target.is_relative_to(root):
        raise MediaError(f"{where}: file:// images must be under the allowed media directory")
    if not target.is_file():
        raise MediaError(f"{where}: no such image file under the allowed media directory")
    if target.stat().st_size > limits.max_image_bytes:
        raise MediaError(f"{where}: the image is over {limits.max_image_bytes} bytes")
    return target.read_bytes()


def _decode(data: bytes, limits: MediaLimits, where: str) -> Image.Image:
    from PIL import Image  # Pillow: imported with the first image, so text-only serving never loads it

    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > limits.max_image_pixels:
            raise MediaError(f"{where}: the image is {width}x{height} pixels; at most {limits.max_image_pixels} "
                             "pixels are allowed")  # fmt: skip
        if width < 1 or height < 1:
            raise MediaError(f"{where}: the image is empty")
        image.load()
    except MediaError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise MediaError(f"{where}: not a decodable image ({type(exc).__name__})") from None
    return image


def media_limits_from_flags(limit_mm_per_prompt: str | None, allowed_local_media_path: str | None) -> MediaLimits:
    """The limits ``--limit-mm-per-prompt`` (vLLM's JSON, ``{"image": N}``; other modalities are
    not served, so only 0 is accepted for them) and ``--allowed-local-media-path`` describe."""
    max_images = DEFAULT_MAX_IMAGES
    if limit_mm_per_prompt is not None:
        try:
            raw = json.loads(limit_mm_per_prompt)
        except json.JSONDecodeError:
            raise ValueError(f'--limit-mm-per-prompt must be JSON such as {{"image": 2}} (got {limit_mm_per_prompt!r})'
                             ) from None  # fmt: skip
        if not isinstance(raw, dict):
            raise ValueError('--limit-mm-per-prompt must be a JSON object such as {"image": 2}')
        for key, value in raw.items():
            count = value.get("count") if isinstance(value, dict) else value  # vLLM 0.10+: {"image": {"count": N}}
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"--limit-mm-per-prompt {key!r}: a count >= 0 is needed (got {value!r})")
            if key == "image":
                max_images = count
            elif count:
                raise ValueError(f"--limit-mm-per-prompt {key!r}: only images are served (docs/vision.md)")
    return MediaLimits(max_images=max_images, allowed_local_media_path=allowed_local_media_path)
