"""ShardLayout: which part of the model one tensor-parallel rank owns (Megatron-style).

Attention is split by heads: each rank owns ``num_heads / N`` query heads and
``num_kv_heads / N`` KV heads, or, when there are fewer KV heads than ranks, one KV head
replicated across the ``N / num_kv_heads`` ranks whose query heads read it. The MLP is split
by intermediate columns; the embedding and the LM head by vocabulary rows (padded up to a
multiple of N, the padding rows are zero and never sampled). Pure arithmetic: knows nothing
about torch, processes or weights files.
"""

from __future__ import annotations

from dataclasses import dataclass

from inflight.runtime.model.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class ShardLayout:
    rank: int
    world_size: int
    num_heads: int  # query heads on this rank
    q_head_start: int
    num_kv_heads: int  # KV heads on this rank (1 when replicated)
    kv_head_start: int
    intermediate_size: int  # MLP columns on this rank
    vocab_start: int  # first vocabulary row on this rank
    vocab_end: int  # one past the last real row (<= vocab_start + vocab_per_rank)
    vocab_per_rank: int  # rows of this rank's embedding / LM head shard, padding included

    @property
    def is_sharded(self) -> bool:
        return self.world_size > 1


def valid_tensor_parallel_sizes(spec: ModelSpec, limit: int = 64) -> list[int]:
    """Every size up to ``limit`` that splits ``spec``'s heads and MLP evenly."""
    return [n for n in range(1, limit + 1) if _problem(spec, n) is None]


def _problem(spec: ModelSpec, n: int) -> str | None:
    if spec.num_heads % n:
        return f"the model's {spec.num_heads} attention heads"
    kv = spec.num_kv_heads
    if (kv >= n and kv % n) or (kv < n and n % kv):
        return f"the model's {kv} KV heads (nor is it a multiple of them)"
    if spec.intermediate_size % n:
        return f"the model's MLP width {spec.intermediate_size}"
    if spec.moe is not None and spec.moe.intermediate_size % n:  # experts split like the MLP (model/moe.py)
        return f"the model's expert MLP width {spec.moe.intermediate_size}"
    if spec.moe is not None and spec.moe.shared_intermediate_size % n:  # GLM-4.5's shared expert, the same way
        return f"the model's shared expert width {spec.moe.shared_intermediate_size}"
    return None


def shard_layout(spec: ModelSpec, rank: int, world_size: int) -> ShardLayout:
    """The layout of ``rank`` in a group of ``world_size``; ``ValueError`` if the model does not split."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a tensor-parallel group of {world_size}.")
    problem = _problem(spec, world_size)
    if problem is not None:
        sizes = ", ".join(str(n) for n in valid_tensor_parallel_sizes(spec))
        raise ValueError(
            f"tensor_parallel_size {world_size} does not evenly divide {problem}; "
            f"sizes this model supports: {sizes}."
        )
    num_heads = spec.num_heads // world_size
    if spec.num_kv_heads >= world_size:
        num_kv = spec.num_kv_heads // world_size
        kv_start = rank * num_kv
    else:  # replicate: ranks [k * N/kv, (k+1) * N/kv) share KV head k
        num_kv = 1
        kv_start = rank * spec.num_kv_heads // world_size
    per_rank = -(-spec.vocab_size // world_size)
    vocab_start = min(rank * per_rank, spec.vocab_size)
    return ShardLayout(
        rank=rank,
        world_size=world_size,
        num_heads=num_heads,
        q_head_start=rank * num_heads,
        num_kv_heads=num_kv,
        kv_head_start=kv_start,
        intermediate_size=spec.intermediate_size // world_size,
        vocab_start=vocab_start,
        vocab_end=min(vocab_start + per_rank, spec.vocab_size),
        vocab_per_rank=per_rank,
    )
