"""Qwen2-VL / Qwen2.5-VL image rules: pixels to patches, placeholders to image tokens, M-RoPE ids.

:class:`ImageProcessing` is transformers' ``Qwen2VLImageProcessor`` written with Pillow and numpy
(no torchvision): resize to a multiple of ``patch_size * merge_size`` within ``min_pixels`` ..
``max_pixels`` keeping the aspect ratio (``smart_resize``, bicubic), scale to [0, 1], normalize
with the CLIP mean and std, and cut into ``[grid_h * grid_w, 3 * temporal_patch * patch * patch]``
patches ordered merge-block by merge-block (the still image repeated over the temporal patch).
tests/multimodal/test_qwen2_vl_inputs.py holds it equal to transformers'. :func:`expand_prompt`
turns each ``<|image_pad|>`` the chat template wrote into the image's ``grid_h * grid_w /
merge_size**2`` pad tokens; :func:`mrope_positions` gives the prompt's (t, h, w) position ids as
transformers' ``get_rope_index``: text counts up on all three axes, an image's tokens take its
grid's rows and columns from where the text stopped, and the text after it continues from the
largest id so far plus one. Knows nothing about torch or the engine.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from inflight.runtime.multimodal.inputs import ImageItem, MultimodalInputs

if TYPE_CHECKING:
    from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# The placeholder the chat text carries for each image (Qwen2-VL's, as vLLM writes it)
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True, slots=True)
class ImageProcessing:
    """The preprocessing parameters (``preprocessor_config.json``'s, else Qwen2-VL's defaults)."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD

    @classmethod
    def of_model(cls, model_dir: str | Path, vision_config: dict[str, Any]) -> ImageProcessing:
        """The parameters of the checkpoint in ``model_dir`` (its vision config's patch and merge
        sizes; its ``preprocessor_config.json``'s pixel bounds, mean and std when it has one)."""
        kwargs: dict[str, Any] = {
            "patch_size": int(vision_config.get("patch_size", 14)),
            "merge_size": int(vision_config.get("spatial_merge_size", 2)),
            "temporal_patch_size": int(vision_config.get("temporal_patch_size", 2)),
        }  # fmt: skip
        path = Path(model_dir) / "preprocessor_config.json"
        if path.is_file():
            raw = json.loads(path.read_text())
            size = raw.get("size") or {}
            for key, alt in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
                value = raw.get(key, size.get(alt))
                if value is not None:
                    kwargs[key] = int(value)
            for key in ("image_mean", "image_std"):
                if raw.get(key) is not None:
                    kwargs[key] = tuple(float(v) for v in raw[key])
        out = cls(**kwargs)
        if not 0 < out.min_pixels <= out.max_pixels:
            raise ValueError(f"image min_pixels {out.min_pixels} and max_pixels {out.max_pixels} must satisfy "
                             "0 < min_pixels <= max_pixels.")  # fmt: skip
        return out

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """transformers' ``smart_resize``: (height, width) multiples of :attr:`factor`, pixels
        within the bounds, the aspect ratio kept as closely as that allows."""
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise ValueError(f"an image's aspect ratio must be under {MAX_ASPECT_RATIO} (got {width}x{height})")
        f = self.factor
        h_bar, w_bar = round(height / f) * f, round(width / f) * f
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h_bar = max(f, math.floor(height / beta / f) * f)
            w_bar = max(f, math.floor(width / beta / f) * f)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar, w_bar = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return h_bar, w_bar

    def num_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens an image of this size becomes."""
        h, w = self.resized_size(height, width)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size**2

    def preprocess(self, image: Image.Image) -> ImageItem:
        """One image as the encoder takes it (RGB, resized, normalized, patchified)."""
        from PIL import Image  # Pillow: imported with the first image

        rgb = image.convert("RGB")
        height, width = self.resized_size(rgb.height, rgb.width)
        resized = rgb.resize((width, height), Image.Resampling.BICUBIC)
        pixels = np.asarray(resized)  # [h, w, 3] uint8
        digest = hashlib.sha256(f"{width}x{height}\0".encode() + pixels.tobytes()).hexdigest()
        scaled = (pixels.astype(np.float64) * (1 / 255)).astype(np.float32)
        mean, std = np.array(self.image_mean, np.float32), np.array(self.image_std, np.float32)
        normed = ((scaled - mean) / std).transpose(2, 0, 1)  # [3, h, w]
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = height // p, width // p
        patches = normed.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], tp, p, p))
        flat = np.ascontiguousarray(patches.reshape(gh * gw, 3 * tp * p * p), dtype=np.float32)
        return ImageItem(flat, (1, gh, gw), digest, gh * gw // m**2)


def expand_prompt(token_ids: list[int], images: list[ImageItem], image_token_id: int) -> tuple[list[int], list[int]]:
    """``token_ids`` with each ``image_token_id`` (one per image, in order) repeated the image's
    ``num_tokens`` times; and each image's first index in the result. ``ValueError`` when the
    prompt holds another number of image tokens than there are images."""
    found = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if len(found) != len(images):
        raise ValueError(f"the prompt has {len(found)} image placeholder tokens for {len(images)} images; image "
                         "tokens may only come from image content parts")  # fmt: skip
    out: list[int] = []
    offsets: list[int] = []
    prev = 0
    for index, image in zip(found, images, strict=True):
        out.extend(token_ids[prev:index])
        offsets.append(len(out))
        out.extend([image_token_id] * image.num_tokens)
        prev = index + 1
    out.extend(token_ids[prev:])
    return out, offsets


def mrope_positions(num_tokens: int, images: list[ImageItem], offsets: list[int],
                    merge_size: int) -> tuple[np.ndarray, int]:  # fmt: skip
    """``[3, num_tokens]`` (t, h, w) position ids of a prompt with ``images`` at ``offsets``, and
    the rope delta of the tokens after it (``max id + 1 - num_tokens``), as transformers'
    ``Qwen2_5_VLModel.get_rope_index`` computes them for still images."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    cur, prev = 0, 0
    for offset, image in zip(offsets, images, strict=True):
        n = offset - prev
        out[:, prev:offset] = np.arange(cur, cur + n)
        cur += n
        t, h, w = image.grid_thw[0], image.grid_thw[1] // merge_size, image.grid_thw[2] // merge_size
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        out[:, offset : offset + image.num_tokens] = np.stack([tt, hh, ww]).reshape(3, -1) + cur
        cur += max(h, w)
        prev = offset + image.num_tokens
    out[:, prev:] = np.arange(cur, cur + num_tokens - prev)
    delta = int(out.max()) + 1 - num_tokens if num_tokens else 0
    return out, delta


@dataclass(frozen=True, slots=True)
class VisionFacts:
    """What the front end needs of a Qwen2-VL-family checkpoint to turn images into prompt tokens."""

    image_token_id: int
    processing: ImageProcessing
    placeholder: str = IMAGE_PLACEHOLDER

    def inputs(self, token_ids: list[int], images: list[ImageItem]) -> tuple[list[int], MultimodalInputs]:
        """The prompt with its placeholders expanded, and the request's :class:`MultimodalInputs`."""
        return build_inputs(token_ids, images, self.image_token_id, self.processing.merge_size)


VISION_ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)


def vision_facts(model_dir: str | Path) -> VisionFacts | None:
    """The image facts of the checkpoint in ``model_dir`` (its ``config.json`` and
    ``preprocessor_config.json``); None for a model that takes no images."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    if not set(raw.get("architectures") or ()) & set(VISION_ARCHITECTURES):
        return None
    return VisionFacts(int(raw["image_token_id"]), ImageProcessing.of_model(model_dir, raw.get("vision_config") or {}))


def build_inputs(token_ids: list[int], images: list[ImageItem], image_token_id: int,
                 merge_size: int) -> tuple[list[int], MultimodalInputs]:  # fmt: skip
    """The expanded prompt and the request's :class:`MultimodalInputs`."""
    ids, offsets = expand_prompt(token_ids, images, image_token_id)
    positions, delta = mrope_positions(len(ids), images, offsets, merge_size)
    return ids, MultimodalInputs(tuple(images), tuple(offsets), positions, delta)
