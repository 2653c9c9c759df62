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
(:func:`step_with_text`, which aborts in the engine between two steps). The front end reads a
step's outputs straight from the columns of its :class:`~.protocol.StepDone`
(:meth:`OutputText.process_step_done`), building each output once, with its text. Stop strings
end a request whatever ``min_tokens`` says. Knows nothing about processes or HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inflight.runtime.engine_core.detokenizer import IncrementalDetokenizer, stream_decoding
from inflight.runtime.engine_core.protocol import StepDone, logprobs_from_plain, times_from_plain
from inflight.runtime.outputs import RequestOutput, RequestTimes, TokenLogprob
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
        self._stream = stream_decoding(tokenizer)  # chosen once for the tokenizer

    def add(self, req_id: str, params: SamplingParams) -> None:
        skip = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        self._requests[req_id] = _Text(IncrementalDetokenizer(self.tokenizer, params.stop, skip, self._stream,
                                                              params.skip_special_tokens))

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
        return self._row(state, out.req_id, out.new_token_ids, out.num_prompt_tokens, out.num_cached_tokens,
                         out.finished, out.finish_reason, out.new_logprobs, out.times, out.prompt_logprobs,
                         out.error, out.pooled)  # fmt: skip

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

    def process_step_done(self, step: StepDone) -> tuple[list[RequestOutput], tuple[str, ...]]:
        """:meth:`process_step` of ``step.outputs()``, read from the message's columns: each
        output is built once, with its text."""
        done: list[RequestOutput] = []
        stopped: list[str] = []
        requests, extras = self._requests, step.extras
        rows = zip(step.req_ids, step.new_token_ids, step.num_prompt_tokens, step.num_cached_tokens, strict=True)
        for i, (req_id, token_ids, num_prompt, num_cached) in enumerate(rows):
            state = requests.get(req_id)
            if state is None:
                continue
            extra = extras.get(i) if extras else None
            if extra is None and len(token_ids) == 1:  # the common row: a running request's next token
                detok = state.detok
                state.num_output_tokens += 1
                if not detok.append(token_ids[0]):
                    done.append(RequestOutput(req_id, token_ids, detok.take_delta(False), False, None, num_prompt,
                                              state.num_output_tokens, num_cached))  # fmt: skip
                    continue
                detok.flush()  # that token completed a stop string
                del requests[req_id]
                stopped.append(req_id)
                done.append(RequestOutput(req_id, token_ids, detok.take_delta(True), True, "stop", num_prompt,
                                          state.num_output_tokens, num_cached, stop_reason=detok.stop_hit))  # fmt: skip
                continue
            if extra is None:  # a running request's next tokens (several: speculative decoding)
                out, stop_here = self._row(state, req_id, token_ids, num_prompt, num_cached, False, None, None,
                                           None, None, None)  # fmt: skip
            else:
                finished, reason, _, plain_logprobs, times, prompt_logprobs, error, pooled = extra
                out, stop_here = self._row(state, req_id, token_ids, num_prompt, num_cached, finished, reason,
                                           logprobs_from_plain(plain_logprobs), times_from_plain(times),
                                           logprobs_from_plain(prompt_logprobs), error, pooled)  # fmt: skip
            done.append(out)
            if stop_here:
                stopped.append(req_id)
        return done, tuple(stopped)

    def _row(
        self, state: _Text, req_id: str, token_ids: tuple[int, ...], num_prompt: int, num_cached: int,
        finished: bool, reason: str | None, logprobs: tuple[TokenLogprob, ...] | None, times: RequestTimes | None,
        prompt_logprobs: tuple[TokenLogprob, ...] | None, error: str | None, pooled: bytes | None = None,
    ) -> tuple[RequestOutput, bool]:
        """One row's output with its text, cut at a stop string; and True when that stop string
        ended a request the core still runs (the caller aborts it there)."""
        text, kept, stop_here = self._advance(state, req_id, token_ids, finished)
        if stop_here:
            token_ids, reason, error = token_ids[:kept], "stop", None
            logprobs = logprobs[:kept] if logprobs is not None else None
        return RequestOutput(req_id, token_ids, text, finished or stop_here, reason, num_prompt,
                             state.num_output_tokens, num_cached, logprobs, times, prompt_logprobs,
                             error, pooled, state.detok.stop_hit if stop_here else None), stop_here and not finished  # fmt: skip

    def _advance(self, state: _Text, req_id: str, token_ids: tuple[int, ...], finished: bool) -> tuple[str, int, bool]:
        """Feed a row's tokens: (its text delta, how many tokens it keeps, whether a stop string
        ended it). A request that ends here (finished, or stopped) is forgotten."""
        detok = state.detok
        kept, stopped = len(token_ids), False
        for i, token_id in enumerate(token_ids):
            if detok.append(token_id):
                kept, stopped = i + 1, True
                break
        state.num_output_tokens += kept
        if finished or stopped:
            detok.flush()
            del self._requests[req_id]
            return detok.take_delta(True), kept, stopped
        return detok.take_delta(False), kept, False


def step_with_text(engine: LLMEngine, text: OutputText) -> list[RequestOutput]:
    """One step of an engine in this process, its outputs through ``text`` (each request
    added to it first): a request that reached a stop string is aborted in the engine at once,
    as the front end's ``Abort`` does in a core (the offline ``LLM``; tests that read text)."""
    outputs, stopped = text.process_step(engine.step())
    for req_id in stopped:
        engine.abort_request(req_id)
    return outputs
