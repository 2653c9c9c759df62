"""``python -m bench.mla_prefill``: one layer's MLA prefill on the CPU, for chunks of several shapes at
DeepSeek-V3's widths a tensor-parallel rank (16 heads of 128 at TP=8; latent 512, rope 64, nope and
v 128), three ways measured side by side in one run: the absorbed torch reference
(``mla_reference.paged_mla_prefill``), the absorbed native C kernel (``cpu_mla.c``), and the
expanded path (context gathered, ``kv_b_proj`` GEMM into per-head K/V, causal SDPA: what
``model/mla.py`` runs for a chunk it does not absorb); each absorbed time includes the ``W_UK`` /
``W_UV`` products. Prints milliseconds (best of ``--repeats``), the ratios, and which path
``absorbs_prefill`` picks. The Triton kernel is not timed here (the interpreter is no measure).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

HEADS, RANK, ROPE, NOPE, V = 16, 512, 64, 128, 128
BLOCK_SIZE = 16
SHAPES = ((16, 4096), (64, 1024), (128, 2048), (256, 256), (512, 512))  # (queries, context incl. the chunk)


def _best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (the C kernel builds on first use)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _case(queries: int, context: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    blocks = -(-context // BLOCK_SIZE)
    return {
        "q_nope": torch.randn(queries, HEADS, NOPE, generator=gen) * 0.1,
        "q_pe": torch.randn(queries, HEADS, ROPE, generator=gen) * 0.1,
        "latent": torch.randn(blocks + 1, BLOCK_SIZE, 1, RANK, generator=gen),
        "pe": torch.randn(blocks + 1, BLOCK_SIZE, 1, ROPE, generator=gen),
        "table": torch.randperm(blocks + 1, generator=gen)[:blocks].to(torch.int32)[None],
        "starts": torch.tensor([0, queries], dtype=torch.int32),
        "lens": torch.tensor([context], dtype=torch.int32),
        "w_kv": torch.randn(HEADS, NOPE + V, RANK, generator=gen) * RANK**-0.5,
    }


def _absorbed(c: dict[str, torch.Tensor], kernel: Callable[..., torch.Tensor], scale: float) -> torch.Tensor:
    w_uk, w_uv = c["w_kv"][:, :NOPE], c["w_kv"][:, NOPE:]
    q_latent = torch.bmm(c["q_nope"].transpose(0, 1), w_uk).transpose(0, 1).contiguous()
    out = kernel(q_latent, c["q_pe"], c["latent"], c["pe"], c["table"], c["starts"], c["lens"], scale)
    return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def _expanded(c: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    from inflight.kernels.mla_reference import gather_context

    context, queries = int(c["lens"][0]), c["q_nope"].shape[0]
    latent = gather_context(c["latent"], c["table"][0], context)
    k_pe = gather_context(c["pe"], c["table"][0], context)
    k_nope, value = (latent @ c["w_kv"].reshape(-1, RANK).T).view(context, HEADS, -1).split([NOPE, V], dim=-1)
    key = torch.cat([k_nope, k_pe[:, None, :].expand(context, HEADS, -1)], dim=-1)
    query = torch.cat([c["q_nope"], c["q_pe"]], dim=-1)
    visible = torch.arange(context)[None, :] <= torch.arange(queries)[:, None] + (context - queries)
    return F.scaled_dot_product_attention(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
                                          attn_mask=visible, scale=scale).transpose(0, 1)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    from inflight.kernels import mla_reference
    from inflight.kernels.cpu_native import CPU_OPS
    from inflight.runtime.model.mla import absorbs_prefill
    from inflight.runtime.model.spec_types import MlaSpec

    parser = argparse.ArgumentParser(prog="python -m bench.mla_prefill")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch and OpenMP threads (0: torch's default)")
    parser.add_argument("--quick", action="store_true", help="every shape 16x smaller (a smoke run)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    mla = MlaSpec(q_lora_rank=1536, kv_lora_rank=RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
                  rope_interleave=True)  # fmt: skip
    scale, gen = (NOPE + ROPE) ** -0.5, torch.Generator().manual_seed(0)
    print(f"MLA prefill, one layer, {HEADS} heads (DeepSeek-V3 at TP=8), fp32, {torch.get_num_threads()} threads; "
          f"ms, best of {args.repeats}")  # fmt: skip
    print(f"{'queries':>7} {'context':>7} {'absorbed ref':>12} {'absorbed C':>10} {'expanded':>9} "
          f"{'ref/C':>6} {'exp/C':>6}  picked")  # fmt: skip
    for queries, context in SHAPES:
        if args.quick:
            queries, context = max(1, queries // 16), max(1, context // 16)
        c = _case(queries, context, gen)
        ref = _best_ms(lambda c=c: _absorbed(c, mla_reference.paged_mla_prefill, scale), args.repeats)
        native = _best_ms(lambda c=c: _absorbed(c, CPU_OPS.paged_mla_prefill, scale), args.repeats)
        expanded = _best_ms(lambda c=c: _expanded(c, scale), args.repeats)
        picked = "absorbed" if absorbs_prefill(mla, queries, context) else "expanded"
        print(f"{queries:>7} {context:>7} {ref:>12.1f} {native:>10.1f} {expanded:>9.1f} {ref / native:>6.2f} "
              f"{expanded / native:>6.2f}  {picked}")  # fmt: skip


if __name__ == "__main__":
    main()
