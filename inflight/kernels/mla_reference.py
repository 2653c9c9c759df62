"""Torch references of the multi-head latent attention (MLA) kernels: the specification the Triton
(:mod:`.triton_mla_decode`, :mod:`.triton_mla_prefill`) and native C (:mod:`.cpu_mla`) kernels are
tested against, and what runs where no other kernel exists.

The paged MLA cache of one layer is two tensors indexed by the same block tables as every other
family's K/V: ``latent_cache`` ``[num_blocks, block_size, 1, kv_lora_rank]`` (the normed KV latent
of each token) and ``pe_cache`` ``[num_blocks, block_size, 1, qk_rope_head_dim]`` (its roped key,
shared by every head). ``block_tables``, ``context_lens`` and ``slot_mapping`` mean what they mean in
:mod:`.reference` (context lengths include this step's tokens, stored before attention runs).

Absorbed decode: each head's query is already projected into the latent space (``q_nope @ W_UK``:
``q_latent`` ``[num_seqs, num_heads, kv_lora_rank]``) beside its roped part (``q_pe``); a score is
``(q_latent . latent + q_pe . k_pe) * scale`` and the output is the softmax-weighted sum of the
latents, ``[num_seqs, num_heads, kv_lora_rank]``, which the model projects through ``W_UV``. So a
decode step reads only the latent cache.

Absorbed prefill (:func:`paged_mla_prefill`): the same in the latent space for chunks of query
tokens packed back to back (``query_start_loc``, as :func:`.reference.paged_prefill_attention`):
the ``q_len`` queries of sequence ``s`` sit at positions ``context_len - q_len .. context_len - 1``
and each sees every cached latent at or before its own position (the chunk's own latents are stored
before attention runs). Knows nothing about the model or the scheduler.
"""

from __future__ import annotations

import torch

from inflight.kernels.reference import _gather_blocks


def paged_mla_decode(
    q_latent: torch.Tensor,  # [num_seqs, num_heads, kv_lora_rank]
    q_pe: torch.Tensor,  # [num_seqs, num_heads, rope_dim]
    latent_cache: torch.Tensor,  # [num_blocks, block_size, 1, kv_lora_rank]
    pe_cache: torch.Tensor,  # [num_blocks, block_size, 1, rope_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, kv_lora_rank]
    """One query token per sequence attending, in the latent space, to its cached context."""
    num_seqs, _, rank = q_latent.shape
    if num_seqs == 0:
        return torch.empty_like(q_latent)
    block_size = latent_cache.shape[1]
    num_blocks = -(-int(context_lens.max()) // block_size)
    table = block_tables[:num_seqs, :num_blocks].long()
    latent = _gather_blocks(latent_cache, table).reshape(num_seqs, num_blocks * block_size, rank).float()
    pe = _gather_blocks(pe_cache, table).reshape(num_seqs, num_blocks * block_size, -1).float()
    scores = torch.bmm(q_latent.float(), latent.transpose(1, 2)) + torch.bmm(q_pe.float(), pe.transpose(1, 2))
    positions = torch.arange(num_blocks * block_size, device=q_latent.device)
    beyond = positions[None, :] >= context_lens[:num_seqs, None].long()  # [num_seqs, padded context]
    scores = (scores * scale).masked_fill(beyond[:, None, :], float("-inf"))
    return torch.bmm(torch.softmax(scores, dim=-1), latent).to(q_latent.dtype)


def paged_mla_prefill(
    q_latent: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank], sequences packed back to back
    q_pe: torch.Tensor,  # [num_tokens, num_heads, rope_dim]
    latent_cache: torch.Tensor,  # [num_blocks, block_size, 1, kv_lora_rank]
    pe_cache: torch.Tensor,  # [num_blocks, block_size, 1, rope_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, offsets of each sequence's queries
    context_lens: torch.Tensor,  # [num_seqs] int32, cached tokens incl. this chunk
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, kv_lora_rank]
    """Chunks of query tokens attending, in the latent space, to their paged context, causally."""
    out = torch.empty_like(q_latent)
    starts, lens = query_start_loc.tolist(), context_lens.tolist()
    for s, context in enumerate(lens):
        lo, hi = starts[s], starts[s + 1]
        if hi == lo:
            continue
        latent = gather_context(latent_cache, block_tables[s], context).float()  # [context, rank]
        k_pe = gather_context(pe_cache, block_tables[s], context).float()  # [context, rope_dim]
        scores = (torch.einsum("thc,jc->htj", q_latent[lo:hi].float(), latent)
                  + torch.einsum("thr,jr->htj", q_pe[lo:hi].float(), k_pe)) * scale  # fmt: skip
        rows = torch.arange(hi - lo, device=q_latent.device)[:, None] + (context - (hi - lo))
        visible = torch.arange(context, device=q_latent.device)[None, :] <= rows  # [q_len, context]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[lo:hi] = torch.einsum("htj,jc->thc", probs, latent).to(out.dtype)
    return out


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first ``context_len`` cached rows of one sequence, ``[context_len, width]``."""
    block_size = cache.shape[1]
    rows = _gather_blocks(cache, block_table[: -(-context_len // block_size)].long())
    return rows.reshape(-1, cache.shape[-1])[:context_len]
