"""The scheduler's speculation and async-pipeline planning: which decodes carry drafts and which sit
a step out because the step in flight samples their last token.

With speculative decoding on, a decoding request whose parameters allow it (and while fewer than
``disable_by_batch_size`` requests run) speculates: its chunk is its last token plus up to
``num_speculative_tokens`` draft tokens, each costing one token of the budget and a KV slot, never
more than it could emit (the accepted drafts plus one token) or fit its context. N-gram drafts are
proposed here; a draft model's or an EAGLE-3 / MTP head's are proposed by the engine just before the
forward (the chunk says how many, and carries the drafter's context).

Under async scheduling a request's last token may be a placeholder (negative: the step in flight
samples it). Such a request never speculates (its drafts need the token) unless it drafts in
pipelined steps (:mod:`inflight.runtime.core.spec_pipeline`: a model drafter proposes on the
worker once the token is known there; its counts here are optimistic, so its drafts are capped
by ``max_tokens`` as if the step in flight's were all rejected, and the worker trims them to what
the synchronous engine would give: :func:`drafts_in_flight`), and one whose placeholder
is its last token of all (``max_tokens`` or the context length) sits the step out and finishes
when the step in flight is read. The pipeline asks :meth:`SpecPlanner.speculates` and
:meth:`SpecPlanner.may_draft` whether to let the step in flight finish first
(:mod:`inflight.runtime.core.async_steps`).

Imports no torch; knows nothing about the queues, the KV blocks or the budget (the scheduler's).
"""

from __future__ import annotations

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.request import Request, chunk_of, decode_chunk
from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.spec_decode.speculative import MODEL_METHODS, NgramIndex, parse_speculative_config


def drafts_cap(k: int, max_tokens: int, num_tokens: int, num_prompt_tokens: int, max_model_len: int) -> int:
    """``k`` drafts capped for a request of ``num_tokens`` tokens (its last one not computed yet):
    never more than it may still emit after one more token (``max_tokens``), nor than fit its
    context. The one rule, for the scheduler and for the worker's trim (core/spec_pipeline.py)."""
    return min(k, max_tokens - (num_tokens - num_prompt_tokens) - 1, max_model_len - num_tokens)


def drafts_in_flight(req: Request) -> int:
    """The drafts of ``req``'s step in flight (its trailing placeholders less one; 0 when that step
    does not speculate for it): its output count here may run ahead of the real one by up to as
    many, so its next drafts are capped as if all were rejected and the worker trims them to the
    real count (core/spec_pipeline.py)."""
    ids = req.token_ids
    last = ids[-1] if ids else 0
    if last >= 0:
        return 0
    n = 1
    while n < len(ids) and ids[-1 - n] == last:
        n += 1
    return n - 1


class SpecPlanner:
    """The speculation config of one engine and the per-request rules that read it."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config  # live: max_model_len is read at each call
        self.spec = parse_speculative_config(config.speculative_config)  # None: speculation off
        self.draft_context = self.spec is not None and self.spec.method in MODEL_METHODS  # a model drafter reads it

    def speculates(self, num_running: int) -> bool:
        """Whether a step with ``num_running`` running requests may speculate: speculation is on and
        fewer than ``disable_by_batch_size`` requests run."""
        return self.spec is not None and num_running < self.spec.disable_by_batch_size

    def may_draft(self, req: Request) -> bool:
        """Whether ``req``'s next decode may carry drafts as far as its own state goes (past its
        ``min_tokens``, room left under ``max_tokens`` and the context; see speculative_chunk)."""
        p, num_output = req.params, req.num_output_tokens
        return p.min_tokens <= num_output < p.max_tokens - 1 and req.num_tokens < (self.config.max_model_len or 0)

    def ends_in_flight(self, req: Request) -> bool:
        """Async scheduling: the token the step in flight samples for ``req`` is its last one
        (``max_tokens`` or the context length), so it sits this step out and finishes then."""
        if not req.awaits_token:
            return False
        max_len = self.config.max_model_len
        return req.num_output_tokens >= req.params.max_tokens or (max_len is not None and req.num_tokens >= max_len)

    def sits_out(self, req: Request) -> bool:
        """Whether running ``req`` gets no chunk this step as far as its own state goes: parked
        (its grammar's mask is being filled), in a pipeline step not yet back, or its placeholder is
        its last token (:meth:`ends_in_flight`)."""
        token_ids = req.token_ids
        return req.parked or req.in_flight or (bool(token_ids) and token_ids[-1] < 0 and self.ends_in_flight(req))

    def decode(self, req: Request) -> ScheduledChunk:
        """A plain decode's chunk (its last token), with what a model drafter reads beyond it when
        one drafts."""
        return chunk_of(req, 1, True, (), 0, True) if self.draft_context else decode_chunk(req)

    def speculative_chunk(self, req: Request, room: int) -> ScheduledChunk | None:
        """A decoding request's last token plus drafts (n-gram proposals, or room for the draft
        model's), at most ``room`` of them, never more than could be emitted (each step emits the
        accepted drafts plus one token) or fit its context; None when it does not speculate this step
        (speculation off, a placeholder last token, below ``min_tokens``, no room, no n-gram match)."""
        spec = self.spec
        if spec is None or (req.token_ids[-1] < 0 and not req.spec_pipelined):  # drafts need the token, but
            return None  # a model drafter's for a pipelined request: proposed on the worker (core/spec_pipeline.py)
        p = req.params
        if req.num_output_tokens < p.min_tokens:  # every parameter speculates; this state does not
            return None
        # capped as if the step in flight's drafts were all rejected (a pipelined request's count runs ahead)
        k = drafts_cap(min(spec.num_speculative_tokens, room), p.max_tokens + drafts_in_flight(req), req.num_tokens,
                       req.num_prompt_tokens, self.config.max_model_len or 0)  # fmt: skip
        if k <= 0:
            return None
        if spec.method in MODEL_METHODS:  # a draft model or an EAGLE-3 head fills them before the forward
            return chunk_of(req, 1 + k, True, num_model_drafts=k, draft_context=True)
        if req.token_ids[-1] < 0:  # pipelined: the worker proposes them once the token is known there
            return chunk_of(req, 1 + k, True, num_model_drafts=k)
        return self.ngram_chunk(req, k)

    def ngram_chunk(self, req: Request, k: int) -> ScheduledChunk | None:
        """``req``'s last token and up to ``k`` n-gram drafts from its tokens (None: no match)."""
        spec = self.spec
        assert spec is not None
        if req.ngram is None:
            req.ngram = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max)
        drafts = req.ngram.propose(req.token_ids, k)
        return chunk_of(req, 1 + len(drafts), True, tuple(drafts)) if drafts else None
