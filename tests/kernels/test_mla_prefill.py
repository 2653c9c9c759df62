"""Paged MLA prefill (absorbed): the torch reference against plain causal attention over the expanded
K/V and against the decode reference, the Triton kernel (the interpreter on the CPU) and the native C
kernel against the reference: varlen chunks of several sequences behind cached prefixes, odd lengths,
chunks across block boundaries, fp32/fp16/bf16."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import mla_reference

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# (block_size, num_heads, kv_lora_rank, rope_dim, dtype, [(query_len, context_len)]): chunks behind a
# cached prefix and whole prompts, a block smaller than a tile, more heads than a program's rows, a
# rank that is not a power of two, DeepSeek-V3's widths.
CASES = [
    (16, 4, 64, 16, F32, [(1, 1), (5, 17), (16, 16), (33, 40), (7, 7)]),
    (8, 20, 96, 32, F16, [(9, 9), (1, 30), (17, 50)]),
    (32, 16, 512, 64, BF16, [(5, 64), (40, 100), (3, 3)]),
    (16, 64, 64, 16, F32, [(3, 35), (0, 20), (13, 13)]),  # a sequence with no query this step
]


def _ids(case: tuple) -> str:
    bs, h, c, r, dtype, chunks = case
    return f"bs{bs}-h{h}-c{c}-r{r}-{str(dtype)[6:]}-{len(chunks)}seqs"


def _inputs(make_paged_cache, case: tuple, device: torch.device) -> tuple:
    block_size, heads, rank, rope, dtype, chunks = case
    lens = [ctx for _, ctx in chunks]
    latent = make_paged_cache(lens, block_size, 1, rank, dtype, device)
    pe = make_paged_cache(lens, block_size, 1, rope, dtype, device)  # the same number of blocks
    num_tokens = sum(q for q, _ in chunks)
    gen = torch.Generator().manual_seed(rank + heads + num_tokens)
    q_latent = (torch.randn(num_tokens, heads, rank, generator=gen) * 0.2).to(dtype).to(device)
    q_pe = torch.randn(num_tokens, heads, rope, generator=gen).to(dtype).to(device)
    starts = torch.tensor([0] + [q for q, _ in chunks], dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    return (q_latent, q_pe, latent.k_cache, pe.k_cache, latent.block_tables, starts, latent.context_lens,
            (rank + rope) ** -0.5)  # fmt: skip


def test_absorbed_prefill_equals_causal_attention_over_expanded_keys(make_paged_cache) -> None:
    """``W_UV(prefill(q_nope @ W_UK, ...))`` is causal softmax((q_nope . k_nope + q_pe . k_pe) * scale) @ v
    with k_nope = latent @ W_UK.T and v = latent @ W_UV.T per head, each chunk behind its cached prefix."""
    heads, nope, v_dim, rank, rope, chunks = 4, 32, 24, 64, 16, [(5, 17), (9, 9)]
    q_latent, q_pe, latent_cache, pe_cache, tables, starts, lens, scale = _inputs(
        make_paged_cache, (16, heads, rank, rope, F32, chunks), torch.device("cpu"))
    gen = torch.Generator().manual_seed(9)
    w_uk, w_uv = torch.randn(heads, nope, rank, generator=gen) * 0.2, torch.randn(heads, v_dim, rank, generator=gen)
    q_nope = torch.randn(q_latent.shape[0], heads, nope, generator=gen)
    q_latent = torch.einsum("thn,hnc->thc", q_nope, w_uk)
    out = mla_reference.paged_mla_prefill(q_latent, q_pe, latent_cache, pe_cache, tables, starts, lens, scale)
    got = torch.einsum("thc,hvc->thv", out, w_uv)
    for s, (q_len, n) in enumerate(chunks):
        lo = int(starts[s])
        latent = mla_reference.gather_context(latent_cache, tables[s], n)  # [n, rank]
        k_pe = mla_reference.gather_context(pe_cache, tables[s], n)
        key = torch.cat([torch.einsum("jc,hnc->hjn", latent, w_uk), k_pe[None].expand(heads, -1, -1)], dim=-1)
        query = torch.cat([q_nope[lo : lo + q_len], q_pe[lo : lo + q_len]], dim=-1).transpose(0, 1)
        visible = torch.arange(n)[None, :] <= torch.arange(q_len)[:, None] + (n - q_len)
        want = torch.nn.functional.scaled_dot_product_attention(
            query, key, torch.einsum("jc,hvc->hjv", latent, w_uv), attn_mask=visible, scale=scale)
        torch.testing.assert_close(got[lo : lo + q_len], want.transpose(0, 1), rtol=1e-4, atol=1e-4)


def test_a_query_sees_what_a_decode_at_its_position_sees(make_paged_cache) -> None:
    """Each query of a chunk equals the decode reference run with the context cut at its position."""
    args = _inputs(make_paged_cache, CASES[0], torch.device("cpu"))
    q_latent, q_pe, latent_cache, pe_cache, tables, starts, lens, scale = args
    out = mla_reference.paged_mla_prefill(*args)
    for s, (q_len, n) in enumerate(CASES[0][5]):
        for j in range(q_len):
            t = int(starts[s]) + j
            want = mla_reference.paged_mla_decode(q_latent[t : t + 1], q_pe[t : t + 1], latent_cache, pe_cache,
                                                  tables[s : s + 1], torch.tensor([n - q_len + j + 1]), scale)
            torch.testing.assert_close(out[t : t + 1], want)


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_triton_matches_reference(case, device, make_paged_cache, poison_allocations, assert_close) -> None:
    from inflight.kernels.triton_mla_prefill import paged_mla_prefill

    args = _inputs(make_paged_cache, case, device)
    assert_close(paged_mla_prefill(*args), mla_reference.paged_mla_prefill(*args))


@pytest.mark.parametrize("rows", [16, 64])
def test_triton_row_splits_match_reference(rows, device, make_paged_cache, poison_allocations,
                                           assert_close) -> None:  # fmt: skip
    """Programs of 16 rows (4 heads: 4 queries each) and of 64 (16 queries across block edges)."""
    from inflight.kernels.triton_mla_prefill import plan_mla_prefill, prefill_with_rows

    case = (8, 4, 64, 16, F32, [(21, 30), (1, 8), (19, 19), (8, 9)])
    assert plan_mla_prefill(4, rows) == (rows // 4, 4) and plan_mla_prefill(20, 32) == (1, 32)
    args = _inputs(make_paged_cache, case, device)
    assert_close(prefill_with_rows(*args, rows), mla_reference.paged_mla_prefill(*args))


def test_triton_refuses_bad_inputs(make_paged_cache) -> None:
    pytest.importorskip("triton")
    from inflight.kernels.triton_mla_prefill import paged_mla_prefill

    q_latent, q_pe, latent_cache, pe_cache, tables, starts, lens, scale = _inputs(
        make_paged_cache, CASES[0], torch.device("cpu"))
    with pytest.raises(ValueError, match="widths"):
        paged_mla_prefill(q_latent[:, :, :32], q_pe, latent_cache, pe_cache, tables, starts, lens, scale)
    with pytest.raises(ValueError, match="num_seqs \\+ 1"):
        paged_mla_prefill(q_latent, q_pe, latent_cache, pe_cache, tables, starts[:-1], lens, scale)


@pytest.mark.usefixtures("native_built")
@pytest.mark.parametrize("case", [c for c in CASES if c[4] == F32] + [(16, 20, 512, 64, F32, [(7, 300), (30, 47)])],
                         ids=lambda c: _ids(c))
def test_native_cpu_matches_reference(case, make_paged_cache) -> None:
    """The CPU bundle's MLA prefill (cpu_mla.c for float32) equals the reference; a strided query
    (a slice of a wider tensor, as the decoder's q_pe is) too."""
    from inflight.kernels import cpu_mla
    from inflight.kernels.cpu_native import CPU_OPS, compile_library

    lib, why = compile_library(cpu_mla.SOURCE, "cpu_mla", cpu_mla._SIGNATURES)
    assert lib is not None, why  # the native kernel runs, not the reference behind it
    args = _inputs(make_paged_cache, case, torch.device("cpu"))
    expected = mla_reference.paged_mla_prefill(*args)
    torch.testing.assert_close(CPU_OPS.paged_mla_prefill(*args), expected, rtol=1e-5, atol=1e-5)
    q_pe = args[1]
    wide = torch.cat([q_pe, q_pe], dim=-1)[..., : q_pe.shape[-1]]  # stride(1) 2R, stride(2) 1
    got = CPU_OPS.paged_mla_prefill(args[0], wide, *args[2:])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_native_cpu_takes_other_dtypes_through_the_reference(make_paged_cache) -> None:
    from inflight.kernels.cpu_native import CPU_OPS

    args = _inputs(make_paged_cache, CASES[1], torch.device("cpu"))  # float16: the reference's path
    torch.testing.assert_close(CPU_OPS.paged_mla_prefill(*args), mla_reference.paged_mla_prefill(*args))


@pytest.mark.usefixtures("native_built")
def test_bench_prints_the_three_paths_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m bench.mla_prefill`` runs (shapes 16x smaller) and names the path each shape takes."""
    from bench.mla_prefill import SHAPES, main

    main(["--quick", "--repeats", "1"])
    rows = capsys.readouterr().out.splitlines()[2:]
    assert len(rows) == len(SHAPES)
    assert [row.split()[-1] for row in rows] == ["absorbed"] * 3 + ["expanded"] * 2  # 8 queries behind 128 absorb


def test_prefill_path_choice_follows_the_arithmetic() -> None:
    """At DeepSeek-V3's widths a whole prompt expands at any length, a short chunk behind a long
    cached context absorbs, and the crossover for a long context is near 170 queries."""
    from inflight.runtime.model.mla import absorbs_prefill
    from inflight.runtime.model.spec_types import MlaSpec

    v3 = MlaSpec(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                 rope_interleave=True)  # fmt: skip
    assert not any(absorbs_prefill(v3, n, n) for n in (1, 16, 512, 8192))
    assert absorbs_prefill(v3, 1, 2) and absorbs_prefill(v3, 16, 4096) and absorbs_prefill(v3, 128, 2048)
    assert absorbs_prefill(v3, 160, 100_000) and not absorbs_prefill(v3, 180, 100_000)
    assert not absorbs_prefill(v3, 256, 1024)
