"""Vision-language steps (Qwen2.5-VL): image embeddings in place of the image tokens, M-RoPE positions.

The model runner hands a vision-language model's steps here. :meth:`VisionStep.plan` reads the
packed batch's chunks (in :func:`~.batch_inputs.packed_order`) and, for each request with
images (``chunk.facts.mm_inputs``), works out each row's (t, h, w) rotary position: the
prompt's from its :class:`~inflight.runtime.multimodal.inputs.MultimodalInputs`, a position
``p`` past the prompt at ``p + rope_delta`` on all three axes; text-only requests keep their
positions. When every row's three ids agree (decode steps, text chunks) the batch keeps one
position per row and the usual rope table; otherwise the step carries ``[3, num_tokens]`` ids and
:meth:`VisionStep.execute` gathers a table row per token (:func:`~inflight.runtime.model.rope.mrope_cos_sin`).
The rows of image placeholder tokens take the vision tower's embeddings: the tower runs once per
image, at the first chunk that reaches it (one call for every image a step reaches first), and
an image's output is kept until a chunk of its request has passed its last token (a chunked
prefill takes its slices; an image a prefix-cache hit skipped is never encoded; a request that
stops coming, finished, aborted or preempted, loses its entries at the next step, and a
preempted one runs the tower again when it returns). These steps run eagerly (no decode
graphs, no CPU lanes) on one rank. Knows nothing about scheduling or sampling.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.model.rope import mrope_cos_sin, mrope_sections
from inflight.runtime.worker.batch_inputs import BatchInputs, packed_order, upload

if TYPE_CHECKING:
    from inflight.runtime.multimodal.inputs import MultimodalInputs
    from inflight.runtime.worker.model_runner import ModelRunner


@dataclass(frozen=True, slots=True)
class ImageRows:
    """Rows ``row .. row + count`` of the batch take embeddings ``first .. first + count`` of
    image ``image`` of request ``req_id``."""

    row: int
    req_id: str
    image: int
    first: int
    count: int


@dataclass(frozen=True, slots=True)
class VisionPlan:
    mrope_positions: torch.Tensor | None  # [3, num_tokens] when some row's t/h/w ids differ
    image_rows: tuple[ImageRows, ...]
    images_of: dict[str, MultimodalInputs]  # the requests whose embeddings these rows read
    # requests of this step with image tokens still to come, and where their chunk ends: the
    # embeddings of their images not yet passed stay
    keep: dict[str, tuple[MultimodalInputs, int]]


@dataclass(frozen=True, slots=True)
class VisionBatch(BatchInputs):
    """A vision-language model's batch: the packed batch and its :class:`VisionPlan`."""

    plan: VisionPlan | None = None


class VisionStep:
    """The vision side of a vision-language model's runner (see the module docstring)."""

    def __init__(self, model: Any, hf_config: Any) -> None:
        sections = mrope_sections(hf_config)
        if sections is None:
            raise ValueError("a Qwen2.5-VL config needs rope_parameters.mrope_section (its M-RoPE sections)")
        self.model = model
        self.sections = sections
        self.embeddings: dict[tuple[str, int], torch.Tensor] = {}  # (req_id, image) -> [num_tokens, hidden]

    def plan(self, batch: BatchInputs, chunks: Sequence[ScheduledChunk], device: torch.device) -> BatchInputs:
        """``batch`` with its rows' M-RoPE positions and the rows its images fill."""
        ordered = packed_order(chunks)
        if not any(c.facts.mm_inputs is not None for c in ordered):
            return batch
        positions = np.empty((3, batch.input_ids.shape[0]), dtype=np.int64)
        image_rows: list[ImageRows] = []
        images_of: dict[str, MultimodalInputs] = {}
        keep: dict[str, tuple[MultimodalInputs, int]] = {}
        row = 0
        for chunk in ordered:
            n = 1 + len(chunk.draft_token_ids) if chunk.draft_token_ids else chunk.num_tokens
            start, mm = chunk.start, chunk.facts.mm_inputs
            index = np.arange(start, start + n)
            if mm is None:
                positions[:, row : row + n] = index
            else:
                prompt = mm.positions.shape[1]
                inside = index[index < prompt]
                positions[:, row : row + inside.size] = mm.positions[:, inside]
                positions[:, row + inside.size : row + n] = index[inside.size :] + mm.rope_delta
                rows = _image_rows(mm, chunk.req_id, start, n, row)
                if rows:
                    image_rows += rows
                    images_of[chunk.req_id] = mm
                if start + n < mm.image_end:
                    keep[chunk.req_id] = (mm, start + n)
            row += n
        flat = bool((positions[0] == positions[1]).all() and (positions[0] == positions[2]).all())
        new_positions = upload(positions[0].tolist(), torch.int64, device)
        mrope = None if flat else torch.from_numpy(positions).to(device)
        plan = VisionPlan(mrope, tuple(image_rows), images_of, keep)
        fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(BatchInputs)}
        return VisionBatch(**{**fields, "positions": new_positions}, plan=plan)

    @torch.inference_mode()
    def execute(self, runner: ModelRunner, batch: BatchInputs) -> torch.Tensor:
        """Logits ``[num_sampled, vocab]`` (float32) for the sampling rows of ``batch``."""
        plan = batch.plan if isinstance(batch, VisionBatch) else None
        model, positions, cos_sin, embeds = self.model, batch.positions, runner.cos_sin, None
        if plan is not None and plan.mrope_positions is not None:
            cos_sin = mrope_cos_sin(runner.cos_sin[0], plan.mrope_positions, self.sections)[None]
            positions = torch.arange(positions.shape[0], device=positions.device)
        if plan is not None and plan.image_rows:
            embeds = model.embed(batch.input_ids)
            self._encode(plan, embeds)
            for rows in plan.image_rows:
                source = self.embeddings[(rows.req_id, rows.image)]
                embeds[rows.row : rows.row + rows.count] = source[rows.first : rows.first + rows.count]
        hidden = model(batch.input_ids, positions, cos_sin, runner.kv_caches, batch.meta, runner.ops,
                       inputs_embeds=embeds)  # fmt: skip
        keep = {} if plan is None else plan.keep
        self.embeddings = {(r, i): v for (r, i), v in self.embeddings.items()
                           if r in keep and keep[r][0].offsets[i] + keep[r][0].images[i].num_tokens > keep[r][1]}
        return model.compute_logits(hidden[batch.sample_indices], runner.ops)

    def _encode(self, plan: VisionPlan, like: torch.Tensor) -> None:
        """Run the vision tower once over every image this step reads that is not encoded yet."""
        missing = sorted({(r.req_id, r.image) for r in plan.image_rows} - set(self.embeddings))
        if not missing:
            return
        images = [plan.images_of[req_id].images[i] for req_id, i in missing]
        pixels = torch.from_numpy(np.concatenate([im.pixel_values for im in images])).to(like.device, like.dtype)
        out = self.model.visual(pixels, [im.grid_thw for im in images]).to(like.dtype)
        for key, part in zip(missing, out.split([im.num_tokens for im in images]), strict=True):
            self.embeddings[key] = part


def _image_rows(mm: MultimodalInputs, req_id: str, start: int, n: int, row: int) -> list[ImageRows]:
    """The runs of image tokens among prompt positions ``start .. start + n`` (batch rows from ``row``)."""
    out = []
    for i, (offset, image) in enumerate(zip(mm.offsets, mm.images, strict=True)):
        lo, hi = max(start, offset), min(start + n, offset + image.num_tokens)
        if lo < hi:
            out.append(ImageRows(row + lo - start, req_id, i, lo - offset, hi - lo))
    return out


def vision_step_of(model: Any, hf_config: Any, world_size: int, config: EngineConfig) -> VisionStep | None:
    """The vision step of a model with a vision tower (None for a text-only one); ``ValueError``
    for what it does not serve yet (tensor or pipeline parallelism, LoRA, speculative decoding)."""
    if not hasattr(model, "visual"):
        return None
    if world_size > 1:
        raise ValueError("Qwen2.5-VL is served on one rank: tensor and pipeline parallelism do not carry images yet.")
    if config.enable_lora:
        raise ValueError("LoRA adapters are not served with Qwen2.5-VL yet (enable_lora must be off).")
    if config.speculative_config is not None:
        raise ValueError("speculative decoding is not served with Qwen2.5-VL yet (drafters see no images).")
    return VisionStep(model, hf_config)
