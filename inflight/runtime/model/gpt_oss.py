"""gpt-oss's expert tensors from a checkpoint into :class:`~.moe.Experts` (this rank's columns).

transformers 5 writes (and, from MXFP4 blocks, dequantizes to) every expert fused and
transposed, gate and up interleaved column by column:

* ``mlp.experts.gate_up_proj`` ``[E, hidden, 2 * I]`` (gate = ``[..., 0::2]``, up = ``[..., 1::2]``)
  and ``gate_up_proj_bias`` ``[E, 2 * I]``, interleaved the same way;
* ``mlp.experts.down_proj`` ``[E, I, hidden]`` and ``down_proj_bias`` ``[E, hidden]``.

We hold them as the other families do: ``gate_up_proj`` ``[E, 2 * w, hidden]`` (gate rows, then
up rows), ``down_proj`` ``[E, hidden, w]``, ``gate_up_proj_bias`` ``[E, 2 * w]`` (gate, then up),
``down_proj_bias`` ``[E, hidden]``, where ``w = I / N`` under tensor parallelism: each rank reads
only its ``2 * w`` interleaved columns, and the down bias is rank 0's alone (zeros elsewhere) so
the all-reduce adds it once. Knows nothing about the rest of the decoder or the loader.
"""

from __future__ import annotations

from typing import Any

import torch

from inflight.runtime.model.layout import ShardLayout
from inflight.runtime.model.spec import ModelSpec


def read_expert_tensor(hf_name: str, kind: str, part: Any, spec: ModelSpec, layout: ShardLayout) -> torch.Tensor:
    """This rank's part of gpt-oss checkpoint tensor ``hf_name`` (``kind``: "gate_up",
    "down", "gate_up_bias" or "down_bias"), in our layout."""
    assert spec.moe is not None
    full, hidden, num_experts = spec.moe.intermediate_size, spec.hidden_size, spec.moe.num_experts
    expected = {
        "gate_up": (num_experts, hidden, 2 * full), "down": (num_experts, full, hidden),
        "gate_up_bias": (num_experts, 2 * full), "down_bias": (num_experts, hidden),
    }[kind]  # fmt: skip
    shape = tuple(part.get_shape())
    if shape != expected:
        raise ValueError(f"{hf_name}: shape {shape}, expected {expected} (gpt-oss's fused expert layout).")
    width = full // layout.world_size
    lo, hi = layout.rank * width, (layout.rank + 1) * width
    if kind == "gate_up":
        cols = part[:, :, 2 * lo : 2 * hi]  # [E, hidden, 2w], gate and up interleaved
        return torch.cat([cols[..., 0::2], cols[..., 1::2]], dim=-1).transpose(1, 2)  # [E, 2w, hidden]
    if kind == "gate_up_bias":
        cols = part[:, 2 * lo : 2 * hi]  # [E, 2w]
        return torch.cat([cols[:, 0::2], cols[:, 1::2]], dim=-1)
    if kind == "down":
        return part[:, lo:hi, :].transpose(1, 2)  # [E, hidden, w]
    bias = part[:]
    return bias if layout.rank == 0 else torch.zeros_like(bias)
