"""The collectives a tensor-parallel shard of the model calls: the decoder's whole view of its group.

A leaf (imports only torch). The decoder, the MoE layer and the loader take a
:class:`Collectives` (``None``: one rank, no collective is called); the one implementation is
:class:`inflight.runtime.distributed.comm.TensorParallel`, which the model never imports, and
a test checks that it satisfies this protocol. Knows nothing about process groups or messages.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Collectives(Protocol):
    """One rank's collectives over the ranks that hold the other shards of the model."""

    rank: int  # which shard this rank holds (inflight.runtime.model.layout slices by it)
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place, and return it."""
        ...

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: ``[n, world_size * vocab_per_rank]`` from every rank's vocabulary shard; others: None."""
        ...
