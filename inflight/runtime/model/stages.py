"""Pipeline stages: which contiguous range of decoder layers a stage holds.

A leaf (no torch). The decoder builds only its stage's layers (:class:`StageLayers`), the
embedding on the first stage (and on the last too when the LM head is tied to it), the final
norm and the LM head on the last; the loader skips the other stages' tensors. Layers keep their
global index for everything the spec decides per layer (windows, rope tables, MoE layers) and
are renumbered from 0 inside the stage, so the stage's KV cache holds only its own layers.
Knows nothing about processes or how activations travel (:mod:`inflight.runtime.distributed.pipeline`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StageLayers:
    """Stage ``index`` of ``num_stages``: global decoder layers ``start`` to ``end`` (exclusive)."""

    index: int
    num_stages: int
    start: int
    end: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def num_layers(self) -> int:
        return self.end - self.start


def split_layers(num_layers: int, num_stages: int) -> list[StageLayers]:
    """Contiguous, as even as possible; a remainder goes to the stages before the last (the last
    stage also runs the final norm, the LM head and the logit gather). ``ValueError`` when a
    stage would get no layer."""
    if num_stages < 1:
        raise ValueError(f"pipeline_parallel_size must be at least 1 (got {num_stages}).")
    if num_stages > num_layers:
        raise ValueError(f"pipeline_parallel_size {num_stages} exceeds the model's {num_layers} decoder layers; "
                         f"each stage needs at least one (use at most {num_layers}).")
    sizes = [num_layers // num_stages] * num_stages
    for i in range(num_layers % num_stages):
        sizes[-2 - i if num_stages > 1 else 0] += 1
    stages, start = [], 0
    for index, size in enumerate(sizes):
        stages.append(StageLayers(index, num_stages, start, start + size))
        start += size
    return stages


def local_name(name: str, stage: StageLayers, tied: bool) -> str | None:
    """A checkpoint tensor's name (``model.`` prefix removed) inside this stage's module, or None
    when another stage holds it: ``layers.{i}.*`` renumbered from the stage's first layer."""
    parts = name.split(".", 2)
    if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
        index = int(parts[1])
        if not stage.start <= index < stage.end:
            return None
        return ".".join(["layers", str(index - stage.start), *parts[2:]])
    if parts[0] == "embed_tokens":
        return name if stage.is_first or (stage.is_last and tied) else None
    if parts[0] in ("norm", "lm_head"):
        return name if stage.is_last else None
    return name
