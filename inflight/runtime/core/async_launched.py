"""One step launched under async scheduling, as the engine thread keeps it
(:mod:`inflight.runtime.core.async_steps`): the :class:`Launched` record and its sampled tokens
(:class:`Sampled`, and a speculating path step's :class:`RowOutcome` per row), the
placeholders that stand for tokens not sampled yet, and what binds, rolls back or undoes a
launched step's chunks; and when a device's forward pass counts as issued
(:func:`issued_on_return`). Knows nothing about scheduling or the model.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from inflight.runtime.core.request import Request, RequestStatus
from inflight.runtime.core.sched_output import ScheduledChunk, SchedulerOutput
from inflight.runtime.outputs import TokenLogprob
from inflight.runtime.worker.sampler import PendingSample, SamplingRow


def issued_on_return(device: torch.device) -> bool:
    """Whether a forward pass on ``device`` is issued only once the runner's ``execute`` returns:
    on CUDA, where ``execute`` queues the pass's kernels (each launch a GIL release) and returns
    before they run. On the CPU, and the simulated device (which holds the worker for the step's
    modelled time), ``execute`` is the pass itself, so the pass is issued as it is called."""
    return device.type == "cuda"


def placeholder(row: int) -> int:
    """The token id standing for row ``row`` of the step in flight's sampled tokens."""
    return -1 - row


@dataclass(frozen=True, slots=True)
class RowOutcome:
    """What one sampled row of a step emitted, as the worker knows it once the step is verified."""

    tokens: tuple[int, ...]  # its accepted drafts and one more token; (-1,) for a row not sampled
    num_drafts: int = 0  # the drafts it verified (0: a plain row)
    scheduled: int = 0  # the drafts the host scheduled room for (the worker may have trimmed them)
    # the speculating path's rows: the tokens just before the next chunk's start (its drafter
    # context, as far back as the chunk that ran knew), and the drafter's KV lag after the step
    known: tuple[int, ...] | None = None
    lag: int = 0

    @property
    def rejected(self) -> int:
        """The drafts scheduled but not kept (trimmed on the worker, or rejected): how far the
        optimistic schedule ran ahead."""
        return self.scheduled - (len(self.tokens) - 1) if self.scheduled else 0


@dataclass(frozen=True, slots=True)
class Sampled:
    """A step's sampled tokens: per batch row (``-1`` for a row not sampled), and on the device
    for the next step's placeholders."""

    output: PendingSample  # for the rows in ``rows``, in that order; .result() waits for the host copy
    rows: tuple[int, ...]  # batch rows sampled
    token_ids: torch.Tensor  # [num_sampled_chunks] int64 on the device (a speculating row's last token)
    # a step run through the speculating path (spec_pipeline.py): each batch row's outcome and logprob entries
    outcomes: tuple[RowOutcome, ...] | None = None
    logprobs: tuple[tuple[TokenLogprob | None, ...], ...] = ()


@dataclass(slots=True)
class Launched:
    """One step submitted to the worker, and what the host needs to finish it."""

    chunks: tuple[ScheduledChunk, ...]
    requests: tuple[Request, ...]  # chunk i's request (as launched: an aborted one's id may be reused)
    sampled_chunks: tuple[ScheduledChunk, ...]  # one logits row each, in this order
    sampled_requests: tuple[Request, ...]  # sampled chunk i's request
    forward: Future[torch.Tensor]  # [num_sampled_chunks, vocab] float32 logits
    launched_at: float
    sample: Future[Sampled] | None = None
    rows: tuple[int, ...] = ()  # batch rows sampled (their requests get a placeholder)
    deferred: tuple[int, ...] = ()  # batch rows whose grammar mask was late: no token
    kv_lags: dict[str, int] = dataclasses.field(default_factory=dict)  # a model drafter's, after the forward
    # the speculating path (spec_pipeline.py): chunks rebound and proposed on the worker, verified there
    spec_path: bool = False
    speculating: bool = False  # some chunk carries drafts (its request's next start moves back by its rejects)
    ran: tuple[ScheduledChunk, ...] = ()  # on the worker: the sampled chunks as they ran (drafts filled in)
    draft_probs: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # a sampled draft's q
    # set on the worker once the step's forward pass is issued (issued_on_return), or has failed
    issued: threading.Event = dataclasses.field(default_factory=threading.Event)


def requests_of(sched: SchedulerOutput, live: dict[str, Request]) -> tuple[Request, ...]:
    """Each chunk's request: as the scheduler handed them over, else looked up by id."""
    if len(sched.requests) == len(sched.chunks):
        return sched.requests
    return tuple([live[c.req_id] for c in sched.chunks])


def roll_back(launched: Launched) -> None:
    """Put each still-running chunk's computed count back to where it was scheduled."""
    for chunk, req in zip(launched.chunks, launched.requests, strict=True):
        if req.status is RequestStatus.RUNNING:
            req.num_computed_tokens = chunk.start


def undo(launched: Launched) -> None:
    """Wait for ``launched``'s forward pass (its failure is expected: it may have read a failed
    step's tokens) and roll its chunks back."""
    try:
        launched.forward.result()
    except Exception:  # noqa: BLE001 - it is run again, or its requests fail, in the retry
        pass
    roll_back(launched)


def bind_placeholder(chunk: ScheduledChunk, tokens: list[int]) -> ScheduledChunk:
    """``chunk`` with the token its placeholder stands for (``tokens``: the step before's, per
    row), as a drafter on the worker reads it (only a chunk's last token can be one)."""
    ids = chunk.token_ids
    if ids[-1] >= 0:
        return chunk
    return chunk._replace(token_ids=(*ids[:-1], tokens[-1 - ids[-1]]))


def no_sampling_row(req_id: str) -> SamplingRow:
    """The sampling rows a drafter asks for in an async step: none, as no chunk there drafts."""
    raise RuntimeError(f"request {req_id!r} drafts in an async step")


def drop_placeholder(req: Request, row: int) -> None:
    """Take back the placeholders ``req`` carries for ``row``'s tokens (one; a speculating row's
    one per position it computed), if it still does."""
    ids, mark = req.token_ids, placeholder(row)
    while ids and ids[-1] == mark:
        ids.pop()
