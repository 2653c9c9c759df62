"""What the single-device hybrid models share (Qwen3-Next, Granite 4): the refusal of tensor and
pipeline parallelism, and the embedding / layers / final norm / LM head built whole on one rank.

Each family names itself and its state layers, and makes its own layer; its forward stays its own.
Knows nothing about scheduling or kernels.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from inflight.runtime.model.collectives import Collectives
from inflight.runtime.model.decoder import CausalLM, RMSNorm
from inflight.runtime.model.layout import shard_layout
from inflight.runtime.model.spec_types import ModelSpec
from inflight.runtime.model.stages import StageLayers


class SingleDeviceLM(CausalLM):
    """A causal LM served whole on one device (see module docstring)."""

    FAMILY: ClassVar[str] = ""  # the family's name in the refusal, e.g. "Qwen3-Next"
    STATE_LAYERS: ClassVar[str] = ""  # what its parallel versions lack, e.g. "linear-attention layers"

    def __init__(self, spec: ModelSpec, tp: Collectives | None = None, stage: StageLayers | None = None) -> None:
        if tp is not None or stage is not None:
            raise ValueError(f"{self.FAMILY} is served on one device: tensor and pipeline parallelism are not done "
                             f"for its {self.STATE_LAYERS} (docs/models.md).")  # fmt: skip
        nn.Module.__init__(self)
        self.spec, self.tp, self.stage = spec, None, None
        self.layout = shard_layout(spec, 0, 1)
        vocab = self.layout.vocab_per_rank
        self.embed_tokens = nn.Embedding(vocab, spec.hidden_size, _weight=torch.empty(vocab, spec.hidden_size))
        self.layers = nn.ModuleList(self.make_layer(i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, vocab, bias=False)
        self.score = None
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._stack = None

    def make_layer(self, index: int) -> nn.Module:
        """The family's decoder layer ``index`` (``self.spec`` and ``self.layout`` are set)."""
        raise NotImplementedError
