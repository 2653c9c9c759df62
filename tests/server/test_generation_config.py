"""The server's request policy: sampling defaults from a model's generation_config.json (vLLM's
``--generation-config``) for the fields a request leaves out, a request's own fields winning,
and ``--max-logprobs`` raised and lowered, through the parser, a live server and ``inflight
serve`` itself."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inflight.runtime.cli.command import main
from inflight.runtime.config import EngineConfig
from inflight.runtime.generation_defaults import SamplingDefaults, load_sampling_defaults
from inflight.runtime.server import ServerSettings
from inflight.runtime.server.errors import APIError
from inflight.runtime.server.openai.protocol import (
    RequestPolicy,
    parse_chat_request,
    parse_completion_request,
)
from tests.server.server_helpers import MODEL_NAME, LiveServer, ServeProcess, http

GENERATION_CONFIG = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.0, "top_p": 0.9,
                     "max_new_tokens": 7}
RAISED = 2000  # above the demo model's vocabulary of 1024
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def gc_model_dir(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model with sampling fields in its generation_config.json."""
    out = shutil.copytree(demo_model_dir, tmp_path_factory.mktemp("gc-model") / "demo")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return out


@pytest.fixture(scope="module")
def gc_server(gc_model_dir: Path) -> Iterator[LiveServer]:
    """``--generation-config auto --max-logprobs 2000`` on that model."""
    settings = ServerSettings(model_name=MODEL_NAME, sampling_defaults=load_sampling_defaults("auto", gc_model_dir),
                              max_logprobs=RAISED)
    live = LiveServer(gc_model_dir, EngineConfig(max_num_sequences=4, num_kv_blocks=64, max_model_len=256),
                      settings).start()
    yield live
    live.stop()


def _chat(url: str, **fields: Any) -> tuple[int, dict[str, Any]]:
    reply = http("POST", f"{url}/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 8,
                                                         **fields})
    return reply.status, reply.json()


def _text(body: dict[str, Any]) -> str:
    return body["choices"][0]["message"]["content"]


# --- the parser: the SamplingParams a request is built into ---------------------------------

def test_omitted_fields_take_the_defaults_and_a_requests_own_win() -> None:
    policy = RequestPolicy(SamplingDefaults(temperature=0.3, top_k=7, repetition_penalty=1.1))
    params = parse_chat_request({"messages": CHAT}, policy).params
    assert (params.temperature, params.top_k, params.repetition_penalty, params.top_p) == (0.3, 7, 1.1, 1.0)
    params = parse_chat_request({"messages": CHAT, "temperature": 1.0, "top_k": 0, "top_p": None}, policy).params
    assert (params.temperature, params.top_k, params.top_p) == (1.0, 0, 1.0)  # null is left out, as in vLLM
    params = parse_completion_request({"prompt": "x", "repetition_penalty": 1.0}, policy).params
    assert (params.temperature, params.repetition_penalty) == (0.3, 1.0)
    assert parse_chat_request({"messages": CHAT}).params.temperature == 1.0  # no policy: OpenAI's defaults


@pytest.mark.parametrize(("ceiling", "ok", "too_many"), [(5, 5, 6), (30, 30, 31)])
def test_the_logprobs_ceiling_is_the_servers(ceiling: int, ok: int, too_many: int) -> None:
    policy = RequestPolicy(max_logprobs=ceiling)
    assert parse_completion_request({"prompt": "x", "logprobs": ok}, policy).num_logprobs == ok
    assert parse_chat_request({"messages": CHAT, "logprobs": True, "top_logprobs": ok}, policy).num_logprobs == ok
    assert parse_completion_request({"prompt": "x", "prompt_logprobs": ok}, policy).params.prompt_logprobs == ok
    for body, field in (({"prompt": "x", "logprobs": too_many}, "logprobs"),
                        ({"prompt": "x", "prompt_logprobs": too_many}, "prompt_logprobs"),
                        ({"messages": CHAT, "logprobs": True, "top_logprobs": too_many}, "top_logprobs")):
        parse = parse_chat_request if "messages" in body else parse_completion_request
        with pytest.raises(APIError) as exc:
            parse(body, policy)
        assert exc.value.status == 400 and exc.value.param == field
        assert f"between 0 and {ceiling}" in exc.value.message and "--max-logprobs" in exc.value.message


def test_no_ceiling_leaves_the_vocabulary_as_the_limit() -> None:
    policy = ServerSettings(model_name=MODEL_NAME, max_logprobs=-1).request_policy
    assert policy.max_logprobs is None
    assert parse_completion_request({"prompt": "x", "logprobs": 5000}, policy).num_logprobs == 5000
    with pytest.raises(APIError):
        parse_completion_request({"prompt": "x", "logprobs": -1}, policy)
    with pytest.raises(ValueError, match="max_logprobs"):
        ServerSettings(model_name=MODEL_NAME, max_logprobs=-2)


# --- a live server ----------------------------------------------------------------------------

def test_a_request_without_temperature_gets_the_files(gc_server: LiveServer, server: LiveServer) -> None:
    # The file's temperature 0: a request without one is greedy, seed or not.
    status, omitted = _chat(gc_server.url, seed=3)
    assert status == 200
    assert _text(omitted) == _text(_chat(gc_server.url, temperature=0, seed=11)[1])
    # A request's own temperature wins; the file's top_p still fills the field it leaves out:
    # the same as a server without defaults given that top_p explicitly.
    sampled = _text(_chat(gc_server.url, temperature=1.0, seed=5)[1])
    assert sampled == _text(_chat(server.url, temperature=1.0, top_p=0.9, seed=5)[1])
    # Without defaults (vllm), the same seed samples at temperature 1 with top_p 1.
    plain = _text(_chat(server.url, seed=5)[1])
    assert plain == _text(_chat(server.url, temperature=1.0, top_p=1.0, seed=5)[1])


def test_a_raised_ceiling_serves_more_alternatives(gc_server: LiveServer) -> None:
    status, body = _chat(gc_server.url, logprobs=True, top_logprobs=25, max_tokens=2)
    assert status == 200
    assert all(len(entry["top_logprobs"]) == 25 for entry in body["choices"][0]["logprobs"]["content"])
    status, body = _chat(gc_server.url, logprobs=True, top_logprobs=RAISED + 1)
    assert status == 400 and body["error"]["param"] == "top_logprobs" and str(RAISED) in body["error"]["message"]
    # Under the ceiling but past the vocabulary: the engine's check answers, nothing crashes.
    reply = http("POST", f"{gc_server.url}/v1/completions",
                 {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 1, "prompt_logprobs": 1025})
    assert reply.status == 400 and reply.json()["error"]["param"] == "prompt_logprobs"
    assert "vocabulary" in reply.json()["error"]["message"]
    assert _chat(gc_server.url, max_tokens=1)[0] == 200


# --- inflight serve ---------------------------------------------------------------------------

def test_serve_states_the_defaults_and_enforces_a_lowered_ceiling(gc_model_dir: Path) -> None:
    server = ServeProcess(["--model", str(gc_model_dir), "--served-model-name", MODEL_NAME, "--port", "0",
                           "--single-process", "--num-kv-blocks", "64", "--max-model-len", "256",
                           "--override-generation-config", '{"top_k": 5, "presence_penalty": 1}',
                           "--max-logprobs", "3"])
    try:
        server.wait_ready()
        line = next(t for t in server.log().splitlines() if "sampling defaults for fields a request leaves out" in t)
        assert "temperature=0.0, top_p=0.9, top_k=5" in line and "generation_config.json" in line
        assert "not applied: max_new_tokens, presence_penalty (--override-generation-config)" in line
        assert line.rstrip().endswith("max logprobs 3")
        status, body = _chat(server.url, logprobs=True, top_logprobs=4)
        assert status == 400 and body["error"]["param"] == "top_logprobs"
        assert "between 0 and 3" in body["error"]["message"]
        status, body = _chat(server.url, logprobs=True, top_logprobs=3, max_tokens=1)
        assert status == 200 and len(body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3
        server.terminate()
        assert server.proc.wait(30) == 0
    finally:
        server.stop()


@pytest.mark.parametrize(("argv", "said"), [
    (["--generation-config", "/no/such/dir"], "--generation-config /no/such/dir: not auto, vllm or a directory"),
    (["--override-generation-config", "[1]"], "must be a JSON object"),
    (["--override-generation-config", '{"temperature": 9}'], "temperature must be in [0, 2]"),
    (["--max-logprobs", "-2"], "use an integer >= 0, or -1 for no ceiling"),
])
def test_bad_generation_flags_are_usage_errors(gc_model_dir: Path, capsys: pytest.CaptureFixture[str],
                                               argv: list[str], said: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", str(gc_model_dir), *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and said in err and "usage: inflight serve" in err


def test_a_bad_file_stops_the_start_before_any_weight_loads(gc_model_dir: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str],
                                                            logging_restored: None) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    code = main(["serve", str(gc_model_dir), "--port", "0", "--generation-config", str(bad)])
    err = capsys.readouterr().err
    assert code == 1 and "top_p must be in (0, 1]" in err and str(bad) in err and "--generation-config vllm" in err
