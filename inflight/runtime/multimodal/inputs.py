"""The values a vision-language request carries from the front end to the worker.

:class:`ImageItem` is one preprocessed image (its patches, grid and content hash);
:class:`MultimodalInputs` is a request's images, where their placeholder tokens sit in the
prompt, and the M-RoPE position ids of the prompt with the rope delta its generated tokens add.
:func:`mm_block_hashes` keys prefix-cache blocks that hold image tokens by the image's hash as
well as the token ids (vLLM's "extra keys"), so two requests whose prompts differ only in the
image never share KV. Plain frozen values (numpy arrays inside), pickled across the engine
process's pipe. Knows nothing about models or torch.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from inflight.runtime.outputs import RequestRejectedError


@dataclass(frozen=True, slots=True, eq=False)
class ImageItem:
    """One image as the vision encoder takes it."""

    pixel_values: np.ndarray  # [grid_t * grid_h * grid_w, channels * temporal_patch * patch * patch] float32
    grid_thw: tuple[int, int, int]  # patches along time, height, width (before the merge)
    content_hash: str  # SHA-256 of the decoded pixels and their size (the prefix cache's extra key)
    num_tokens: int  # placeholder tokens in the prompt: the grid after the spatial merge


@dataclass(frozen=True, slots=True, eq=False)
class MultimodalInputs:
    """A request's images and where they sit in its prompt.

    ``offsets[i]``: the prompt index of image ``i``'s first placeholder token (its
    ``images[i].num_tokens`` placeholders follow). ``positions``: ``[3, num_prompt_tokens]`` M-RoPE
    ids (t, h, w) of the prompt; a token at index ``p`` past the prompt sits at ``p + rope_delta``
    on all three axes."""

    images: tuple[ImageItem, ...]
    offsets: tuple[int, ...]
    positions: np.ndarray  # [3, num_prompt_tokens] int64
    rope_delta: int

    @property
    def image_end(self) -> int:
        """One past the prompt index of the last placeholder token."""
        return self.offsets[-1] + self.images[-1].num_tokens if self.images else 0

    def spans(self) -> list[tuple[int, int, str]]:
        """``(start, end, content_hash)`` prompt ranges of each image's placeholders."""
        return [(o, o + im.num_tokens, im.content_hash) for o, im in zip(self.offsets, self.images, strict=True)]


def check_mm_inputs(prompt_token_ids: Sequence[int], mm: MultimodalInputs, takes_images: bool) -> None:
    """``RequestRejectedError`` unless the model takes images and ``mm`` describes this prompt."""
    if not takes_images:
        raise RequestRejectedError("this model takes no images", "invalid_request", "messages")
    n = len(prompt_token_ids)
    fits = mm.positions.shape == (3, n) and len(mm.offsets) == len(mm.images) and all(
        0 <= o and o + im.num_tokens <= n for o, im in zip(mm.offsets, mm.images, strict=True))
    if not fits:
        raise RequestRejectedError("the images' placeholders do not fit this prompt", "invalid_request", "messages")


def mm_block_hashes(token_ids: Sequence[int], block_size: int, parent_hashes: Sequence[bytes], root: bytes,
                    mm: MultimodalInputs) -> list[bytes]:  # fmt: skip
    """Chained keys of every full block of ``token_ids`` from ``root`` (reusing ``parent_hashes``),
    as the block pool's chain, except that a block holding any of an image's placeholder tokens
    also hashes that image's content hash (and where in the image the block starts)."""
    hashes = list(parent_hashes)
    parent = hashes[-1] if hashes else root
    spans = mm.spans()
    for i in range(len(hashes), len(token_ids) // block_size):
        start, end = i * block_size, (i + 1) * block_size
        digest = hashlib.sha256(parent + array("q", token_ids[start:end]).tobytes())
        for s, e, content_hash in spans:
            if s < end and start < e:
                digest.update(f"\0inflight-image\0{content_hash}\0{start - s}".encode())
        parent = digest.digest()
        hashes.append(parent)
    return hashes
