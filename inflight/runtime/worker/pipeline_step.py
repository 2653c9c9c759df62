"""One pipeline stage's share of a step, on any rank (issue 54).

Every rank has the step's batch (rank 0 broadcast it). A stage after the first receives the
previous stage's hidden states and residual, runs its layers over its own KV cache (same block
ids as every stage), and either sends the result on or, on the last stage, computes the sampled
rows' logits (gathered over its tensor-parallel ranks) and sends them to rank 0, which waits for
them after sending its own stage's output (:func:`stage_forward`), or, with several steps in flight
(:mod:`inflight.runtime.core.engine_batch_queue`), posts the receive and returns at once
(:func:`launch`; the engine waits on :class:`PendingLogits` later). Knows nothing about sampling or scheduling; the sends
are :class:`inflight.runtime.distributed.pipeline.PipelineComm`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from inflight.runtime.model.batch import AttentionMetadata
from inflight.runtime.model.stage_forward import run_stage
from inflight.runtime.worker.batch_inputs import BatchInputs

if TYPE_CHECKING:
    from inflight.runtime.worker.model_runner import ModelRunner


def stage_forward(runner: ModelRunner, input_ids: torch.Tensor, positions: torch.Tensor,
                  meta: AttentionMetadata, sample_indices: torch.Tensor) -> torch.Tensor | None:
    """Rank 0: ``[num_sampled, vocab]`` float32 logits from the last stage; other ranks: None."""
    pp, model = runner.pp, runner.model
    assert pp is not None
    if runner._cpu_threads is not None:
        runner._set_cpu_threads(input_ids.shape[0], meta, sample_indices.shape[0])
    carried = None
    if not pp.stage.is_first:
        carried = pp.recv_carried(input_ids.shape[0], runner.spec.hidden_size, runner.dtype, runner.device)
    out = run_stage(model, input_ids, positions, runner.cos_sin, runner.kv_caches, meta, runner.ops, carried)
    if not pp.stage.is_last:
        pp.send_carried(out)  # [2, num_tokens, hidden]
        if pp.rank != 0:
            return None
        return pp.recv_logits(sample_indices.shape[0], runner.spec.vocab_size, runner.device)
    logits = model.compute_logits(out[sample_indices], runner.ops)  # None off the stage's tp rank 0
    if logits is not None and pp.sends_logits:
        pp.send_logits(logits)
    return None


@dataclass(slots=True)
class PendingLogits:
    """A launched step's logits, once its last stage has sent them (rank 0)."""

    logits: torch.Tensor  # [num_sampled, vocab] float32: filled when ``works`` are done
    works: list[Any]  # torch.distributed work handles: the step's broadcast, sends and the receive
    keep: tuple[torch.Tensor, ...]  # what the sends read, alive until they are done

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        self.works.clear()
        self.keep = ()
        return self.logits


def launch(runner: ModelRunner, batch: BatchInputs) -> PendingLogits:
    """Rank 0: broadcast ``batch`` without waiting, run the first stage, post its send and the
    receive of the logits; return without waiting for the later stages."""
    pp, workers = runner.pp, runner.workers
    assert pp is not None and workers is not None and pp.rank == 0 and not pp.stage.is_last

    @torch.inference_mode()
    def forward() -> PendingLogits:
        if runner._cpu_threads is not None:
            runner._set_cpu_threads(batch.input_ids.shape[0], batch.meta, batch.sample_indices.shape[0])
        out = run_stage(runner.model, batch.input_ids, batch.positions, runner.cos_sin, runner.kv_caches, batch.meta,
                        runner.ops)  # fmt: skip
        send = pp.isend_carried(out)  # [2, num_tokens, hidden]
        logits, receive = pp.irecv_logits(batch.sample_indices.shape[0], runner.spec.vocab_size, runner.device)
        return PendingLogits(logits, [w for w in (send, receive) if w is not None], (out,))

    broadcast, pending = workers.launch_step(forward, (batch.input_ids, batch.positions, batch.meta,
                                                       batch.sample_indices))  # fmt: skip
    pending.works[:0] = broadcast
    return pending


def collect(runner: ModelRunner, pending: PendingLogits) -> torch.Tensor:
    """Rank 0: wait for a launched step's logits ``[num_sampled, vocab]``; any failure is fatal."""
    assert runner.workers is not None
    return runner.workers.guard(pending.wait)
