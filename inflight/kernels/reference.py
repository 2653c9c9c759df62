"""Torch reference implementations of every kernel, with the signatures the Triton kernels share.

These run on any device and are the ground truth the Triton kernels are tested against.
Shapes (all packed, no padding of tokens):

* ``k_cache``/``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer.
* ``slot_mapping``: ``[num_tokens]`` int64, ``block_id * block_size + offset``; ``-1`` skips a token.
* ``block_tables``: ``[num_seqs, max_blocks_per_seq]`` int32, unused entries arbitrary.
* ``context_lens``: ``[num_seqs]`` int32, tokens in the cache for each sequence *including*
  the tokens of this step (their K/V are stored before attention runs).
* ``sliding_window``: ``None`` (or 0) attends to the whole context; ``W`` lets the query at
  position ``p`` see only keys at positions ``p - W + 1 .. p`` (``W`` keys, itself included),
  transformers' convention (``kv_idx > q_idx - sliding_window``). Keys outside the window may
  sit in the cache (their blocks stay allocated); they are masked, never read as weights.
* ``sinks``: ``None``, or ``[num_heads]`` float32 (gpt-oss): a learned logit per query head that
  joins each softmax's denominator with no value, ``softmax([scores, sink])[:-1] @ V``. It is a
  logit as is (the attention scale does not apply to it).
* ``k_scale``/``v_scale`` (keyword only): the per-layer scales of an fp8 cache (``float8_e4m3fn``
  or ``float8_e5m2``; :mod:`inflight.kernels.fp8_kv`): the store quantizes ``x * (1 / scale)``
  (saturating), attention reads ``stored * scale`` and runs the float path. None: 1.0. A float
  cache is never scaled. Attention always sees the context as the cache holds it (a whole
  prompt's own K/V are rounded through the cache's format too).

This module knows nothing about the scheduler or the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inflight.kernels import fp8_kv
from inflight.kernels.fp8_kv import Scale


def store_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    *,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> None:
    """Write each token's K and V into its slot of the paged cache (in place), quantized when
    the cache is fp8."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    flat_k = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    _index_copy(flat_k, slot_mapping, fp8_kv.store_value(key, k_cache.dtype, k_scale))
    _index_copy(flat_v, slot_mapping, fp8_kv.store_value(value, v_cache.dtype, v_scale))


def _index_copy(flat: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``flat[slots] = rows`` in place; fp8 through byte views (torch has no fp8 index_copy)."""
    if fp8_kv.is_fp8(flat.dtype):
        flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
    flat.index_copy_(0, slots, rows)


def _gather_blocks(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``cache[table]`` for an int64 block table of any shape, via one ``index_select`` (faster on CPU)."""
    raw = cache.view(torch.uint8) if fp8_kv.is_fp8(cache.dtype) else cache  # no fp8 index_select
    rows = raw.flatten(1).index_select(0, table.reshape(-1)).view(cache.dtype)  # [table.numel(), bs * H_kv * D]
    return rows.view(*table.shape, *cache.shape[1:])


def _gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> torch.Tensor:
    """The first ``context_len`` cached rows of one sequence: [context_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    rows = _gather_blocks(
        cache, block_table[:num_blocks].long()
    )  # [num_blocks, block_size, H_kv, D]
    return rows.reshape(-1, cache.shape[2], cache.shape[3])[:context_len]


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] float32 logits
    *,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query token per sequence attending to its cached context (GQA aware), the last
    ``sliding_window`` tokens of it when a window is given, with a sink logit per head when given.

    Sequences are bucketed by context length (see :func:`_length_buckets`) so the gathered,
    padded K/V stay close to the real context instead of ``num_seqs x`` the longest one.
    """
    num_seqs = query.shape[0]
    if num_seqs == 0:
        return torch.empty_like(query)
    buckets = _length_buckets(context_lens.tolist(), k_cache.shape[1])
    if len(buckets) == 1:
        return _decode_bucket(
            query, k_cache, v_cache, block_tables, context_lens, scale, buckets[0][1], sliding_window, sinks,
            (k_scale, v_scale),
        )
    out = torch.empty_like(query)
    for rows, num_blocks in buckets:
        idx = torch.tensor(rows, dtype=torch.long, device=query.device)
        part = _decode_bucket(
            query.index_select(0, idx), k_cache, v_cache, block_tables.index_select(0, idx),
            context_lens.index_select(0, idx), scale, num_blocks, sliding_window, sinks, (k_scale, v_scale),
        )
        out.index_copy_(0, idx, part)
    return out


def _length_buckets(context_lens: list[int], block_size: int) -> list[tuple[list[int], int]]:
    """Rows grouped by context length, longest first: ``(row indices, blocks to gather)``.

    A new bucket starts when a sequence needs under 3/4 of the bucket's longest, which keeps
    the padding within a third of what is gathered; few buckets when lengths are close.
    """
    order = sorted(range(len(context_lens)), key=lambda i: -context_lens[i])
    buckets: list[tuple[list[int], int]] = []
    for i in order:
        num_blocks = max(1, -(-context_lens[i] // block_size))
        if buckets and 4 * num_blocks >= 3 * buckets[-1][1]:
            buckets[-1][0].append(i)
        else:
            buckets.append(([i], num_blocks))
    return buckets


def _decode_bucket(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, >= max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    max_blocks: int,  # blocks of the longest context in this bucket
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
    kv_scales: tuple[Scale, Scale] = (None, None),
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_slots = max_blocks * k_cache.shape[1]
    table = block_tables[:, :max_blocks].long()
    # Gather every sequence's blocks at once, then view them as [S, H_kv, T, D] (no copy).
    keys = fp8_kv.dequantize(_gather_blocks(k_cache, table), kv_scales[0])
    values = fp8_kv.dequantize(_gather_blocks(v_cache, table), kv_scales[1])
    keys = keys.view(num_seqs, num_slots, num_kv_heads, head_dim).transpose(1, 2)
    values = values.view(num_seqs, num_slots, num_kv_heads, head_dim).transpose(1, 2)
    # The G query heads sharing a KV head act as G queries of one attention call.
    q = query.reshape(num_seqs, num_kv_heads, group, head_dim)
    positions = torch.arange(num_slots, device=query.device)
    lens = context_lens.long()[:, None]  # [S, 1]
    visible = positions[None, :] < lens  # [S, T]
    if sliding_window:  # the query sits at position len - 1: keys after len - 1 - W
        visible &= positions[None, :] >= lens - sliding_window
    visible = visible[:, None, None, :]  # [S, 1, 1, T]
    if sinks is not None:
        out = attention_with_sinks(q[:, :, :, None], keys[:, :, None], values[:, :, None],
                                   visible[:, :, :, None], scale, sinks)[:, :, :, 0]  # fmt: skip
        return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)
    out = F.scaled_dot_product_attention(
        q.float(), keys.float(), values.float(), attn_mask=visible, scale=scale
    )  # [S, H_kv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences packed back to back
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, offsets of each sequence's queries
    context_lens: torch.Tensor,  # [num_seqs] int32, cached tokens incl. this chunk
    scale: float,
    key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim], this chunk's own K
    value: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim], this chunk's own V
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] float32 logits
    *,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Chunks of prompt tokens attending to their paged context, causal within the chunk.

    The ``q_len`` queries of sequence ``s`` sit at positions ``context_len - q_len ..
    context_len - 1``; each attends to every cached key at or before its own position (and,
    with ``sliding_window`` ``W``, after ``position - W``).
    With ``key``/``value`` (the chunk's own K/V, packed like ``query``), a whole prompt (no
    cached prefix) attends to them directly instead of gathering them back from the cache.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for s in range(len(lens)):
        q_begin, q_end, ctx = starts[s], starts[s + 1], lens[s]
        q_len = q_end - q_begin
        if q_len == 0:
            continue
        if key is not None and value is not None and ctx == q_len:  # as the cache holds them
            keys, values = _as_cached(key[q_begin:q_end], k_cache.dtype, k_scale), _as_cached(
                value[q_begin:q_end], v_cache.dtype, v_scale)  # [ctx, H_kv, D] float32
        else:
            keys = fp8_kv.dequantize(_gather_context(k_cache, block_tables[s], ctx), k_scale)  # [ctx, H_kv, D]
            values = fp8_kv.dequantize(_gather_context(v_cache, block_tables[s], ctx), v_scale)
        q = query[q_begin:q_end].float().transpose(0, 1)[None]  # [1, H, q_len, D]
        visible = None  # a whole prompt (no cached prefix): plain causal, no mask tensor
        windowed = bool(sliding_window) and ctx > sliding_window
        if ctx != q_len or windowed or sinks is not None:
            q_pos = torch.arange(ctx - q_len, ctx, device=query.device)
            k_pos = torch.arange(ctx, device=query.device)
            visible = k_pos[None, :] <= q_pos[:, None]  # [q_len, ctx]
            if windowed:
                visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
        if sinks is not None:
            q5 = q.reshape(1, num_kv_heads, group, q_len, head_dim)
            k5 = keys.transpose(0, 1)[None, :, None]  # [1, H_kv, 1, ctx, D]
            v5 = values.transpose(0, 1)[None, :, None]
            o5 = attention_with_sinks(q5, k5, v5, visible, scale, sinks)  # [1, H_kv, G, q_len, D]
            o = o5.reshape(num_heads, q_len, head_dim).transpose(0, 1)
            out[q_begin:q_end] = o.to(query.dtype)
            continue
        o = F.scaled_dot_product_attention(
            q,
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=visible,
            is_causal=visible is None,
            scale=scale,
            enable_gqa=group > 1,
        )[0].transpose(0, 1)  # [q_len, H, D]
        out[q_begin:q_end] = o.reshape(q_len, num_heads, head_dim).to(query.dtype)
    return out


def _as_cached(x: torch.Tensor, cache_dtype: torch.dtype, scale: Scale) -> torch.Tensor:
    """float32 ``x`` as a cache of ``cache_dtype`` reads it back (rounded through fp8, or through
    bfloat16 for a float32 engine's bfloat16 cache)."""
    return fp8_kv.dequantize(fp8_kv.store_value(x, cache_dtype, scale), scale)


def attention_with_sinks(
    q: torch.Tensor,  # [B, H_kv, G, L, D]
    k: torch.Tensor,  # [B, H_kv, 1, T, D]
    v: torch.Tensor,  # [B, H_kv, 1, T, D]
    visible: torch.Tensor,  # bool, broadcastable to [B, H_kv, G, L, T]
    scale: float,
    sinks: torch.Tensor,  # [H_kv * G] logits
) -> torch.Tensor:  # [B, H_kv, G, L, D] float32
    """Softmax attention whose denominator also holds each head's sink logit, in float32, as
    transformers' gpt-oss eager attention: ``softmax([scores, sink] - max)[:-1] @ V``."""
    num_kv_heads, group = q.shape[1], q.shape[2]
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, H_kv, G, L, T]
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.float().reshape(1, num_kv_heads, group, 1, 1).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.matmul(probs, v.float())


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x + residual``; returns (normed, the new residual ``x + residual``)."""
    if residual is not None:
        x = x + residual
    new_residual = x
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    normed = (xf * torch.rsqrt(variance + eps)).to(x.dtype)
    return weight * normed, new_residual


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim] (cos half, then sin half), fp32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding over the first ``rotary_dim`` features."""
    cos_sin = cos_sin_cache[positions]  # [num_tokens, rotary_dim]
    cos, sin = cos_sin.chunk(2, dim=-1)  # [num_tokens, rotary_dim / 2] each
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1] * 2
    x_rot = x[..., :rot].float()
    x1, x2 = x_rot.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    if rot == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rot:]), dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [num_tokens, d]
    """SwiGLU: ``silu(gate) * up`` where ``gate_up`` is [num_tokens, 2 * d] (gate, then up)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(
    x: torch.Tensor,  # [num_rows, in_features]
    weight: torch.Tensor,  # [out_features, in_features]
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [num_rows, out_features]
    """``x @ weight.T + bias``: every weight matmul of the model goes through here."""
    return F.linear(x, weight, bias)


@dataclass(frozen=True, slots=True)
class ClampedSwiglu:
    """gpt-oss's expert activation over (gate, up): ``gate`` clamped above at ``limit``, ``up``
    to ``[-limit, limit]``, then ``(up + 1) * gate * sigmoid(alpha * gate)``."""

    alpha: float
    limit: float


def clamped_swiglu(gate_up: torch.Tensor, act: ClampedSwiglu) -> torch.Tensor:  # [num_rows, d]
    """:class:`ClampedSwiglu` of ``gate_up`` [num_rows, 2 * d] (gate, then up)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))


def fused_moe(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]: each expert's gate rows, then up rows
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32 or int64
    *,
    w13_bias: torch.Tensor | None = None,  # [num_experts, 2 * intermediate] (gate, then up)
    w2_bias: torch.Tensor | None = None,  # [num_experts, hidden]
    activation: ClampedSwiglu | None = None,  # None: silu(gate) * up
) -> torch.Tensor:  # [num_tokens, hidden]
    """Mixture-of-experts SwiGLU MLP: ``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t])``.

    The ``num_tokens * top_k`` (token, expert) pairs are sorted by expert, so each expert that
    has tokens runs two matmuls over all of its rows at once (no loop over tokens); experts with
    no tokens cost nothing. Each expert's output is rounded to ``hidden``'s dtype, weighted and
    summed over the top-k in float32, and the sum rounded once. Reads the per-expert counts on
    the host, so it is not graph-safe. gpt-oss's experts add ``w13_bias``/``w2_bias`` to their
    matmuls and use the :class:`ClampedSwiglu` ``activation``.
    """
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).long()  # [num_tokens * top_k]
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert, tokens in order
    token_of = order // top_k  # [num_tokens * top_k] the token of each sorted pair
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    rows = hidden.index_select(0, token_of)  # [num_tokens * top_k, hidden]
    expert_out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        b13 = None if w13_bias is None else w13_bias[expert]
        b2 = None if w2_bias is None else w2_bias[expert]
        gate_up = F.linear(rows[start:end], w13[expert], b13)  # [count, 2 * intermediate]
        act = silu_and_mul(gate_up) if activation is None else clamped_swiglu(gate_up, activation)
        expert_out[start:end] = F.linear(act, w2[expert], b2)
        start = end
    weighted = expert_out.float() * topk_weights.reshape(-1)[order].float().unsqueeze(-1)
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    return out.index_add_(0, token_of, weighted).to(hidden.dtype)
