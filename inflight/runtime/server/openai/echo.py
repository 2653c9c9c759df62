"""Echo and prompt logprobs in response bodies (what evaluation harnesses read).

``echo`` on /v1/completions puts the prompt in front of each choice's text, and, with
``logprobs``, the prompt tokens in front of the legacy logprobs arrays (the first prompt token
has no context: ``None``), which is how lm-evaluation-harness's ``local-completions`` scores
loglikelihoods. ``prompt_logprobs`` (vLLM's field) adds per-choice (completions) or per-response
(chat) lists: ``None`` for the first token, then ``{token_id: {logprob, rank, decoded_token}}``
holding the prompt token (its rank in the whole vocabulary when it is not among the top
alternatives, as vLLM answers) and its top alternatives. Knows nothing about HTTP or the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from inflight.runtime.outputs import TokenLogprob
from inflight.runtime.server.openai.responses import LOGPROB_FLOOR, ChoiceState

TokenText = Callable[[int], str]


def _finite(lp: float) -> float:
    return lp if lp > LOGPROB_FLOOR else LOGPROB_FLOOR


def vllm_prompt_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText) -> list[dict[str, Any] | None]:
    out: list[dict[str, Any] | None] = [None]
    for entry in entries:
        ranks = {tid: rank for rank, (tid, _) in enumerate(entry.top, start=1)}
        item = {str(entry.token_id): {"logprob": _finite(entry.logprob), "rank": ranks.get(entry.token_id, entry.rank),
                                      "decoded_token": token_text(entry.token_id)}}
        for rank, (tid, lp) in enumerate(entry.top, start=1):
            item.setdefault(str(tid), {"logprob": _finite(lp), "rank": rank, "decoded_token": token_text(tid)})
        out.append(item)
    return out


def _echo_logprobs(
    prompt_ids: Sequence[int], entries: Sequence[TokenLogprob], output: dict[str, Any] | None, token_text: TokenText
) -> dict[str, Any]:
    tokens = [token_text(t) for t in prompt_ids]
    token_logprobs: list[float | None] = [None]
    tops: list[dict[str, float] | None] = [None]
    for entry in entries:
        top = {token_text(entry.token_id): _finite(entry.logprob)}
        for tid, lp in entry.top:
            top.setdefault(token_text(tid), _finite(lp))
        token_logprobs.append(_finite(entry.logprob))
        tops.append(top)
    offsets, offset = [], 0
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    output = output or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    return {
        "tokens": tokens + output["tokens"],
        "token_logprobs": token_logprobs + output["token_logprobs"],
        "top_logprobs": tops + output["top_logprobs"],
        "text_offset": offsets + [offset + o for o in output["text_offset"]],
    }


def select_best(
    body: dict[str, Any], choices: Sequence[ChoiceState], n: int, best_of: int, keep_logprobs: bool
) -> tuple[list[ChoiceState], list[int]]:
    """``best_of``: keep the ``n`` candidates of each prompt with the highest total logprob
    (vLLM's rule), renumbered; drop logprobs the client did not ask for. Returns the kept
    choices and the prompt index of each (usage still counts every candidate, as OpenAI bills)."""
    kept_states, kept_bodies, prompt_index = [], [], []
    for p in range(len(choices) // best_of):
        group = list(zip(choices[p * best_of:(p + 1) * best_of], body["choices"][p * best_of:(p + 1) * best_of],
                         strict=True))
        group.sort(key=lambda sc: -sum(e.logprob for e in sc[0].logprobs))
        for rank, (state, choice) in enumerate(group[:n]):
            choice["index"] = p * n + rank
            if not keep_logprobs:
                choice["logprobs"] = None
            kept_states.append(state)
            kept_bodies.append(choice)
            prompt_index.append(p)
    body["choices"] = kept_bodies
    return kept_states, prompt_index


def decorate_completion(
    body: dict[str, Any], choices: Sequence[ChoiceState], prompt_index: Sequence[int],
    prompt_ids: Sequence[Sequence[int]], prompt_texts: Sequence[str], echo: bool, want_prompt_logprobs: bool,
    token_text: TokenText,
) -> None:
    """Add echo and prompt logprobs to a /v1/completions body; ``prompt_index``: each choice's prompt."""
    for state, choice, p in zip(choices, body["choices"], prompt_index, strict=True):
        if echo:
            choice["text"] = prompt_texts[p] + choice["text"]
            if choice.get("logprobs") is not None:
                choice["logprobs"] = _echo_logprobs(prompt_ids[p], state.prompt_logprobs or (),
                                                    choice["logprobs"], token_text)
        if want_prompt_logprobs:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(state.prompt_logprobs or (), token_text)


def decorate_chat(body: dict[str, Any], choices: Sequence[ChoiceState], token_text: TokenText) -> None:
    """vLLM puts chat prompt logprobs on the response, once."""
    body["prompt_logprobs"] = vllm_prompt_logprobs(choices[0].prompt_logprobs or (), token_text) if choices else None
