"""LoRA adapters served over real HTTP with the ``openai`` client (issue 49), the engine core on a
thread and in its own process: a request's ``model`` picks the adapter and gets the offline
engine's greedy tokens with it, base and adapter requests mixed in one batch, /v1/models with
``parent`` and ``root``, live load and unload under traffic (no error, no leaked KV block, an
adapter unloaded mid-request finishing with it), 404 for an unknown adapter, 400 with the reason
for a refused one (the loaded ones keep serving), the admin key, ``vllm:lora_requests_info`` and
``--lora-modules`` at start. Adapters are made locally (random A, non-zero B); every step is
slowed by an injected fault so a request stays in flight while the test acts, whatever the speed."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.llm import LLM
from inflight.runtime.lora.types import LoRARequest
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.server import ServerSettings
from inflight.runtime.server.lora import LoRAModule
from inflight.runtime.server.state import STATE
from tests.server.lora_adapters import ATTENTION, MLP, make_adapter
from tests.server.server_helpers import (
    ADMIN_AUTH,
    ADMIN_KEY,
    API_KEY,
    MODEL_NAME,
    LiveServer,
    http,
    metrics,
    parse_metrics,
    wait_until,
)

ENGINE = dict(max_num_sequences=4, num_kv_blocks=128, max_queue_len=64, max_model_len=512, enable_lora=True,
              max_loras=2, max_lora_rank=16)
PROMPTS = ("def fib(n):", "The quick brown fox", "import numpy as np\n")
MAX_TOKENS = 10
LONG_TOKENS = 120  # a request that outlasts the admin calls made while it runs (steps are slowed)
SLOW_STEP_MS = 10
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def adapters(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "sql": make_adapter(demo_model_dir, root / "sql", seed=1),
        "chat": make_adapter(demo_model_dir, root / "chat", seed=2, rank=4, targets=ATTENTION + MLP),
        "extra": make_adapter(demo_model_dir, root / "extra", seed=3, rank=16, targets=("k_proj", "up_proj")),
        "too-big": make_adapter(demo_model_dir, root / "too-big", seed=4, rank=32),
        "misshapen": make_adapter(demo_model_dir, root / "misshapen", seed=5, out_features_delta=3),
    }


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(demo_model_dir: Path, adapters: dict[str, Path]) -> dict[tuple[str | None, str, int], str]:
    """The offline engine's greedy text for each (adapter or None, prompt, max_tokens)."""
    texts: dict[tuple[str | None, str, int], str] = {}
    with LLM(demo_model_dir, **ENGINE) as llm:
        for name in (None, "sql", "chat", "extra"):
            lora = None if name is None else LoRARequest(name, str(adapters[name]))
            for max_tokens in (MAX_TOKENS, LONG_TOKENS):
                outs = llm.generate(list(PROMPTS), _params(max_tokens), lora_request=lora)
                texts.update({(name, prompt, max_tokens): out.text for prompt, out in zip(PROMPTS, outs, strict=True)})
    for name in ("sql", "chat", "extra"):  # else the test below could not tell an adapter from the base
        assert any(texts[(name, p, MAX_TOKENS)] != texts[(None, p, MAX_TOKENS)] for p in PROMPTS), name
    return texts


def _settings(adapters: dict[str, Path], modules: tuple[LoRAModule, ...] | None = None) -> ServerSettings:
    if modules is None:
        modules = (LoRAModule("sql", str(adapters["sql"])), LoRAModule("chat", str(adapters["chat"]), "demo-base"))
    return ServerSettings(model_name=MODEL_NAME, api_key=API_KEY, admin_api_key=ADMIN_KEY, lora_modules=modules)


@pytest.fixture(scope="module", params=["thread", "process"])
def lora_server(request: pytest.FixtureRequest, demo_model_dir: Path, adapters: dict[str, Path]) -> Iterator[LiveServer]:
    live = LiveServer(demo_model_dir, EngineConfig(**ENGINE), _settings(adapters),
                      engine_process=request.param == "process", fault=f"slow-steps:{SLOW_STEP_MS}").start()
    yield live
    live.stop()


def _client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _complete(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].text


def _admin(live: LiveServer, path: str, body: dict, headers: dict[str, str] | None = ADMIN_AUTH):
    return http("POST", f"{live.url}/v1/{path}", body, headers=headers)


def _no_leaks(live: LiveServer) -> bool:
    m = metrics(live.url, AUTH)
    idle = (m["inflight:num_requests_running"] == 0 and m["inflight:num_requests_waiting"] == 0
            and m["inflight:kv_cache_usage_perc"] == 0)
    if idle and not live.engine_process:
        engine = live.app[STATE].engine.engine
        return engine.stats().num_used_kv_blocks == 0 and not engine.has_unfinished_requests()
    return idle


def test_model_picks_the_adapter_as_the_offline_engine_does(lora_server: LiveServer, reference: dict) -> None:
    client = _client(lora_server)
    for model, adapter in ((MODEL_NAME, None), ("sql", "sql"), ("chat", "chat")):
        for prompt in PROMPTS:
            assert _complete(client, model, prompt) == reference[(adapter, prompt, MAX_TOKENS)], (model, prompt)


def test_every_generate_endpoint_takes_the_adapter(lora_server: LiveServer) -> None:
    client = _client(lora_server)
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "sql" and chat.choices[0].message.content is not None
    response = client.responses.create(model="sql", input="hi", max_output_tokens=4)
    assert response.model == "sql"
    reply = http("POST", f"{lora_server.url}/v1/messages", {"model": "chat", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"}]}, headers=AUTH)
    assert reply.status == 200 and json.loads(reply.text)["model"] == "chat"
    tokens = http("POST", f"{lora_server.url}/tokenize", {"model": "sql", "prompt": "hi"}, headers=AUTH)
    assert tokens.status == 200


def test_base_and_adapters_in_one_batch(lora_server: LiveServer, reference: dict) -> None:
    client = openai.AsyncOpenAI(base_url=f"{lora_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    jobs = [(model, adapter, prompt) for prompt in PROMPTS
            for model, adapter in ((MODEL_NAME, None), ("sql", "sql"), ("chat", "chat"))]

    async def run() -> list[str]:
        outs = await asyncio.gather(*(client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
            for model, _, prompt in jobs))
        await client.close()
        return [out.choices[0].text for out in outs]

    texts = asyncio.run(run())
    assert texts == [reference[(adapter, prompt, MAX_TOKENS)] for _, adapter, prompt in jobs]
    assert wait_until(lambda: _no_leaks(lora_server), 30)


def test_models_lists_the_adapters_with_parent_and_root(lora_server: LiveServer, adapters: dict[str, Path]) -> None:
    client = _client(lora_server)
    assert [m.id for m in client.models.list()] == [MODEL_NAME, "sql", "chat"]
    cards = {c["id"]: c for c in json.loads(http("GET", f"{lora_server.url}/v1/models", headers=AUTH).text)["data"]}
    assert (cards["sql"]["parent"], cards["sql"]["root"]) == (MODEL_NAME, str(adapters["sql"]))
    assert (cards["chat"]["parent"], cards["chat"]["root"]) == ("demo-base", str(adapters["chat"]))
    assert client.models.retrieve("chat").id == "chat"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_unknown_adapter_is_openais_404(lora_server: LiveServer) -> None:
    with pytest.raises(openai.NotFoundError) as error:
        _complete(_client(lora_server), "nope", "hi")
    assert error.value.body["code"] == "model_not_found" and error.value.body["param"] == "model"


def test_refused_adapters_say_why_and_lose_nothing(lora_server: LiveServer, adapters: dict[str, Path],
                                                   reference: dict) -> None:
    for name, path, said in (("too-big", adapters["too-big"], "rank 32"), ("gone", "/nonexistent/x", "not a directory"),
                             ("misshapen", adapters["misshapen"], "model wants A")):
        reply = _admin(lora_server, "load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        error = json.loads(reply.text)["error"]
        assert reply.status == 400 and said in error["message"] and error["type"] == "invalid_request_error", reply
    clash = _admin(lora_server, "load_lora_adapter", {"lora_name": "sql", "lora_path": str(adapters["extra"])})
    assert clash.status == 400 and "another" in json.loads(clash.text)["error"]["message"], clash
    again = _admin(lora_server, "load_lora_adapter", {"lora_name": "sql", "lora_path": str(adapters["sql"])})
    assert again.status == 200  # the same name and path: success, nothing changes (the operator re-sends)
    for body in ({"lora_name": "x"}, {"lora_path": "/p"}, {"lora_name": "x", "lora_path": "/p", "load_inplace": True},
                 {"lora_name": "x", "lora_path": "/p", "other": 1}, {"lora_name": MODEL_NAME, "lora_path": "/p"}):
        assert _admin(lora_server, "load_lora_adapter", body).status == 400, body
    assert _admin(lora_server, "unload_lora_adapter", {"lora_name": "nope"}).status == 404
    assert [m.id for m in _client(lora_server).models.list()] == [MODEL_NAME, "sql", "chat"]
    assert _complete(_client(lora_server), "sql", PROMPTS[0]) == reference[("sql", PROMPTS[0], MAX_TOKENS)]


def test_the_lora_endpoints_need_the_admin_key(lora_server: LiveServer, adapters: dict[str, Path]) -> None:
    body = {"lora_name": "extra", "lora_path": str(adapters["extra"])}
    for headers in (None, AUTH, {"Authorization": "Bearer wrong"}):
        for path in ("load_lora_adapter", "unload_lora_adapter"):
            reply = _admin(lora_server, path, body, headers)
            assert reply.status == 401 and json.loads(reply.text)["error"]["code"] == "invalid_admin_key", (path, headers)
    assert "extra" not in [m.id for m in _client(lora_server).models.list()]


def test_load_and_unload_live_under_traffic(lora_server: LiveServer, adapters: dict[str, Path],
                                            reference: dict) -> None:
    """Traffic on the base model and on ``sql`` never stops while ``extra`` is loaded, used and
    unloaded, twice; a request of ``extra`` in flight when it is unloaded finishes with it."""
    client = _client(lora_server)
    errors: list[str] = []
    stop = threading.Event()

    def traffic(model: str, adapter: str | None) -> None:
        while not stop.is_set():
            for prompt in PROMPTS:
                try:
                    text = _complete(client, model, prompt)
                except Exception as exc:  # noqa: BLE001 - counted: there must be none
                    errors.append(f"{model}: {exc!r}")
                    continue
                if text != reference[(adapter, prompt, MAX_TOKENS)]:
                    errors.append(f"{model}: {text!r}")

    threads = [threading.Thread(target=traffic, args=args) for args in ((MODEL_NAME, None), ("sql", "sql"))]
    for thread in threads:
        thread.start()
    try:
        for _ in range(2):
            load = {"lora_name": "extra", "lora_path": str(adapters["extra"])}
            reply = _admin(lora_server, "load_lora_adapter", load)
            assert reply.status == 200 and reply.text == "Success: LoRA adapter 'extra' added successfully."
            assert _complete(client, "extra", PROMPTS[1]) == reference[("extra", PROMPTS[1], MAX_TOKENS)]
            stream = client.completions.create(model="extra", prompt=PROMPTS[2], max_tokens=LONG_TOKENS,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
            chunks = iter(stream)
            first = next(chunks).choices[0].text  # admitted and running: it has a token
            reply = _admin(lora_server, "unload_lora_adapter", {"lora_name": "extra"})
            assert reply.status == 200 and reply.text == "Success: LoRA adapter 'extra' removed successfully."
            with pytest.raises(openai.NotFoundError):
                _complete(client, "extra", PROMPTS[1])
            rest = "".join(c.choices[0].text for c in chunks)
            assert first + rest == reference[("extra", PROMPTS[2], LONG_TOKENS)]
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
    assert errors == []
    assert wait_until(lambda: _no_leaks(lora_server), 30)


def test_lora_requests_info_names_the_running_adapter(lora_server: LiveServer) -> None:
    client = _client(lora_server)
    stream = client.completions.create(model="sql", prompt=PROMPTS[0], max_tokens=LONG_TOKENS, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    scraped = metrics(lora_server.url, AUTH)
    series = [k for k in scraped if k.startswith("vllm:lora_requests_info{")]
    assert series == ['vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql",waiting_lora_adapters=""}']
    assert scraped[series[0].replace("vllm:", "inflight:")] == pytest.approx(scraped[series[0]], abs=60)
    for _ in chunks:
        pass
    assert wait_until(lambda: _no_leaks(lora_server), 30)
    idle = parse_metrics(http("GET", f"{lora_server.url}/metrics", headers=AUTH).text)
    assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in idle


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
def test_a_refused_lora_module_fails_the_start(demo_model_dir: Path, adapters: dict[str, Path],
                                               engine_process: bool) -> None:
    modules = (LoRAModule("sql", str(adapters["sql"])), LoRAModule("big", str(adapters["too-big"])))
    live = LiveServer(demo_model_dir, EngineConfig(**ENGINE), _settings(adapters, modules), engine_process)
    try:
        with pytest.raises(RuntimeError, match=r"--lora-modules big=.*rank 32 is over max_lora_rank 16"):
            live.start()
    finally:
        live.stop()


def test_lora_calls_without_enable_lora_are_400(server: LiveServer) -> None:
    reply = http("POST", f"{server.url}/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/p"},
                 headers=ADMIN_AUTH)
    assert reply.status == 400 and json.loads(reply.text)["error"]["code"] == "lora_not_enabled"
    assert [c["id"] for c in json.loads(http("GET", f"{server.url}/v1/models").text)["data"]] == [MODEL_NAME]
