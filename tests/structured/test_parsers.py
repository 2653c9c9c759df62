"""Table tests for the pure parsers: tool calls per family, reasoning, and the streaming
state machines (deltas reassemble to the whole-text result, whatever the split points)."""

from __future__ import annotations

import json

import pytest

from inflight.runtime.server.openai.chat_output import ChatOutputPlan, ChatStream, build_message
from inflight.runtime.server.openai.reasoning import ReasoningStream, split_reasoning
from inflight.runtime.server.openai.tool_calls import ToolCall, detect_family, parse_tool_calls

W = ToolCall("get_weather", json.dumps({"city": "Oslo"}))
T = ToolCall("get_time", json.dumps({"tz": "utc"}))

CASES = [
    ("hermes", "plain text", "plain text", ()),
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     "Sure.\n", (W,)),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"utc\\"}"}</tool_call>', None, (W, T)),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}', None, (W,)),  # EOS, no close
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", ()),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, (W,)),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
               '{"name": "get_time", "parameters": {"tz": "utc"}}', None, (W, T)),
    ("llama3", "The answer is {1}.", "The answer is {1}.", ()),
    ("llama3", '{"no_name": 1}', '{"no_name": 1}', ()),
    ("mistral", 'Ok [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "Ok ", (W,)),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{"tz": "utc"}', None, (W, T)),
    ("mistral", "[TOOL_CALLS][oops", "[TOOL_CALLS][oops", ()),
    ("required", '[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"get_time","parameters":{"tz":"utc"}}]',
     None, (W, T)),
    ("required", '[{"name":"get_weather","parameters":{"city":"Os', '[{"name":"get_weather","parameters":{"city":"Os', ()),
]


@pytest.mark.parametrize("mode, text, content, calls", CASES)
def test_parse_tool_calls(mode: str, text: str, content: str | None, calls: tuple[ToolCall, ...]) -> None:
    parsed = parse_tool_calls(mode, text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        (c.name, json.loads(c.arguments)) for c in calls]


def test_named_keeps_the_generated_arguments() -> None:
    assert parse_tool_calls("named", '{"tz":"utc"}', "get_time").tool_calls == (ToolCall("get_time", '{"tz":"utc"}'),)
    assert parse_tool_calls("named", '{"tz":', "get_time").tool_calls == ()


@pytest.mark.parametrize("template, family", [
    ("... <tool_call> ...", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|> ipython", "llama3"), ("", "hermes"),
])
def test_detect_family(template: str, family: str) -> None:
    assert detect_family(template) == family


@pytest.mark.parametrize("text, starts_in, expected", [
    ("<think>why</think>\n\nanswer", False, ("why", "\n\nanswer")),
    ("  <think>why</think>answer", False, ("why", "answer")),
    ("no thinking here", False, (None, "no thinking here")),
    ("<think>cut off", False, ("cut off", "")),
    ("why</think>answer", True, ("why", "answer")),
    ("<thinking is not a tag", False, (None, "<thinking is not a tag")),
])
def test_split_reasoning(text: str, starts_in: bool, expected: tuple[str | None, str]) -> None:
    assert split_reasoning(text, starts_in) == expected


def _splits(text: str) -> list[list[str]]:
    return [[text[i:i + k] for i in range(0, len(text), k)] for k in (1, 2, 3, 7, len(text) or 1)]


@pytest.mark.parametrize("text", ["<think>a</think>b", "  <think>ab</thi", "plain", "<thin", "<think></think>"])
def test_reasoning_stream_reassembles(text: str) -> None:
    for parts in _splits(text):
        stream = ReasoningStream(False)
        pieces = [stream.feed(p, i == len(parts) - 1) for i, p in enumerate(parts)]
        reasoning = "".join(r for r, _ in pieces)
        content = "".join(c for _, c in pieces)
        want_r, want_c = split_reasoning(text, False)
        assert (reasoning, content) == (want_r or "", want_c)


STREAM_CASES = [
    (ChatOutputPlan(tool_mode="hermes"), 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                                         '</tool_call><tool_call>{"name": "get_time", "arguments": {"tz": "utc"}}</tool_call>'),
    (ChatOutputPlan(tool_mode="hermes"), "no calls, just <tool text"),
    (ChatOutputPlan(reasoning=True, tool_mode="hermes"),
     '<think>hmm</think>ok<tool_call>{"name": "get_time", "arguments": {"tz": "utc"}}</tool_call>'),
    (ChatOutputPlan(tool_mode="llama3"), '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    (ChatOutputPlan(tool_mode="llama3"), "just words {not a call}"),
    (ChatOutputPlan(tool_mode="mistral"), 'x[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "utc"}}]'),
    (ChatOutputPlan(tool_mode="required"), '[{"name":"get_time","parameters":{"tz":"utc"}}]'),
    (ChatOutputPlan(tool_mode="named", tool_name="get_time"), '{"tz":"utc"}'),
    (ChatOutputPlan(tool_mode="hermes", single_call=True),
     '<tool_call>{"name": "get_time", "arguments": {"tz": "utc"}}</tool_call>'
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'),
]


def test_single_call_keeps_the_first() -> None:
    text = STREAM_CASES[-1][1]
    message, _ = build_message(STREAM_CASES[-1][0], text, "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]


@pytest.mark.parametrize("plan, text", STREAM_CASES)
def test_chat_stream_reassembles_to_the_whole_message(plan: ChatOutputPlan, text: str) -> None:
    whole, whole_finish = build_message(plan, text, "stop")
    for parts in _splits(text):
        stream = ChatStream(plan)
        content, reasoning, calls = "", "", {}
        for i, part in enumerate(parts):
            delta = stream.feed(part, i == len(parts) - 1)
            content += delta.get("content", "")
            reasoning += delta.get("reasoning_content", "")
            for tc in delta.get("tool_calls", []):
                slot = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                slot["name"] += tc.get("function", {}).get("name") or ""
                slot["arguments"] += tc.get("function", {}).get("arguments") or ""
        assert stream.finish_reason("stop") == whole_finish
        assert (content or None) == whole["content"]
        assert (reasoning or None) == whole.get("reasoning_content")
        assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.get("tool_calls", [])]


def test_auto_tools_need_a_template_that_renders_them() -> None:
    from types import SimpleNamespace

    from inflight.runtime.demo.model import CHAT_TEMPLATE
    from inflight.runtime.server.errors import APIError
    from inflight.runtime.server.openai.chat_support import output_plan
    from inflight.runtime.server.openai.protocol import parse_chat_request

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    plain = SimpleNamespace(chat_template=CHAT_TEMPLATE, decode=lambda ids, **kw: "")
    with pytest.raises(APIError) as info:
        output_plan(parse_chat_request(body), plain, [1, 2])
    assert info.value.param == "tools"
    forced = parse_chat_request({**body, "tool_choice": "required"})
    assert output_plan(forced, plain, [1, 2]).tool_mode == "required"
