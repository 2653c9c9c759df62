"""What a target forward hands a draft head: the residual stream at the layers the head reads.

An EAGLE-3 head (:mod:`inflight.runtime.spec_decode.eagle3`) fuses the states entering a few of the
target's layers; an MTP layer (:mod:`inflight.runtime.spec_decode.mtp`) reads the last layer's output
before the final norm. The decoder's layer loop offers each layer's state to an :class:`AuxHidden`,
which keeps the ones asked for, in layer order. Knows nothing about the heads or the layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AuxHidden:
    """What a forward collects for an EAGLE-3 head: the residual stream entering each layer of
    ``layer_ids`` (0: the embeddings; ``num_layers``: the last layer's output before the final norm,
    what MTP layers read), in layer order. Such a forward runs layer by layer (never the one-call
    stack, which returns only the final state): a path choice."""

    layer_ids: tuple[int, ...]
    hidden: list[torch.Tensor] = field(default_factory=list)  # each [num_tokens, hidden]

    def keep(self, layer_id: int, hidden: torch.Tensor, residual: torch.Tensor | None = None) -> None:
        """Keep the state at ``layer_id`` (``hidden`` plus the pending ``residual``, if any) when
        it is one of ``layer_ids``; the sum is formed only then."""
        if layer_id in self.layer_ids:
            self.hidden.append(hidden if residual is None else hidden + residual)
