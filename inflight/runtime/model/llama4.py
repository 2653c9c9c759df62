"""Llama 4 text's attention twists and checkpoint layout, for the shared decoder.

Each Llama 4 layer's :class:`~.decoder.Attention` carries a :class:`LayerAttention` (its
``variant``) that takes the place of the plain rotary call: RoPE layers rotate, then (with
``use_qk_norm``) L2-normalise q and k (a weightless RMS norm); NoPE layers do not rotate and, with
``attn_temperature_tuning``, scale each query by ``log1p(floor((pos + 1) / floor_scale)) *
attn_scale + 1``. Chunked layers (the RoPE layers: keys only within the query's own
``attention_chunk_size`` chunk) need no kernel change: a query's visible keys are a suffix of its
sequence's block table that starts at a chunk boundary, so :func:`chunked_metadata` rewrites the
step's metadata for those layers: each decode row's block table shifted to its chunk's first block
and its context cut to the chunk; each prompt chunk split where it crosses a chunk boundary into
pieces that are attended as separate sequences the same way. That needs ``attention_chunk_size``
to be a multiple of the KV block size (Llama 4's 8192 is, for every block size we allow).

Rotary: Llama 4 rotates interleaved pairs (features 2i, 2i+1) where our kernels rotate halves
(i, i + D/2). The loader permutes each head's q/k projection rows (:func:`halves_from_pairs`) so
pairs land as halves; attention scores are sums over features, so they are unchanged (the L2
norm too). Experts come as transformers 5 holds them, ``experts.gate_up_proj`` ``[E, hidden, 2I]``
and ``experts.down_proj`` ``[E, I, hidden]``: :func:`read_expert_tensor` transposes them into
ours. Knows nothing about scheduling or files.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from inflight.kernels.ops import KernelOps
from inflight.runtime.model.batch import AttentionMetadata
from inflight.runtime.model.layout import ShardLayout
from inflight.runtime.model.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """One Llama 4 layer's attention options (see the module docstring)."""

    use_rope: bool
    chunk_size: int | None  # None: full causal attention
    l2_norm_eps: float | None  # None: no L2 q/k norm
    temperature: tuple[float, float] | None  # (floor_scale, attn_scale) of a NoPE layer; None: off

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
        meta: AttentionMetadata, k_cache: torch.Tensor, ops: KernelOps,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:  # fmt: skip
        """q ``[num_tokens, num_heads, head_dim]`` and k ready for the store and attention, and the
        metadata this layer's attention reads."""
        if self.use_rope:
            q, k = ops.rotary_embedding(positions, q, k, cos_sin)
        if self.l2_norm_eps is not None:
            q, k = l2_norm(q, self.l2_norm_eps), l2_norm(k, self.l2_norm_eps)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * scales[:, None, None]).to(q.dtype)
        if self.chunk_size is not None:
            meta = chunked_metadata(meta, self.chunk_size, k_cache.shape[1])
        return q, k, meta


def layer_attention(spec: ModelSpec, index: int) -> LayerAttention | None:
    """Layer ``index``'s :class:`LayerAttention`; None for every family but Llama 4."""
    if spec.arch != "llama4_text":
        return None
    nope = index in spec.nope_layers
    return LayerAttention(
        use_rope=not nope,
        chunk_size=spec.attention_chunk_size if index in spec.chunked_layers else None,
        l2_norm_eps=spec.rms_norm_eps if spec.l2_qk_norm and not nope else None,
        temperature=spec.attn_temperature if nope else None,
    )


def check_chunk_size(spec: ModelSpec, block_size: int) -> None:
    """``ValueError`` at startup when chunked layers' chunks do not start on KV block boundaries."""
    chunk = spec.attention_chunk_size
    if chunk is not None and spec.chunked_layers and chunk % block_size:
        raise ValueError(f"Llama 4's attention_chunk_size {chunk} must be a multiple of the KV block size "
                         f"{block_size}: choose a --block-size that divides it.")  # fmt: skip


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    """``x / rms(x)`` over the last dimension in float32 (no weight), back in ``x``'s dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _shift_rows(tables: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """Each row of ``tables`` ``[rows, max_blocks]`` moved left by its ``shifts`` entries (the tail
    repeats the last column: past the context, never read)."""
    cols = torch.arange(tables.shape[1], device=tables.device)[None, :] + shifts[:, None].long()
    return torch.gather(tables, 1, cols.clamp(max=max(tables.shape[1] - 1, 0))).contiguous()


def chunked_metadata(meta: AttentionMetadata, chunk_size: int, block_size: int) -> AttentionMetadata:
    """``meta`` rewritten so every query sees only the keys of its own chunk (module docstring)."""
    if chunk_size % block_size:  # check_chunk_size refuses it at startup
        raise ValueError(f"attention_chunk_size {chunk_size} is not a multiple of the KV block size {block_size}.")
    blocks_per_chunk = chunk_size // block_size
    fields: dict[str, Any] = {}
    if meta.num_decode_tokens:
        ctx = meta.decode_context_lens.long()
        first_chunk = (ctx - 1) // chunk_size  # the chunk of each row's query (at ctx - 1)
        fields["decode_block_tables"] = _shift_rows(meta.decode_block_tables, first_chunk * blocks_per_chunk)
        fields["decode_context_lens"] = (ctx - first_chunk * chunk_size).to(meta.decode_context_lens.dtype)
    if meta.num_prefills:
        starts, lens = meta.prefill_query_start_loc.tolist(), meta.prefill_context_lens.tolist()
        rows, shifts, locs, ctxs = [], [], [0], []
        for s, ctx in enumerate(lens):
            pos = ctx - (starts[s + 1] - starts[s])  # the first query's position
            while pos < ctx:
                chunk_start = pos // chunk_size * chunk_size
                end = min(ctx, chunk_start + chunk_size)
                rows.append(s)
                shifts.append(chunk_start // block_size)
                locs.append(locs[-1] + end - pos)
                ctxs.append(end - chunk_start)
                pos = end
        device = meta.prefill_block_tables.device
        tables = meta.prefill_block_tables[torch.tensor(rows, dtype=torch.long, device=device)]
        fields["prefill_block_tables"] = _shift_rows(tables, torch.tensor(shifts, device=device))
        fields["prefill_query_start_loc"] = torch.tensor(locs, dtype=meta.prefill_query_start_loc.dtype, device=device)
        fields["prefill_context_lens"] = torch.tensor(ctxs, dtype=meta.prefill_context_lens.dtype, device=device)
        fields["num_prefills"] = len(rows)
    return dataclasses.replace(meta, **fields)


def halves_from_pairs(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q/k projection rows (or biases) ``[heads * head_dim, ...]`` with each head's features
    reordered from interleaved pairs (0, 1), (2, 3), ... to halves: 0, 2, 4, ..., then 1, 3, 5, ...."""
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    heads = weight.reshape(-1, head_dim, *weight.shape[1:])
    return heads[:, order].reshape(weight.shape)


def read_expert_tensor(hf_name: str, kind: str, part: Any, spec: ModelSpec, layout: ShardLayout) -> torch.Tensor:
    """This rank's columns of a Llama 4 fused expert tensor, in our layout (``[E, 2I/N, hidden]``
    gate then up; ``[E, hidden, I/N]``)."""
    assert spec.moe is not None
    full, hidden, num_experts = spec.moe.intermediate_size, spec.hidden_size, spec.moe.num_experts
    expected = {"gate_up": (num_experts, hidden, 2 * full), "down": (num_experts, full, hidden)}.get(kind)
    shape = tuple(part.get_shape())
    if expected is None or shape != expected:
        raise ValueError(f"{hf_name}: shape {shape}, expected {expected} (Llama 4's experts have no biases).")
    width = full // layout.world_size
    lo, hi = layout.rank * width, (layout.rank + 1) * width
    if kind == "gate_up":
        return torch.cat([part[:, :, lo:hi], part[:, :, full + lo : full + hi]], dim=2).transpose(1, 2)
    return part[:, lo:hi, :].transpose(1, 2)
