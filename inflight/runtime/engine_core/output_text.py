"""The one text path: detokenizing and stop strings for the engine's token-only outputs.

The engine core never makes text: its outputs carry each step's new token ids (``new_text`` is
empty) and it never stops on a stop string, which needs text. :class:`OutputText` keeps one
:class:`~inflight.runtime.engine_core.detokenizer.IncrementalDetokenizer` per request, fills in
each output's text delta, and ends a request at its stop string itself: the output is cut at
the token that completed the string and marked finished (``stop``), and the caller aborts the
request in the engine (:meth:`OutputText.process_step` names them). Every mode goes through
it: the server's front end (engine-core process or ``--single-process`` thread, which send
``Abort``; the core may already have computed one more token, dropped here, as is any output
that arrives for a request this side has finished) and the offline ``LLM``
(:func:`step_with_text`, which aborts in the engine between two steps). Stop strings end a
request whatever ``min_tokens`` says. Knows nothing about processes or HTTP.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inflight.runtime.engine_core.detokenizer import IncrementalDetokenizer
from inflight.runtime.outputs import RequestOutput
from inflight.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from inflight.runtime.core.engine import LLMEngine


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

    def process_step(self, outputs: Sequence[RequestOutput]) -> tuple[list[RequestOutput], tuple[str, ...]]:
        """One step's outputs with their text (those of requests finished here dropped), and
        the requests that ended at a stop string in them: the caller aborts those in the engine."""
        done, stopped = [], []
        for out in outputs:
            processed, stop_here = self.process(out)
            if processed is not None:
                done.append(processed)
            if stop_here:
                stopped.append(out.req_id)
        return done, tuple(stopped)


def step_with_text(engine: LLMEngine, text: OutputText) -> list[RequestOutput]:
    """One step of an engine in this process, its outputs through ``text`` (each request
    added to it first): a request that reached a stop string is aborted in the engine at once,
    as the front end's ``Abort`` does in a core (the offline ``LLM``; tests that read text)."""
    outputs, stopped = text.process_step(engine.step())
    for req_id in stopped:
        engine.abort_request(req_id)
    return outputs
