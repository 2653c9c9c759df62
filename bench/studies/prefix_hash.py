"""``python -m bench.studies.prefix_hash``: what the SHA-256 prefix-cache keys cost per step.

Times, on this machine, the key work of (a) admitting 64 prompts of 512 tokens (hashing every
full block and looking each up with its token check) and (b) one decode step of 64 sequences
(on average 64 / block_size blocks fill per step and get hashed and registered), for the
SHA-256 keys against the Python ``hash`` of a tuple they replaced, and puts both beside an
engine decode step of 64 sequences on the small demo model measured in the same run. Prints
a table; knows the pool only through its public functions.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.gpu.timing import wall_median_ms
from inflight.runtime.core import block_pool

NUM_SEQS = 64
PROMPT_LEN = 512
BLOCK = 16


def _old_hash(parent: object, token_ids: Sequence[int]) -> int:
    return hash((parent, tuple(token_ids)))


def _admit(hash_fn: Callable, prompts: list[list[int]]) -> None:
    pool = block_pool.KVBlockPool(NUM_SEQS * PROMPT_LEN // BLOCK)
    for prompt in prompts:
        keys, parent = [], pool.root_hash
        for i in range(len(prompt) // BLOCK):
            parent = hash_fn(parent, prompt[i * BLOCK : (i + 1) * BLOCK])
            keys.append(parent)
        blocks = pool.allocate(len(keys)) or []
        pool.find_cached(keys, prompt, BLOCK)
        for i, (b, k) in enumerate(zip(blocks, keys, strict=True)):
            pool.cache_block(b, k, prompt[i * BLOCK : (i + 1) * BLOCK])


def _decode_step(hash_fn: Callable, prompts: list[list[int]]) -> None:
    pool = block_pool.KVBlockPool(NUM_SEQS)
    blocks = pool.allocate(NUM_SEQS // BLOCK) or []
    for s, b in enumerate(blocks):  # the sequences whose last block fills this step
        pool.cache_block(b, hash_fn(pool.root_hash, prompts[s][:BLOCK]), prompts[s][:BLOCK])


def _engine_step_ms() -> float:
    from bench.gpu.engine import time_decode_steps
    from inflight.runtime.config import EngineConfig
    from inflight.runtime.core.engine import LLMEngine
    from inflight.runtime.demo.model import make_demo_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_demo_model(Path(tmp) / "small", "llama", "small", eos=False)
        engine = LLMEngine.from_model_dir(model_dir, EngineConfig(device="cpu", max_num_sequences=NUM_SEQS,
                                                                  num_kv_blocks=1024))  # fmt: skip
        seconds, _ = time_decode_steps(engine, NUM_SEQS, 4000, device="cpu")
    return seconds * 1e3


def main() -> int:
    prompts = [[(s * 7919 + i * 31) % 49152 for i in range(PROMPT_LEN)] for s in range(NUM_SEQS)]
    step_ms = _engine_step_ms()
    print(f"engine decode step, {NUM_SEQS} sequences, small demo model, CPU: {step_ms:.2f} ms\n")
    print(f"{'work':<44} {'tuple hash ms':>14} {'SHA-256 ms':>11}")
    for name, work in ((f"admit {NUM_SEQS} prompts of {PROMPT_LEN} tokens", _admit),
                       (f"one decode step of {NUM_SEQS} sequences", _decode_step)):  # fmt: skip
        old = wall_median_ms(lambda w=work: w(_old_hash, prompts), reps=15)
        new = wall_median_ms(lambda w=work: w(block_pool.hash_block, prompts), reps=15)
        print(f"{name:<44} {old:>14.3f} {new:>11.3f}")
        if work is _decode_step:
            print(f"  -> {100 * new / step_ms:.2f}% of the decode step")
        else:
            print(f"  -> {1e3 * new / (NUM_SEQS * PROMPT_LEN):.3f} us per prompt token (prefill computes each)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
