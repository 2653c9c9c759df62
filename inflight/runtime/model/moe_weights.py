"""Expert weights from a checkpoint into :class:`~.moe.Experts` (this rank's columns of each).

Two layouts load, with Mixtral's ``block_sparse_moe`` read as ``mlp``:

* per expert, as the Hub's checkpoints and transformers 5's ``save_pretrained`` write them:
  ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`` (Qwen3-MoE) or
  ``experts.{e}.w1/w3/w2.weight`` (Mixtral: w1 gate, w3 up, w2 down);
* fused, as transformers 5 holds them in memory: ``mlp.experts.gate_up_proj``
  ``[E, 2 * I, hidden]`` (gate rows, then up rows) and ``mlp.experts.down_proj`` ``[E, hidden, I]``;
  gpt-oss's fused tensors (transposed, gate/up interleaved, with ``*_bias``) are read by
  :mod:`.gpt_oss`, Llama 4's (transposed: ``[E, hidden, 2I]``, ``[E, I, hidden]``) by :mod:`.llama4`.

Under tensor parallelism each rank reads only its slice of every expert's intermediate
dimension (``get_slice``). The router (``mlp.gate.weight``) is an ordinary replicated tensor and
is not handled here. Knows nothing about the rest of the decoder.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from inflight.runtime.model import gpt_oss, llama4
from inflight.runtime.model.layout import ShardLayout
from inflight.runtime.model.spec import ModelSpec

_PER_EXPERT = re.compile(r"(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_FUSED = re.compile(r"(layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?")
_KIND = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


@dataclass(frozen=True, slots=True)
class ExpertPiece:
    """The part of one of our expert parameters a checkpoint tensor fills."""

    target: str  # our parameter: "layers.3.mlp.experts.gate_up_proj" or "...down_proj"
    expert: int | None  # None: the tensor holds every expert (the fused layout)
    kind: str  # "gate", "up" or "down" (one expert); "gate_up", "down" or either + "_bias" (fused)

    @property
    def key(self) -> str:
        """What the loader records as loaded (``target:...``, see :func:`missing_pieces`)."""
        return f"{self.target}:{'all' if self.expert is None else self.expert}:{self.kind}"


def expert_piece(name: str) -> ExpertPiece | None:
    """The expert piece checkpoint tensor ``name`` (without ``model.``) fills, or None."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    if m := _PER_EXPERT.fullmatch(name):
        kind = _KIND[m.group(3)]
        return ExpertPiece(f"{m.group(1)}.{'down_proj' if kind == 'down' else 'gate_up_proj'}", int(m.group(2)), kind)
    if m := _FUSED.fullmatch(name):
        kind = ("gate_up" if m.group(2) == "gate_up_proj" else "down") + (m.group(3) or "")
        return ExpertPiece(f"{m.group(1)}.{m.group(2)}{m.group(3) or ''}", None, kind)
    return None


def read_piece(
    hf_name: str, piece: ExpertPiece, part: Any, spec: ModelSpec, layout: ShardLayout
) -> torch.Tensor:
    """This rank's columns of checkpoint tensor ``hf_name`` (a safetensors slice)."""
    assert spec.moe is not None
    if spec.arch == "gpt_oss":
        if piece.expert is not None:
            raise ValueError(f"{hf_name}: gpt-oss checkpoints hold experts fused (experts.gate_up_proj ...).")
        return gpt_oss.read_expert_tensor(hf_name, piece.kind, part, spec, layout)
    if spec.arch == "llama4_text":
        if piece.expert is not None:
            raise ValueError(f"{hf_name}: Llama 4 checkpoints hold experts fused (experts.gate_up_proj ...).")
        return llama4.read_expert_tensor(hf_name, piece.kind, part, spec, layout)
    if piece.kind.endswith("_bias"):
        raise ValueError(f"{hf_name}: {spec.arch}'s experts have no biases.")
    full, hidden, num_experts = spec.moe.intermediate_size, spec.hidden_size, spec.moe.num_experts
    width = full // layout.world_size
    lo, hi = layout.rank * width, (layout.rank + 1) * width
    expected = {
        ("gate", False): (full, hidden), ("up", False): (full, hidden), ("down", False): (hidden, full),
        ("gate_up", True): (num_experts, 2 * full, hidden), ("down", True): (num_experts, hidden, full),
    }[piece.kind, piece.expert is None]
    shape = tuple(part.get_shape())
    if shape != expected:
        raise ValueError(f"{hf_name}: shape {shape}, expected {expected}.")
    if piece.expert is not None and piece.expert >= num_experts:
        raise ValueError(f"{hf_name}: expert {piece.expert} of a model with {num_experts} experts.")
    if piece.kind in ("gate", "up"):
        return part[lo:hi]
    if piece.kind == "gate_up":
        return torch.cat([part[:, lo:hi], part[:, full + lo : full + hi]], dim=1)
    return part[:, lo:hi] if piece.expert is not None else part[:, :, lo:hi]


def destination(param: torch.Tensor, piece: ExpertPiece) -> torch.Tensor:
    """The view of our parameter ``param`` that ``piece`` fills."""
    if piece.expert is None:
        return param
    width = param.shape[1] // 2
    if piece.kind == "gate":
        return param[piece.expert, :width]
    if piece.kind == "up":
        return param[piece.expert, width:]
    return param[piece.expert]


def missing_pieces(spec: ModelSpec, loaded: set[str]) -> list[str]:
    """Expert parameters some part of which no checkpoint tensor filled, named with the part."""
    if spec.moe is None:
        return []
    missing = []
    for layer in spec.moe.sparse_layers:
        for param, kinds in (("gate_up_proj", ("gate", "up")), ("down_proj", ("down",))):
            target = f"layers.{layer}.mlp.experts.{param}"
            if f"{target}:all:{'gate_up' if param == 'gate_up_proj' else 'down'}" in loaded:
                continue
            missing += [
                f"{target} (expert {e} {kind})"
                for e in range(spec.moe.num_experts) for kind in kinds
                if f"{target}:{e}:{kind}" not in loaded
            ]
    return missing
