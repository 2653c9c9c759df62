"""What a drafter hands the engine each step (:class:`Proposal`: the chunks with their drafts, and
the distributions sampled drafts were drawn from) and how a model's drafts are chosen from its
logits (:func:`choose_drafts`), and the tokens around a chunk a drafter reads
(:func:`known_tokens`). Shared by the draft model (:mod:`.draft_proposer`) and the EAGLE-3 head
(:mod:`.eagle3`); knows nothing about either model, and reads plain chunks, never a request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.spec_decode.rejection import exponential_race
from inflight.runtime.spec_decode.verify import sampling_probs
from inflight.runtime.worker.sampler import SamplingRow


@dataclass(frozen=True, slots=True)
class Proposal:
    """A step's chunks with the drafter's drafts filled in."""

    chunks: tuple[ScheduledChunk, ...]
    draft_probs: dict[str, torch.Tensor]  # req_id -> [k, vocab]: q of a sampled request's drafts

    def probs_of(self, chunk: ScheduledChunk) -> torch.Tensor | None:
        """The distributions ``chunk``'s drafts were drawn from (None: greedy drafts)."""
        return self.draft_probs.get(chunk.req_id)


def known_tokens(chunk: ScheduledChunk) -> tuple[int, Sequence[int]]:
    """``(first, ids)``: the tokens a drafter knows around ``chunk``, at positions ``first ..``:
    those before it whose drafter KV lags, its own known tokens, and the known token after it
    (its :class:`~inflight.runtime.core.sched_output.DraftContext`)."""
    context = chunk.draft_context
    if context is None:
        raise RuntimeError(f"request {chunk.req_id!r}: a chunk for a model drafter has no draft context")
    after = () if context.next_token_id is None else (context.next_token_id,)
    return chunk.start - len(context.lagging_ids), (*context.lagging_ids, *chunk.token_ids, *after)


def choose_drafts(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[torch.Tensor | None]]:
    """One draft per row of ``logits``: the argmax for a greedy request, else a draw from its
    sampling distribution, which is returned beside it (None for greedy rows)."""
    tokens = [0] * len(rows)
    dists: list[torch.Tensor | None] = [None] * len(rows)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy:
        for i, token in zip(greedy, logits[greedy].argmax(dim=-1).tolist(), strict=True):
            tokens[i] = token
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        probs = sampling_probs(logits[sampled], [rows[i] for i in sampled])
        drawn = torch.cat([exponential_race(probs[j], rows[i].generator) for j, i in enumerate(sampled)])
        for j, (i, token) in enumerate(zip(sampled, drawn.tolist(), strict=True)):  # one host read for them all
            tokens[i] = token
            dists[i] = probs[j]
    return tokens, dists
