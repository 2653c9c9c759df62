"""Apply grammar token masks to the constrained rows of a step's logits.

Masks are filled on the CPU (one bit per token, see
:mod:`inflight.runtime.structured.mask_fills`), then unpacked and applied on the logits'
device in one masked fill. Free rows of the batch are not touched. Knows nothing about
requests or matchers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def apply_bitmask(logits: torch.Tensor, row_indices: Sequence[int], bitmask: np.ndarray) -> None:
    """Set disallowed tokens of ``logits[row_indices]`` to -inf (in place).

    ``logits``: ``[num_rows, vocab]``; ``bitmask``: ``[len(row_indices), ceil(vocab/32)]``.
    Columns past the mask's width (padding rows of the embedding) are disallowed too.
    """
    dev = logits.device
    vocab = logits.shape[-1]
    mask = _upload(torch.from_numpy(bitmask), dev)  # [k, words]
    shifts = torch.arange(32, device=dev, dtype=torch.int32)
    bits = ((mask.unsqueeze(-1) >> shifts) & 1).reshape(mask.shape[0], -1)  # [k, words * 32]
    allowed = torch.zeros(mask.shape[0], vocab, dtype=torch.bool, device=dev)
    width = min(vocab, bits.shape[1])
    allowed[:, :width] = bits[:, :width].bool()
    idx = _upload(torch.tensor(list(row_indices), dtype=torch.int64), dev)
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))


def _upload(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """``t`` on ``dev`` without a host sync (pinned and non-blocking on CUDA: a pageable copy
    would wait for every kernel queued before it, the step's forward pass included)."""
    if dev.type == "cpu":
        return t
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t.to(dev)
