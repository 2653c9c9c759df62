"""A LoRA adapter's whole-model tensors as one int64 payload of the control channel (issue 49).

Rank 0 writes an adapter into a device slot and sends the same tensors to ranks 1..N-1
(:meth:`~.comm.TensorParallel.send_lora`), each of which keeps its shard
(:meth:`inflight.runtime.lora.slots.LoRASlots.load`): the workers never read the adapter's
files, so a file changed on disk cannot put the ranks out of step. Layout:
``[slot, num_pairs, (layer, module index, rank) * num_pairs, float32 bits of A then B, pair by pair]``.
Knows nothing about process groups.
"""

from __future__ import annotations

import torch

from inflight.runtime.lora.peft_format import MODULES, module_shape
from inflight.runtime.model.spec import ModelSpec

Tensors = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def encode_adapter(slot: int, tensors: Tensors) -> torch.Tensor:  # [n] int64
    pairs = sorted(tensors.items())
    head = [slot, len(pairs)]
    floats: list[torch.Tensor] = []
    for (layer, module), (a, b) in pairs:
        head += [layer, MODULES.index(module), a.shape[0]]
        floats += [a.float().reshape(-1), b.float().reshape(-1)]
    bits = torch.cat(floats).view(torch.int32).to(torch.int64) if floats else torch.empty(0, dtype=torch.int64)
    return torch.cat([torch.tensor(head, dtype=torch.int64), bits])


def decode_adapter(payload: torch.Tensor, spec: ModelSpec) -> tuple[int, Tensors]:
    """(slot, tensors) back from :func:`encode_adapter`'s payload (on the CPU)."""
    payload = payload.cpu()
    slot, num_pairs = payload[:2].tolist()
    meta = payload[2 : 2 + 3 * num_pairs].view(num_pairs, 3).tolist()
    bits = payload[2 + 3 * num_pairs :].to(torch.int32).view(torch.float32)
    tensors: Tensors = {}
    offset = 0
    for layer, module_index, rank in meta:
        module = MODULES[module_index]
        in_f, out_f = module_shape(spec, module)
        a = bits[offset : offset + rank * in_f].view(rank, in_f)
        offset += rank * in_f
        b = bits[offset : offset + out_f * rank].view(out_f, rank)
        offset += out_f * rank
        tensors[(layer, module)] = (a, b)
    if offset != bits.numel():
        raise ValueError(f"a LoRA message of {bits.numel()} numbers carried {offset}")
    return slot, tensors
