"""Images in chat completions over real HTTP with the ``openai`` client: a tiny random Qwen2.5-VL
answers token-exact with transformers' ``generate`` on the same image and prompt; the limits and
bad images answer 400 in OpenAI's error format; a text-only model answers 400 naming itself; no
KV block is left held."""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import torch

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine_types import EngineRequest
from inflight.runtime.multimodal.media import MediaLimits
from inflight.runtime.multimodal.qwen2_vl import vision_facts
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.server import ServerSettings
from tests.multimodal.vl_models import make_qwen2_5_vl_model, random_image
from tests.server.server_helpers import LiveServer

MAX_TOKENS = 8


def _data_url(image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("media")
    random_image(64, 48, 11).save(path / "cat.png")
    return path


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen2_5_vl_model(tmp_path_factory.mktemp("served-vl"))


@pytest.fixture(scope="module")
def vl_server(vl_dir: Path, media_dir: Path) -> Iterator[LiveServer]:
    limits = MediaLimits(max_images=2, max_image_bytes=200_000, max_image_pixels=500 * 500,
                         allowed_local_media_path=str(media_dir))  # fmt: skip
    live = LiveServer(vl_dir, EngineConfig(device="cpu", dtype="float32", num_kv_blocks=96, max_model_len=256,
                                           max_num_sequences=4, block_size=4),
                      ServerSettings(model_name="vl", media_limits=limits)).start()  # fmt: skip
    yield live
    live.stop()


def _client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0, timeout=120)


def _expected(vl_dir: Path, content: list[dict], images: list) -> list[int]:
    """transformers' greedy tokens for the chat, the prompt rendered as the server renders it."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(str(vl_dir))
    facts = vision_facts(vl_dir)
    text = "".join(facts.placeholder if p["type"] == "image_url" else p["text"] for p in content)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)  # fmt: skip
    ids, mm = facts.inputs(tokenizer.encode(prompt, add_special_tokens=False),
                           [facts.processing.preprocess(im) for im in images])
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(vl_dir), dtype=torch.float32).eval()
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=MAX_TOKENS,
                             do_sample=False, pixel_values=torch.from_numpy(np.concatenate(
                                 [im.pixel_values for im in mm.images])),
                             image_grid_thw=torch.tensor([im.grid_thw for im in mm.images]),
                             mm_token_type_ids=(input_ids == facts.image_token_id).int())  # fmt: skip
    return out[0, len(ids) :].tolist()


def test_chat_with_images_matches_transformers(vl_server: LiveServer, vl_dir: Path, media_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(vl_dir))
    one, two = random_image(90, 60, 1), random_image(50, 110, 2)
    cases = [
        ([{"type": "text", "text": "what is in "}, _image_part(_data_url(one)), {"type": "text", "text": " ?"}], [one]),
        ([_image_part(_data_url(two, "JPEG")), {"type": "text", "text": " and "},
          _image_part(f"file://{media_dir / 'cat.png'}")], None),
    ]
    from PIL import Image

    for content, images in cases:
        if images is None:  # decode the JPEG as the server does: its pixels are what the model sees
            jpeg = Image.open(io.BytesIO(base64.b64decode(content[0]["image_url"]["url"].split(",", 1)[1])))
            images = [jpeg, Image.open(media_dir / "cat.png")]
        reply = _client(vl_server).chat.completions.create(
            model="vl", messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS, temperature=0)
        expected = _expected(vl_dir, content, images)
        assert reply.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
        assert reply.usage.prompt_tokens > sum(1 for p in content if p["type"] == "image_url") * 4
    pool = vl_server.engine.pool
    assert pool.num_free_blocks == pool.num_blocks  # nothing held after the answers


@pytest.mark.parametrize(("url", "says"), [
    ("data:image/png;base64,!!notbase64!!", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), "not a decodable image"),
    ("data:text/plain;base64,aGVsbG8=", "image/* type"),
    ("https://example.com/cat.png", "fetches no URLs"),
    ("file:///etc/passwd", "under the allowed media directory"),
    ("ftp://example.com/cat.png", "data:image/...;base64 URL"),
], ids=["bad-base64", "not-an-image", "not-image-type", "http", "file-outside", "other-scheme"])
def test_bad_images_answer_400(vl_server: LiveServer, url: str, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        _client(vl_server).chat.completions.create(
            model="vl", messages=[{"role": "user", "content": [_image_part(url)]}], max_tokens=2)
    body = error.value.response.json()["error"]
    assert says in body["message"] and body["param"] == "messages" and body["type"] == "invalid_request_error"


def test_limits_answer_400(vl_server: LiveServer) -> None:
    client = _client(vl_server)
    small = _data_url(random_image(30, 30, 3))
    with pytest.raises(openai.BadRequestError, match="at most 2 are allowed per prompt"):
        client.chat.completions.create(model="vl", messages=[{"role": "user", "content": [_image_part(small)] * 3}],
                                       max_tokens=2)  # fmt: skip
    from PIL import Image

    flat = Image.new("RGB", (600, 600), (10, 20, 30))  # small once compressed, big once decoded
    with pytest.raises(openai.BadRequestError, match="at most 250000 pixels"):
        client.chat.completions.create(model="vl", max_tokens=2, messages=[
            {"role": "user", "content": [_image_part(_data_url(flat))]}])
    noise = np.random.default_rng(0).integers(0, 256, (400, 400, 3), dtype=np.uint8)

    with pytest.raises(openai.BadRequestError, match="over 200000 bytes"):
        client.chat.completions.create(model="vl", max_tokens=2, messages=[
            {"role": "user", "content": [_image_part(_data_url(Image.fromarray(noise)))]}])
    with pytest.raises(openai.BadRequestError, match="image slots"):
        client.chat.completions.create(model="vl", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "\ufffc"}, _image_part(small)]}])
    with pytest.raises(openai.BadRequestError, match="image_url must be an object"):
        client.chat.completions.create(model="vl", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"detail": "high"}}]}])
    pool = vl_server.engine.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_tokenize_counts_the_image_tokens(vl_server: LiveServer, vl_dir: Path) -> None:
    """/tokenize of a chat with an image gives the prompt the engine would run: the image's pad
    tokens expanded."""
    from tests.server.server_helpers import http

    facts = vision_facts(vl_dir)
    image = random_image(90, 60, 1)
    content = [{"type": "text", "text": "see "}, _image_part(_data_url(image))]
    reply = http("POST", f"{vl_server.url}/tokenize", {"model": "vl", "messages": [{"role": "user",
                                                                                     "content": content}]})
    assert reply.status == 200, reply.text
    tokens = reply.json()["tokens"]
    assert tokens.count(facts.image_token_id) == facts.processing.preprocess(image).num_tokens > 1


def test_text_only_model_takes_no_images(tmp_path: Path) -> None:
    from inflight.runtime.demo.model import make_demo_model

    live = LiveServer(make_demo_model(tmp_path / "demo", size="tiny"), EngineConfig(num_kv_blocks=32),
                      ServerSettings(model_name="demo")).start()  # fmt: skip
    try:
        with pytest.raises(openai.BadRequestError, match=r"this model \(demo\) takes no images") as error:
            _client(live).chat.completions.create(model="demo", max_tokens=2, messages=[
                {"role": "user", "content": [_image_part(_data_url(random_image(30, 30, 3)))]}])
        assert error.value.response.json()["error"]["param"] == "messages"
    finally:
        live.stop()


def test_engine_core_process_serves_images(vl_dir: Path) -> None:
    """The images cross the pipe to an engine-core process (as ``inflight serve`` runs) and the
    answer is still transformers'; streamed, as clients mostly ask."""
    from transformers import AutoTokenizer

    live = LiveServer(vl_dir, EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=256,
                                           block_size=4),
                      ServerSettings(model_name="vl"), engine_process=True).start()  # fmt: skip
    try:
        image = random_image(70, 45, 9)
        content = [_image_part(_data_url(image)), {"type": "text", "text": "caption"}]
        stream = _client(live).chat.completions.create(
            model="vl", messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS, temperature=0,
            stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    finally:
        live.stop()
    tokenizer = AutoTokenizer.from_pretrained(str(vl_dir))
    assert text == tokenizer.decode(_expected(vl_dir, content, [image]), skip_special_tokens=True)


def test_engine_requests_carry_images_across_the_pipe(vl_dir: Path) -> None:
    """What crosses to an engine-core process: the request with its images pickles whole."""
    facts = vision_facts(vl_dir)
    ids, mm = facts.inputs([1, facts.image_token_id, 2], [facts.processing.preprocess(random_image(40, 40, 5))])
    back = pickle.loads(pickle.dumps(EngineRequest("r", ids, SamplingParams(max_tokens=2), mm_inputs=mm)))
    assert back.prompt_token_ids == ids
    np.testing.assert_array_equal(back.mm_inputs.images[0].pixel_values, mm.images[0].pixel_values)
    np.testing.assert_array_equal(back.mm_inputs.positions, mm.positions)
    assert back.mm_inputs.images[0].content_hash == mm.images[0].content_hash
