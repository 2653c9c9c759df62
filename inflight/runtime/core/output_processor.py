"""OutputProcessor: each request's output state, and a step's sampled tokens made into outputs.

Owns one :class:`RequestOutputState` per live request (its random generator, its grammar
matcher, the logprobs not sent yet and the prompt logprobs collected so far) and the
engine-wide token counts. Each step the engine hands it the tokens it sampled
(:meth:`OutputProcessor.process`); the processor appends them to their requests, applies the
stop rules on token ids (EOS and stop tokens once ``min_tokens`` is reached, ``max_tokens``,
``max_model_len``, the end of a grammar), finishes requests with their reason and builds one
:class:`RequestOutput` delta per request. A request whose tokens cannot be appended finishes
with ``finish_reason == "error"`` while the others go on.

Token ids only: outputs carry no text (``new_text == ""``) and stop strings are not looked
for here. Text and stop strings have one home whatever the mode, the offline ``LLM``
included: :class:`~inflight.runtime.engine_core.output_text.OutputText`, whose caller aborts
a request that reached its stop string.

Knows nothing about the model, the layout of the logits or scheduling policy: a finished
request goes to the ``release`` callback (the scheduler frees its blocks), and a speculating
request's computed count moves through the caller's ``advance``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from inflight.runtime.core.prompt_logprobs import span_logprobs
from inflight.runtime.core.request import Request, RequestStatus
from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.core.tenant_stats import TenantMeter
from inflight.runtime.outputs import EngineFatalError, RequestOutput, RequestTimes, TokenLogprob
from inflight.runtime.structured.manager import RequestMatcher
from inflight.runtime.structured.mask_fills import MIN_GRACE_S as SLOW_ADVANCE_S
from inflight.runtime.worker.penalty_state import RequestPenalties
from inflight.runtime.worker.sampler import SamplingRow

logger = logging.getLogger("inflight.engine")


@dataclass(slots=True)
class SampledTokens:
    """What one chunk emitted this step: one token, or a speculating chunk's accepted drafts
    plus one, each with its logprob entry (None when the request asks for none). Read-only by
    convention, not frozen (one per row per step; a frozen ``__init__`` costs four times as much)."""

    chunk: ScheduledChunk
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob | None, ...]


class RequestOutputState:
    """Per-request engine-side state that is not scheduling state."""

    __slots__ = ("request", "generator", "matcher", "pending_logprobs", "prompt_logprobs",
                 "prompt_logprobs_sent", "penalties")  # fmt: skip

    def __init__(
        self, request: Request, generator: torch.Generator | None, matcher: RequestMatcher | None = None,
    ) -> None:
        self.request = request
        self.generator = generator
        self.matcher = matcher  # structured outputs: advanced once per accepted output token
        self.pending_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob] = []  # prompt tokens 1.. (token 0 has no context)
        self.prompt_logprobs_sent = False
        self.penalties = RequestPenalties() if request.params.needs_penalties else None  # released in _finish


class OutputProcessor:
    """See module docstring."""

    def __init__(
        self, eos_token_ids: tuple[int, ...], max_model_len: int, release: Callable[[Request], None],
        count_tenants: bool = False, metrics_tenants: tuple[str, ...] = (),
    ) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._release = release
        self._states: dict[str, RequestOutputState] = {}
        self.num_matchers = 0  # live requests with a grammar (none: no grammar work per step)
        self._count_tenants = count_tenants
        self._metrics_tenants = metrics_tenants  # the tenants counted under their own names
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.tenants = TenantMeter(metrics_tenants) if count_tenants else None

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._states

    def reset_counts(self) -> None:
        """Forget the token counts (after the warm-up)."""
        self.num_prompt_tokens = self.num_generation_tokens = 0
        self.tenants = TenantMeter(self._metrics_tenants) if self._count_tenants else None

    # -- requests ---------------------------------------------------------------------
    def add(self, req: Request, generator: torch.Generator | None, matcher: RequestMatcher | None) -> None:
        """Start keeping ``req``'s output state."""
        self._states[req.req_id] = RequestOutputState(req, generator, matcher)
        if matcher is not None:
            self.num_matchers += 1

    def request_of(self, req_id: str) -> Request | None:
        """The live request ``req_id`` (None once it has finished)."""
        state = self._states.get(req_id)
        return None if state is None else state.request

    def sampling_row(self, req_id: str) -> SamplingRow:
        """What the sampler needs to know about live request ``req_id`` this step."""
        state = self._states[req_id]
        req = state.request
        return SamplingRow(req.params, req.prompt_token_ids, req.output_token_range(), state.generator,
                           self.eos_token_ids, state.matcher, state.penalties)  # fmt: skip

    def collect_prompt_logprobs(self, req_id: str, first: int, logits: torch.Tensor) -> None:
        """Record live request ``req_id``'s prompt logprobs from ``logits`` (``[count, vocab]``, positions
        ``first ..``). Only positions not collected yet are kept, so a recompute (or a retried
        step) adds nothing twice."""
        state = self._states[req_id]
        req, collected = state.request, state.prompt_logprobs
        if first + logits.shape[0] > len(collected) >= first:
            entries = span_logprobs(logits, req.prompt_token_ids, first, req.params.prompt_logprobs or 0)
            collected.extend(entries[len(collected) - first :])

    def finish(self, req_id: str, reason: str, error: str | None = None) -> RequestOutput | None:
        """Finish a live request now (``abort``, ``error`` with its message): its last output,
        or None if unknown."""
        state = self._states.get(req_id)
        return None if state is None else self._finish(state, reason, (), error)

    def finish_pooled(self, req: Request, pooled: bytes) -> RequestOutput:
        """A pooling request's prompt is computed: its one output, finished (``stop``), carrying
        ``pooled`` (:attr:`RequestOutput.pooled`); its prompt tokens counted as a first token's are."""
        req.first_token_time = time.monotonic()
        self.num_prompt_tokens += req.num_prompt_tokens
        if self.tenants is not None:
            self.tenants.count(req.tenant, req.num_prompt_tokens, 0)
        return dataclasses.replace(self._finish(self._states[req.req_id], "stop", ()), pooled=pooled)

    def end(self, req_id: str, reason: str, error: str | None = None) -> RequestOutput | None:
        """End a live request between steps (its grammar completed, failed or ran out of
        time); None if unknown."""
        state = self._states.get(req_id)
        return None if state is None else self._output_after(state, (), reason, error)

    def matcher_of(self, req_id: str) -> RequestMatcher | None:
        """Live request ``req_id``'s grammar state (None for a free request)."""
        return self._states[req_id].matcher

    # -- one step ---------------------------------------------------------------------
    def process(
        self, sampled: Sequence[SampledTokens], failed: Sequence[str],
        advance: Callable[[ScheduledChunk, int], None],
    ) -> list[RequestOutput]:
        """One step's outputs: an ``error`` one for each request id in ``failed``, then one for
        each chunk in ``sampled``. ``advance(chunk, n)`` moves a speculating chunk that is still
        running once its tokens are in: it computed one position per token it emitted (its
        last known token and the drafts it kept; the new one is computed next step)."""
        outputs = [self._finish(self._states[req_id], "error", ()) for req_id in failed]
        now = time.monotonic()
        states = self._states
        for item in sampled:
            state = states[item.chunk.req_id]
            req = state.request
            try:
                out = self._append_tokens(state, req, item.token_ids, item.logprobs, now)
                if item.chunk.draft_token_ids and req.status is RequestStatus.RUNNING:
                    advance(item.chunk, len(item.token_ids))
            except EngineFatalError:
                raise
            except Exception:
                logger.exception("request %s failed while appending its token", req.req_id)
                out = self._finish(state, "error", ())
            outputs.append(out)
        return outputs

    def _append_tokens(
        self, state: RequestOutputState, req: Request, token_ids: tuple[int, ...],
        logprobs: tuple[TokenLogprob | None, ...], now: float,
    ) -> RequestOutput:
        """Append the step's tokens (one, or a speculating request's accepted drafts plus one)
        until one of them finishes the request; one output for all of them."""
        first = req.first_token_time is None
        if first:
            req.first_token_time = now
            self.num_prompt_tokens += req.num_prompt_tokens
        reason = error = None
        matcher = state.matcher
        if matcher is None and len(token_ids) == 1 == len(logprobs):  # a plain decode: one token, no grammar
            token_id, logprob = token_ids[0], logprobs[0]
            req.token_ids.append(token_id)
            if logprob is not None:
                state.pending_logprobs.append(logprob)
            self.num_generation_tokens += 1
            if self.tenants is not None:
                self.tenants.count(req.tenant, req.num_prompt_tokens if first else 0, 1)
            reason = self._stop_reason(req, token_id)
            if reason is None:
                return self._delta(state, tuple(token_ids), None)
            return self._finish(state, reason, tuple(token_ids))
        num_new = 0
        for token_id, logprob in zip(token_ids, logprobs, strict=True):
            req.token_ids.append(token_id)
            num_new += 1
            if logprob is not None:
                state.pending_logprobs.append(logprob)
            reason = self._stop_reason(req, token_id)
            if matcher is not None and matcher.slow and reason is None and len(token_ids) == 1:
                matcher.pending_token = token_id  # a slow grammar advances off the step, in its next fill
            elif matcher is not None:
                error = _grammar_error(req, matcher, token_id)
                if error is not None:
                    reason = "error"
                elif matcher.is_finished:
                    reason = "stop"
            if reason is not None:
                break
        self.num_generation_tokens += num_new
        new_ids = tuple(token_ids) if num_new == len(token_ids) else tuple(token_ids[:num_new])
        if self.tenants is not None:
            self.tenants.count(req.tenant, req.num_prompt_tokens if first else 0, num_new)
        if reason is None:
            return self._delta(state, new_ids, None)
        return self._finish(state, reason, new_ids, error)

    def _output_after(
        self, state: RequestOutputState, new_ids: tuple[int, ...], reason: str | None, error: str | None
    ) -> RequestOutput:
        if reason is None:
            return self._delta(state, new_ids, None)
        return self._finish(state, reason, new_ids, error)

    def _stop_reason(self, req: Request, token_id: int) -> str | None:
        p = req.params
        num_tokens = len(req.token_ids)
        num_output = num_tokens - len(req.prompt_token_ids)
        if num_output >= p.min_tokens:
            if not p.ignore_eos and token_id in self.eos_token_ids:
                return "stop"
            if p.stop_token_ids and token_id in p.stop_token_ids:
                return "stop"
        if num_output >= p.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return None

    # -- outputs ----------------------------------------------------------------------
    def _finish(
        self, state: RequestOutputState, reason: str, new_ids: tuple[int, ...], error: str | None = None
    ) -> RequestOutput:
        """Release ``state``'s request with ``reason``, forget it, and return its last output."""
        req = state.request
        self._release(req)
        req.finish_reason = reason
        times = RequestTimes(req.arrival_time, req.first_scheduled_time, req.first_token_time, time.monotonic())
        out = self._delta(state, new_ids, times, error)
        del self._states[req.req_id]
        if state.penalties is not None:
            state.penalties.release()
        if state.matcher is not None:
            self.num_matchers -= 1
        return out

    def _delta(
        self, state: RequestOutputState, new_ids: tuple[int, ...], times: RequestTimes | None,
        error: str | None = None,
    ) -> RequestOutput:
        """The output since the last one (token ids, no text); ``times`` is set once the request
        has finished."""
        req, finished = state.request, times is not None
        params = req.params
        num_prompt = len(req.prompt_token_ids)
        logprobs = None
        if params.logprobs is not None:
            logprobs = tuple(state.pending_logprobs)
            state.pending_logprobs.clear()
        elif state.pending_logprobs:
            state.pending_logprobs.clear()
        if not finished and logprobs is None and params.prompt_logprobs is None:
            # A running request's delta without logprobs: the row most steps make, built from
            # positional fields (keywords cost ~0.4 us a row more).
            return RequestOutput(req.req_id, new_ids, "", False, None, num_prompt, len(req.token_ids) - num_prompt,
                                 req.num_cached_tokens)  # fmt: skip
        prompt_logprobs = None
        if params.prompt_logprobs is not None and not state.prompt_logprobs_sent and (new_ids or finished):
            prompt_logprobs, state.prompt_logprobs_sent = tuple(state.prompt_logprobs), True
        return RequestOutput(
            req_id=req.req_id, new_token_ids=new_ids, new_text="", finished=finished,
            finish_reason=req.finish_reason if finished else None, num_prompt_tokens=num_prompt,
            num_output_tokens=len(req.token_ids) - num_prompt, num_cached_tokens=req.num_cached_tokens,
            new_logprobs=logprobs, times=times, prompt_logprobs=prompt_logprobs, error=error,
        )


def _grammar_error(req: Request, matcher: RequestMatcher, token_id: int) -> str | None:
    """Advance ``req``'s grammar past ``token_id``; why the request cannot go on, or None.

    Called once per accepted token, never for tokens recomputed after a preemption. A token
    the grammar refuses (the matcher hit an internal limit, e.g. llguidance's row limit on a
    very large choice list, so no mask constrained the draw) ends the request with an error:
    output that does not match the constraint must never finish as ``stop``.
    """
    started = time.thread_time()
    accepted = matcher.accept(token_id)
    if time.thread_time() - started > SLOW_ADVANCE_S:
        matcher.slow = True  # later tokens advance it off the step (mask_fills)
    if accepted:
        return None
    message = matcher.error_message()
    logger.warning("request %s: token %d does not match its grammar (%s); ending it with an error",
                   req.req_id, token_id, message)
    return f"the output could not follow its structured-output constraint: {message}"
