"""The logits row layout: what the runner lays out, :func:`split_logits` cuts back apart."""

from __future__ import annotations

from typing import Any, cast

import torch

from inflight.runtime.worker.logit_rows import logit_row_order, split_logits


def test_sampled_rows_come_first_then_prompt_logprob_spans() -> None:
    a, b = cast(Any, "chunk a"), cast(Any, "chunk b")  # the layout never looks inside a chunk
    order = logit_row_order([4, 7, 8, 9, 12], [0, 1, 2, 10])
    assert order == [4, 7, 8, 9, 12, 0, 1, 2, 10]
    logits = torch.tensor(order, dtype=torch.float32)[:, None]  # [num_rows, 1]: each row its batch row
    split = split_logits(logits, (1, 3, 1), ((a, 0, 3), (b, 5, 1)))
    assert split.starts == (0, 1, 4, 5)
    assert split.sampled[:, 0].tolist() == [4, 7, 8, 9, 12]
    assert [(chunk, first, rows[:, 0].tolist()) for chunk, first, rows in split.prompt_spans] == [
        (a, 0, [0, 1, 2]), (b, 5, [10]),
    ]


def test_without_prompt_logprobs_the_sampled_rows_are_the_logits() -> None:
    logits = torch.randn(3, 8)
    split = split_logits(logits, (1, 1, 1), ())
    assert split.sampled is logits and split.prompt_spans == ()
