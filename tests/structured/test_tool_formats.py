"""The tool-call formats of current models (qwen3_coder, deepseek_v3/v31, kimi_k2, glm45, pythonic,
gpt-oss harmony) on text: each read whole and streamed (one character at a time, in random
splits, and with every marker split across deltas) to the same content and calls, arguments in
the one compact rendering, and adversarial output (unterminated markers, invalid JSON, markers
inside strings, nested markers, huge and deep arguments) kept as text, in linear work. The
timeouts are hang guards, far above the milliseconds these take; they measure nothing."""

from __future__ import annotations

import json
import random

import pytest

from inflight.runtime.server.openai.chat_output import ChatOutputPlan, ChatStream, build_message
from inflight.runtime.server.openai.tool_calls import TOOL_CALL_PARSERS, detect_family, parse_tool_calls
from inflight.runtime.server.openai.tool_parsers.harmony import parse_harmony
from inflight.runtime.server.openai.tool_stream import ToolStream

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "metric": {"type": "boolean"}, "hours": {"type": "array"}}}
TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}})
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
KIMI = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
        "<|tool_call_end|>", "<|tool_calls_section_end|>")
# (mode, text, content, [(name, arguments as rendered)])
WELL_FORMED = [
    ("qwen3_coder",
     "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[1, 2]\n"
     "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
     "Let me check.\n", [("get_weather", '{"city":"São Paulo","days":3,"metric":true,"hours":[1,2]}'),
                         ("get_time", "{}")]),
    ("deepseek_v3",
     f"Sure.{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{\"city\": \"Oslo\", \"days\": 2}}\n```"
     f"{DS_CALL_END}\n{DS_CALL}function{DS_SEP}get_time\n```json\n{{}}\n```{DS_CALL_END}{DS_END}",
     "Sure.", [("get_weather", '{"city":"Oslo","days":2}'), ("get_time", "{}")]),
    ("deepseek_v31",
     f"{DS_BEGIN}{DS_CALL}get_weather{DS_SEP}{{\"city\": \"Oslo\"}}{DS_CALL_END}"
     f"{DS_CALL}get_time{DS_SEP}{{}}{DS_CALL_END}{DS_END}",
     None, [("get_weather", '{"city":"Oslo"}'), ("get_time", "{}")]),
    ("kimi_k2",
     f"Checking. {KIMI[0]}{KIMI[1]}functions.get_weather:0{KIMI[2]}{{\"city\": \"Oslo\"}}{KIMI[3]}"
     f"{KIMI[1]}functions.get_time:1{KIMI[2]}{{}}{KIMI[3]}{KIMI[4]}",
     "Checking. ", [("get_weather", '{"city":"Oslo"}'), ("get_time", "{}")]),
    ("glm45",
     "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n<arg_key>days</arg_key>\n"
     "<arg_value>2</arg_value>\n</tool_call>\n<tool_call>get_time\n</tool_call>",
     None, [("get_weather", '{"city":"42","days":2}'), ("get_time", "{}")]),
    ("pythonic", "[get_weather(city='Oslo', days=2, hours=(1, 2)), get_time()]",
     None, [("get_weather", '{"city":"Oslo","days":2,"hours":[1,2]}'), ("get_time", "{}")]),
    ("harmony",
     "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
     "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}<|call|>",
     None, [("get_weather", '{"city":"Oslo"}')]),
]
IDS = [w[0] for w in WELL_FORMED]


def _stream(mode: str, deltas: list[str]) -> tuple[str, list[tuple[str, str]], ToolStream]:
    stream = ToolStream(mode, None, TOOLS)
    content, calls = "", []
    for i, delta in enumerate(deltas):
        text, found, _ = stream.feed(delta, i == len(deltas) - 1)
        content += text
        calls += [(c.name, c.arguments) for c in found]
    return content, calls, stream


def _splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize(("mode", "text", "content", "calls"), WELL_FORMED, ids=IDS)
def test_whole_and_streamed_give_the_same_calls(mode: str, text: str, content: str | None,
                                                calls: list[tuple[str, str]]) -> None:
    parsed = parse_tool_calls(mode, text, tools=TOOLS)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls
    rng = random.Random(mode)
    for deltas in ([text], list(text), *[_splits(text, rng) for _ in range(30)]):
        got_content, got_calls, _ = _stream(mode, deltas)
        assert (got_content or None, got_calls) == (content, calls), deltas


@pytest.mark.parametrize(("mode", "text", "content", "calls"), WELL_FORMED, ids=IDS)
def test_a_call_is_sent_when_its_close_marker_arrives(mode: str, text: str, content: str | None,
                                                      calls: list[tuple[str, str]]) -> None:
    """Not at the end only: the first call goes out before the second one's text has come."""
    if len(calls) < 2 or mode == "pythonic":  # a pythonic reply is one list, read when it ends
        return
    second = text.rfind(calls[1][0])
    _, found, _ = _stream(mode, [text[:second]])
    assert found == calls[:1]


def test_kimi_ids_are_the_ids_the_model_wrote() -> None:
    text = WELL_FORMED[3][1]
    ids = [c.call_id for c in parse_tool_calls("kimi_k2", text).tool_calls]
    assert ids == ["functions.get_weather:0", "functions.get_time:1"]
    message, finish = build_message(ChatOutputPlan(tool_mode="kimi_k2"), text, "stop")
    assert [c["id"] for c in message["tool_calls"]] == ids and finish == "tool_calls"


def test_qwen3_coder_values_follow_the_schema() -> None:
    def args(params: str) -> dict:
        text = f"<tool_call>\n<function=get_weather>\n{params}</function>\n</tool_call>"
        return json.loads(parse_tool_calls("qwen3_coder", text, tools=TOOLS).tool_calls[0].arguments)

    assert args("<parameter=city>\n007\n</parameter>\n") == {"city": "007"}  # a string stays a string
    assert args("<parameter=days>\nseveral\n</parameter>\n") == {"days": "several"}  # not an int: kept
    assert args("<parameter=metric>\nFalse\n</parameter>\n") == {"metric": False}
    assert args("<parameter=other>\n12\n</parameter>\n") == {"other": "12"}  # undeclared: text, as vLLM
    assert args("<parameter=city>\nline one\nline two\n</parameter>\n") == {"city": "line one\nline two"}


def test_harmony_splits_reasoning_content_and_calls_whole_and_streamed() -> None:
    text = ("<|channel|>analysis<|message|>The user wants a greeting.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>")
    out = parse_harmony(text, with_tools=False)
    assert (out.reasoning, out.content, out.tool_calls) == ("The user wants a greeting.", "Hello there!", ())
    plan = ChatOutputPlan(harmony=True)
    message, _ = build_message(plan, text, "stop")
    assert message == {"role": "assistant", "content": "Hello there!", "reasoning_content": "The user wants a greeting."}
    rng = random.Random(7)
    for deltas in (list(text), *[_splits(text, rng) for _ in range(20)]):
        stream = ChatStream(plan)
        joined = [stream.feed(d, i == len(deltas) - 1) for i, d in enumerate(deltas)]
        assert "".join(d.get("reasoning_content", "") for d in joined) == out.reasoning
        assert "".join(d.get("content", "") for d in joined) == out.content
    # to= before the channel, a commentary preamble, no stop token at the end (it is the model's EOS)
    text = ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_time"
            "<|channel|>commentary json<|message|>{}")
    message, finish = build_message(ChatOutputPlan(tool_mode="harmony", harmony=True), text, "stop")
    assert message["content"] == "Checking." and "reasoning_content" not in message and finish == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [("get_time", "{}")]
    # without tools offered a call's body is content; a forced call's JSON is not read by channels
    assert parse_harmony(text, with_tools=False).content == "Checking.{}"
    forced = build_message(ChatOutputPlan(tool_mode="named", tool_name="get_time", harmony=True), "{}", "stop")
    assert forced[0]["tool_calls"][0]["function"]["arguments"] == "{}"


def test_templates_name_their_format_and_vllm_names_map_to_it() -> None:
    assert detect_family("<|start|>{{ m }}<|channel|>final<|message|>") == "harmony"
    assert detect_family("{{ tools }}<tool_call>\n<function=x>") == "qwen3_coder"
    assert detect_family("{{ tools }}<tool_call>{{ name }}<arg_key>") == "glm45"
    assert detect_family(f"{DS_CALL}function{DS_SEP}" + "```json") == "deepseek_v3"
    assert detect_family(f"{DS_CALL}{{{{ name }}}}{DS_SEP}") == "deepseek_v31"
    assert detect_family(KIMI[1]) == "kimi_k2"
    assert {k: TOOL_CALL_PARSERS[k] for k in ("qwen3_coder", "openai", "deepseek_v3", "deepseek_v31", "kimi_k2",
                                              "glm45", "pythonic")} == {
        "qwen3_coder": "qwen3_coder", "openai": "harmony", "deepseek_v3": "deepseek_v3",
        "deepseek_v31": "deepseek_v31", "kimi_k2": "kimi_k2", "glm45": "glm45", "pythonic": "pythonic"}


N = 100_000
DEEP = "[" * N
QWEN_OPEN = "<tool_call>\n<function=get_weather>\n<parameter=city>\n"
HARMONY_CALL = "<|channel|>commentary to=functions.get_weather<|message|>"
# Output that holds no call: it all stays content, whole and streamed.
NO_CALLS = [
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo"),  # unterminated
    ("qwen3_coder", "<tool_call>" + " " * N),
    ("qwen3_coder", "<tool_call><tool_call><function=f></function></tool_call>"),  # nested open markers
    ("qwen3_coder", "<tool_call>\n<function=f x" + "y" * N + "</tool_call>"),
    ("deepseek_v3", f"{DS_BEGIN}{DS_CALL}function{DS_SEP}f\n```json\n{{\"a\": }}\n```{DS_CALL_END}"),  # bad JSON
    ("deepseek_v3", f"{DS_BEGIN}{DS_CALL}function{DS_SEP}f\n```json\n{DEEP}"),
    ("deepseek_v31", f"{DS_BEGIN}{DS_CALL}f{DS_SEP}{{\"a\": \"{DS_CALL_END}\"}}{DS_CALL_END}"),  # marker in a string
    ("deepseek_v31", f"{DS_BEGIN}" + DS_CALL * 1000),
    ("kimi_k2", f"{KIMI[0]}{KIMI[1]}functions.f{KIMI[2]}{{}}{KIMI[3]}"),  # no :index
    ("kimi_k2", f"{KIMI[0]}{KIMI[1]}functions.f:0{KIMI[2]}{{\"a\": [{DEEP}{KIMI[3]}"),
    ("glm45", "<tool_call>f\n<arg_key>a</arg_key>\n" + "<arg_value>" * 1000),
    ("glm45", "<tool_call>f\n<arg_key>a</arg_key>stray<arg_value>1</arg_value></tool_call>"),
    ("pythonic", "[f(a=__import__('os').system('true'))]"),  # never evaluated: not a literal
    ("pythonic", "[f(1, 2)]"),
    ("pythonic", "[f(a=float('nan'))]"),
    ("pythonic", "[f(a=1e999)]"),  # an infinity: no JSON
    ("pythonic", DEEP + "]" * N),
    ("pythonic", "[" + "f(a=1), " * (N // 8) + "g(a="),
    ("harmony", HARMONY_CALL + "{not json}<|call|>"),
    ("harmony", "<|channel|>analysis" + " " * N),  # a header that never ends
    ("harmony", HARMONY_CALL + DEEP),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("mode", "text"), NO_CALLS, ids=[f"{m}-{i}" for i, (m, _) in enumerate(NO_CALLS)])
def test_adversarial_output_stays_text(mode: str, text: str) -> None:
    parsed = parse_tool_calls(mode, text, tools=TOOLS)
    if mode == "harmony":  # its markup is read (the header), what holds no call is content
        assert parsed.tool_calls == () and parsed.content is not None
    else:
        assert parsed.tool_calls == () and parsed.content == text  # nothing dropped, nothing raised
    content, calls, stream = _stream(mode, [text[i:i + 3] for i in range(0, len(text), 3)])
    assert calls == [] and (content or None) == parsed.content
    assert stream.scanned <= 6 * max(len(text), 1000), stream.scanned  # linear, whatever the deltas


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["qwen3_coder", "deepseek_v31", "kimi_k2", "glm45"])
def test_many_calls_and_huge_arguments_in_linear_work(mode: str) -> None:
    one = {"qwen3_coder": "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
           "deepseek_v31": f"{DS_CALL}get_time{DS_SEP}{{}}{DS_CALL_END}",
           "kimi_k2": f"{KIMI[1]}functions.get_time:0{KIMI[2]}{{}}{KIMI[3]}",
           "glm45": "<tool_call>get_time\n</tool_call>"}[mode]
    head = {"deepseek_v31": DS_BEGIN, "kimi_k2": KIMI[0]}.get(mode, "")
    text = head + one * (N // len(one))
    content, calls, stream = _stream(mode, [text[i:i + 3] for i in range(0, len(text), 3)])
    assert len(calls) == N // len(one) and not content
    assert stream.scanned <= 6 * len(text), stream.scanned
    big = "x" * N
    huge = {"qwen3_coder": f"{QWEN_OPEN}{big}\n</parameter>\n</function>\n</tool_call>",
            "deepseek_v31": f"{DS_BEGIN}{DS_CALL}get_weather{DS_SEP}{{\"city\": \"{big}\"}}{DS_CALL_END}",
            "kimi_k2": f"{KIMI[0]}{KIMI[1]}functions.get_weather:0{KIMI[2]}{{\"city\": \"{big}\"}}{KIMI[3]}",
            "glm45": f"<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>{big}</arg_value></tool_call>"}[mode]
    _, calls, stream = _stream(mode, [huge[i:i + 3] for i in range(0, len(huge), 3)])
    assert [json.loads(a) for _, a in calls] == [{"city": big}]
    assert stream.scanned <= 6 * len(huge), stream.scanned


def test_text_after_a_bad_block_is_content_and_earlier_calls_stand() -> None:
    good = "<tool_call>get_time\n</tool_call>"
    bad = "<tool_call>\n<arg_value>x</tool_call> tail"
    parsed = parse_tool_calls("glm45", "Hi " + good + bad, tools=TOOLS)
    assert [c.name for c in parsed.tool_calls] == ["get_time"] and parsed.content == "Hi " + bad
    content, calls, _ = _stream("glm45", list("Hi " + good + bad))
    assert (content, [n for n, _ in calls]) == ("Hi " + bad, ["get_time"])


FRAGMENTS = {
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=get_weather>", "</function>", "<parameter=city>",
                    "</parameter>", "\n", "Oslo", "2", "<tool", "x"],
    "glm45": ["<tool_call>", "</tool_call>", "get_time", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
              "\n", "city", "1", "<", "x"],
    "deepseek_v3": [DS_BEGIN, DS_END, DS_CALL, DS_CALL_END, DS_SEP, "function", "get_time", "\n```json\n", "{}",
                    "\n```", "{", "x", "\n"],
    "deepseek_v31": [DS_BEGIN, DS_END, DS_CALL, DS_CALL_END, DS_SEP, "get_time", "{}", '{"a": "', "x", "\n"],
    "kimi_k2": [*KIMI, "functions.get_time:0", "{}", "x", "\n", "<|"],
    "pythonic": ["[", "]", "get_time(", ")", "a=1", ", ", "'s'", "x", " "],
    "harmony": ["<|start|>", "assistant", "<|channel|>", "analysis", "final", "commentary", " to=functions.get_time",
                "<|message|>", "<|end|>", "<|call|>", "<|return|>", "{}", "x", " "],
}


@pytest.mark.parametrize("mode", list(FRAGMENTS))
def test_random_fragments_stream_as_they_parse_whole(mode: str) -> None:
    """Whatever the model writes (random runs of the format's markers and bits), the stream's
    content and calls, in any split, are the whole text's."""
    rng = random.Random(f"fragments-{mode}")
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS[mode]) for _ in range(rng.randint(1, 14)))
        parsed = parse_tool_calls(mode, text, tools=TOOLS)
        want = (parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls])
        for deltas in (list(text), _splits(text, rng) if len(text) > 1 else [text]):
            content, calls, _ = _stream(mode, deltas)
            assert (content if content.strip() else None, calls) == want, (text, deltas)
