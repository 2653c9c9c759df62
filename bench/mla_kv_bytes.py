"""``python -m bench.mla_kv_bytes``: KV bytes a token of DeepSeek-V3's latent cache against the same
model's per-head K/V, and how many 4096-token sequences one pool of a given size holds each way.

Reads only transformers' ``DeepseekV3Config`` defaults (DeepSeek-V3's published shape: 61 layers,
128 heads, kv_lora_rank 512, qk_rope 64, qk_nope 128, v 128) through our spec and cache-size
functions (``model/mla_kv.py``); no weights. Prints ratios computed side by side; times nothing.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    from transformers import DeepseekV3Config

    from inflight.runtime.model.mla_kv import gqa_values_per_token, mla_block_bytes
    from inflight.runtime.model.spec import spec_from_hf_config

    parser = argparse.ArgumentParser(prog="python -m bench.mla_kv_bytes")
    parser.add_argument("--pool-gib", type=float, default=80.0, help="KV pool per rank (GiB)")
    parser.add_argument("--seq-len", type=int, default=4096)
    args = parser.parse_args(argv)
    config = DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"])
    spec = spec_from_hf_config(config)
    layers, elem = spec.num_layers, 2  # bf16
    mla_token = mla_block_bytes(spec, layers, 1, elem)
    pool = int(args.pool_gib * 2**30)
    print(f"DeepSeek-V3 ({layers} layers, {spec.num_heads} heads), bf16, {args.seq_len}-token sequences, "
          f"{args.pool_gib:g} GiB of KV per rank")  # fmt: skip
    print(f"{'TP':>3} {'MLA B/token':>12} {'per-head K/V B/token':>21} {'ratio':>6} {'seqs MLA':>9} {'seqs K/V':>9}")
    for tp in (1, 8):
        kv_token = gqa_values_per_token(spec, spec.num_heads // tp) * elem * layers
        seqs = (pool // (mla_token * args.seq_len), pool // (kv_token * args.seq_len))
        print(f"{tp:>3} {mla_token:>12,} {kv_token:>21,} {kv_token / mla_token:>6.1f} {seqs[0]:>9,} {seqs[1]:>9,}")


if __name__ == "__main__":
    main()
