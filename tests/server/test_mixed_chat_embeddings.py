"""/v1/embeddings on a generate model's server, scheduled beside its chat requests (core/mixed_pooling.py).

The embedding is transformers' last-token ``last_hidden_state`` (after the final norm), normalized,
for short and chunked prompts; a mixed burst of streamed chats and embedding requests on one server
has no error, its chats are token-identical to the same chats run alone, and no KV block stays in
use; pooled and generated requests preempted together keep their answers; where the mix is not built
(async scheduling) an embedding request is a 400 saying why, in and across the engine-core process.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core import engine as engine_module
from inflight.runtime.core import pooling_step as pooling_step_module
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.core.mixed_pooling import run_mixed
from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.outputs import RequestOutput, RequestRejectedError
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.server import ServerSettings
from inflight.runtime.server.pooling_api.common import POOLING_PARAMS
from tests.runtime.pooling_models import reference_embedding
from tests.server.server_helpers import MODEL_NAME, LiveServer, http, wait_until

# max_num_tokens 16: a prompt over 16 tokens is computed in chunks across steps
CONFIG = dict(max_num_sequences=6, num_kv_blocks=96, max_model_len=256, max_num_tokens=16, block_size=16)


@pytest.fixture(scope="module")
def mixed_server(demo_model_dir: Path) -> Iterator[LiveServer]:
    live = LiveServer(demo_model_dir, EngineConfig(**CONFIG), ServerSettings(model_name=MODEL_NAME)).start()
    yield live
    live.stop()


def _prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 13 * k) % 90 + 5 for k in range(n)]


def test_generate_model_embedding_is_the_last_token_final_hidden_state(mixed_server: LiveServer,
                                                                        demo_model_dir: Path) -> None:
    prompts = [_prompt(1, 5), _prompt(2, 16), _prompt(3, 41)]  # one chunk, a full chunk, three chunks
    reply = http("POST", f"{mixed_server.url}/v1/embeddings", {"input": prompts, "encoding_format": "float"})
    assert reply.status == 200, reply.text
    data = reply.json()
    assert data["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    for ids, item in zip(prompts, data["data"], strict=True):
        ref = reference_embedding(demo_model_dir, ids, "LAST", normalize=True)
        np.testing.assert_allclose(np.array(item["embedding"]), ref, rtol=1e-4, atol=1e-5)
    for path, body in (("/v1/score", {"text_1": "a", "text_2": "b"}), ("/v1/rerank", {"query": "a", "documents": ["b"]})):
        reply = http("POST", mixed_server.url + path, body)
        assert reply.status == 400 and reply.json()["error"]["code"] == "wrong_runner", reply.text


async def _chat(session: aiohttp.ClientSession, url: str, i: int) -> tuple[int, str]:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"tell me about item {i} " * (1 + i % 4)}],
            "max_tokens": 10, "temperature": 0.0, "stream": True, "ignore_eos": True}
    text = []
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices") or []
                text.extend(c["delta"].get("content") or "" for c in choices)
        return resp.status, "".join(text)


async def _embed(session: aiohttp.ClientSession, url: str, i: int) -> tuple[int, str]:
    body = {"input": [_prompt(i, 3 + 5 * (i % 7)), _prompt(i + 50, 30)]}
    async with session.post(f"{url}/v1/embeddings", json=body) as resp:
        await resp.read()
        return resp.status, ""


def test_mixed_burst_on_one_server_has_no_error_and_the_same_chats(mixed_server: LiveServer,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    url = mixed_server.url
    mixed_steps = []

    def spy(engine: LLMEngine, chunks: tuple[ScheduledChunk, ...]) -> list:
        kinds = {engine.scheduler.requests[c.req_id].params.pooling for c in chunks}
        mixed_steps.append(len(kinds) == 2)
        return run_mixed(engine, chunks)

    monkeypatch.setattr(engine_module, "run_mixed", spy)

    async def alone() -> list[tuple[int, str]]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(_chat(session, url, i) for i in range(16)))

    async def mixed() -> list[tuple[int, str]]:
        async with aiohttp.ClientSession() as session:
            jobs = []
            for i in range(16):
                jobs += [_chat(session, url, i), _embed(session, url, i)]
            return await asyncio.gather(*jobs)

    chats = asyncio.run(alone())
    assert all(status == 200 for status, _ in chats) and all(text for _, text in chats)
    results = asyncio.run(mixed())
    assert [status for status, _ in results] == [200] * 32
    assert [r for r in results[0::2]] == chats  # token-identical with and without the embeddings
    assert any(mixed_steps)  # some step held both chat and pooled chunks
    engine = mixed_server.engine
    assert wait_until(lambda: engine.pool.num_used_blocks == 0 and not engine.has_unfinished_requests(), 10)


def test_embeddings_refused_where_the_mix_is_not_built(demo_model_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(demo_model_dir, EngineConfig(**CONFIG, async_scheduling=True))
    try:
        with pytest.raises(RequestRejectedError, match="async scheduling"):
            engine.validate_request([5, 6, 7], POOLING_PARAMS)
    finally:
        engine.close()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_across_the_engine_core_process(demo_model_dir: Path, async_scheduling: bool) -> None:
    """The pooled mark crosses the engine-core protocol; async scheduling: a 400 saying why."""
    live = LiveServer(demo_model_dir, EngineConfig(**CONFIG, async_scheduling=async_scheduling),
                      ServerSettings(model_name=MODEL_NAME), engine_process=True).start()
    try:
        ids = _prompt(4, 37)
        reply = http("POST", f"{live.url}/v1/embeddings", {"input": [ids], "encoding_format": "float"})
        if async_scheduling:
            assert reply.status == 400 and "async scheduling" in reply.json()["error"]["message"], reply.text
            return
        assert reply.status == 200, reply.text
        ref = reference_embedding(demo_model_dir, ids, "LAST", normalize=True)
        np.testing.assert_allclose(np.array(reply.json()["data"][0]["embedding"]), ref, rtol=1e-4, atol=1e-5)
    finally:
        live.stop()


def test_pooled_and_generated_requests_survive_preemption_together(demo_model_dir: Path) -> None:
    """Eight blocks for four long prompts and two chats: preempted and recomputed, the answers unchanged."""
    config = EngineConfig(max_num_tokens=64, long_prefill_token_threshold=16, num_kv_blocks=8, block_size=16,
                          max_model_len=128)
    chat = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    chats = [_prompt(10, 30), _prompt(11, 40)]
    pooled = [_prompt(i, 70 + 5 * i) for i in range(4)]

    def run(engine: LLMEngine, with_pooled: bool) -> dict[str, RequestOutput]:
        for i, ids in enumerate(chats):
            engine.add_request(f"c{i}", ids, chat)
        for i, ids in enumerate(pooled if with_pooled else []):
            engine.add_request(f"p{i}", ids, POOLING_PARAMS)
        done: dict[str, list] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done.setdefault(out.req_id, []).append(out)
        return done

    engine = LLMEngine.from_model_dir(demo_model_dir, config)
    try:
        alone = run(engine, False)
        before = engine.stats().num_preemptions
        mixed = run(engine, True)
        assert engine.stats().num_preemptions > before and engine.pool.num_used_blocks == 0
    finally:
        engine.close()
    for i in range(len(chats)):
        tokens = [[t for o in outs for t in o.new_token_ids] for outs in (alone[f"c{i}"], mixed[f"c{i}"])]
        assert tokens[0] == tokens[1] and len(tokens[0]) == 12
    for i, ids in enumerate(pooled):
        final = mixed[f"p{i}"][-1]
        assert final.finished and final.pooled is not None and not any(o.new_token_ids for o in mixed[f"p{i}"])
        vector = np.frombuffer(final.pooled, dtype="<f4")
        ref = reference_embedding(demo_model_dir, ids, "LAST", normalize=False)
        np.testing.assert_allclose(vector, ref, rtol=1e-4, atol=1e-4)


def test_a_failing_pooling_forward_hurts_no_chat(demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("injected pooling failure")

    engine = LLMEngine.from_model_dir(demo_model_dir, EngineConfig(**CONFIG))
    try:
        chat = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        engine.add_request("c", _prompt(1, 20), chat)
        monkeypatch.setattr(pooling_step_module, "chunk_parts", broken)
        engine.add_request("p", _prompt(2, 20), POOLING_PARAMS)
        outs: dict[str, list[RequestOutput]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs.setdefault(out.req_id, []).append(out)
        assert outs["p"][-1].finish_reason == "error" and outs["p"][-1].pooled is None
        assert outs["c"][-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs["c"]) == 6
        assert engine.pool.num_used_blocks == 0
    finally:
        engine.close()
