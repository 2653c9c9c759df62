"""MTP speculation (``"method": "mtp"``): the served model's own multi-token-prediction layer
(:mod:`.mtp_head`) proposes the drafts, loaded from the served model's checkpoint.

An MTP layer is driven exactly as an EAGLE-3 head is (:class:`~.eagle3.Eagle3Proposer`, whose
docstring says how): its own paged KV on the target's block tables, one step behind the target,
the target's state of each position kept from the step that computed it, caught up before the
next forward, ``k - 1`` chained one-token passes for the rest of the drafts (each reading the
layer's own pre-norm output in place of the target's: the one MTP layer reused recursively, as
vLLM does), the same draft choice and rejection sampling. What differs is what it reads and
holds: the target's last-layer output (``AuxHidden`` id ``num_layers``), through the served
model's final norm as the layer reads it (vLLM and SGLang hand it the model's normed output), no
``fc``, the full vocabulary, and its KV in the target's format (the latent and roped key of
latent attention for DeepSeek-V3, K/V for GLM-4.5). Under tensor parallelism the layer is whole
on rank 0, with whole embedding and LM-head tables (its own copies from the checkpoint, or the
served model's read from it). Qwen3-Next's MTP layer (:mod:`.qwen3_next_mtp`) is driven the same way;
it reads the served model's final-normed output (its head applies the served model's final norm to
the pre-norm state) and chains its own normed output, as vLLM's ``Qwen3NextMTP`` does; a rejected
draft's recurrent state is rolled back in the target (worker/hybrid_cache.py). Knows nothing about
scheduling policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from inflight.runtime.config import EngineConfig
from inflight.runtime.model.loader import Progress, checkpoint_tensors, load_hf_config
from inflight.runtime.model.mla_kv import allocate_mla_caches, mla_block_bytes
from inflight.runtime.spec_decode.eagle3 import Eagle3Proposer, head_device_dtype, target_embeddings
from inflight.runtime.spec_decode.mtp_head import MTP_ARCHS, MtpHead, load_mtp_head
from inflight.runtime.spec_decode.qwen3_next_mtp import Qwen3NextMtpHead, load_qwen3_next_mtp_head
from inflight.runtime.spec_decode.speculative import draft_states, parse_speculative_config
from inflight.runtime.worker.graph_backend import GraphBackend
from inflight.runtime.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from inflight.runtime.distributed.comm import TensorParallel
    from inflight.runtime.distributed.launcher import WorkerGroup


class MtpProposer(Eagle3Proposer):
    """Proposes drafts with the served model's MTP layer (see module docstring)."""

    head: MtpHead  # type: ignore[assignment]

    @property
    def bytes_per_block(self) -> int:
        spec = self.head.spec
        if spec.mla is None:
            return super().bytes_per_block
        return mla_block_bytes(spec, 1, self.block_size, torch.finfo(self.target.dtype).bits // 8)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        spec = self.head.spec
        if spec.mla is None:
            super().allocate_kv_cache(num_blocks)
            return
        self.kv_caches = allocate_mla_caches(spec, spec.num_heads, 1, (num_blocks, self.block_size), self.target.dtype,
                                             self.target.device, lambda _: None)  # fmt: skip


def load_mtp_runners(
    model_dir: str | Path, config: EngineConfig, progress: Progress | None = None,
    tp: TensorParallel | None = None, workers: WorkerGroup | None = None, graph_backend: GraphBackend | None = None,
) -> tuple[ModelRunner, MtpProposer]:
    """The served model's runner and the MTP proposer: the MTP layer's weights load first (a
    checkpoint without them fails before the target loads), then the target, whose KV pool is
    sized for both caches' bytes per block, then the layer's cache of the same block count."""
    hf_config = load_hf_config(model_dir)
    device, dtype = head_device_dtype(model_dir, config, tp)
    qwen3_next = getattr(hf_config, "model_type", None) == "qwen3_next"
    head = (load_qwen3_next_mtp_head if qwen3_next else load_mtp_head)(model_dir, hf_config, device, dtype)
    if progress:
        where = "mtp.layers.0" if qwen3_next else f"model.layers.{head.config.first_layer}"
        progress(f"loaded the {MTP_ARCHS[head.spec.arch]} MTP layer ({where}) as the drafter")
    elem = torch.finfo(dtype).bits // 8
    spec = head.spec
    head_bytes = (mla_block_bytes(spec, 1, config.block_size, elem) if spec.mla is not None
                  else 2 * config.block_size * spec.num_kv_heads * spec.head_dim * elem)  # fmt: skip
    runner = ModelRunner(model_dir, config, progress, tp=tp, workers=workers, graph_backend=graph_backend,
                         kv_bytes_beside=head_bytes,  # a hybrid target's scratch states (worker/hybrid_cache.py):
                         draft_states=draft_states(parse_speculative_config(config.speculative_config),
                                                   config.max_num_sequences))  # fmt: skip
    try:
        if dtype != runner.dtype:
            head = head.to(runner.dtype)
        embeddings = None
        if tp is not None and head.embed_tokens is None:  # rank 0's table is a slice: read the whole one
            embeddings = target_embeddings(model_dir).to(device=runner.device, dtype=runner.dtype)
        head.final_norm = (runner.model.norm.weight, runner.model.norm.eps)  # the layer reads the normed output
        if isinstance(head, Qwen3NextMtpHead):  # the served model's LM head (its own none)
            head.lm_head_weight = _target_lm_head(model_dir, runner, False)
        elif head.layer.shared_head.head is None:
            head.lm_head_weight = _target_lm_head(model_dir, runner, tp is not None)
        proposer = MtpProposer(head, hf_config, runner, embeddings)
        proposer.allocate_kv_cache(runner.num_kv_blocks)
    except BaseException:
        runner.close()
        raise
    return runner, proposer


def _target_lm_head(model_dir: str | Path, runner: ModelRunner, sharded: bool) -> torch.Tensor:  # [vocab, hidden]
    """The served model's whole LM head: its own (unsharded), or read from the checkpoint."""
    if not sharded and runner.model.lm_head is not None:  # whole on one rank (maybe prepacked: ops.linear reads it)
        return runner.model.lm_head.weight
    want = "model.embed_tokens.weight" if runner.spec.tie_word_embeddings else "lm_head.weight"
    for name, part in checkpoint_tensors(model_dir):
        if name == want:
            return part[:].to(device=runner.device, dtype=runner.dtype)
    raise ValueError(f"{model_dir} has no {want} for the MTP layer to score with (and no shared_head.head)")
