"""Qwen2.5-VL served token-exact against transformers' own ``generate`` (CPU, fp32, greedy) on a
tiny random checkpoint: one image, two images, an image split across prefill chunks, text-only
requests in the same steps; and the prefix cache keyed by the image."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.multimodal.inputs import MultimodalInputs
from inflight.runtime.multimodal.qwen2_vl import IMAGE_PLACEHOLDER, vision_facts
from inflight.runtime.sampling_params import SamplingParams
from tests.multimodal.vl_models import make_qwen2_5_vl_model, random_image

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen2_5_vl_model(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def hf_model(vl_dir: Path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(str(vl_dir), dtype=torch.float32).eval()


def _request(vl_dir: Path, text: str, images: list) -> tuple[list[int], MultimodalInputs | None]:
    """``text`` (``{}`` where each image goes) as token ids with the images' placeholders expanded."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(vl_dir))
    ids = tokenizer.encode(text.format(*[IMAGE_PLACEHOLDER] * len(images)))
    if not images:
        return ids, None
    facts = vision_facts(vl_dir)
    assert facts is not None
    return facts.inputs(ids, [facts.processing.preprocess(im) for im in images])


def _hf_tokens(model, ids: list[int], mm: MultimodalInputs | None, max_tokens: int) -> list[int]:
    kwargs = {}
    input_ids = torch.tensor([ids])
    if mm is not None:
        kwargs = dict(pixel_values=torch.from_numpy(np.concatenate([im.pixel_values for im in mm.images])),
                      image_grid_thw=torch.tensor([im.grid_thw for im in mm.images]),
                      mm_token_type_ids=(input_ids == model.config.image_token_id).int())  # fmt: skip
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens,
                             do_sample=False, **kwargs)  # fmt: skip
    return out[0, len(ids) :].tolist()


def _engine_tokens(engine: LLMEngine, requests: list[tuple[list[int], MultimodalInputs | None]],
                   max_tokens: int) -> list[list[int]]:  # fmt: skip
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(requests))}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, (ids, mm) in enumerate(requests):
        engine.add_request(str(i), ids, params, mm_inputs=mm)
    for _ in range(1000):
        for out in engine.step():
            tokens[out.req_id].extend(out.new_token_ids)
        if not engine.has_unfinished_requests():
            return [tokens[str(i)] for i in range(len(requests))]
    raise AssertionError("the engine did not finish")


def _requests(vl_dir: Path) -> list[tuple[list[int], MultimodalInputs | None]]:
    a, b, c = random_image(90, 60, 1), random_image(40, 120, 2), random_image(200, 200, 3)
    return [
        _request(vl_dir, "describe {} please", [a]),
        _request(vl_dir, "def walk(self): return self.value", []),
        _request(vl_dir, "first {} then {} and compare them", [b, c]),
        _request(vl_dir, "{}", [c]),
        _request(vl_dir, "import os\nfor name in sorted(os.listdir('.')):", []),
    ]


@pytest.mark.parametrize(("max_num_tokens", "num_kv_blocks", "pipelined"),
                         [(512, 128, False), (7, 128, False), (512, 24, False), (7, 128, True)],
                         ids=["whole-prompts", "chunks-of-7", "preempted", "chunks-of-7-async"])
def test_engine_matches_transformers(vl_dir: Path, hf_model, max_num_tokens: int, num_kv_blocks: int,
                                     pipelined: bool) -> None:
    """Every request in the same steps (decodes beside prompt chunks); with chunks of 7 tokens
    every image is cut across chunks (also with async scheduling: step N+1 prepared while step N
    runs); with 24 blocks of 4 tokens requests are preempted and recomputed (their images encoded
    again)."""
    requests = _requests(vl_dir)
    assert any(mm is not None and len(mm.images) == 2 for _, mm in requests)
    assert max(im.num_tokens for _, mm in requests if mm is not None for im in mm.images) > 7
    expected = [_hf_tokens(hf_model, ids, mm, MAX_TOKENS) for ids, mm in requests]
    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=num_kv_blocks, block_size=4,
                          max_num_tokens=max_num_tokens, enable_chunked_context=True,
                          async_scheduling=pipelined)  # fmt: skip
    engine = LLMEngine.from_model_dir(vl_dir, config)
    encoded = _count_encoded(engine)
    got = _engine_tokens(engine, requests, MAX_TOKENS)
    assert got == expected
    preempted = engine.stats().num_preemptions > 0
    assert preempted == (num_kv_blocks == 24)
    num_images = sum(len(mm.images) for _, mm in requests if mm is not None)
    assert len(encoded) >= num_images if preempted else len(encoded) == num_images  # once per image
    assert engine.runner.vision.embeddings == {}  # every request's image embeddings were let go
    assert engine.pool.num_free_blocks == engine.pool.num_blocks  # no block leaked


def _count_encoded(engine: LLMEngine) -> list[tuple[int, int, int]]:
    """The grids of every image the engine's vision tower encodes from now on, in order."""
    visual = engine.runner.model.visual
    forward = visual.forward
    seen: list[tuple[int, int, int]] = []

    def counting(pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        seen.extend(grids)
        return forward(pixels, grids)

    visual.forward = counting
    return seen


def _run_one(engine: LLMEngine, req_id: str, ids: list[int], mm: MultimodalInputs | None) -> tuple[list[int], int]:
    """Greedy tokens of one request run alone, and its prompt tokens found in the prefix cache."""
    engine.add_request(req_id, ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), mm_inputs=mm)
    tokens, cached = [], -1
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            if out.finished:
                cached = out.num_cached_tokens
    return tokens, cached


def test_prefix_cache_is_keyed_by_the_image(vl_dir: Path, hf_model) -> None:
    """The same prompt with the same image hits the cache (whole blocks past the image); with
    another image of the same size (the same pad tokens) only the blocks before the image hit,
    and both still answer as transformers does."""
    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=128, block_size=4, max_num_tokens=512,
                          enable_prefix_caching=True)  # fmt: skip
    engine = LLMEngine.from_model_dir(vl_dir, config)
    text = "a long enough preamble to fill blocks {} describe it"
    first = _request(vl_dir, text, [random_image(80, 80, 7)])
    same = _request(vl_dir, text, [random_image(80, 80, 7)])
    other = _request(vl_dir, text, [random_image(80, 80, 8)])
    assert first[0] == other[0] and first[1].images[0].content_hash != other[1].images[0].content_hash
    start = first[1].offsets[0]
    tokens, cached = _run_one(engine, "first", *first)
    assert cached == 0 and tokens == _hf_tokens(hf_model, *first, MAX_TOKENS)
    tokens, cached = _run_one(engine, "other", *other)
    assert cached == start // 4 * 4  # the text blocks before the image only
    assert tokens == _hf_tokens(hf_model, *other, MAX_TOKENS)
    encoded = _count_encoded(engine)
    tokens, cached = _run_one(engine, "same", *same)
    assert cached > first[1].image_end  # past the image
    assert encoded == []  # a prefix hit past the image: the tower never runs
    assert tokens == _hf_tokens(hf_model, *same, MAX_TOKENS)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


@pytest.mark.parametrize(("change", "says"), [({"enable_lora": True}, "LoRA"),
                                              ({"speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}'},
                                               "speculative decoding")], ids=["lora", "speculation"])
def test_what_is_not_served_yet_is_refused_at_start(vl_dir: Path, change: dict, says: str) -> None:
    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=32, **change)
    with pytest.raises(ValueError, match=says):
        LLMEngine.from_model_dir(vl_dir, config)


def test_vision_tower_equals_transformers(vl_dir: Path, hf_model) -> None:
    """Our tower's embeddings for two images (several windows each) equal transformers' visual."""
    facts = vision_facts(vl_dir)
    items = [facts.processing.preprocess(random_image(w, h, s)) for w, h, s in ((200, 120, 1), (60, 90, 2))]
    pixels = torch.from_numpy(np.concatenate([im.pixel_values for im in items]))
    grids = [im.grid_thw for im in items]
    engine = LLMEngine.from_model_dir(vl_dir, EngineConfig(device="cpu", dtype="float32", num_kv_blocks=8))
    with torch.no_grad():
        ours = engine.runner.model.visual(pixels, grids)
        theirs = hf_model.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
    assert ours.shape == (sum(im.num_tokens for im in items), hf_model.config.text_config.hidden_size)
    # fp32 summation order (the engine runs torch on fewer threads) moves the last digits only
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_images_for_a_model_without_vision_or_another_prompt_are_refused(vl_dir: Path, tmp_path: Path) -> None:
    from inflight.runtime.demo.model import make_demo_model
    from inflight.runtime.outputs import RequestRejectedError

    ids, mm = _request(vl_dir, "look {}", [random_image(40, 40, 1)])
    params = SamplingParams(max_tokens=2)
    text_only = LLMEngine.from_model_dir(make_demo_model(tmp_path / "demo", size="tiny"),
                                         EngineConfig(device="cpu", num_kv_blocks=8))  # fmt: skip
    with pytest.raises(RequestRejectedError, match="takes no images"):
        text_only.add_request("a", [min(t, 1000) for t in ids], params, mm_inputs=mm)  # within its vocabulary
    engine = LLMEngine.from_model_dir(vl_dir, EngineConfig(device="cpu", dtype="float32", num_kv_blocks=8))
    with pytest.raises(RequestRejectedError, match="do not fit this prompt"):
        engine.add_request("b", ids[:-1], params, mm_inputs=mm)
    assert not engine.has_unfinished_requests()


def test_a_model_with_a_buffer_is_refused_before_it_is_allocated_empty() -> None:
    """A buffer built on the meta device would serve garbage after the empty allocation: refused."""
    from inflight.runtime.model.loader import refuse_buffers

    with torch.device("meta"):
        module = torch.nn.Module()
        module.register_buffer("inv_freq", torch.arange(4.0), persistent=False)
    with pytest.raises(RuntimeError, match="inv_freq"):
        refuse_buffers(module)
    refuse_buffers(torch.nn.Linear(2, 2))  # parameters only: fine
