"""What the scheduler hands on for one step: the chunks to run and who was admitted or preempted.

A leaf: the worker, the drafters and the output processor import these types from here, not
from the scheduler, so the device side depends on the step's plan and not on how it was made
(tests/test_import_graph.py). A :class:`ScheduledChunk` is plain data, a copy of what the
runner and the drafters read (the request's id, the chunk's position and token ids, its block
table, its sample flag and drafts), never the live :class:`Request`: the device side cannot
write a request, and what the drafters learn that the core must know (the draft model's KV
lag) goes back as a result the engine applies. What stays fixed while a request runs (its
prompt length, prompt-logprob count, LoRA load, images) is made once at its admission
(:class:`RequestFacts`, vLLM's ``NewRequestData``) and shared by all its chunks, so a step
copies per row only what changes: its position, its new token ids and its block table (a tuple
the request remakes only when a block is added; with per-group KV tables, every group's, in
``group_tables``: :mod:`.kv_groups`). :class:`SchedulerOutput` itself is the core's:
it carries the admitted and preempted requests, which the device side never reads. :class:`KVCopies`
are the step's block copies between the device KV pool and the host tier (:mod:`.host_tier`),
which the worker runs before the step's forward. Imports nothing at run time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from inflight.runtime.core.request import Request
    from inflight.runtime.multimodal.inputs import MultimodalInputs


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class RequestFacts:
    """What the device side may know of a request for one stay in the running set: made at
    each admission (a preempted request gets new facts when it boards again, so a drafter's
    state kept by its facts, weakly, is dropped with the stay it belongs to). Compared by identity."""

    req_id: str
    num_prompt_tokens: int
    prompt_logprobs: int | None  # SamplingParams.prompt_logprobs
    lora_load_id: int | None = None  # its LoRA adapter's load id (None: the base model)
    mm_inputs: MultimodalInputs | None = None  # a vision-language request's images (multimodal/inputs.py)
    max_tokens: int | None = None  # SamplingParams.max_tokens: the worker caps a pipelined step's drafts by it


@dataclass(frozen=True, slots=True)
class DraftContext:
    """What a model drafter reads beyond a chunk's own tokens (only set with draft-model or
    EAGLE-3 speculation): the tokens just before the chunk whose drafter KV is not written yet
    (``Request.draft_kv_lag`` of them), and the known token after the chunk's last position."""

    lagging_ids: tuple[int, ...]  # the tokens at positions start - len(lagging_ids) .. start - 1
    next_token_id: int | None  # the token at start + num_tokens (None: not known yet, or speculating)


class ScheduledChunk(NamedTuple):
    """``num_tokens`` positions of request ``req_id`` from position ``start``, as plain data.

    ``token_ids`` are the known tokens it feeds: ``num_tokens`` of them, or for a speculating
    chunk its last known token alone (its drafts follow in ``draft_token_ids``). Under async
    scheduling a token may be a placeholder for one the step in flight samples (``-1 - row``).
    A named tuple, not a dataclass: one is made per row per step, and ``tuple.__new__`` is the
    cheapest immutable record there is (a frozen dataclass's ``__init__`` costs about four times
    a plain one's; :func:`~inflight.runtime.core.request.chunk_of` makes them). Change one with
    ``_replace``. Equal by value, like any tuple: the engine keys chunks by ``id()``."""

    req_id: str
    start: int  # the request's num_computed_tokens when scheduled
    num_tokens: int
    token_ids: Sequence[int]
    block_table: tuple[int, ...]  # the request's block ids, placeholders for released ones included
    sample: bool  # this chunk completes the known tokens, so a new token is sampled
    facts: RequestFacts
    draft_token_ids: tuple[int, ...] = ()  # proposals after the last known token (num_tokens = 1 + len)
    # Draft-model speculation: how many drafts the engine has the draft model propose before
    # the forward (num_tokens = 1 + this); draft_token_ids is empty until it fills them in.
    num_model_drafts: int = 0
    draft_context: DraftContext | None = None
    # Per-group KV tables (core/kv_groups.py): every group's block ids, group 0's being block_table;
    # None: one table serves every layer
    group_tables: tuple[tuple[int, ...], ...] | None = None

    @property
    def speculative(self) -> bool:
        """The request's last token plus drafts (the chunk advances once its tokens are verified)."""
        return bool(self.draft_token_ids) or self.num_model_drafts > 0


@dataclass(frozen=True, slots=True)
class KVCopies:
    """Block copies to run before a step's forward, in this order: every copy-out (a device
    block the pool evicted, saved to a host slot), then every copy-in (a host slot a prefix hit
    brings back into a fresh device block). Copy-outs first, because a block evicted and handed
    out again in the same step is overwritten by a copy-in or by the forward, and a copy-in may
    read a slot a copy-out of the same step has just filled."""

    copy_out: tuple[tuple[int, int], ...] = ()  # (device block, host slot)
    copy_in: tuple[tuple[int, int], ...] = ()  # (host slot, device block)

    @property
    def num_blocks(self) -> int:
        return len(self.copy_out) + len(self.copy_in)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    admitted: tuple[Request, ...]
    preempted: tuple[Request, ...]
    num_batched_tokens: int
    kv_copies: KVCopies | None = None  # the host tier's copies for this step (None: nothing to copy)
    requests: tuple[Request, ...] = ()  # chunk i's live request, handed over in order (async scheduling)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
