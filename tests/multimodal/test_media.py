"""Image URLs and limits (multimodal/media.py) and their flags, without a server."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
from PIL import Image

from inflight.runtime.cli.command import build_parser, server_settings_from_args
from inflight.runtime.multimodal.media import MediaError, MediaLimits, load_image, media_limits_from_flags


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


def test_data_url_decodes() -> None:
    url = "data:image/png;base64," + base64.b64encode(_png(7, 5)).decode()
    assert load_image(url, MediaLimits(), "image 0").size == (7, 5)


def test_local_files_only_under_the_allowed_directory(tmp_path: Path) -> None:
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(_png(4, 4))
    (tmp_path / "secret.png").write_bytes(_png(4, 4))
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    limits = MediaLimits(allowed_local_media_path=str(allowed))
    assert load_image(f"file://{allowed / 'a.png'}", limits, "x").size == (4, 4)
    for path in (tmp_path / "secret.png", allowed / ".." / "secret.png", allowed / "link.png"):
        with pytest.raises(MediaError, match="under the allowed media directory"):
            load_image(f"file://{path}", limits, "x")
    with pytest.raises(MediaError, match="not allowed on this server"):
        load_image(f"file://{allowed / 'a.png'}", MediaLimits(), "x")


def test_pixels_are_bounded_before_decoding() -> None:
    url = "data:image/png;base64," + base64.b64encode(_png(300, 300)).decode()
    with pytest.raises(MediaError, match="300x300 pixels; at most 10000"):
        load_image(url, MediaLimits(max_image_pixels=10_000), "x")


@pytest.mark.parametrize(("flag", "images"), [(None, 4), ('{"image": 2}', 2), ('{"image": {"count": 1}}', 1),
                                              ('{"image": 0, "video": 0}', 0)])
def test_limit_mm_per_prompt(flag: str | None, images: int) -> None:
    assert media_limits_from_flags(flag, None).max_images == images


@pytest.mark.parametrize(("flag", "says"), [("2", "JSON object"), ("{", "must be JSON"),
                                            ('{"video": 1}', "only images"), ('{"image": -1}', "count >= 0")])
def test_bad_limit_mm_per_prompt(flag: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        media_limits_from_flags(flag, None)


def test_the_flags_reach_the_server_settings(tmp_path: Path) -> None:
    args = build_parser().parse_args(["serve", "--model", "m", "--limit-mm-per-prompt", '{"image": 3}',
                                      "--allowed-local-media-path", str(tmp_path)])  # fmt: skip
    limits = server_settings_from_args(args).media_limits
    assert (limits.max_images, limits.allowed_local_media_path) == (3, str(tmp_path))
