"""EncoderRunner: the pooling runner of a BERT-family encoder (no KV cache, whole prompts).

Holds a :class:`~inflight.runtime.model.encoder.BertEncoder` and answers what the engine asks a
runner (device, spec, sizes, health) with no KV cache behind its block count: the scheduler
still hands out blocks (a count of what may run at once), but an encoder attends within the
prompt it is given, so every prompt must be scheduled whole in one step (the engine turns
chunked context and prefix caching off for it). :meth:`pool_chunks` is the encoder's
:func:`~inflight.runtime.worker.pooling_runner.chunk_parts`: each prompt's last row, sum of
rows or first row; a classifier's logits from its ``[CLS]`` row through BERT's pooler. Knows
nothing about scheduling.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.model.encoder import load_encoder
from inflight.runtime.model.loader import Progress, load_hf_config
from inflight.runtime.model.spec import ENCODER_ARCHITECTURES, spec_from_hf_config
from inflight.runtime.tokenizer import load_tokenizer
from inflight.runtime.worker.cpu.device_setup import resolve_device, resolve_dtype


def is_encoder_dir(model_dir: str | Path) -> bool:
    """Whether ``model_dir``'s config.json names a BERT-family encoder architecture."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return False
    archs = json.loads(path.read_text()).get("architectures") or []
    return any(a in ENCODER_ARCHITECTURES for a in archs)


class EncoderRunner:
    """See module docstring."""

    workers = None  # one rank only

    def __init__(self, model_dir: str | Path, config: EngineConfig, progress: Progress | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.hf_config = load_hf_config(model_dir)
        self.spec = spec_from_hf_config(self.hf_config)
        if self.spec.arch != "bert":
            raise ValueError(f"{model_dir} is not a BERT encoder")
        self.device = resolve_device(config.device)
        checkpoint = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
        self.dtype = resolve_dtype(config.dtype, self.device, checkpoint)
        sep = load_tokenizer(model_dir).sep_token_id
        self.model = load_encoder(self.model_dir, self.hf_config, self.spec.head, sep, self.device, self.dtype)
        limit = self.spec.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds what the model supports ({limit}).")
        self.max_model_len = config.max_model_len or limit
        self.block_size = config.block_size
        # no memory behind the blocks: how many prompts of full length may be in flight at once
        self.num_kv_blocks = config.num_kv_blocks or config.max_num_sequences * -(-self.max_model_len
                                                                                   // self.block_size)
        if progress:
            progress(f"BERT encoder: {self.spec.num_layers} layers, {self.device}, {self.dtype} (no KV cache)")

    @property
    def resolved(self) -> dict[str, str]:
        return {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "kernel_backend": "torch", "quantization": "none"}

    @property
    def device_busy_seconds(self) -> float | None:
        return None

    def check_health(self) -> None:
        """Nothing to check: no worker processes."""

    def close(self) -> None:
        """Nothing to release but the Python objects."""

    @torch.inference_mode()
    def pool_chunks(self, chunks: Sequence[ScheduledChunk], pooling_type: str) -> torch.Tensor:
        """``[len(chunks), hidden]`` (or ``[len(chunks), num_labels]``) float32 on the CPU."""
        prompts = []
        for chunk in chunks:
            if chunk.start != 0 or chunk.num_tokens != chunk.facts.num_prompt_tokens:
                raise RuntimeError(f"request {chunk.req_id!r}: an encoder needs its prompt whole in one step")
            prompts.append(torch.tensor(list(chunk.token_ids), dtype=torch.long, device=self.device))
        hidden = self.model(prompts)  # each [n_i, hidden]
        if self.spec.head == "score":
            return self.model.score(torch.stack([h[0] for h in hidden])).float().cpu()
        if pooling_type == "CLS":
            parts = [h[0] for h in hidden]
        elif pooling_type == "LAST":
            parts = [h[-1] for h in hidden]
        elif pooling_type == "MEAN":
            parts = [h.float().sum(0) for h in hidden]
        else:
            raise ValueError(f"unknown pooling type {pooling_type!r}")
        return torch.stack(parts).float().cpu()
