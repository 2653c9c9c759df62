"""The row layout of a step's logits: which rows belong to which request.

The runner computes logits only for the rows of the packed batch it is asked for, in this
order (``BatchInputs.sample_indices``):

1. the **sampled rows**: for each chunk that samples this step, in ``sampled_chunks`` order,
   ``sample_counts[i]`` rows: 1 (its last token), or 1 + k for a speculating chunk (its last
   known token and each of its k draft positions, for the verification);
2. then the **prompt-logprob rows**: for each span ``(chunk, first, count)`` of
   ``prompt_logprob_spans``, in order, ``count`` rows at positions ``first ..``; the row at
   position p scores prompt token p + 1.

:func:`logit_row_order` is how the runner lays the rows out; :func:`split_logits` is how the
engine cuts them back apart. This module is the one place that knows the order; it knows no
model, no sampling and no scheduling policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inflight.runtime.core.sched_output import ScheduledChunk

# (chunk, first position, count): ``count`` prompt-logprob rows of ``chunk`` from ``first``.
PromptLogprobSpan = tuple[ScheduledChunk, int, int]


def logit_row_order(sample_rows: list[int], prompt_rows: list[int]) -> list[int]:
    """The rows to compute logits for: the sampled rows, then the prompt-logprob rows."""
    return sample_rows + prompt_rows


@dataclass(frozen=True, slots=True)
class SplitLogits:
    """A step's logits cut along the layout (views, no copies)."""

    sampled: torch.Tensor  # [num_sampled_rows, vocab]
    # Sampled chunk i's rows are sampled[starts[i] : starts[i + 1]] (len(sample_counts) + 1 entries).
    starts: tuple[int, ...]
    # (chunk, first position, its rows [count, vocab]) per prompt-logprob span.
    prompt_spans: tuple[tuple[ScheduledChunk, int, torch.Tensor], ...]


def split_logits(
    logits: torch.Tensor, sample_counts: tuple[int, ...], prompt_logprob_spans: tuple[PromptLogprobSpan, ...]
) -> SplitLogits:
    """Cut ``logits`` (``[num_rows, vocab]``, in :func:`logit_row_order`) back into its parts."""
    starts = [0]
    for count in sample_counts:
        starts.append(starts[-1] + count)
    row = starts[-1]
    spans = []
    for chunk, first, count in prompt_logprob_spans:
        spans.append((chunk, first, logits[row : row + count]))
        row += count
    sampled = logits[: starts[-1]] if prompt_logprob_spans else logits
    return SplitLogits(sampled, tuple(starts), tuple(spans))
