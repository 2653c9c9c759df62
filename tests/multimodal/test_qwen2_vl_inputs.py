"""Qwen2-VL image preprocessing and M-RoPE ids equal transformers' (its PIL image processor and
``Qwen2_5_VLModel.get_rope_index``), and the prefix-cache keys of image blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from inflight.runtime.multimodal.inputs import mm_block_hashes
from inflight.runtime.multimodal.qwen2_vl import ImageProcessing, build_inputs, expand_prompt

IMAGE_TOKEN = 290


def _image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).convert(mode)


@pytest.mark.parametrize(("width", "height", "mode"), [(56, 56, "RGB"), (100, 37, "RGB"), (300, 200, "RGB"),
                                                       (64, 90, "L"), (40, 41, "RGBA")])
def test_preprocessing_equals_transformers(width: int, height: int, mode: str) -> None:
    ours = ImageProcessing(min_pixels=28 * 28, max_pixels=28 * 28 * 12)
    theirs = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 12)
    image = _image(width, height, mode=mode)
    item = ours.preprocess(image)
    ref = theirs(images=[image.convert("RGB")], return_tensors="np")
    assert item.grid_thw == tuple(int(v) for v in ref["image_grid_thw"][0])
    assert item.pixel_values.shape == ref["pixel_values"].shape
    np.testing.assert_allclose(item.pixel_values, ref["pixel_values"], rtol=0, atol=1e-5)
    assert item.num_tokens == item.grid_thw[1] * item.grid_thw[2] // 4 == ours.num_tokens(height, width)
    assert item.num_tokens <= 12


def test_content_hash_follows_the_pixels() -> None:
    proc = ImageProcessing(min_pixels=28 * 28, max_pixels=28 * 28 * 4)
    a, b = proc.preprocess(_image(56, 56, 0)), proc.preprocess(_image(56, 56, 0))
    c = proc.preprocess(_image(56, 56, 1))
    assert a.content_hash == b.content_hash != c.content_hash


def test_mrope_positions_equal_get_rope_index() -> None:
    proc = ImageProcessing(min_pixels=28 * 28, max_pixels=28 * 28 * 12)
    images = [proc.preprocess(_image(100, 37, 1)), proc.preprocess(_image(60, 120, 2))]
    prompt = [5, 6, 292, IMAGE_TOKEN, 293, 7, 8, 9, 292, IMAGE_TOKEN, 293, 10]
    ids, mm = build_inputs(prompt, images, IMAGE_TOKEN, 2)
    assert len(ids) == len(prompt) - 2 + sum(im.num_tokens for im in images)
    config = Qwen2_5_VLConfig(text_config={"vocab_size": 300, "hidden_size": 16, "num_hidden_layers": 1,
                                           "num_attention_heads": 2, "num_key_value_heads": 1,
                                           "intermediate_size": 32},
                              vision_config={"depth": 1, "hidden_size": 16, "num_heads": 1, "out_hidden_size": 16},
                              image_token_id=IMAGE_TOKEN)  # fmt: skip
    with torch.device("meta"):
        model = Qwen2_5_VLModel(config)
    input_ids = torch.tensor([ids])
    types = (input_ids == IMAGE_TOKEN).int()
    grids = torch.tensor([im.grid_thw for im in images])
    positions, deltas = Qwen2_5_VLModel.get_rope_index(model, input_ids, types, image_grid_thw=grids)
    np.testing.assert_array_equal(mm.positions, positions[:, 0].numpy())
    assert mm.rope_delta == int(deltas[0, 0]) < 0
    assert [ids[o] for o in mm.offsets] == [IMAGE_TOKEN, IMAGE_TOKEN] and ids[mm.offsets[0] - 1] == 292


def test_placeholder_count_must_match_the_images() -> None:
    proc = ImageProcessing(min_pixels=28 * 28, max_pixels=28 * 28 * 4)
    with pytest.raises(ValueError, match="2 image placeholder tokens for 1 images"):
        expand_prompt([IMAGE_TOKEN, 1, IMAGE_TOKEN], [proc.preprocess(_image(56, 56))], IMAGE_TOKEN)


def test_image_blocks_are_keyed_by_the_image() -> None:
    proc = ImageProcessing(min_pixels=28 * 28, max_pixels=28 * 28 * 16)
    prompt = [1, 2, 3, 292, IMAGE_TOKEN, 293] + list(range(10, 30))
    ids_a, mm_a = build_inputs(prompt, [proc.preprocess(_image(112, 112, 0))], IMAGE_TOKEN, 2)
    ids_b, mm_b = build_inputs(prompt, [proc.preprocess(_image(112, 112, 1))], IMAGE_TOKEN, 2)
    assert ids_a == ids_b
    root = b"\0" * 32
    a = mm_block_hashes(ids_a, 4, [], root, mm_a)
    b = mm_block_hashes(ids_b, 4, [], root, mm_b)
    assert a[0] == b[0]  # text only
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))  # the image's blocks and all after them
    assert mm_block_hashes(ids_a, 4, a[:2], root, mm_a) == a  # extends a known chain


def test_mrope_table_rows_equal_transformers_rotary() -> None:
    """Each token's (cos, sin) row from our one table equals Qwen2_5_VLRotaryEmbedding's for its
    (t, h, w) ids; a token whose three ids agree reads the plain row."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

    from inflight.runtime.model.rope import build_cos_sin_cache, mrope_cos_sin

    config = Qwen2_5_VLConfig(text_config={"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                                           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                               "mrope_section": [2, 3, 3]}})  # fmt: skip
    table = build_cos_sin_cache(config.text_config, 16, 64)  # [64, 16]
    positions = torch.tensor([[0, 5, 5, 9, 30], [0, 5, 6, 2, 30], [0, 5, 7, 4, 30]])
    ours = mrope_cos_sin(table, positions, (2, 3, 3))
    cos, sin = Qwen2_5_VLRotaryEmbedding(config.text_config)(torch.zeros(1), positions[:, None, :])
    torch.testing.assert_close(ours, torch.cat((cos[0, :, :8], sin[0, :, :8]), dim=-1), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours[[0, 1, 4]], table[[0, 5, 30]])
