"""Fill and apply grammar token masks to the constrained rows of a step's logits.

Masks are filled on the CPU (one bit per token), one row per worker thread so that each row
has its own deadline (the sampler ends a row whose mask is late, and the others go on), then
unpacked and applied on the logits' device in one masked fill. Free rows of the batch are not
touched. Knows nothing about requests beyond their matchers.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance.numpy as llnp
import numpy as np
import torch

from inflight.runtime.structured.faults import STALL_CAP_S
from inflight.runtime.structured.manager import RequestMatcher

# How long a row's token mask may take, from when the step starts filling it (it overlaps the
# forward pass). A mask normally takes microseconds to a few milliseconds; an ambiguous grammar
# can take seconds per token (issue 19: ~2 s on a 49k vocabulary), which would stall every row
# of every step. Past this the row's request ends with an error, so another stream's
# inter-token gap grows by at most this much, once per such request.
MASK_DEADLINE_S = 0.5
MAX_MASK_WORKERS = 64  # threads start on demand; a late row keeps one busy until llguidance returns


def fill_row(matcher: RequestMatcher, bitmask: np.ndarray, index: int) -> None:
    """Fill row ``index`` of ``bitmask`` with ``matcher``'s allowed tokens (a worker thread)."""
    if matcher.stall is not None:  # an injected slow-mask fault (tests only)
        matcher.stall.wait(STALL_CAP_S)
    llnp.fill_next_token_bitmask(matcher.matcher, bitmask, index)


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
