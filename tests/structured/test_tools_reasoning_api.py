"""Tools, tool_choice, chat.completions.parse and reasoning through the official openai client,
on random-weight models whose chat templates speak each family's formats."""

from __future__ import annotations

import json

import pydantic
import pytest

from tests.server.server_helpers import MODEL_NAME, client_for

jsonschema = pytest.importorskip("jsonschema")  # absent on a bare GPU machine (docs/gpu.md)
openai = pytest.importorskip("openai")  # absent on a bare GPU machine (docs/gpu.md)

MESSAGES = [{"role": "user", "content": "What is the weather?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}}, "required": ["tz"],
        "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": TIME}


class Answer(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    verdict: bool
    grade: int = pydantic.Field(ge=1, le=5)
    label: str = pydantic.Field(max_length=6)


def test_parse_with_pydantic(any_server) -> None:
    client = client_for(any_server)
    completion = client.chat.completions.parse(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=60, response_format=Answer, seed=1)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Answer) and 1 <= parsed.grade <= 5
    assert list(json.loads(completion.choices[0].message.content)) == ["verdict", "grade", "label"]  # declared order


def _assert_calls_validate(message, finish: str, names: set[str]) -> None:
    assert finish == "tool_calls"
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


@pytest.mark.parametrize("parallel", [False, True])
def test_tool_choice_required(any_server, parallel: bool) -> None:
    client = client_for(any_server)
    for seed in range(3):
        choice = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=500,
            parallel_tool_calls=parallel, seed=seed, temperature=1.0).choices[0]
        _assert_calls_validate(choice.message, choice.finish_reason, set(SCHEMA_OF))
        if not parallel:
            assert len(choice.message.tool_calls) == 1


def test_tool_choice_named(any_server) -> None:
    client = client_for(any_server)
    for name in SCHEMA_OF:
        choice = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=100, seed=5,
            tool_choice={"type": "function", "function": {"name": name}}).choices[0]
        _assert_calls_validate(choice.message, choice.finish_reason, {name})
        assert [c.function.name for c in choice.message.tool_calls] == [name]


def _reassemble(stream) -> tuple[dict[int, dict], str, str, str | None]:
    calls: dict[int, dict] = {}
    content, reasoning, finish = "", "", None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        delta = choice.delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or (delta.model_extra or {}).get("reasoning_content") or ""
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.id or slot["id"]
            if tc.function is not None:
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
    return calls, content, reasoning, finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_streamed_tool_calls_reassemble(any_server, tool_choice) -> None:
    client = client_for(any_server)
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=300,
                  temperature=1.0, seed=3, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls, content, _, finish = _reassemble(client.chat.completions.create(stream=True, **kwargs))
    assert finish == whole.finish_reason == "tool_calls"
    assert not content and whole.message.content is None
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert all(c["id"] for c in calls.values())


HERMES_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "utc"}}\n</tool_call>'


def test_auto_tool_call_parsed_hermes(qwen3_server) -> None:
    """A Qwen-format reply (forced by a regex so the random model writes it) is parsed into
    tool_calls with any text before it as content, streamed or not."""
    client = client_for(qwen3_server)
    regex = r"<think>[a-z]{1,5}</think>Hi [a-z]{1,4}\n" + _escape(HERMES_CALL)
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=120, seed=2,
                  extra_body={"guided_regex": regex})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == [
        ("get_time", {"tz": "utc"})]
    assert whole.message.content.startswith("Hi ")
    calls, content, reasoning, finish = _reassemble(client.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls" and content == whole.message.content
    assert reasoning == whole.message.model_extra["reasoning_content"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_time", {"tz": "utc"})]


def test_auto_tool_call_parsed_llama3(llama_server) -> None:
    client = client_for(llama_server)
    regex = _escape('{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}')
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=80,
                                           extra_body={"guided_regex": regex}).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert json.loads(whole.message.tool_calls[0].function.arguments) == {"city": "Oslo", "days": 2}


def test_auto_tool_calls_parsed_mistral(mistral_server) -> None:
    client = client_for(mistral_server)
    reply = ('Sure [TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "cet"}}, '
             '{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}]')
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=120,
                  extra_body={"guided_regex": _escape(reply)})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Sure "
    want = [("get_time", {"tz": "cet"}), ("get_weather", {"city": "Rome", "days": 3})]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == want
    calls, content, _, finish = _reassemble(client.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls" and content == "Sure "
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == want


def test_reasoning_split_from_content(qwen3_server) -> None:
    client = client_for(qwen3_server)
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=80, seed=4,
                  extra_body={"guided_regex": "<think>[a-z ]{3,12}</think>[a-z]{2,8}"})
    whole = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = whole.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in whole.content
    _, content, streamed_reasoning, _ = _reassemble(client.chat.completions.create(stream=True, **kwargs))
    assert (streamed_reasoning, content) == (reasoning, whole.content)


def test_enable_thinking_false_reaches_the_template(qwen3_server) -> None:
    client = client_for(qwen3_server)
    tok = qwen3_server.engine.tokenizer
    for enable in (True, False):
        usage = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=1,
            extra_body={"chat_template_kwargs": {"enable_thinking": enable}}).usage
        expected = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                           return_dict=False, enable_thinking=enable)
        assert usage.prompt_tokens == len(expected)
    off = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_tool_history_is_rendered(request: pytest.FixtureRequest, arch: str) -> None:
    any_server = request.getfixturevalue(f"{arch}_server")
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    usage = client_for(any_server).chat.completions.create(
        model=MODEL_NAME, messages=history, tools=TOOLS, max_tokens=1).usage
    tok = any_server.engine.tokenizer
    rendered = tok.apply_chat_template(
        [history[0], {**history[1], "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}}]}, history[2]],
        tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "Oslo" in rendered and "sunny" in rendered
    assert usage.prompt_tokens == len(tok(rendered, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"guided_regex": "a["}, "guided_regex"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"audio": {"voice": "x"}}, "audio"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 500}}, "logit_bias"),
    ({"logit_bias": {"999999": 5}}, "logit_bias"),
])
def test_bad_requests_are_400_naming_the_field(llama_server, body, param) -> None:
    client = client_for(llama_server)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, extra_body=body)
    assert info.value.body["param"] == param, info.value.body


def test_harmless_openai_fields_are_accepted(llama_server) -> None:
    resp = client_for(llama_server).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=2, user="u", metadata={"k": "v"}, store=False,
        service_tier="auto", extra_body={"prompt_cache_key": "k"})
    assert resp.choices[0].finish_reason in ("stop", "length")


def _escape(text: str) -> str:
    import re

    return re.escape(text)


OPEN_WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "where": {"type": "object", "properties": {"lat": {"type": "integer"}}, "required": ["lat"]},
}, "required": ["city", "where"]}


def test_forced_call_on_an_open_schema_adds_no_undeclared_keys(any_server) -> None:
    """Tool parameter schemas without ``additionalProperties`` are closed for forced calls
    (OpenAI strict function calling, vLLM's xgrammar default): random weights then emit only
    the declared keys, at every nesting level."""
    client = client_for(any_server)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": OPEN_WEATHER}}]
    closed = {**OPEN_WEATHER, "additionalProperties": False, "properties": {
        **OPEN_WEATHER["properties"], "where": {**OPEN_WEATHER["properties"]["where"], "additionalProperties": False}}}
    for seed in range(3):
        choice = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=tools, max_tokens=300, seed=seed, temperature=1.0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), closed)


@pytest.mark.parametrize(("schema", "closed"), [
    ({"type": "object", "properties": {"a": {"type": "string"}}},
     {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False}),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True},
     {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True}),
    ({"type": "array", "items": {"properties": {"b": {}}}},
     {"type": "array", "items": {"properties": {"b": {}}, "additionalProperties": False}}),
    ({"anyOf": [{"properties": {"c": {}}}, {"type": "null"}], "$defs": {"d": {"properties": {"e": {}}}}},
     {"anyOf": [{"properties": {"c": {}}, "additionalProperties": False}, {"type": "null"}],
      "$defs": {"d": {"properties": {"e": {}}, "additionalProperties": False}}}),
    ({"allOf": [{"properties": {"f": {}}}, {"properties": {"g": {}}}]},
     {"allOf": [{"properties": {"f": {}}}, {"properties": {"g": {}}}]}),
    ({"type": "object", "properties": {"properties": {"type": "object"}}},
     {"type": "object", "properties": {"properties": {"type": "object"}}, "additionalProperties": False}),
])
def test_tool_parameter_schemas_are_closed_by_table(schema, closed) -> None:
    from inflight.runtime.server.openai.tool_requests import _closed

    assert _closed(schema) == closed
