"""The model depends on a small collectives protocol, never on the tensor-parallel implementation."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from inflight.runtime.distributed.comm import TensorParallel
from inflight.runtime.model.collectives import Collectives
from inflight.runtime.model.decoder import CausalLM

MODEL = Path(__file__).resolve().parents[2] / "inflight" / "runtime" / "model"


def test_tensor_parallel_satisfies_the_protocol() -> None:
    tp = TensorParallel(0, 2, None, None, lambda n: n)
    assert isinstance(tp, Collectives)


def test_the_model_package_never_names_the_distributed_package() -> None:
    """Not even under ``TYPE_CHECKING``: the model's whole view of its group is ``Collectives``."""
    offenders = []
    for path in sorted(MODEL.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("inflight.runtime.distributed"):
                offenders.append(f"{path.name}:{node.lineno}")
            elif isinstance(node, ast.Import) and any(a.name.startswith("inflight.runtime.distributed")
                                                      for a in node.names):
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, offenders


class _SumOfTwo:
    """A fake second rank holding the same shard: all-reduce doubles, the gather repeats."""

    rank, world_size = 0, 2

    def __init__(self) -> None:
        self.calls: list[str] = []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append("all_reduce")
        return x.mul_(2)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        self.calls.append("gather_vocab")
        return torch.cat([logits, logits], dim=-1)


def test_the_decoder_runs_on_any_implementation_of_the_protocol() -> None:
    """A stand-in that is not TensorParallel drives the sharded decoder: the decoder calls only
    what the protocol names (here the embedding's all-reduce and the vocabulary gather)."""
    from transformers import LlamaConfig

    from inflight.kernels.dispatch import TORCH_OPS
    from inflight.runtime.model.spec import spec_from_hf_config

    spec = spec_from_hf_config(LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                           num_key_value_heads=2, num_hidden_layers=1, vocab_size=64))
    fake = _SumOfTwo()
    assert isinstance(fake, Collectives)
    model = CausalLM(spec, fake)
    with torch.no_grad():  # a model leaves its weights uninitialized (the loader fills them): any NaN
        for weight in model.parameters():  # in them would leak through the other rank's masked row
            weight.normal_()
    hidden = model.embed(torch.tensor([1, 2, 40]))
    assert hidden.shape == (3, spec.hidden_size) and fake.calls == ["all_reduce"]
    assert torch.equal(hidden[2], torch.zeros(spec.hidden_size))  # token 40 is the other rank's
    logits = model.compute_logits(torch.zeros(2, spec.hidden_size), TORCH_OPS)
    assert logits is not None and logits.shape == (2, spec.vocab_size) and fake.calls[-1] == "gather_vocab"
