"""A decoder step's one-call decode paths: the rows the one-call attention block takes (converted
once for every layer, or once per KV group's view), and the one-call layer stack, built once and
kept while what it was built from stays the same objects.

Which steps take them is a path choice, documented where it is made: a step with prompt chunks, an
fp8 KV cache (docs/kv-cache-dtype.md: the one-call kernels read float caches only), Llama 4's layers
(NoPE and chunked attention, :mod:`.llama4`) and latent attention (:mod:`.mla`, its own decode path)
get no rows and run op by op; the stack also needs no LoRA rows, no per-group KV tables and no
draft-head states (:class:`~inflight.runtime.model.aux_hidden.AuxHidden`). Which layers the stack can
hold is the decoder's (:func:`inflight.runtime.model.decoder.decode_stack_of`). Knows nothing about
the layers' arithmetic, scheduling or sampling.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inflight.kernels import fp8_kv
from inflight.kernels.decode_block import DecodeRows
from inflight.kernels.decode_stack import DecodeStack
from inflight.kernels.ops import KernelOps
from inflight.runtime.model.batch import AttentionMetadata, layer_metas

# architectures whose attention the one-call block does not do (see the module docstring)
OP_BY_OP_ARCHS = frozenset({"llama4_text", "deepseek_v3", "deepseek_v2"})


def decode_rows(positions: torch.Tensor, meta: AttentionMetadata, ops: KernelOps) -> DecodeRows | None:
    """A pure-decode step's rows for the one-call attention block, converted once for every layer;
    None when the step has prompt chunks or the bundle has no such block."""
    if meta.num_prefills or ops.decode_attention_block is None:
        return None
    return DecodeRows.of(positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens)


def step_rows(arch: str, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
              meta: AttentionMetadata, ops: KernelOps) -> DecodeRows | None:  # fmt: skip
    """The step's one-call rows (:func:`decode_rows`), or None where a path choice rules the block
    out: an fp8 cache, or an ``arch`` of :data:`OP_BY_OP_ARCHS`."""
    fp8 = bool(kv_caches) and fp8_kv.is_fp8(kv_caches[0][0].dtype)
    return None if fp8 or arch in OP_BY_OP_ARCHS else decode_rows(positions, meta, ops)


def layer_rows(meta: AttentionMetadata, layer_groups: tuple[int, ...] | None, num_layers: int,
               rows: DecodeRows | None, positions: torch.Tensor,
               ops: KernelOps) -> tuple[list[AttentionMetadata], list[DecodeRows | None]]:  # fmt: skip
    """Each layer's metadata and one-call rows: ``meta`` and ``rows`` for every layer, or with
    per-group KV tables (``layer_groups``) its group's view and that view's rows
    (:func:`~inflight.runtime.model.batch.layer_metas`)."""
    return layer_metas(meta, layer_groups, num_layers, rows, lambda view: decode_rows(positions, view, ops))


def stack_applies(rows: DecodeRows | None, meta: AttentionMetadata, ops: KernelOps, collects_aux: bool) -> bool:
    """Whether the step may run the whole stack in one call: one-call rows, a bundle with the
    stack, no LoRA rows (the stack has no place for their deltas), no draft-head states to collect
    (it returns only the final state) and one block table (no per-group KV tables)."""
    return (rows is not None and ops.decode_layer_stack is not None and meta.token_slots is None
            and not collects_aux and meta.group_slot_mapping is None)  # fmt: skip


class StackCache:
    """The one-call decode stack and what it was built from (the KV caches, the rope tables, the
    first layer's q/k/v weight, which prepacking replaces): rebuilt when any of them is another
    object."""

    __slots__ = ("_key", "_stack")

    def __init__(self) -> None:
        self._key: tuple[object, object, object] | None = None
        self._stack: DecodeStack | None = None

    def get(self, kv_caches: object, cos_sin: object, weight: object,
            build: Callable[[], DecodeStack | None]) -> DecodeStack | None:  # fmt: skip
        """The stack for these objects: the kept one, or ``build()``'s (None: the layers cannot
        be stacked, also kept)."""
        key = self._key
        if key is None or key[0] is not kv_caches or key[1] is not cos_sin or key[2] is not weight:
            self._stack = build()
            self._key = (kv_caches, cos_sin, weight)
        return self._stack
