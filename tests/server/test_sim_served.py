"""The simulated device served (``--device sim``): a burst of streams completes every one, the
same requests get the same text in either process mode, and /metrics counts device busy time.
A zero step time: no test knows how fast anything is."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from inflight.runtime import LLM, SamplingParams
from inflight.runtime.config import EngineConfig
from inflight.runtime.server import ServerSettings
from tests.server.server_helpers import MODEL_NAME, LiveServer, http, metrics

BUSY = "inflight:device_busy_seconds_total"
PROMPTS = ["hello", "def f(x):"]


@pytest.fixture(scope="module")
def sim_config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    profile = tmp_path_factory.mktemp("sim") / "tiny.json"
    profile.write_text(json.dumps({"base_ms": 0.001, "decode_row_ms": 0, "prefill_token_ms": 0,
                                   "attention_ms_per_1k_context": 0}))
    return EngineConfig(device="sim", sim_profile=str(profile), max_num_sequences=8, num_kv_blocks=256,
                        max_model_len=512, max_queue_len=64)


@pytest.fixture(scope="module", params=[False, True], ids=["thread", "core-process"])
def sim_server(request: pytest.FixtureRequest, demo_model_dir: Path, sim_config: EngineConfig) -> Iterator[LiveServer]:
    live = LiveServer(demo_model_dir, sim_config, ServerSettings(model_name=MODEL_NAME),
                      engine_process=request.param).start()
    yield live
    live.stop()


async def _stream(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int) -> tuple[str, str | None]:
    body = {"model": MODEL_NAME, "prompt": f"# task {i}\ndef f{i}(x):", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    text, reason, done = [], None, False
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: [DONE]"):
                done = True
            elif line.startswith(b"data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice["text"])
                reason = choice.get("finish_reason") or reason
    assert done
    return "".join(text), reason


async def _burst(url: str, num_streams: int, max_tokens: int) -> list[tuple[str, str | None]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        return await asyncio.gather(*[_stream(session, url, i, max_tokens) for i in range(num_streams)])


def test_a_burst_completes_every_stream_and_busy_time_grows(sim_server: LiveServer) -> None:
    before = metrics(sim_server.url)[BUSY]
    results = asyncio.run(_burst(sim_server.url, 24, 16))  # 3x max_num_sequences: requests wait and board
    assert [reason for _, reason in results] == ["length"] * 24
    assert metrics(sim_server.url)[BUSY] > before


@pytest.fixture(scope="module")
def offline_texts(demo_model_dir: Path, sim_config: EngineConfig) -> list[str]:
    llm = LLM(demo_model_dir, **sim_config.to_dict())
    try:
        seeded = llm.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=5))
        greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0))
    finally:
        llm.close()
    return [o.text for o in seeded + greedy]


def test_same_text_as_offline_in_either_process_mode(sim_server: LiveServer, offline_texts: list[str]) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPTS, "max_tokens": 12, "ignore_eos": True, "temperature": 0.8, "seed": 5}
    texts = [c["text"] for c in http("POST", f"{sim_server.url}/v1/completions", body).json()["choices"]]
    greedy = {**body, "temperature": 0, "seed": None}  # greedy and unseeded: the prompt decides
    texts += [c["text"] for c in http("POST", f"{sim_server.url}/v1/completions", greedy).json()["choices"]]
    assert texts == offline_texts
