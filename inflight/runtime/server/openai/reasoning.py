"""Reasoning (``<think>...</think>``) split from the answer, whole or streamed.

A reasoning model writes ``<think>`` reasoning ``</think>`` answer. Some templates open the
``<think>`` themselves in the generation prompt (then the output starts inside it). Text
before ``</think>`` becomes ``reasoning_content``; the rest is ``content``. An output that
never closes its ``</think>`` (cut by max_tokens) is all reasoning. This is what vLLM's
``deepseek_r1``, ``deepseek_v3``, ``qwen3``, ``glm45`` and ``kimi_k2`` reasoning parsers read;
gpt-oss's harmony channels (``openai_gptoss``) are split by ``tool_parsers.harmony`` instead. Pure
functions and a small state machine; knows nothing about HTTP or the engine.
"""

from __future__ import annotations

from inflight.runtime.server.openai.tool_calls import partial_marker_len

THINK_START, THINK_END = "<think>", "</think>"


def split_reasoning(text: str, starts_in_reasoning: bool) -> tuple[str | None, str]:
    """(reasoning or None when the output has none, content)."""
    if not starts_in_reasoning:
        stripped = text.lstrip()
        if not stripped.startswith(THINK_START):
            return None, text
        text = stripped[len(THINK_START):]
    end = text.find(THINK_END)
    if end < 0:
        return text, ""
    return text[:end], text[end + len(THINK_END):]


class ReasoningStream:
    """Feed text deltas; get (reasoning delta, content delta) so that the concatenations equal
    :func:`split_reasoning` of the whole text."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        self.state = "think" if starts_in_reasoning else "pending"
        self.buffer = ""

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        self.buffer += delta
        reasoning = ""
        if self.state == "pending":
            stripped = self.buffer.lstrip()
            if stripped.startswith(THINK_START):
                self.state, self.buffer = "think", stripped[len(THINK_START):]
            elif not finished and THINK_START.startswith(stripped):
                return "", ""  # whitespace or a partial "<think>": not known yet
            else:
                self.state = "content"
        if self.state == "think":
            end = self.buffer.find(THINK_END)
            if end >= 0:
                reasoning, self.buffer = self.buffer[:end], self.buffer[end + len(THINK_END):]
                self.state = "content"
            else:
                hold = 0 if finished else partial_marker_len(self.buffer, THINK_END)
                cut = len(self.buffer) - hold
                reasoning, self.buffer = self.buffer[:cut], self.buffer[cut:]
                return reasoning, ""
        content, self.buffer = self.buffer, ""
        return reasoning, content
