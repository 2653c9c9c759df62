"""``python -m bench.host_arena_pin``: on CUDA, the host KV tier's pinned bytes, one registered
arena (inflight/runtime/worker/host_arena.py) beside one ``pin_memory`` tensor per layer (what the
tier did before), for a pool whose per-layer share is just over a power of two; and a round trip
of blocks through the arena (``non_blocking`` copies on the stream) checked bit for bit.

Prints the bytes asked, each way's pinned bytes (PyTorch's host allocator statistics) and their
ratio to the bytes asked, measured side by side in one run. Needs CUDA; exits 2 without it.
"""

from __future__ import annotations

import sys

import torch

from inflight.runtime.core.sched_output import KVCopies
from inflight.runtime.worker.kv_copies import HostKV

NUM_LAYERS, BLOCK_SIZE, HEADS, HEAD_DIM = 8, 16, 8, 128  # fp16: 32 KiB a block per layer and K/V
NUM_SLOTS = 2**12 + 64  # each layer's K (or V): 128 MiB + 2 MiB, just over a power of two


def _pinned_bytes() -> int:
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


def main() -> int:
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    device = torch.device("cuda")
    caches = [[tuple(torch.randn(64, BLOCK_SIZE, HEADS, HEAD_DIM, device=device, dtype=torch.float16)
                     for _ in range(2)) for _ in range(NUM_LAYERS)]]  # fmt: skip
    per_layer = NUM_SLOTS * BLOCK_SIZE * HEADS * HEAD_DIM * 2
    asked = 2 * NUM_LAYERS * per_layer
    before = _pinned_bytes()
    old = [torch.empty(per_layer, dtype=torch.uint8, pin_memory=True) for _ in range(2 * NUM_LAYERS)]
    old_pinned = _pinned_bytes() - before
    del old
    host = HostKV(caches, NUM_SLOTS)
    ok = host.arena.pinned and all(v.is_pinned() for v in host.arena.views) and host.arena.nbytes == asked
    want = [(k[3].clone(), v[3].clone()) for k, v in caches[0]]
    host.run(KVCopies(copy_out=((3, NUM_SLOTS - 1), (4, 0)), copy_in=()))
    host.run(KVCopies(copy_out=(), copy_in=((NUM_SLOTS - 1, 10),)))
    torch.cuda.synchronize()
    ok = ok and all(torch.equal(k[10], wk) and torch.equal(v[10], wv) for (k, v), (wk, wv) in zip(caches[0], want, strict=True))
    print(f"asked {asked / 2**20:.0f} MiB; per-layer pin_memory pinned {old_pinned / 2**20:.0f} MiB "
          f"({old_pinned / asked:.2f}x); one registered arena {host.arena.nbytes / 2**20:.0f} MiB "
          f"({host.arena.nbytes / asked:.2f}x); views pinned and round trip exact: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
