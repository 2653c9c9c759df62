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

import torch
import torch.distributed as dist

from inflight import env_vars
from inflight.runtime.model.batch import AttentionMetadata

# A step message is one fixed-size broadcast: a header (command, num_tokens,
# num_decode_tokens, num_prefills, decode table width, prefill table width, num_sampled)
# and the payload inline when it fits (a decode step of 64 sequences with 2k-token contexts
# does); a larger payload follows in a second broadcast.
_HEADER_LEN = 7
_INLINE_LEN: int = env_vars.read_int("INFLIGHT_TP_INLINE_INTS")  # type: ignore[assignment]  # int64s: 64 KiB
CMD_STOP, CMD_STEP = 0, 1
StepTensors = tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]


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

    # -- the model's collectives ------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        dist.all_reduce(x, group=self.model_group)
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: ``[n, world_size * vocab_per_rank]`` from every rank's shard; others: None."""
        logits = logits.contiguous()
        if self.rank != 0:
            dist.gather(logits, None, dst=0, group=self.model_group)
            return None
        parts = [torch.empty_like(logits) for _ in range(self.world_size)]
        dist.gather(logits, parts, dst=0, group=self.model_group)
        return torch.cat(parts, dim=-1)

    # -- the step channel (rank 0 -> others) ------------------------------------------------
    def send_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  sample_indices: torch.Tensor) -> None:
        """Rank 0: broadcast one step's packed inputs (one gloo broadcast, two when large)."""
        parts = [input_ids, positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
                 meta.prefill_block_tables, meta.prefill_query_start_loc, meta.prefill_context_lens,
                 sample_indices]
        header = [CMD_STEP, input_ids.numel(), meta.num_decode_tokens, meta.num_prefills,
                  meta.decode_block_tables.shape[1], meta.prefill_block_tables.shape[1], sample_indices.numel()]
        payload = torch.cat([p.reshape(-1).to("cpu", torch.int64) for p in parts])
        message = torch.zeros(_HEADER_LEN + _INLINE_LEN, dtype=torch.int64)
        message[:_HEADER_LEN] = torch.tensor(header, dtype=torch.int64)
        inline = payload.numel() <= _INLINE_LEN
        if inline:
            message[_HEADER_LEN : _HEADER_LEN + payload.numel()] = payload
        dist.broadcast(message, src=0, group=self.control_group)
        if not inline:
            dist.broadcast(payload, src=0, group=self.control_group)

    def send_stop(self) -> None:
        message = torch.zeros(_HEADER_LEN + _INLINE_LEN, dtype=torch.int64)
        message[0] = CMD_STOP
        dist.broadcast(message, src=0, group=self.control_group)

    def receive_step(self, device: torch.device) -> StepTensors | None:
        """Ranks 1..N-1: wait for the next step's inputs; None when rank 0 says stop."""
        message = torch.empty(_HEADER_LEN + _INLINE_LEN, dtype=torch.int64)
        dist.broadcast(message, src=0, group=self.control_group)
        cmd, n, nd, np_, wd, wp, ns = message[:_HEADER_LEN].tolist()
        if cmd == CMD_STOP:
            return None
        sizes = [n, n, n, nd * wd, nd, np_ * wp, np_ + 1, np_, ns]  # decodes are one token each
        total = sum(sizes)
        if total <= _INLINE_LEN:
            payload = message[_HEADER_LEN : _HEADER_LEN + total]
        else:
            payload = torch.empty(total, dtype=torch.int64)
            dist.broadcast(payload, src=0, group=self.control_group)
        ids, pos, slots, dtab, dctx, ptab, qsl, pctx, sample = payload.to(device).split(sizes)
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decode_tokens=nd,
            decode_block_tables=dtab.reshape(nd, wd).to(torch.int32),
            decode_context_lens=dctx.to(torch.int32),
            prefill_block_tables=ptab.reshape(np_, wp).to(torch.int32),
            prefill_query_start_loc=qsl.to(torch.int32),
            prefill_context_lens=pctx.to(torch.int32),
            num_prefills=np_,
        )
        return ids, pos, meta, sample
