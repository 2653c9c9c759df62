"""What a drafter hands the engine each step (:class:`Proposal`: the chunks with their drafts, and
the distributions sampled drafts were drawn from) and how a model's drafts are chosen from its
logits (:func:`choose_drafts`). Shared by the draft model (:mod:`.draft_proposer`) and the
EAGLE-3 head (:mod:`.eagle3`); knows nothing about either model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.spec_decode.verify import sampling_probs
from inflight.runtime.worker.sampler import SamplingRow


@dataclass(frozen=True, slots=True)
class Proposal:
    """A step's chunks with the drafter's drafts filled in."""

    chunks: tuple[ScheduledChunk, ...]
    draft_probs: dict[str, torch.Tensor]  # req_id -> [k, vocab]: q of a sampled request's drafts

    def probs_of(self, chunk: ScheduledChunk) -> torch.Tensor | None:
        """The distributions ``chunk``'s drafts were drawn from (None: greedy drafts)."""
        return self.draft_probs.get(chunk.request.req_id)


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
        for j, i in enumerate(sampled):
            tokens[i] = int(torch.multinomial(probs[j], 1, generator=rows[i].generator))
            dists[i] = probs[j]
    return tokens, dists
