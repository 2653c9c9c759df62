"""The tool-call parsers on adversarial model output (a model can be steered to write anything,
e.g. by a regex constraint next to ``tools``): linear time and no exceptions. The old Hermes
pattern backtracked quadratically over a run of whitespace, and JSON nested deep enough made
``json.loads`` raise ``RecursionError`` (a 500, or an error event mid-stream). The timeouts
are hang guards, far above the milliseconds these take; they measure nothing."""

from __future__ import annotations

import pytest

from inflight.runtime.server.openai.tool_calls import parse_tool_calls

SPACES = " " * 100_000
DEEP = "[" * 100_000
ADVERSARIAL = [
    ("hermes", "<tool_call>x" + SPACES + "y"),
    ("hermes", "<tool_call>" + SPACES + "<tool_call>" + SPACES),
    ("hermes", "<tool_call>" + DEEP),
    ("hermes", '<tool_call>{"name": "f", "arguments": "' + DEEP + '"}</tool_call>'),
    ("llama3", "{" * 100_000),
    ("llama3", '{"name": "f", "parameters": ' + DEEP),
    ("mistral", "[TOOL_CALLS]" + DEEP),
    ("mistral", "[TOOL_CALLS]f" + SPACES + "[ARG"),
    ("required", DEEP),
]


@pytest.mark.timeout(20)
@pytest.mark.parametrize(("mode", "text"), ADVERSARIAL, ids=[f"{m}-{i}" for i, (m, _) in enumerate(ADVERSARIAL)])
def test_adversarial_output_stays_text(mode: str, text: str) -> None:
    parsed = parse_tool_calls(mode, text)
    assert parsed.tool_calls == () and parsed.content == text  # nothing dropped, nothing raised


def test_hermes_blocks_still_parse_after_the_rewrite() -> None:
    text = 'Sure.<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "b", "arguments": {}}'
    parsed = parse_tool_calls("hermes", text)
    assert parsed.content == "Sure."
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("a", '{"x":1}'), ("b", "{}")]  # compact
