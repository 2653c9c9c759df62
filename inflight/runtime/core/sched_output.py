"""What the scheduler hands on for one step: the chunks to run and who was admitted or preempted.

A leaf: the worker, the drafters and the output processor import these types from here, not
from the scheduler, so the device side depends on the step's plan and not on how it was made
(tests/test_import_graph.py). The chunks still point at the live :class:`Request` (its token
ids, block table and parameters are read, never written, by the runner); replacing that
pointer by a plain copy of what the runner reads is the next step. :class:`KVCopies` are the
step's block copies between the device KV pool and the host tier (:mod:`.host_tier`), which the
worker runs before the step's forward. Imports nothing at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inflight.runtime.core.request import Request


@dataclass(slots=True, eq=False)
class ScheduledChunk:
    """``num_tokens`` tokens of ``request`` starting at its ``num_computed_tokens``.

    Read-only by convention, not frozen: one is made per row per step, and a frozen
    dataclass's ``__init__`` costs about four times a plain one's. Compared by identity."""

    request: Request
    num_tokens: int
    sample: bool  # this chunk completes the known tokens, so a new token is sampled
    draft_token_ids: tuple[int, ...] = ()  # proposals after the last known token (num_tokens = 1 + len)
    # Draft-model speculation: how many drafts the engine has the draft model propose before
    # the forward (num_tokens = 1 + this); draft_token_ids is empty until it fills them in.
    num_model_drafts: int = 0

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

    @property
    def is_empty(self) -> bool:
        return not self.chunks
