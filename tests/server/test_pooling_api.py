"""/v1/embeddings, /v1/score and /v1/rerank on live servers of tiny pooling checkpoints made here.

Answers are compared with transformers on the same weights (``last_hidden_state`` pooled by hand
and normalized; the classifier's logit through a sigmoid, as vLLM returns scores), through the
``openai`` client too; bad input is a 400 naming the field; a pooling server refuses generation
and a generating server refuses scoring; a mixed burst of chat and embedding requests on two
servers has no error and leaves no KV block in use. One server runs the engine in its own
process, so the pooled vectors cross the engine-core protocol.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.server import ServerSettings
from tests.runtime.pooling_models import (
    bert_reference,
    make_bert,
    make_embedding_model,
    make_reranker,
    reference_embedding,
    reference_logits,
)
from tests.server.server_helpers import MODEL_NAME, LiveServer, http, metrics, wait_until

CONFIG = dict(max_num_sequences=4, num_kv_blocks=64, max_model_len=256, max_num_tokens=32)
DOCS = ["the cat sat on the mat", "import numpy as np", "def f(x):\n    return x * 2\n" * 3]


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_embedding_model(tmp_path_factory.mktemp("embed"), "qwen3",
                                config_fields={"matryoshka_dimensions": [16, 32]})  # fmt: skip


@pytest.fixture(scope="module")
def rerank_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_reranker(tmp_path_factory.mktemp("rerank"), "qwen3")


@pytest.fixture(scope="module")
def embed_server(embed_dir: Path) -> Iterator[LiveServer]:
    live = LiveServer(embed_dir, EngineConfig(**CONFIG), ServerSettings(model_name=MODEL_NAME)).start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def rerank_server(rerank_dir: Path) -> Iterator[LiveServer]:
    live = LiveServer(rerank_dir, EngineConfig(**CONFIG), ServerSettings(model_name=MODEL_NAME),
                      engine_process=True).start()
    yield live
    live.stop()


def _tokens(model_dir: Path, text: str) -> list[int]:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir).encode(text)


def test_embeddings_equal_transformers_through_the_openai_client(embed_server: LiveServer, embed_dir: Path) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{embed_server.url}/v1", api_key="none")
    result = client.embeddings.create(model=MODEL_NAME, input=DOCS)  # the client asks for base64
    assert [d.index for d in result.data] == [0, 1, 2]
    total = 0
    for doc, data in zip(DOCS, result.data, strict=True):
        ids = _tokens(embed_dir, doc)
        total += len(ids)
        ref = reference_embedding(embed_dir, ids, "LAST", normalize=True)
        np.testing.assert_allclose(np.array(data.embedding), ref, rtol=1e-4, atol=1e-5)
    assert result.usage.prompt_tokens == result.usage.total_tokens == total
    floats = client.embeddings.create(model=MODEL_NAME, input=DOCS[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, result.data[0].embedding, rtol=1e-6)
    cut = client.embeddings.create(model=MODEL_NAME, input=DOCS[0], dimensions=16, encoding_format="float")
    vector = np.array(cut.data[0].embedding)
    full = reference_embedding(embed_dir, _tokens(embed_dir, DOCS[0]), "LAST", normalize=False)
    np.testing.assert_allclose(vector, full[:16] / np.linalg.norm(full[:16]), rtol=1e-4, atol=1e-5)
    counted = metrics(embed_server.url)
    assert sum(v for k, v in counted.items() if k.startswith("inflight:request_success_total{")
               and 'finished_reason="stop"' in k) >= 5  # each input a finished request


def test_every_input_form_and_base64_bytes(embed_server: LiveServer, embed_dir: Path) -> None:
    ids = _tokens(embed_dir, DOCS[1])
    url = f"{embed_server.url}/v1/embeddings"
    by_text = http("POST", url, {"input": DOCS[1]}).json()["data"][0]["embedding"]
    by_ids = http("POST", url, {"input": ids}).json()["data"][0]["embedding"]
    by_lists = http("POST", url, {"input": [ids, ids[:3]]}).json()
    np.testing.assert_allclose(by_text, by_ids, rtol=1e-6)
    np.testing.assert_allclose(by_lists["data"][0]["embedding"], by_ids, rtol=1e-6)
    assert by_lists["usage"]["prompt_tokens"] == len(ids) + 3
    cut = http("POST", url, {"input": "word " * 400, "truncate_prompt_tokens": 10}).json()
    assert cut["usage"]["prompt_tokens"] == 10
    raw = http("POST", url, {"input": DOCS[1], "encoding_format": "base64"}).json()["data"][0]["embedding"]
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(raw), dtype="<f4"), by_text, rtol=1e-6)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["a", 1]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [10**9]}, "input"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "dimensions": 20}, "dimensions"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "dimension": 16}, "dimension"),
    ({"input": "a", "model": "other"}, "model"),
    ({}, "input"),
    ({"input": "word " * 400}, "input"),
])
def test_bad_embedding_requests_are_400s_naming_the_field(embed_server: LiveServer, body: dict, param: str) -> None:
    reply = http("POST", f"{embed_server.url}/v1/embeddings", body)
    assert reply.status in (400, 404), reply.text
    assert reply.json()["error"]["param"] == param, reply.text


def test_score_and_rerank_equal_the_classifiers_sigmoid(rerank_server: LiveServer, rerank_dir: Path) -> None:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(rerank_dir)
    query = "what does numpy do"
    expected = [float(1 / (1 + np.exp(-reference_logits(rerank_dir, tokenizer(query, d)["input_ids"])[0])))
                for d in DOCS]  # fmt: skip
    scored = http("POST", f"{rerank_server.url}/v1/score", {"text_1": query, "text_2": DOCS}).json()
    assert [d["index"] for d in scored["data"]] == [0, 1, 2] and scored["object"] == "list"
    np.testing.assert_allclose([d["score"] for d in scored["data"]], expected, rtol=1e-4, atol=1e-6)
    raw = http("POST", f"{rerank_server.url}/v1/score",
               {"text_1": [query], "text_2": DOCS[:1], "use_activation": False}).json()
    logit = reference_logits(rerank_dir, tokenizer(query, DOCS[0])["input_ids"])[0]
    assert raw["data"][0]["score"] == pytest.approx(float(logit), rel=1e-4, abs=1e-5)
    ranked = http("POST", f"{rerank_server.url}/v1/rerank", {"query": query, "documents": DOCS, "top_n": 2}).json()
    order = sorted(range(3), key=lambda i: -expected[i])[:2]
    assert [r["index"] for r in ranked["results"]] == order
    assert [r["document"]["text"] for r in ranked["results"]] == [DOCS[i] for i in order]
    assert ranked["results"][0]["relevance_score"] == pytest.approx(expected[order[0]], rel=1e-4)
    bare = http("POST", f"{rerank_server.url}/v1/rerank",
                {"query": query, "documents": [{"text": d} for d in DOCS], "return_documents": False}).json()
    assert len(bare["results"]) == 3 and "document" not in bare["results"][0]
    assert bare["usage"]["prompt_tokens"] == sum(len(tokenizer(query, d)["input_ids"]) for d in DOCS)


def test_score_on_an_embedding_model_is_the_cosine(embed_server: LiveServer, embed_dir: Path) -> None:
    reply = http("POST", f"{embed_server.url}/v1/score", {"text_1": DOCS[0], "text_2": DOCS[1:]}).json()
    a = reference_embedding(embed_dir, _tokens(embed_dir, DOCS[0]), "LAST", normalize=True)
    for i, doc in enumerate(DOCS[1:]):
        b = reference_embedding(embed_dir, _tokens(embed_dir, doc), "LAST", normalize=True)
        assert reply["data"][i]["score"] == pytest.approx(float(a @ b), rel=1e-4, abs=1e-5)


def test_each_server_refuses_the_other_runners_endpoints(embed_server: LiveServer, rerank_server: LiveServer,
                                                          server: LiveServer) -> None:
    for url in (embed_server.url, rerank_server.url):
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"})):
            reply = http("POST", url + path, body)
            assert reply.status == 400 and reply.json()["error"]["code"] == "wrong_runner", reply.text
    reply = http("POST", f"{rerank_server.url}/v1/embeddings", {"input": "hi"})
    assert reply.status == 400 and reply.json()["error"]["code"] == "wrong_task"
    for path, body in (("/v1/score", {"text_1": "a", "text_2": "b"}),  # /v1/embeddings: test_mixed_chat_embeddings
                       ("/v1/rerank", {"query": "a", "documents": ["b"]})):
        reply = http("POST", server.url + path, body)
        assert reply.status == 400 and reply.json()["error"]["code"] == "wrong_runner", reply.text
    for body, param in (({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"), ({"text_1": "a"}, "text_2"),
                        ({"text_1": "a", "text_2": "b", "txt": 1}, "txt")):
        reply = http("POST", f"{rerank_server.url}/v1/score", body)
        assert reply.status == 400 and reply.json()["error"]["param"] == param, reply.text
    reply = http("POST", f"{rerank_server.url}/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1})
    assert reply.status == 400 and reply.json()["error"]["param"] == "top_n"


def test_mixed_burst_of_chat_and_embeddings_has_no_error(embed_server: LiveServer, server: LiveServer) -> None:
    async def one(session: aiohttp.ClientSession, i: int) -> int:
        if i % 2:
            body = {"input": [DOCS[i % 3], DOCS[(i + 1) % 3]]}
            async with session.post(f"{embed_server.url}/v1/embeddings", json=body) as resp:
                await resp.read()
                return resp.status
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": DOCS[i % 3]}], "max_tokens": 8}
        async with session.post(f"{server.url}/v1/chat/completions", json=body) as resp:
            await resp.read()
            return resp.status

    async def burst() -> list[int]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, i) for i in range(24)))

    assert asyncio.run(burst()) == [200] * 24
    engine = embed_server.engine
    assert wait_until(lambda: engine.pool.num_used_blocks == 0 and not engine.has_unfinished_requests(), 10)


def test_bert_cross_encoder_reranks_as_transformers_scores(tmp_path: Path) -> None:
    bert = make_bert(tmp_path, head="score")
    live = LiveServer(bert, EngineConfig(max_num_sequences=4, num_kv_blocks=64, max_model_len=256),
                      ServerSettings(model_name=MODEL_NAME)).start()
    try:
        ranked = http("POST", f"{live.url}/v1/rerank", {"query": "what does numpy do", "documents": DOCS}).json()
    finally:
        live.stop()
    expected = {i: float(1 / (1 + np.exp(-bert_reference(bert, "what does numpy do", d)[1][0])))
                for i, d in enumerate(DOCS)}  # fmt: skip
    assert [r["index"] for r in ranked["results"]] == sorted(expected, key=lambda i: -expected[i])
    for result in ranked["results"]:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], rel=1e-4, abs=1e-6)
