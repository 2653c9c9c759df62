"""Pipeline parallelism: a rank's place in the stages and the point-to-point sends between them.

World size is ``tensor_parallel_size x pipeline_parallel_size``; rank ``r`` is tensor-parallel rank
``r % tp`` of stage ``r // tp`` (stage-major, as vLLM and Megatron number them), so rank 0 (the
engine process) is the first stage's tensor-parallel rank 0. Each stage's tensor-parallel ranks
have their own model group (``new_group``, made by every rank in the same order); the model's
collectives run in it. Between stages, tensor-parallel rank ``t`` of stage ``s`` sends its hidden
states and residual (``[2, num_tokens, hidden]``, identical on every rank of the stage after its
all-reduces) to rank ``t`` of stage ``s + 1``; the last stage's rank 0 sends the sampled rows'
logits to rank 0, which samples. Sizes are never sent: every rank has the step's batch (the
control broadcast), so each knows the shapes it receives. Sends and receives run on the default
group, under its timeout, so a dead or stalled peer fails the step instead of hanging it.
Knows nothing about requests, the scheduler or processes (:mod:`.launcher`, :mod:`.worker`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from inflight.runtime.distributed.comm import TensorParallel
from inflight.runtime.model.stages import StageLayers, split_layers


class PipelineComm:
    """Where this rank sits among the stages, and its sends and receives (see module docstring)."""

    def __init__(self, rank: int, tp_size: int, stage: StageLayers) -> None:
        self.rank = rank
        self.tp_size = tp_size
        self.stage = stage
        self.world_size = tp_size * stage.num_stages
        self.tp_rank = rank % tp_size

    @property
    def sends_logits(self) -> bool:
        """Whether this rank hands the step's logits to rank 0 (the last stage's tensor-parallel rank 0)."""
        return self.stage.is_last and self.tp_rank == 0

    def recv_carried(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:  # [2, num_tokens, hidden]
        buf = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
        if num_tokens:
            dist.recv(buf, src=self.rank - self.tp_size)
        return buf

    def send_carried(self, carried: torch.Tensor) -> None:
        if carried.numel():
            dist.send(carried.contiguous(), dst=self.rank + self.tp_size)

    def send_logits(self, logits: torch.Tensor) -> None:  # [num_sampled, vocab] float32
        if logits.numel():
            dist.send(logits.contiguous(), dst=0)

    def recv_logits(self, num_rows: int, vocab_size: int, device: torch.device) -> torch.Tensor:
        buf, work = self.irecv_logits(num_rows, vocab_size, device)
        if work is not None:
            work.wait()
        return buf

    # -- rank 0 with several steps in flight: nothing here waits --------------------------
    def isend_carried(self, carried: torch.Tensor) -> dist.Work | None:
        return dist.isend(carried.contiguous(), dst=self.rank + self.tp_size) if carried.numel() else None

    def irecv_logits(self, num_rows: int, vocab_size: int,
                     device: torch.device) -> tuple[torch.Tensor, dist.Work | None]:  # fmt: skip
        """The buffer the last stage's logits land in ``[num_rows, vocab]``, and the receive to wait on."""
        buf = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)
        src = (self.stage.num_stages - 1) * self.tp_size
        return buf, (dist.irecv(buf, src=src) if buf.numel() else None)


def join_stages(
    rank: int, tp_size: int, pp_size: int, num_layers: int, control: dist.ProcessGroup,
    agree_num_blocks: Callable[[int], int], backend: str, timeout: timedelta,
) -> TensorParallel:
    """This rank's channel (the control group and, under tensor parallelism, its stage's model
    group) with its pipeline place attached. Every rank calls it, in the same order."""
    if pp_size == 1:
        return TensorParallel(rank, tp_size, None, control, agree_num_blocks)
    stage = split_layers(num_layers, pp_size)[rank // tp_size]
    groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)), timeout=timeout, backend=backend)
              for s in range(pp_size)] if tp_size > 1 else []  # fmt: skip
    model_group = groups[stage.index] if groups else None
    channel = TensorParallel(rank % tp_size, tp_size, model_group, control, agree_num_blocks)
    channel.pipeline = PipelineComm(rank, tp_size, stage)
    return channel
