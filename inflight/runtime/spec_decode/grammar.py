"""Speculation for grammar-bound requests: the grammar's token mask at every draft position.

A speculating request's ``1 + k`` verification rows each need the mask of their own position:
row ``i`` the one after the drafts before it. :func:`draft_masks` advances the request's
matcher through the drafts the grammar allows, filling one mask row per position, and rolls it
back, so the matcher is as it was (the output processor then advances it past the tokens
actually emitted, as for any token). Rows after the first draft the grammar refuses get no
mask: that draft is not allowed by its own row's mask, so verification rejects it there and
never reads a later row (the refused draft stays in the verification, which keeps a draft
model's rejection sampling exact).

The masks are computed on the engine thread, so only a grammar that has been quick speculates
(:func:`plain_when_grammar_busy`): a slow grammar (``RequestMatcher.slow``), one with a mask
fill or a pending token under way on the mask workers, a failed one or one under an injected
stall runs as a plain decode, through the deferral path of
:mod:`inflight.runtime.structured.mask_fills`. A draft mask that costs more than the quick
grammars' bound marks the grammar slow, which ends its speculation from the next step. Knows
nothing about the model or scheduling policy.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import llguidance.numpy as llnp
import numpy as np

from inflight.runtime.core.sched_output import SchedulerOutput
from inflight.runtime.structured.manager import RequestMatcher
from inflight.runtime.structured.mask_fills import QUICK_AGAIN_S as QUICK_MASK_S


def speculates(matcher: RequestMatcher) -> bool:
    """Whether a grammar-bound request may speculate this step (see module docstring)."""
    return not (matcher.failed or matcher.slow or matcher.fill is not None
                or matcher.pending_token is not None or matcher.stall is not None)  # fmt: skip


def plain_when_grammar_busy(
    sched: SchedulerOutput, matcher_of: Callable[[str], RequestMatcher | None]
) -> SchedulerOutput:
    """``sched`` with each speculating chunk whose grammar (``matcher_of(req_id)``) may not
    speculate turned into a plain decode of its last token (the KV slots held for its drafts stay with the request,
    as a rejected draft's do)."""
    chunks = []
    for chunk in sched.chunks:
        matcher = matcher_of(chunk.req_id) if chunk.speculative else None
        if matcher is not None and not speculates(matcher):
            chunk = chunk._replace(num_tokens=1, draft_token_ids=(), num_model_drafts=0)
        chunks.append(chunk)
    if all(a is b for a, b in zip(chunks, sched.chunks, strict=True)):
        return sched
    return dataclasses.replace(sched, chunks=tuple(chunks),
                               num_batched_tokens=sum(c.num_tokens for c in chunks))  # fmt: skip


def draft_masks(matcher: RequestMatcher, drafts: tuple[int, ...], vocab_size: int) -> np.ndarray:
    """``[1 + n, words]`` int32: the masks of the verification rows ``0..n``, ``n`` the number
    of leading drafts the grammar allows and that leave it open (row ``i`` after
    ``drafts[:i]``; a draft that completes the grammar ends the request, so no row after it is
    emitted); the matcher is left as it was."""
    ll = matcher.matcher
    num_valid = ll.validate_tokens(list(drafts)) if drafts else 0
    bitmask = llnp.allocate_token_bitmask(1 + num_valid, vocab_size)
    num_rows = consumed = 0
    started = time.thread_time()
    try:
        llnp.fill_next_token_bitmask(ll, bitmask, 0)
        num_rows = 1
        for draft in drafts[:num_valid]:
            if not ll.consume_token(draft):
                raise RuntimeError(f"the grammar refused draft {draft}, which it had validated")
            consumed += 1
            if ll.is_stopped():
                break
            llnp.fill_next_token_bitmask(ll, bitmask, num_rows)
            num_rows += 1
    finally:
        if consumed and not ll.rollback(consumed):
            raise RuntimeError(f"the grammar could not roll back {consumed} draft token(s)")
    if time.thread_time() - started > QUICK_MASK_S * num_rows:
        matcher.slow = True  # costly masks: from the next step it decodes through the mask workers
    return bitmask[:num_rows]
