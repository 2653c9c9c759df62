"""Requests parked while their grammar's token mask is being filled.

A constrained row whose mask is not ready when its step samples is deferred (see
:mod:`inflight.runtime.worker.sampler`): its request keeps its blocks and its place among the running
requests but is not scheduled (``Request.parked``) until the fill is done; the position whose
logits were thrown away is recomputed then. So a slow grammar delays its own request, never
the step the other requests share. A fill that costs more than its deadline ends its request
with an error. A slow grammar's request is also parked right after each token, while its
grammar advances past the token and fills its next mask off the step; if the grammar ends
there (complete, or it refused the token) the request ends between steps. Knows nothing about the model or the sampler's internals.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Iterable

from inflight.runtime.core.output_processor import OutputProcessor
from inflight.runtime.core.request import Request, RequestStatus
from inflight.runtime.outputs import RequestOutput
from inflight.runtime.structured.manager import RequestMatcher
from inflight.runtime.structured.mask_fills import MASK_DEADLINE_S, MaskFill, MaskFiller

logger = logging.getLogger("inflight.engine")

IDLE_WAIT_S = 0.02  # with nothing but parked requests, how long a step waits for a mask


class ParkedRequests:
    """The parked requests of one engine, with the fills they wait for."""

    def __init__(self, outputs: OutputProcessor, masks: MaskFiller, vocab_size: int) -> None:
        """``outputs`` ends requests between steps and knows their matchers; ``masks`` fills."""
        self._outputs = outputs
        self._end = outputs.end
        self._masks = masks
        self._vocab_size = vocab_size
        self._parked: dict[str, tuple[Request, MaskFill]] = {}
        self.deadline_s = MASK_DEADLINE_S
        self.num_parked_total = 0  # rows deferred since start (a counter for stats and tests)

    def __len__(self) -> int:
        return len(self._parked)

    def is_parked(self, req_id: str) -> bool:
        """Whether ``req_id`` is held out of the steps now."""
        return req_id in self._parked

    def park(self, req: Request, matcher: RequestMatcher) -> None:
        """Hold ``req`` out of the steps until ``matcher``'s fill under way is done."""
        fill = matcher.fill
        assert isinstance(fill, MaskFill), "a parked request has a fill under way"
        req.parked = True
        self._parked[req.req_id] = (req, fill)
        self.num_parked_total += 1

    def discard(self, req_id: str) -> None:
        """Forget ``req_id`` (aborted)."""
        entry = self._parked.pop(req_id, None)
        if entry is not None:
            entry[0].parked = False

    def park_slow_grammars(self, req_ids: Iterable[str]) -> None:
        """After a step: a slow grammar advances past its new token in its next fill, started
        now, off the step; its request sits out until that fill is done (``req_ids``: the
        step's; those that finished in it are skipped)."""
        if not self._outputs.num_matchers:
            return
        for req_id in req_ids:
            req = self._outputs.request_of(req_id)
            if req is None or req.status is RequestStatus.FINISHED:
                continue
            matcher = self._outputs.matcher_of(req_id)
            if matcher is not None and matcher.pending_token is not None:
                self._masks.fill(matcher, self._vocab_size)
                self.park(req, matcher)

    def settle(self) -> list[RequestOutput]:
        """Unpark the requests whose mask is ready; end those whose grammar ended while it
        advanced (complete: ``stop``; refused the token: ``error``) or whose fill is past its
        deadline (``error``)."""
        outputs: list[RequestOutput] = []
        if not self._parked:
            return outputs
        self._masks.kick()  # replace retired fill threads while fills wait
        for req_id, (req, fill) in list(self._parked.items()):
            if req.status is RequestStatus.FINISHED or fill.done:
                req.parked = False
                del self._parked[req_id]
                out = self._ended(req, fill) if req.status is not RequestStatus.FINISHED else None
                if out is not None:
                    outputs.append(out)
            elif fill.cost_s() > self.deadline_s:
                del self._parked[req_id]
                req.parked = False
                reason = (f"its structured-output constraint took longer than {self.deadline_s:g} s to compute "
                          "the allowed tokens for one step, the most one request may take; simplify it")
                fill.matcher.fail(reason)
                logger.warning("request %s: a grammar mask is past its %.3g s deadline; ending it with an error",
                               req_id, self.deadline_s)
                out = self._end(req_id, "error", reason)
                if out is not None:
                    outputs.append(out)
        return outputs

    def _ended(self, req: Request, fill: MaskFill) -> RequestOutput | None:
        exc = fill.future.exception()
        if exc is not None:  # llguidance failed on this grammar: the request's error, not the step's
            logger.warning("request %s: its grammar failed while advancing: %s", req.req_id, exc)
            return self._end(req.req_id, "error", f"the output could not follow its structured-output constraint: {exc}")
        if fill.outcome == "refused":
            message = fill.matcher.error_message()
            return self._end(req.req_id, "error", f"the output could not follow its structured-output constraint: {message}")
        if fill.outcome == "stopped":
            return self._end(req.req_id, "stop", None)
        return None

    def wait(self, timeout: float = IDLE_WAIT_S) -> None:
        """Block until a parked request's mask is ready, or ``timeout`` (nothing else to run)."""
        futures = [fill.future for _, fill in self._parked.values()]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)
