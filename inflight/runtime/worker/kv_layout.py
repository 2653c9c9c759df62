"""Per-group KV tables: which layers share a block table, and where each layer's blocks live.

A model that mixes attention types (Gemma 3: five sliding-window layers per global one; gpt-oss:
sliding and full layers in turn; Qwen2 with ``max_window_layers`` below its layer count) gets one
block table per *group* of layers with the same window, as vLLM's hybrid allocator does, so a
windowed group gives back the blocks that fell out of its window while a full-attention group
keeps all of its own (:mod:`inflight.runtime.core.kv_groups` does the bookkeeping).

Every group has the same number of layers (``num_slots``), and the cache holds ``num_slots``
physical K/V tensor pairs: tensor ``j`` holds layer ``j`` of *every* group, each group through
its own block ids, so one pool of one page size serves all groups and a block a windowed group
frees is usable by any group. The group size is vLLM's rule: the smallest count of layers of one
type, or the largest when all counts are within 25% of each other; a type whose count is not a
multiple of it is padded (Gemma 3's 26 layers, 22 sliding and 4 global: groups of 4, six sliding
groups and one global group, 28 layer slots for 26 layers, 7% of the cache unused). A pool block
holds ``num_slots`` layers of ``block_size`` tokens.

Left as today (one table, :func:`kv_groups_for` says why): models with one attention type,
Llama 4's chunked layers (their chunk-shifted tables, model/llama4.py), latent attention,
linear-attention and Mamba hybrids, pipeline parallelism (a stage's forward reads one table), a
draft model or EAGLE-3 head (it reads the served model's table), the pooling runner, the host
KV tier (``kv_offloading_size``: it saves whole blocks of every layer) and
``INFLIGHT_KV_GROUPS=0`` (the switch for before/after comparisons). With groups the runner's
``num_kv_blocks`` counts blocks per group (each of ``num_groups * num_slots`` layer slots in bytes);
the pool holds ``num_kv_blocks * num_groups`` blocks of ``num_slots`` layers.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from inflight import env_vars
from inflight.kernels.cpu_huge_pages import cache_zeros

if TYPE_CHECKING:
    from inflight.runtime.config import EngineConfig
    from inflight.runtime.model.spec_types import ModelSpec

KV_GROUPS_ENV = "INFLIGHT_KV_GROUPS"
logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVGroupLayout:
    """Layers grouped by window, and each layer's physical KV tensor."""

    windows: tuple[int | None, ...]  # per group: its sliding window in tokens, None: full attention
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: the physical K/V tensor pair holding its blocks
    num_slots: int  # physical tensor pairs (layers per group)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_cache_layers(self) -> int:
        """Layer slots a block per group costs: every group's slots (padding included)."""
        return self.num_groups * self.num_slots

    @property
    def num_padding_layers(self) -> int:
        """Layer slots no layer uses (their share of every block is allocated and never read)."""
        return self.num_groups * self.num_slots - len(self.layer_group)


def group_layers(layer_windows: Sequence[int | None]) -> KVGroupLayout | None:
    """Group layers by window (``layer_windows[i]``: layer ``i``'s, None: full attention); None
    when every layer has the same one. Full-attention groups come first (group 0 keys the
    prefix cache's events), then windows from the smallest."""
    by_window: dict[int | None, list[int]] = {}
    for i, w in enumerate(layer_windows):
        by_window.setdefault(w, []).append(i)
    if len(by_window) < 2:
        return None
    counts = [len(layers) for layers in by_window.values()]
    size = max(counts) if max(counts) < 1.25 * min(counts) else min(counts)
    windows: list[int | None] = []
    layer_group = [0] * len(layer_windows)
    layer_slot = [0] * len(layer_windows)
    for w in sorted(by_window, key=lambda w: (w is not None, w or 0)):
        layers = by_window[w]
        num_groups = -(-len(layers) // size)
        for k in range(num_groups):
            for slot, layer in enumerate(layers[k::num_groups]):
                layer_group[layer], layer_slot[layer] = len(windows), slot
            windows.append(w)
    return KVGroupLayout(tuple(windows), tuple(layer_group), tuple(layer_slot), size)


def _model_drafts(config: EngineConfig) -> bool:
    """A draft model or an EAGLE-3 head proposes drafts (it reads the served model's table)."""
    text = config.speculative_config
    if not text or not text.strip():
        return False
    try:
        raw = json.loads(text)
    except json.JSONDecodeError:
        return True  # refused with its own message later
    return not isinstance(raw, dict) or raw.get("method", "ngram") != "ngram" or (
        raw.get("model") not in (None, "ngram", "[ngram]"))  # fmt: skip


def kv_groups_for(spec: ModelSpec, config: EngineConfig) -> tuple[KVGroupLayout | None, str | None]:
    """The layout for ``spec`` served with ``config``, or (None, why not) when the model mixes
    attention types but keeps one table (why is None when it has nothing to group)."""
    if spec.sliding_window is None or spec.mla is not None or spec.state_layers:  # latent or hybrid: as today
        return None, None
    if spec.arch == "llama4_text":  # chunked layers read chunk-shifted tables (model/llama4.py)
        return None, None
    layout = group_layers([spec.layer_window(i) for i in range(spec.num_layers)])
    if layout is None:
        return None, None
    why = ("INFLIGHT_KV_GROUPS=0" if (env_vars.read_str(KV_GROUPS_ENV) or "").strip() == "0"
           else "a pipeline stage's forward reads one block table" if config.pipeline_parallel_size > 1
           else "a draft model or EAGLE-3 head reads the served model's block table" if _model_drafts(config)
           else "the host KV tier (kv_offloading_size) saves whole blocks of every layer"
           if config.kv_offloading_size is not None
           else "the pooling runner" if config.runner == "pooling" or spec.head != "lm"
           else None)  # fmt: skip
    return (None, why) if why is not None else (layout, None)


def kv_groups_of(model: Any, config: EngineConfig) -> KVGroupLayout | None:
    """:func:`kv_groups_for` ``model``'s spec, logged, with each layer's group set on the model
    (``CausalLM.kv_layer_groups``: each layer reads its group's table)."""
    layout, why = kv_groups_for(model.spec, config)
    if why is not None:
        logger.info("one KV block table for every layer of %s (%s): its windowed layers free nothing",
                    model.spec.arch, why)
    if layout is None:
        return None
    model.kv_layer_groups = layout.layer_group
    logger.info("per-group KV tables: %d groups of %d layers (windows %s, %d padding layer slots); the "
                "one-call decode stack is off (it takes one block table)",
                layout.num_groups, layout.num_slots, layout.windows, layout.num_padding_layers)
    return layout


def grouped_caches(layout: KVGroupLayout, shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) cache: ``layout.num_slots`` tensor pairs of ``shape`` (``[pool blocks,
    block_size, kv_heads, head_dim]``), layer ``i`` given pair ``layer_slot[i]``."""
    pairs = [(cache_zeros(shape, dtype, device), cache_zeros(shape, dtype, device))
             for _ in range(layout.num_slots)]
    return [pairs[slot] for slot in layout.layer_slot]
