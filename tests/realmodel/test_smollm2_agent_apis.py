"""The agent APIs against ``make run``'s server (SmolLM2-135M-Instruct with ``--chat-template
smollm2-tools --enable-auto-tool-choice --tool-call-parser hermes``), through the real clients:
the ``openai`` client's ``responses.create`` / ``responses.stream`` (plain, streamed, a forced
tool call whose result goes back as ``function_call_output``, ``previous_response_id`` on a
server started with ``--enable-responses-store``) and the ``anthropic`` client's
``messages.create`` / ``messages.stream`` (plain, tools).

Answers are checked against what the same server's /v1/chat/completions says for the same
conversation under greedy decoding, so each API is the chat pipeline in another shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inflight.runtime.model.gguf_smollm2 import SERVED_NAME
from tests.realmodel.conftest import MAKE_RUN_TOOL_FLAGS
from tests.realmodel.helpers import ServerProcess, http_json

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

ASK = "What is the capital of France?"
WEATHER_ASK = "What is the weather in Paris?"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
                    "parameters": SCHEMA}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                                "description": "Get the current weather in a city",
                                                "parameters": SCHEMA}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Get the current weather in a city", "input_schema": SCHEMA}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def oai(smollm2_server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(smollm2_server: ServerProcess) -> Any:
    return anthropic.Anthropic(base_url=smollm2_server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def store_server(smollm2_dir: Path) -> Iterator[ServerProcess]:
    """``make run``'s server plus ``--enable-responses-store``."""
    server = ServerProcess(
        [str(smollm2_dir), "--served-model-name", SERVED_NAME, "--num-kv-blocks", "256", "--max-model-len", "2048",
         "--max-num-seqs", "4", *MAKE_RUN_TOOL_FLAGS, "--enable-responses-store", "--responses-store-size", "16"],
    ).start()
    yield server
    server.stop()


def _chat(oai: Any, messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> Any:
    return oai.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=max_tokens, temperature=0,
                                       **extra).choices[0].message


def test_responses_create_and_stream(oai: Any) -> None:
    r = oai.responses.create(model=SERVED_NAME, input=ASK, max_output_tokens=40, **GREEDY)
    assert "Paris" in r.output_text and r.status == "completed"
    assert r.output_text == _chat(oai, [{"role": "user", "content": ASK}], 40).content
    with oai.responses.stream(model=SERVED_NAME, input=ASK, max_output_tokens=40, **GREEDY) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == r.output_text
    assert final.usage.input_tokens == r.usage.input_tokens and final.usage.output_tokens == r.usage.output_tokens


def test_responses_forced_tool_call_and_its_output(oai: Any) -> None:
    r = oai.responses.create(model=SERVED_NAME, input=WEATHER_ASK, tools=RESPONSES_TOOLS, max_output_tokens=60,
                             tool_choice={"type": "function", "name": "get_weather"}, **GREEDY)
    [call] = r.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    follow = oai.responses.create(model=SERVED_NAME, tools=RESPONSES_TOOLS, max_output_tokens=60, **GREEDY, input=[
        {"role": "user", "content": WEATHER_ASK},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}])
    assert "18" in follow.output_text, follow.output_text
    chat = _chat(oai, [{"role": "user", "content": WEATHER_ASK},
                       {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments}}]},
                       {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"}], 60, tools=CHAT_TOOLS)
    assert follow.output_text == chat.content


def test_responses_previous_response_id(store_server: ServerProcess) -> None:
    oai = openai.OpenAI(base_url=f"{store_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    first = oai.responses.create(model=SERVED_NAME, input=WEATHER_ASK, tools=RESPONSES_TOOLS, max_output_tokens=60,
                                 tool_choice={"type": "function", "name": "get_weather"}, **GREEDY)
    call = first.output[0]
    second = oai.responses.create(model=SERVED_NAME, previous_response_id=first.id, tools=RESPONSES_TOOLS,
                                  max_output_tokens=60, **GREEDY, input=[
                                      {"type": "function_call_output", "call_id": call.call_id,
                                       "output": "18 C, sunny"}])
    assert "18" in second.output_text, second.output_text
    assert oai.responses.retrieve(second.id).output_text == second.output_text
    thanks = "Thanks! In one word, how is the weather?"
    third = oai.responses.create(model=SERVED_NAME, previous_response_id=second.id, input=thanks, tools=RESPONSES_TOOLS,
                                 max_output_tokens=30, **GREEDY)
    history = [{"role": "user", "content": WEATHER_ASK},
               {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                   "name": call.name, "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "name": call.name, "content": "18 C, sunny"},
               {"role": "assistant", "content": second.output_text}, {"role": "user", "content": thanks}]
    status, tokens = http_json(f"{store_server.url}/tokenize", {"model": SERVED_NAME, "messages": history,
                                                                "tools": CHAT_TOOLS})
    assert status == 200 and third.usage.input_tokens == len(tokens["tokens"])


def test_messages_create_and_stream(claude: Any, oai: Any) -> None:
    messages = [{"role": "user", "content": ASK}]
    m = claude.messages.create(model=SERVED_NAME, max_tokens=40, messages=messages, extra_body=GREEDY)
    assert m.stop_reason == "end_turn" and "Paris" in m.content[0].text
    assert m.content[0].text == _chat(oai, messages, 40).content
    with claude.messages.stream(model=SERVED_NAME, max_tokens=40, messages=messages, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == m.content[0].text and final.usage == m.usage
    # The 2.x client sends no temperature: the model's defaults apply, and the answer is served.
    sampled = claude.messages.create(model=SERVED_NAME, max_tokens=20, messages=messages)
    assert sampled.usage.output_tokens >= 1 and sampled.stop_reason in ("end_turn", "max_tokens")


def test_messages_tools_round_trip(claude: Any) -> None:
    ask = [{"role": "user", "content": WEATHER_ASK}]
    m = claude.messages.create(model=SERVED_NAME, max_tokens=60, messages=ask, tools=ANTHROPIC_TOOLS,
                               tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    [use] = m.content
    assert m.stop_reason == "tool_use" and use.type == "tool_use" and use.input == {"city": "Paris"}
    follow = claude.messages.create(model=SERVED_NAME, max_tokens=60, tools=ANTHROPIC_TOOLS, extra_body=GREEDY,
                                    messages=[*ask, {"role": "assistant", "content": m.content}, {"role": "user", "content": [
                                        {"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}]}])
    assert follow.stop_reason == "end_turn" and "18" in follow.content[0].text, follow.content
    with claude.messages.stream(model=SERVED_NAME, max_tokens=60, messages=ask, tools=ANTHROPIC_TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.input) for b in streamed.content] == [("tool_use", {"city": "Paris"})]
