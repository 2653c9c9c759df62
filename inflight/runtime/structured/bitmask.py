"""Apply grammar token masks to the constrained rows of a step's logits.

Masks are filled on the CPU by llguidance's executor (all constrained rows in parallel, one
bit per token), then unpacked and applied on the logits' device in one masked fill. Free rows
of the batch are not touched. Knows nothing about requests beyond their matchers.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import llguidance.numpy as llnp
import numpy as np
import torch

from inflight.runtime.structured.manager import RequestMatcher


def fill_bitmask(
    matchers: Sequence[RequestMatcher], vocab_size: int, executor: llguidance.LLExecutor | None
) -> np.ndarray:
    """``[len(matchers), ceil(vocab/32)]`` int32: bit t of a row set when token t is allowed."""
    bitmask = llnp.allocate_token_bitmask(len(matchers), vocab_size)
    if executor is not None and len(matchers) > 1:
        llnp.fill_next_token_bitmask_par(executor, [(m.matcher, i) for i, m in enumerate(matchers)], bitmask)
    else:
        for i, m in enumerate(matchers):
            llnp.fill_next_token_bitmask(m.matcher, bitmask, i)
    return bitmask


def apply_bitmask(logits: torch.Tensor, row_indices: Sequence[int], bitmask: np.ndarray) -> None:
    """Set disallowed tokens of ``logits[row_indices]`` to -inf (in place).

    ``logits``: ``[num_rows, vocab]``; ``bitmask``: ``[len(row_indices), ceil(vocab/32)]``.
    Columns past the mask's width (padding rows of the embedding) are disallowed too.
    """
    dev = logits.device
    vocab = logits.shape[-1]
    mask = torch.from_numpy(bitmask).to(dev)  # [k, words]
    shifts = torch.arange(32, device=dev, dtype=torch.int32)
    bits = ((mask.unsqueeze(-1) >> shifts) & 1).reshape(mask.shape[0], -1)  # [k, words * 32]
    allowed = torch.zeros(mask.shape[0], vocab, dtype=torch.bool, device=dev)
    width = min(vocab, bits.shape[1])
    allowed[:, :width] = bits[:, :width].bool()
    idx = torch.tensor(list(row_indices), dtype=torch.int64, device=dev)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
