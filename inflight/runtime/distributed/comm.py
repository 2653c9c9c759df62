"""A rank's view of its tensor-parallel group: the model's collectives and the step channel.

Two process groups: the *model* group (NCCL on CUDA, gloo on the CPU) carries the two
all-reduces per layer, the embedding's all-reduce and the logit gather, under a timeout so
a peer that stops answering fails the step instead of hanging it. The *control* group (gloo,
CPU tensors, no practical timeout) carries each step's packed batch from rank 0: idle
workers wait in it for as long as the server is idle. Rank 0 is the engine process; the
scheduler, block tables and sampling never leave it. Knows nothing about processes
(:mod:`.launcher`) or which rows each rank owns (:mod:`inflight.runtime.model.layout`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from inflight import env_vars
from inflight.runtime.distributed import wire
from inflight.runtime.model.batch import AttentionMetadata, StepInputs

if TYPE_CHECKING:
    from inflight.runtime.distributed.pipeline import PipelineComm

# A step message is one fixed-size broadcast: a prefix (command, header length, payload
# length), the header :mod:`.wire` derives from StepInputs' fields (scalars, tensor dtypes and
# shapes), and the payload inline when it fits (a decode step of 64 sequences with 2k-token
# contexts does); a larger payload follows in a second broadcast.
_INLINE_LEN: int = env_vars.read_int("INFLIGHT_TP_INLINE_INTS")  # type: ignore[assignment]  # int64s: 64 KiB
STEP_CODEC = wire.RecordCodec(StepInputs)
CMD_STOP, CMD_STEP, CMD_LORA = 0, 1, 2
# The runner's forward arguments (input_ids, positions, meta, sample_indices): StepInputs' fields.
StepTensors = tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]


def _message_len() -> int:
    return wire.PREFIX_LEN + STEP_CODEC.header_capacity + _INLINE_LEN


class TensorParallel:
    """Collectives of one rank; ``agree_num_blocks`` is supplied by the launcher or worker."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        model_group: dist.ProcessGroup | None,
        control_group: dist.ProcessGroup | None,
        agree_num_blocks: Callable[[int], int],
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.model_group = model_group
        self.control_group = control_group
        self.agree_num_blocks = agree_num_blocks
        # this rank's pipeline stage and its sends (:mod:`.pipeline`); None: no pipeline. Under a
        # pipeline ``rank``/``world_size`` are the rank's place in its stage's tensor-parallel group.
        self.pipeline: PipelineComm | None = None

    # -- the model's collectives ------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        dist.all_reduce(x, group=self.model_group)
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: ``[n, world_size * vocab_per_rank]`` from every rank's shard; others: None."""
        logits = logits.contiguous()
        if self.rank != 0:
            dist.gather(logits, None, group=self.model_group, group_dst=0)
            return None
        parts = [torch.empty_like(logits) for _ in range(self.world_size)]
        dist.gather(logits, parts, group=self.model_group, group_dst=0)
        return torch.cat(parts, dim=-1)

    # -- the step channel (rank 0 -> others) ------------------------------------------------
    def send_step(self, step: StepInputs, wait: bool = True) -> list[dist.Work]:
        """Rank 0: broadcast one step's inputs (one gloo broadcast, two when large). ``wait=False``
        (pipeline stages): return at once with the broadcasts' work handles, so rank 0 runs its
        stage while the later stages still run earlier steps (they join in their order)."""
        header, payload = STEP_CODEC.encode(step)
        message, inline = wire.frame(CMD_STEP, header, payload, _message_len())
        works = [dist.broadcast(message, src=0, group=self.control_group, async_op=not wait)]
        if not inline:
            works.append(dist.broadcast(payload, src=0, group=self.control_group, async_op=not wait))
        return [w for w in works if w is not None]

    def send_lora(self, payload: torch.Tensor) -> None:
        """Rank 0: broadcast a LoRA adapter for a device slot (:mod:`.lora_wire`'s payload)."""
        message, inline = wire.frame(CMD_LORA, [], payload, _message_len())
        dist.broadcast(message, src=0, group=self.control_group)
        if not inline:
            dist.broadcast(payload, src=0, group=self.control_group)

    def send_stop(self) -> None:
        message, _ = wire.frame(CMD_STOP, [], torch.empty(0, dtype=torch.int64), _message_len())
        dist.broadcast(message, src=0, group=self.control_group)

    def receive_step(self, device: torch.device) -> StepInputs | LoRALoad | None:
        """Ranks 1..N-1: wait for the next step's inputs (or a LoRA adapter to load); None when
        rank 0 says stop."""
        message = torch.empty(_message_len(), dtype=torch.int64)
        dist.broadcast(message, src=0, group=self.control_group)
        cmd, header, payload_len, payload = wire.unframe(message)
        if cmd == CMD_STOP:
            return None
        if payload is None:
            payload = torch.empty(payload_len, dtype=torch.int64)
            dist.broadcast(payload, src=0, group=self.control_group)
        if cmd == CMD_LORA:
            return LoRALoad(payload)
        return STEP_CODEC.decode(header, payload.to(device))


@dataclass(frozen=True, slots=True)
class LoRALoad:
    """A LoRA adapter for a device slot, as :mod:`.lora_wire` encodes it (int64, on the CPU)."""

    payload: torch.Tensor
