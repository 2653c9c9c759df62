"""Each new tool-call format served end to end, on its own chat template with the format's real
markers (``tests/data/chat_templates/``, cut-down copies of the models' own): the demo model is
served through the template with ``--enable-auto-tool-choice --tool-call-parser NAME`` (vLLM's
name), its output forced by a ``guided_regex`` to what the real model writes, and the official
``openai`` client reads the same calls, content and reasoning whole and streamed, arguments in the
one compact rendering. The template also renders the request's tools and writes the returned call
back in the format, as the next turn of an agent loop sends it. Harmony (gpt-oss, ``openai``)
splits its analysis channel into ``reasoning_content``; glm45 its ``<think>``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from inflight.runtime.cli.serving_dir import serving_dir
from inflight.runtime.config import EngineConfig
from inflight.runtime.server import ServerSettings
from inflight.runtime.server.openai.chat_support import output_plan
from inflight.runtime.server.openai.protocol import parse_chat_request
from tests.server.server_helpers import MODEL_NAME, LiveServer, http

openai = pytest.importorskip("openai")  # absent on a bare GPU machine (docs/gpu.md)

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
CONFIG = dict(max_num_sequences=4, num_kv_blocks=128, max_model_len=1024)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "Weather in Paris for 2 days?"}]
DS = {"begin": "<｜tool▁calls▁begin｜>", "end": "<｜tool▁calls▁end｜>", "call": "<｜tool▁call▁begin｜>",
      "call_end": "<｜tool▁call▁end｜>", "sep": "<｜tool▁sep｜>"}
ARGS = '{"city":"Paris","days":2}'  # the one rendering every format's arguments come back in


@dataclass(frozen=True)
class Case:
    parser: str  # vLLM's --tool-call-parser name
    template: str  # file under tests/data/chat_templates
    output: str  # what the model is made to write
    content: str | None
    reasoning: str | None
    written_back: str  # the call as the template writes it in the history
    call_id: str | None = None  # the id the model wrote (kimi_k2)


CASES = [
    Case("qwen3_coder", "qwen3_coder.jinja",
         "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>", "I will check.\n", None,
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
         "</parameter>\n</function>\n</tool_call>"),
    Case("openai", "harmony.jinja",
         "<|channel|>analysis<|message|>User wants weather.<|end|><|start|>assistant<|channel|>commentary "
         "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\", \"days\": 2}<|call|>",
         None, "User wants weather.",
         '<|start|>assistant<|channel|>analysis<|message|>User wants weather.<|end|><|start|>assistant '
         'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris", "days": 2}<|call|>'),
    Case("deepseek_v3", "deepseek_v3.jinja",
         f"{DS['begin']}{DS['call']}function{DS['sep']}get_weather\n```json\n{{\"city\": \"Paris\", \"days\": 2}}\n```"
         f"{DS['call_end']}{DS['end']}", None, None,
         f"{DS['begin']}{DS['call']}function{DS['sep']}get_weather\n```json\n{{\"city\": \"Paris\", \"days\": 2}}\n```"
         f"{DS['call_end']}{DS['end']}"),
    Case("deepseek_v31", "deepseek_v31.jinja",
         f"Checking.{DS['begin']}{DS['call']}get_weather{DS['sep']}{{\"city\": \"Paris\", \"days\": 2}}"
         f"{DS['call_end']}{DS['end']}", "Checking.", None,
         f"{DS['begin']}{DS['call']}get_weather{DS['sep']}{{\"city\": \"Paris\", \"days\": 2}}{DS['call_end']}{DS['end']}"),
    Case("kimi_k2", "kimi_k2.jinja",
         "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
         "{\"city\": \"Paris\", \"days\": 2}<|tool_call_end|><|tool_calls_section_end|>", None, None,
         "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
         "{\"city\": \"Paris\", \"days\": 2}<|tool_call_end|><|tool_calls_section_end|>", "functions.get_weather:0"),
    Case("glm45", "glm45.jinja",
         "<think>Need the weather tool.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
         "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
         None, "Need the weather tool.",
         "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
         "<arg_value>2</arg_value>\n</tool_call>"),
    Case("pythonic", "pythonic.jinja", "[get_weather(city='Paris', days=2)]", None, None,
         '[get_weather(city="Paris", days=2)]'),
]


@pytest.fixture(scope="module", params=CASES, ids=[c.parser for c in CASES])
def served(request: pytest.FixtureRequest, demo_model_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Case, LiveServer]]:
    case: Case = request.param
    template = (TEMPLATES / case.template).read_text(encoding="utf-8")
    model_dir = serving_dir(demo_model_dir, None, template, root=tmp_path_factory.mktemp(f"tools-{case.parser}"))
    live = LiveServer(model_dir, EngineConfig(**CONFIG), ServerSettings(
        model_name=MODEL_NAME, enable_auto_tool_choice=True, tool_call_parser=case.parser)).start()
    yield case, live
    live.stop()


def _reasoning(obj: Any) -> str | None:
    return getattr(obj, "reasoning_content", None) or (obj.model_extra or {}).get("reasoning_content")


def test_the_format_is_read_whole_and_streamed(served: tuple[Case, LiveServer]) -> None:
    case, live = served
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=300)
    kwargs = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=400,  # tools, no tool_choice
                  extra_body={"guided_regex": re.escape(case.output)})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    assert whole.message.content == case.content and _reasoning(whole.message) == case.reasoning
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [("get_weather", ARGS)]
    if case.call_id is not None:
        assert whole.message.tool_calls[0].id == case.call_id
    calls: dict[int, dict[str, str]] = {}
    content = reasoning = ""
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        reasoning += _reasoning(choice.delta) or ""
        for tc in choice.delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
    assert finish == "tool_calls"
    # whitespace before a call is streamed as it comes (not yet known to precede a call); whole, it is dropped
    assert (content if content.strip() else None, reasoning or None) == (case.content, case.reasoning)
    assert list(calls.values()) == [{"name": "get_weather", "arguments": ARGS}]
    # The agent loop's next turn: the template renders the tools and writes the call back in the format.
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": whole.message.tool_calls[0].id, "type": "function",
         "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": whole.message.tool_calls[0].id, "name": "get_weather", "content": "18 C"}]
    if case.reasoning is not None:
        history[1]["reasoning_content"] = case.reasoning
    reply = http("POST", f"{live.url}/tokenize", {"model": MODEL_NAME, "messages": history, "tools": TOOLS,
                                                   "add_generation_prompt": True})
    assert reply.status == 200, reply.text
    detok = http("POST", f"{live.url}/detokenize", {"model": MODEL_NAME, "tokens": reply.json()["tokens"]})
    prompt = detok.json()["prompt"]
    assert case.written_back in prompt and "get_weather" in prompt.split(case.written_back)[0]
    follow = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=3)
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("case", CASES, ids=[c.parser for c in CASES])
def test_the_template_alone_names_its_format(case: Case) -> None:
    """Without ``--tool-call-parser`` the format is the one the template teaches (pythonic aside:
    its template is found by Llama 3.2's prompt)."""
    from types import SimpleNamespace

    from inflight.runtime.server.openai.tool_calls import TOOL_CALL_PARSERS

    template = (TEMPLATES / case.template).read_text(encoding="utf-8")
    tokenizer = SimpleNamespace(chat_template=template, decode=lambda ids, **kw: "")
    plan = output_plan(parse_chat_request({"messages": ASK, "tools": TOOLS}), tokenizer, [1, 2], None)
    assert plan.tool_mode == TOOL_CALL_PARSERS[case.parser]
    assert plan.harmony == (case.parser == "openai")
