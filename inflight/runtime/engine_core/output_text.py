"""Text for token-only engine outputs: detokenizing and stop strings, outside the engine core.

An engine core started with ``detokenize=False`` sends each step's new token ids with no text
(and never stops on a stop string, which needs text). :class:`OutputText`, in the front end,
keeps one :class:`~inflight.runtime.core.detokenizer.IncrementalDetokenizer` per request, fills in
each output's text delta, and ends a request at its stop string itself: the output is cut at
the token that completed the string and marked finished (``stop``), and the caller aborts
the request in the core, which may already have computed one more token (dropped here, as is
any output that arrives for a request this side has finished). Stop strings end a request
whatever ``min_tokens`` says, as in the engine. Knows nothing about processes or HTTP.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from inflight.runtime.core.detokenizer import IncrementalDetokenizer
from inflight.runtime.outputs import RequestOutput
from inflight.runtime.sampling_params import SamplingParams


@dataclass(slots=True)
class _Text:
    detok: IncrementalDetokenizer
    num_output_tokens: int = 0


class OutputText:
    """Per-request text state for one engine's outputs (touched from one thread)."""

    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._requests: dict[str, _Text] = {}

    def add(self, req_id: str, params: SamplingParams) -> None:
        skip = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        self._requests[req_id] = _Text(IncrementalDetokenizer(self.tokenizer, params.stop, skip))

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._requests)

    def process(self, out: RequestOutput) -> tuple[RequestOutput | None, bool]:
        """(``out`` with its text, or None for a request already finished here; True when
        this output ends the request at a stop string, so the core must be told to abort it)."""
        state = self._requests.get(out.req_id)
        if state is None:
            return None, False
        detok = state.detok
        kept = len(out.new_token_ids)
        stopped = False
        for i, token_id in enumerate(out.new_token_ids):
            if detok.append(token_id):
                kept, stopped = i + 1, True
                break
        state.num_output_tokens += kept
        finished = out.finished or stopped
        if finished:
            detok.flush()
            del self._requests[out.req_id]
        changes: dict[str, Any] = {"new_text": detok.take_delta(finished),
                                   "num_output_tokens": state.num_output_tokens}  # fmt: skip
        if stopped:
            logprobs = out.new_logprobs[:kept] if out.new_logprobs is not None else None
            changes.update(new_token_ids=out.new_token_ids[:kept], finished=True, finish_reason="stop",
                           error=None, new_logprobs=logprobs)  # fmt: skip
        return dataclasses.replace(out, **changes), stopped and not out.finished
