"""Sampler: turns a step's logits into one token per sampling request.

Applies, per row: ``logit_bias``, repetition / presence / frequency penalties, min_tokens
(EOS and stop tokens masked until reached), the grammar's token mask for constrained rows
(structured outputs; free rows of the same batch are untouched), then greedy argmax or
temperature + top_k + top_p + min_p and a draw from the request's own ``torch.Generator`` (so
a seeded request gets the same tokens whatever else shares the batch). Log-probabilities
(with top alternatives) come from the penalized distribution before temperature. The per-step
work is batched on the logits' device with at most one host sync a step
(:mod:`inflight.runtime.worker.batched_sampling`); a penalized request's tokens are followed
there, step by step, from its sampled ids (:mod:`inflight.runtime.worker.penalty_state`).

Grammar masks are filled on worker threads while the forward pass runs
(:meth:`Sampler.prepare_masks`, :mod:`inflight.runtime.structured.mask_fills`). The sampler
waits a short grace for quick grammars' masks and never for a slow grammar's: a row whose mask
is not ready is *deferred* (no token, no random draw), and the engine parks its request until
the mask is. Knows nothing about scheduling or the model."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from inflight.runtime.outputs import TokenLogprob
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.structured.bitmask import apply_bitmask
from inflight.runtime.structured.manager import RequestMatcher
from inflight.runtime.structured.mask_fills import MaskFill, MaskFiller, grace_s
from inflight.runtime.worker.batched_sampling import (
    HostTokens,
    apply_filters,
    fetch,
    filter_tensors,
    row_index,
    shape_batch,
    start_sample,
    upload,
)
from inflight.runtime.worker.penalty_state import PenaltyPool, RequestPenalties


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one request this step. Read-only by convention,
    not frozen (one per row per step; a frozen ``__init__`` costs four times as much)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: Sequence[int]  # a list, or the request's TokenRange (no copy)
    generator: torch.Generator | None
    eos_token_ids: tuple[int, ...]
    matcher: RequestMatcher | None = None  # structured outputs: the request's grammar state
    penalties: RequestPenalties | None = None  # penalties: the request's state on the device (penalty_state.py)


@dataclass(frozen=True, slots=True)
class PendingMasks:
    """Grammar masks being filled for the constrained rows: ``fills[j]`` is row
    ``row_indices[j]``'s. ``wait``: False to wait for each until it is done (no deferral)."""

    row_indices: tuple[int, ...]
    fills: tuple[MaskFill, ...]
    started: float  # time.monotonic() when the fills were started (the forward pass began)
    wait: bool = False


@dataclass(frozen=True, slots=True)
class SettledMasks:
    """The masks decided on (:meth:`Sampler.settle_masks`): ``bitmask`` (one row per entry of
    ``row_indices``, None when no row is masked) and the rows ``deferred``."""

    row_indices: tuple[int, ...]
    bitmask: np.ndarray | None
    deferred: frozenset[int]


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """``token_ids[i]`` is -1 for a row in ``deferred`` (its grammar mask was not ready)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    deferred: frozenset[int] = field(default_factory=frozenset)


class PendingSample:
    """A step's sampling on its way: ``token_ids`` ``[num_rows]`` int64 on the device (-1 for a
    deferred row) for whatever reads them next on the device; :meth:`result` waits for their
    copy to the host (the step's one sync) and gives the :class:`SamplerOutput`."""

    __slots__ = ("token_ids", "deferred", "_host", "_keep", "_output")

    def __init__(self, token_ids: torch.Tensor, deferred: frozenset[int], host: HostTokens | None,
                 keep: tuple[int, ...] | None = None) -> None:  # fmt: skip
        self.token_ids = token_ids
        self.deferred = deferred
        self._host = host  # None: every row deferred (or none at all)
        self._keep = keep  # the rows ``host`` holds, when some are deferred
        self._output: SamplerOutput | None = None  # known already (:meth:`ready`)

    @classmethod
    def ready(cls, output: SamplerOutput, device: torch.device) -> PendingSample:
        """An output already on the host (a sampler that computes its tokens there)."""
        done = cls(upload(np.asarray(output.token_ids, dtype=np.int64), device), output.deferred, None)
        done._output = output
        return done

    def result(self) -> SamplerOutput:
        if self._output is not None:
            return self._output
        n = self.token_ids.shape[0]
        if self._host is None:
            return SamplerOutput([-1] * n, [None] * n, self.deferred)
        ids, logprobs = self._host.result()
        if self._keep is None:
            return SamplerOutput(ids, logprobs, self.deferred)
        token_ids: list[int] = [-1] * n
        chosen: list[TokenLogprob | None] = [None] * n
        for i, token_id, logprob in zip(self._keep, ids, logprobs, strict=True):
            token_ids[i], chosen[i] = token_id, logprob
        return SamplerOutput(token_ids, chosen, self.deferred)


class Sampler:
    """Stateless apart from the device, its mask threads and the penalized requests' state
    (:mod:`~inflight.runtime.worker.penalty_state`); call :meth:`sample` once per step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.masks = MaskFiller()
        self.penalties = PenaltyPool(device)

    def prepare_masks(self, rows: list[SamplingRow], vocab_size: int) -> PendingMasks | None:
        """Start filling the constrained rows' grammar masks (or keep the fills already under
        way for them), so the work overlaps the forward pass; pass the result to
        :meth:`sample`. The matchers must not advance until then (they advance after sampling)."""
        constrained = [(i, r.matcher) for i, r in enumerate(rows) if r.matcher is not None and not r.matcher.failed]
        if not constrained:
            return None
        fills = tuple(self.masks.fill(m, vocab_size) for _, m in constrained)
        return PendingMasks(tuple(i for i, _ in constrained), fills, time.monotonic())

    def sample(
        self, logits: torch.Tensor, rows: list[SamplingRow], masks: PendingMasks | SettledMasks | None = None
    ) -> SamplerOutput:
        """``logits``: ``[num_rows, vocab]`` float32, modified in place. ``masks``: from
        :meth:`prepare_masks` for these rows (rows whose mask is late are deferred), or already
        settled (:meth:`settle_masks`). Without ``masks`` they are computed here and waited for."""
        return self.start_sample(logits, rows, masks).result()

    @torch.inference_mode()
    def start_sample(
        self, logits: torch.Tensor, rows: list[SamplingRow], masks: PendingMasks | SettledMasks | None = None
    ) -> PendingSample:
        """:meth:`sample` up to the tokens on the device: shaping, masks and the draw are queued
        and the copy to the host started, without waiting for the device (async scheduling
        launches the next step before it calls :meth:`PendingSample.result`)."""
        if not rows:
            return PendingSample(torch.zeros(0, dtype=torch.int64, device=logits.device), frozenset(), None)
        counted = shape_batch(logits, rows, self.penalties)
        deferred = self._apply_grammars(logits, rows, masks)
        if not deferred:
            ids, host = start_sample(logits, rows)
            if counted is not None:
                self.penalties.record(counted, ids)
            return PendingSample(ids, frozenset(), host)
        keep = [i for i in range(len(rows)) if i not in deferred]
        token_ids = torch.full((len(rows),), -1, dtype=torch.int64, device=logits.device)
        if not keep:
            return PendingSample(token_ids, frozenset(deferred), None)
        index = row_index(keep, logits.device)
        ids, host = start_sample(logits.index_select(0, index), [rows[i] for i in keep])
        token_ids.index_copy_(0, index, ids)
        if counted is not None:
            self.penalties.record(counted, token_ids, deferred)
        return PendingSample(token_ids, frozenset(deferred), host, tuple(keep))

    def _apply_grammars(
        self, logits: torch.Tensor, rows: list[SamplingRow], masks: PendingMasks | SettledMasks | None
    ) -> frozenset[int]:
        """Mask each constrained row whose mask is ready; the rows whose mask is not: deferred."""
        settled = masks if isinstance(masks, SettledMasks) else self.settle_masks(rows, masks, logits.shape[-1])
        if settled.bitmask is not None:
            apply_bitmask(logits, list(settled.row_indices), settled.bitmask)
        return settled.deferred

    def settle_masks(self, rows: list[SamplingRow], masks: PendingMasks | None, vocab_size: int) -> SettledMasks:
        """Wait for the masks :meth:`sample` may wait for (a quick grammar's, for its grace) and
        decide: the ready rows' bitmask, and the rows deferred. The engine thread calls this
        itself under async scheduling, so it knows which rows are deferred before the sampling
        runs; :meth:`sample` takes the result in place of ``masks``."""
        if masks is None:
            masks = self.prepare_masks(rows, vocab_size)
            if masks is None:
                return SettledMasks((), None, frozenset())
            masks = PendingMasks(masks.row_indices, masks.fills, masks.started, wait=True)
        awaited = [f.future for f in masks.fills if not f.done and (masks.wait or not f.matcher.slow)]
        if awaited:  # a slow grammar's mask is never waited for
            timeout = None if masks.wait else grace_s(time.monotonic() - masks.started)
            concurrent.futures.wait(awaited, timeout=timeout)
        deferred: set[int] = set()
        ready: list[int] = []
        for j, fill in enumerate(masks.fills):
            if not fill.done:
                self.masks.late(fill)
                deferred.add(masks.row_indices[j])
                continue
            exc = fill.future.exception()
            if exc is not None:
                raise exc
            if fill.outcome != "ok":  # the grammar ended while advancing: the engine ends the request
                deferred.add(masks.row_indices[j])
                continue
            self.masks.consume(fill)
            ready.append(j)
        bitmask = np.concatenate([masks.fills[j].bitmask for j in ready]) if ready else None
        return SettledMasks(tuple(masks.row_indices[j] for j in ready), bitmask, frozenset(deferred))


def shape_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Apply each row's ``logit_bias``, penalties (against its ``output_token_ids``) and
    min_tokens ban to ``logits`` ``[len(rows), vocab]``, in place: the distribution the
    logprobs are taken from, before grammar masks and temperature (batched, no host sync)."""
    shape_batch(logits, rows)


def token_logprobs(logits: torch.Tensor, rows: list[SamplingRow], token_ids: list[int]) -> list[TokenLogprob | None]:
    """The logprob entries (chosen token plus top alternatives) of ``token_ids[i]`` under
    ``logits[i]`` (shaped and masked, before temperature), for the rows that ask for them."""
    ids = upload(np.asarray(token_ids, dtype=np.int64), logits.device)
    return fetch(logits, rows, ids)[1]


def filter_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Mask tokens outside top_k / top_p / min_p (per-row parameters, one sort, no host sync)."""
    return apply_filters(logits, filter_tensors(rows, logits.shape[-1], logits.device))
