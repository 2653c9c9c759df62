"""Build OpenAI response bodies and stream chunks from engine outputs.

Owns the response side of the OpenAI API: per-choice accumulation (``ChoiceState``), a
streamed choice's outputs held until they are sent (``HeldDelta``: merged text and logprobs),
completion / chat bodies, streaming chunks, ``usage`` and both logprobs layouts
(completions: ``tokens``/``token_logprobs``/``top_logprobs``/``text_offset``; chat:
``content: [{token, logprob, bytes, top_logprobs}]``). Knows nothing about HTTP or the
engine thread; token text comes from a callable the handler passes in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from inflight.runtime.outputs import RequestOutput, RequestTimes, TokenLogprob
from inflight.runtime.server.openai.chat_output import ChatOutputPlan, build_message

TokenText = Callable[[int], str]
LOGPROB_FLOOR = -9999.0  # JSON has no -inf; a token the sampler ruled out reports this


def _finite(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


class ChoiceState:
    """Everything one choice has produced so far (one engine request)."""

    def __init__(self, index: int, req_id: str) -> None:
        self.index = index
        self.req_id = req_id
        self.text_parts: list[str] = []
        self.num_chars = 0
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.times: RequestTimes | None = None
        self.last_token_at: float | None = None  # time.monotonic() of the latest delta
        self.prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # prompt tokens 1.., when asked
        self.stop_reason: str | None = None  # the stop string that ended it (RequestOutput.stop_reason)

    def add(self, out: RequestOutput) -> None:
        if out.stop_reason is not None:
            self.stop_reason = out.stop_reason
        self.text_parts.append(out.new_text)
        self.num_chars += len(out.new_text)
        if out.new_logprobs:
            self.logprobs.extend(out.new_logprobs)
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_output_tokens = out.num_output_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.times is not None:
            self.times = out.times
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason = out.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


LogprobPart = tuple[Sequence[TokenLogprob], int]  # one output's logprobs and its text offset


class HeldDelta:
    """One streamed choice's outputs taken from the engine but not sent yet, merged in order:
    their text, logprobs (per output, with the output's text offset), token count and the last
    one's finish (``--stream-interval``, or a reader that fell behind)."""

    __slots__ = ("text_parts", "logprob_parts", "num_tokens", "finished", "finish_reason", "sent_first")

    def __init__(self) -> None:
        self.text_parts: list[str] = []
        self.logprob_parts: list[LogprobPart] = []
        self.num_tokens = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.sent_first = False  # a chunk of this choice went out (its first token is never held)

    def add(self, out: RequestOutput, start_offset: int) -> None:
        """Hold ``out``; ``start_offset``: the choice's text length before it."""
        if out.new_text:
            self.text_parts.append(out.new_text)
        if out.new_logprobs:
            self.logprob_parts.append((out.new_logprobs, start_offset))
        self.num_tokens += len(out.new_token_ids)
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason

    def is_due(self, interval: int) -> bool:
        """Send now: the last output, the first token, or ``interval`` tokens held."""
        return self.finished or self.num_tokens >= interval or (self.num_tokens > 0 and not self.sent_first)

    @property
    def text(self) -> str:
        parts = self.text_parts
        return parts[0] if len(parts) == 1 else "".join(parts)

    @property
    def logprob_entries(self) -> list[TokenLogprob]:
        return [entry for entries, _ in self.logprob_parts for entry in entries]

    def taken(self, sent: bool) -> None:
        """The held outputs were turned into a chunk (``sent``) or found to say nothing yet (their
        text, if any, went into a parser); their tokens still count towards the next chunk then."""
        self.text_parts.clear()
        self.logprob_parts.clear()
        if sent:
            self.num_tokens = 0
            self.sent_first = True


def usage(prompt_lens: Sequence[int], choices: Sequence[ChoiceState]) -> dict[str, int]:
    """OpenAI usage: each prompt counted once (not once per choice), every choice's output."""
    prompt_tokens = sum(prompt_lens)
    completion_tokens = sum(c.num_output_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(
    entries: Sequence[TokenLogprob], token_text: TokenText, start_offset: int
) -> dict[str, Any]:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = start_offset
    for entry in entries:
        text = token_text(entry.token_id)
        tokens.append(text)
        token_logprobs.append(_finite(entry.logprob))
        top = {text: _finite(entry.logprob)}
        for token_id, logprob in entry.top:
            top.setdefault(token_text(token_id), _finite(logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for entry in entries:
        row = item(entry.token_id, entry.logprob)
        row["top_logprobs"] = [item(t, lp) for t, lp in entry.top]
        content.append(row)
    return {"content": content}


def completion_body(
    meta: dict[str, Any],
    choices: Sequence[ChoiceState],
    prompt_lens: Sequence[int],
    token_text: TokenText | None,
) -> dict[str, Any]:
    """The non-streaming /v1/completions body. ``meta``: id, created, model."""
    return {
        **meta,
        "object": "text_completion",
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": completion_logprobs(c.logprobs, token_text, 0) if token_text else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage(prompt_lens, choices),
    }


def chat_body(
    meta: dict[str, Any],
    choices: Sequence[ChoiceState],
    prompt_lens: Sequence[int],
    token_text: TokenText | None,
    plan: ChatOutputPlan | None = None,
) -> dict[str, Any]:
    """The non-streaming /v1/chat/completions body. ``plan``: how to split reasoning and
    parse tool calls out of the text (None: the text is the content)."""
    bodies = []
    for c in choices:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        finish = c.finish_reason
        if plan is not None:
            message, finish = build_message(plan, c.text, finish)
        bodies.append({
            "index": c.index,
            "message": message,
            "logprobs": chat_logprobs(c.logprobs, token_text) if token_text else None,
            "finish_reason": finish,
        })
    return {**meta, "object": "chat.completion", "choices": bodies, "usage": usage(prompt_lens, choices)}


def completion_delta(
    index: int,
    text: str,
    logprob_parts: Sequence[LogprobPart],
    token_text: TokenText | None,
    finish_reason: str | None,
) -> dict[str, Any]:
    """A streamed completion choice: ``text`` and the logprobs of one or more outputs, each
    part's ``text_offset`` counted from its output's own start (as if sent one by one)."""
    logprobs = None
    if token_text is not None:
        if len(logprob_parts) == 1:
            logprobs = completion_logprobs(logprob_parts[0][0], token_text, logprob_parts[0][1])
        else:
            logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for entries, start_offset in logprob_parts:
                for key, values in completion_logprobs(entries, token_text, start_offset).items():
                    logprobs[key].extend(values)
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_delta(
    index: int, delta: dict[str, Any], finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A streamed chat choice (the chunk around it: :class:`~.streaming.ChunkFormat`)."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def usage_chunk(meta: dict[str, Any], obj: str, usage_counts: dict[str, int]) -> dict[str, Any]:
    """The final chunk of a stream with ``stream_options.include_usage``: no choices."""
    return {**meta, "object": obj, "choices": [], "usage": usage_counts}


def cached_token_text(decode: TokenText) -> TokenText:
    """``decode`` with a cache: a token's text is looked up once per request."""
    cache: dict[int, str] = {}

    def token_text(token_id: int) -> str:
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = decode(token_id)
        return text

    return token_text
