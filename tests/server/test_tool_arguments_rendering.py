"""One JSON rendering of tool-call arguments, whatever the ``tool_choice`` (auto, required, a
named function), streamed or not: compact JSON (no spaces after ``:`` and ``,``, non-ASCII as is),
which is what OpenAI's API returns (``"{\\"location\\":\\"Paris, France\\"}"`` in its function
calling guide) and what a forced call's grammar generates. It used to come back spaced under
``required`` (re-rendered by ``json.dumps``) but compact under a named tool (passed through).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inflight.runtime import chat_templates
from inflight.runtime.cli.serving_dir import read_chat_template, serving_dir
from inflight.runtime.config import EngineConfig
from inflight.runtime.server import ServerSettings
from inflight.runtime.server.openai.tool_calls import parse_tool_calls
from tests.server.server_helpers import MODEL_NAME, LiveServer

openai = pytest.importorskip("openai")  # absent on a bare GPU machine (docs/gpu.md)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SPACED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n</tool_call>'


def _compact(arguments: str) -> str:
    return json.dumps(json.loads(arguments), separators=(",", ":"), ensure_ascii=False)


@pytest.fixture(scope="module")
def client(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    template = read_chat_template(chat_templates.resolve("smollm2-tools"))
    model_dir = serving_dir(demo_model_dir, None, template, root=tmp_path_factory.mktemp("render-overlay"))
    live = LiveServer(model_dir, EngineConfig(max_num_sequences=4, num_kv_blocks=128, max_model_len=1024),
                      ServerSettings(model_name=MODEL_NAME, tool_call_parser="hermes")).start()
    yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120)
    live.stop()


@pytest.mark.parametrize("tool_choice", ["auto", "required", "named"])
def test_arguments_are_compact_whatever_the_tool_choice(client: Any, tool_choice: str) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=120, seed=2,
                                  temperature=1.0, parallel_tool_calls=False)
    if tool_choice == "auto":  # the model writes spaced JSON; it comes back compact
        kwargs["extra_body"] = {"guided_regex": re.escape(SPACED)}
    else:
        kwargs["tool_choice"] = tool_choice if tool_choice == "required" else {
            "type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    assert len(whole) == 1 and whole[0].function.arguments == _compact(whole[0].function.arguments)
    if tool_choice == "auto":
        assert whole[0].function.arguments == '{"city":"Zürich","days":2}'
    streamed = "".join(tc.function.arguments or "" for chunk in client.chat.completions.create(stream=True, **kwargs)
                       for tc in (chunk.choices[0].delta.tool_calls or []) if tc.function is not None)
    assert streamed == whole[0].function.arguments  # same seed, same call, same text


@pytest.mark.parametrize(("mode", "text"), [
    ("hermes", SPACED),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Zürich", "days": 2}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}]'),
    ("required", '[{"name": "get_weather", "parameters": {"city": "Zürich", "days": 2}}]'),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Zürich</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"),
    ("pythonic", "[get_weather(city='Zürich', days=2)]"),
])
def test_every_parser_renders_the_same_text(mode: str, text: str) -> None:
    calls = parse_tool_calls(mode, text, tools=TOOLS).tool_calls
    assert [c.arguments for c in calls] == ['{"city":"Zürich","days":2}']
