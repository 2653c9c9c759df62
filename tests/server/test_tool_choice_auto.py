"""``tool_choice: auto`` as vLLM users configure it: ``--enable-auto-tool-choice``,
``--tool-call-parser`` and ``--chat-template smollm2-tools`` (the packaged SmolLM2 template with
Hermes-style tools), on the tiny demo model served through the template.

The server renders tools and a tool-call history exactly as transformers' ``apply_chat_template``
renders them with the same template, parses a Hermes call (forced by a regex so the random model
writes one) with ``tool_choice`` left out, and accepts the follow-up turn that carries the tool's
result. ``--no-enable-auto-tool-choice`` refuses auto with vLLM's message while ``required``
still works; a template that does not render tools is refused naming ``--chat-template`` (and
start-up says so when the flags are given); ``--tool-call-parser`` picks the format over the
template's; a Hermes block holding a list of calls is read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from inflight.runtime import chat_templates
from inflight.runtime.cli.command import build_parser, server_settings_from_args
from inflight.runtime.cli.serving_dir import read_chat_template, serving_dir
from inflight.runtime.config import EngineConfig
from inflight.runtime.demo.model import CHAT_TEMPLATE
from inflight.runtime.server import ServerSettings
from inflight.runtime.server.errors import APIError
from inflight.runtime.server.openai.chat_support import AUTO_OFF, output_plan
from inflight.runtime.server.openai.protocol import parse_chat_request
from tests.server.server_helpers import MODEL_NAME, LiveServer, http

openai = pytest.importorskip("openai")  # absent on a bare GPU machine (docs/gpu.md)

CONFIG = dict(max_num_sequences=4, num_kv_blocks=128, max_model_len=1024)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather in a city",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEMPLATE = read_chat_template(chat_templates.resolve("smollm2-tools"))


def _history(arguments: Any) -> list[dict[str, Any]]:
    return [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]


@pytest.fixture(scope="module")
def tools_dir(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model served with ``--chat-template smollm2-tools`` (the CLI's overlay)."""
    return serving_dir(demo_model_dir, None, TEMPLATE, root=tmp_path_factory.mktemp("tools-overlay"))


def _serve(model_dir: Path, **settings: Any) -> LiveServer:
    return LiveServer(model_dir, EngineConfig(**CONFIG), ServerSettings(model_name=MODEL_NAME, **settings)).start()


@pytest.fixture(scope="module")
def tools_server(tools_dir: Path) -> Iterator[LiveServer]:
    """``--chat-template smollm2-tools --enable-auto-tool-choice --tool-call-parser hermes``."""
    live = _serve(tools_dir, enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(tools_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tools_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_tokenizer(tools_dir: Path) -> Any:
    """transformers' own load of the overlay (the demo tokenizer, the packaged template)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(tools_dir))


def _hf_ids(tok: Any, messages: list[dict[str, Any]]) -> list[int]:
    return list(tok.apply_chat_template(messages, tools=TOOLS, tokenize=True, return_dict=False,
                                        add_generation_prompt=True))


@pytest.mark.parametrize("messages", [ASK, _history({"city": "Paris"})], ids=["question", "tool-result"])
def test_tools_and_history_render_as_transformers(tools_server: LiveServer, hf_tokenizer: Any,
                                                  messages: list[dict[str, Any]]) -> None:
    assert hf_tokenizer.chat_template == TEMPLATE
    sent = json.loads(json.dumps(messages))
    for message in sent:  # OpenAI clients send arguments as a JSON string
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    reply = http("POST", f"{tools_server.url}/tokenize", {"model": MODEL_NAME, "messages": sent, "tools": TOOLS})
    assert reply.status == 200, reply.text
    want = _hf_ids(hf_tokenizer, messages)
    assert reply.json()["tokens"] == want
    text = hf_tokenizer.decode(want)
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    if len(messages) > 1:
        assert CALL in text and "<|im_start|>tool\nThe get_weather tool returned: 18 C, sunny<|im_end|>" in text


def test_auto_call_parsed_hermes_with_tool_choice_left_out(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=80,
                  extra_body={"guided_regex": "Sure\\.\\n" + re.escape(CALL)})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Sure.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in streamed] == [
        ("get_weather", {"city": "Paris"})]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_follow_up_turn_with_the_tool_result_is_served(client: openai.OpenAI, hf_tokenizer: Any) -> None:
    """The agent loop: the reply's message goes back as it came, then a ``tool`` message."""
    first = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, max_tokens=80,
                                           extra_body={"guided_regex": re.escape(CALL)}).choices[0].message
    messages: list[Any] = [*ASK, first]
    messages.append({"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "18 C, sunny"})
    final = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, max_tokens=4)
    history = _history({"city": "Paris"})
    history[1]["tool_calls"][0]["id"] = first.tool_calls[0].id
    history[2]["tool_call_id"] = first.tool_calls[0].id
    assert final.usage.prompt_tokens == len(_hf_ids(hf_tokenizer, history))
    assert final.choices[0].finish_reason in ("stop", "length")


def test_without_the_flag_auto_is_refused_as_vllm_refuses_it(tools_dir: Path) -> None:
    live = _serve(tools_dir, enable_auto_tool_choice=False)
    try:
        for choice in ({}, {"tool_choice": "auto"}):
            reply = http("POST", f"{live.url}/v1/chat/completions",
                         {"model": MODEL_NAME, "messages": ASK, "tools": TOOLS, "max_tokens": 4, **choice})
            assert reply.status == 400 and reply.json()["error"]["message"] == AUTO_OFF, reply.text
            assert reply.json()["error"]["param"] == "tool_choice"
        forced = http("POST", f"{live.url}/v1/chat/completions", {
            "model": MODEL_NAME, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200,
            "parallel_tool_calls": False})
        assert forced.status == 200, forced.text
        choice = forced.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    finally:
        live.stop()


def _plan(template: str, body: dict[str, Any], settings: ServerSettings | None = None) -> Any:
    tokenizer = SimpleNamespace(chat_template=template, decode=lambda ids, **kw: "")
    return output_plan(parse_chat_request({"messages": ASK, "tools": TOOLS, **body}), tokenizer, [1, 2], settings)


def test_a_template_without_tools_refuses_auto_naming_chat_template() -> None:
    for body in ({}, {"tool_choice": "auto"}):
        with pytest.raises(APIError) as info:
            _plan(CHAT_TEMPLATE, body)
        assert info.value.status == 400 and info.value.param == "tools"
        assert "--chat-template" in info.value.message and "smollm2-tools" in info.value.message
    assert _plan(CHAT_TEMPLATE, {"tool_choice": "required"}).tool_mode == "required"
    assert _plan(CHAT_TEMPLATE, {"tool_choice": "none"}).tool_mode is None


@pytest.mark.parametrize(("settings", "mode"), [
    (None, "hermes"),
    (ServerSettings(model_name="m"), "hermes"),
    (ServerSettings(model_name="m", enable_auto_tool_choice=True), "hermes"),
    (ServerSettings(model_name="m", tool_call_parser="llama3_json"), "llama3"),
    (ServerSettings(model_name="m", enable_auto_tool_choice=True, tool_call_parser="mistral"), "mistral"),
])
def test_the_parser_flag_decides_the_format_else_the_template(settings: ServerSettings | None, mode: str) -> None:
    assert _plan(TEMPLATE, {}, settings).tool_mode == mode


def _args(*argv: str) -> Any:
    args = build_parser().parse_args(["serve", "m", *argv])
    args.model = args.model_path
    return args


def test_flags_reach_the_server_settings(capsys: pytest.CaptureFixture[str]) -> None:
    settings = server_settings_from_args(_args("--enable-auto-tool-choice", "--tool-call-parser", "hermes"))
    assert (settings.enable_auto_tool_choice, settings.tool_call_parser) == (True, "hermes")
    settings = server_settings_from_args(_args("--no-enable-auto-tool-choice"))
    assert (settings.enable_auto_tool_choice, settings.tool_call_parser) == (False, None)
    assert server_settings_from_args(_args()).enable_auto_tool_choice is None
    with pytest.raises(SystemExit) as exc:
        _args("--tool-call-parser", "granite")
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "'granite'" in err and "hermes, llama3_json, mistral" in err
    with pytest.raises(ValueError, match="granite"):
        ServerSettings(model_name="m", tool_call_parser="granite")


def test_builtin_template_names_resolve_to_package_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = Path(chat_templates.resolve("smollm2-tools"))
    assert path.parent == Path(chat_templates.__file__).parent and path.name == "smollm2-tools.jinja"
    assert "<tool_call>" in path.read_text() and "tools" in path.read_text()
    assert chat_templates.resolve("{{ messages }}") == "{{ messages }}"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-tools").write_text("{{ 'mine' }}")
    assert chat_templates.resolve("smollm2-tools") == "smollm2-tools"  # a file of that name wins


def test_hermes_blocks_holding_a_list_of_calls_are_read() -> None:
    from inflight.runtime.server.openai.chat_output import ChatOutputPlan, ChatStream, build_message
    from inflight.runtime.server.openai.tool_calls import parse_tool_calls

    text = ('On it. <tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
            '{"name": "get_time", "arguments": {}}]</tool_call>')
    parsed = parse_tool_calls("hermes", text)
    assert parsed.content == "On it. "
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    for bad in ("<tool_call>[]</tool_call>", '<tool_call>[{"name": "f"}, 3]</tool_call>'):
        assert parse_tool_calls("hermes", bad).tool_calls == () and parse_tool_calls("hermes", bad).content == bad
    plan = ChatOutputPlan(tool_mode="hermes")
    stream = ChatStream(plan)
    deltas = [stream.feed(text[i:i + 7], i + 7 >= len(text)) for i in range(0, len(text), 7)]
    streamed = [tc["function"]["name"] for d in deltas for tc in d.get("tool_calls", [])]
    assert streamed == ["get_weather", "get_time"] == [
        c["function"]["name"] for c in build_message(plan, text, "stop")[0]["tool_calls"]]


@pytest.mark.parametrize(("template", "warned"), [(CHAT_TEMPLATE, True), ("smollm2-tools", False)])
def test_start_up_says_when_auto_tools_meet_a_template_without_tools(
    demo_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    template: str, warned: bool,
) -> None:
    from inflight.runtime.cli.command import engine_config_from_args
    from inflight.runtime.cli.preflight import check_served, served_dir

    monkeypatch.setenv("INFLIGHT_CACHE_DIR", str(tmp_path))
    args = build_parser().parse_args(["serve", str(demo_model_dir), "--chat-template", template,
                                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    args.model = args.model_path
    with caplog.at_level("WARNING", logger="inflight.cli"):
        served = served_dir(args, lambda line: None)
        check_served(args, engine_config_from_args(args), served)
    said = [r.getMessage() for r in caplog.records if "does not render tools" in r.getMessage()]
    assert bool(said) == warned and all("--chat-template" in line for line in said)
    assert ("<tool_call>" in (served / "chat_template.jinja").read_text()) == (not warned)
