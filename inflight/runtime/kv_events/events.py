"""The KV-cache events a router follows, and their bytes on the wire (vLLM's layout).

vLLM declares its events as msgspec structs with ``array_like=True`` and ``tag=True``
(``vllm/distributed/kv_events.py``): each event is a msgpack array whose first item is the
class name (``"BlockStored"``, ``"BlockRemoved"``, ``"AllBlocksCleared"``) followed by every
field in declaration order, ``nil`` where unset (msgspec writes the defaults of an array-like
struct too); a batch is ``[ts, events, data_parallel_rank]``. llm-d's KV-cache indexer
(``pkg/kvevents/engineadapter/vllm_adapter.go``) reads those arrays by position. This module
writes the same bytes with ``msgpack`` (tests/kv_events decode them with msgspec and structs
mirroring vLLM's, and compare bytes).

Block hashes go out in vLLM's default integer form (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``):
the low 64 bits of the block's digest, big-endian, unsigned; llm-d maps any form to that same
uint64. A BlockStored's ``parent_block_hash`` is None for the first block of a chain.
``medium`` is ``"GPU"`` for the device pool and ``"CPU"`` for the host tier, whose
``BlockStored`` carries hashes only (no tokens, ``block_size`` 0), as vLLM's offloading connector
sends them.

Knows nothing about sockets, the pool or requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

MEDIUM_GPU = "GPU"  # vLLM's medium for blocks in the device pool
MEDIUM_CPU = "CPU"  # vLLM's medium for blocks its offloading connector keeps in host memory


def external_hash(block_hash: bytes) -> int:
    """vLLM's integer form of a block digest: its last 8 bytes as a big-endian unsigned int."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks newly findable in the prefix cache, a chain: ``block_hashes[0]``'s parent is
    ``parent_block_hash``, each next block's parent the one before it. ``token_ids``: all the
    blocks' tokens, ``block_size`` per block."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None

    def to_wire(self) -> list[object]:
        # extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window: unset
        return ["BlockStored", list(self.block_hashes), self.parent_block_hash, list(self.token_ids),
                self.block_size, self.lora_id, self.medium, self.lora_name, None, None, None, None]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks no longer findable in the prefix cache (evicted)."""

    block_hashes: tuple[int, ...]
    medium: str | None = MEDIUM_GPU

    def to_wire(self) -> list[object]:
        return ["BlockRemoved", list(self.block_hashes), self.medium, None]  # group_idx: unset


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of the prefix cache dropped (a reset)."""

    def to_wire(self) -> list[object]:
        return ["AllBlocksCleared"]


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """The events of one engine step, in order; ``ts``: wall-clock seconds when it was taken."""

    ts: float
    events: tuple[KVCacheEvent, ...]
    data_parallel_rank: int | None = None


def encode_batch(batch: KVEventBatch) -> bytes:
    """``batch`` as vLLM's msgspec encoder writes a ``KVEventBatch`` (see module docstring)."""
    wire = [float(batch.ts), [e.to_wire() for e in batch.events], batch.data_parallel_rank]
    return msgpack.packb(wire, use_bin_type=True)
