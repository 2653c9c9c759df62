"""Paged MLA decode (absorbed): the torch reference against plain attention over the expanded K/V,
and the Triton kernel (the interpreter on the CPU) against the reference."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import mla_reference

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# (block_size, num_heads, kv_lora_rank, rope_dim, dtype, context_lens): a block smaller than a
# tile, more heads than one program takes, a rank that is not a power of two, DeepSeek-V3's widths.
CASES = [
    (16, 4, 64, 16, F32, [1, 16, 33, 7]),
    (8, 20, 96, 32, F16, [9, 1, 40]),
    (32, 16, 512, 64, BF16, [5, 64, 100]),
]


def _inputs(make_paged_cache, case: tuple, device: torch.device) -> tuple:
    block_size, heads, rank, rope, dtype, lens = case
    latent = make_paged_cache(lens, block_size, 1, rank, dtype, device)
    pe = make_paged_cache(lens, block_size, 1, rope, dtype, device)  # the same number of blocks
    gen = torch.Generator().manual_seed(rank + heads)
    q_latent = (torch.randn(len(lens), heads, rank, generator=gen) * 0.2).to(dtype).to(device)
    q_pe = torch.randn(len(lens), heads, rope, generator=gen).to(dtype).to(device)
    return q_latent, q_pe, latent.k_cache, pe.k_cache, latent.block_tables, latent.context_lens, (rank + rope) ** -0.5


def _ids(case: tuple) -> str:
    bs, h, c, r, dtype, _ = case
    return f"bs{bs}-h{h}-c{c}-r{r}-{str(dtype)[6:]}"


def test_absorbed_decode_equals_attention_over_expanded_keys(make_paged_cache) -> None:
    """``W_UV(decode(q_nope @ W_UK, ...))`` is softmax((q_nope . k_nope + q_pe . k_pe) * scale) @ v with
    k_nope = latent @ W_UK.T and v = latent @ W_UV.T per head: the absorption is exact algebra."""
    heads, nope, v_dim, rank, rope, lens = 4, 32, 24, 64, 16, [7, 20]
    q_latent, q_pe, latent_cache, pe_cache, tables, context_lens, scale = _inputs(
        make_paged_cache, (16, heads, rank, rope, F32, lens), torch.device("cpu"))
    gen = torch.Generator().manual_seed(9)
    w_uk, w_uv = torch.randn(heads, nope, rank, generator=gen) * 0.2, torch.randn(heads, v_dim, rank, generator=gen)
    q_nope = torch.randn(len(lens), heads, nope, generator=gen)
    q_latent = torch.einsum("shn,hnc->shc", q_nope, w_uk)
    out = mla_reference.paged_mla_decode(q_latent, q_pe, latent_cache, pe_cache, tables, context_lens, scale)
    got = torch.einsum("shc,hvc->shv", out, w_uv)
    for s, n in enumerate(lens):
        latent = mla_reference.gather_context(latent_cache, tables[s], n)  # [n, rank]
        k_pe = mla_reference.gather_context(pe_cache, tables[s], n)
        k_nope = torch.einsum("tc,hnc->htn", latent, w_uk)
        value = torch.einsum("tc,hvc->htv", latent, w_uv)
        scores = (torch.einsum("hn,htn->ht", q_nope[s], k_nope) + q_pe[s] @ k_pe.T) * scale
        want = torch.einsum("ht,htv->hv", torch.softmax(scores, dim=-1), value)
        torch.testing.assert_close(got[s], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_triton_matches_reference(case, device, make_paged_cache, poison_allocations, assert_close) -> None:
    from inflight.kernels.triton_mla_decode import paged_mla_decode

    args = _inputs(make_paged_cache, case, device)
    expected = mla_reference.paged_mla_decode(*args)
    assert_close(paged_mla_decode(*args), expected)


@pytest.mark.parametrize("splits", [2, 5])
def test_triton_split_context_matches_reference(splits, device, make_paged_cache, poison_allocations,
                                                assert_close) -> None:  # fmt: skip
    """The context split across programs (each split's partial merged by log-sum-exp) gives the
    reference; splits past a short row's context are empty and weigh nothing."""
    from inflight.kernels.triton_mla_decode import decode_with_splits, split_of

    case = (16, 20, 96, 32, F32, [1, 200, 47, 130])
    args = _inputs(make_paged_cache, case, device)
    max_context = args[4].shape[1] * 16
    plan = split_of(max_context, splits)
    assert plan[0] > 1
    assert_close(decode_with_splits(*args, plan), mla_reference.paged_mla_decode(*args))


def test_split_plan_follows_idle_sms() -> None:
    from inflight.kernels.triton_mla_decode import BLOCK_N, plan_mla_decode

    assert plan_mla_decode(64, 8, 4096, sms=132) == (1, 4096)  # enough programs: no split
    splits, size = plan_mla_decode(1, 1, 4096, sms=132)  # batch 1, 16 heads a rank: split the context
    assert splits == 16 and size == 256 and size % BLOCK_N == 0
    assert plan_mla_decode(1, 1, 100, sms=132)[0] == 1  # too short to be worth a merge


def test_triton_refuses_mismatched_widths(make_paged_cache) -> None:
    pytest.importorskip("triton")
    from inflight.kernels.triton_mla_decode import paged_mla_decode

    q_latent, q_pe, latent_cache, pe_cache, tables, lens, scale = _inputs(
        make_paged_cache, CASES[0], torch.device("cpu"))
    with pytest.raises(ValueError, match="widths"):
        paged_mla_decode(q_latent[:, :, :32], q_pe, latent_cache, pe_cache, tables, lens, scale)
    with pytest.raises(ValueError, match="same rows and heads"):
        paged_mla_decode(q_latent, q_pe[:, :2], latent_cache, pe_cache, tables, lens, scale)


@pytest.mark.usefixtures("native_built")
@pytest.mark.parametrize("case", [c for c in CASES if c[4] == F32] + [(16, 20, 512, 64, F32, [1, 300, 47])],
                         ids=lambda c: _ids(c))
def test_native_cpu_matches_reference(case, make_paged_cache) -> None:
    """The CPU bundle's MLA decode (cpu_mla.c for float32) equals the reference; a strided query
    (a slice of a wider tensor, as the decoder's q_pe is) too."""
    from inflight.kernels import cpu_mla
    from inflight.kernels.cpu_native import CPU_OPS, compile_library

    lib, why = compile_library(cpu_mla.SOURCE, "cpu_mla", cpu_mla._SIGNATURES)
    assert lib is not None, why  # the native kernel runs, not the reference behind it
    args = _inputs(make_paged_cache, case, torch.device("cpu"))
    expected = mla_reference.paged_mla_decode(*args)
    torch.testing.assert_close(CPU_OPS.paged_mla_decode(*args), expected, rtol=1e-5, atol=1e-5)
    q_latent, q_pe = args[0], args[1]
    wide = torch.cat([q_pe, q_pe], dim=-1)[..., : q_pe.shape[-1]]  # stride(1) 2R, stride(2) 1
    got = CPU_OPS.paged_mla_decode(q_latent, wide, *args[2:])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_native_cpu_takes_other_dtypes_through_the_reference(make_paged_cache) -> None:
    from inflight.kernels.cpu_native import CPU_OPS

    args = _inputs(make_paged_cache, CASES[1], torch.device("cpu"))  # float16: the reference's path
    torch.testing.assert_close(CPU_OPS.paged_mla_decode(*args), mla_reference.paged_mla_decode(*args))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_launches_without_a_host_sync(make_paged_cache) -> None:
    """The Triton MLA decode reads nothing on the host, so a DeepSeek decode step can be captured."""
    from inflight.kernels.triton_ops import TRITON_OPS

    args = _inputs(make_paged_cache, CASES[2], torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        TRITON_OPS.paged_mla_decode(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
