"""The native CPU prefill attention (``cpu_prefill_attention.h`` via :mod:`inflight.kernels.
cpu_prefill`) against the torch reference: whole prompts, later chunks and prefix-cache hits
(context longer than the chunk), decodes riding in the batch, sequences with nothing scheduled,
GQA groups of 1-7, head sizes with and without a vector tail, sliding windows, attention sinks, a
strided query (rows of the fused q/k/v projection), one and two threads, the 8-wide (AVX2) build,
and caches whose rows past every context are NaN (the kernel must not read them). Long chunks
and layouts the kernel does not take go to the reference; malformed offsets are a ValueError. The engine's token-exact tests
against transformers run this kernel for every prompt on the CPU.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from inflight.kernels import cpu_native, cpu_prefill, reference
from tests.kernels.cpu_flags import has_cpu_flag
from tests.kernels.threads import with_threads

pytestmark = pytest.mark.usefixtures("native_built")

F32 = torch.float32
CPU = torch.device("cpu")

# (block_size, head_dim, num_heads, num_kv_heads, [(q_len, context_len)])
CASES = [
    (16, 64, 8, 4, [(93, 93), (1, 1), (16, 16), (5, 37), (0, 9), (20, 52)]),
    (32, 128, 8, 2, [(32, 32), (7, 40), (33, 97)]),
    (16, 32, 7, 1, [(17, 17), (3, 19), (1, 30)]),  # a group of 7 heads
    (16, 80, 4, 4, [(9, 41), (40, 40)]),  # head_dim with a tail past the last whole vector
    (8, 64, 4, 2, [(200, 200), (64, 130)]),  # long prompts over many small blocks
    (16, 64, 4, 2, [(400, 400), (30, 30), (330, 500)]),  # longer chunks, one after a cached prefix
]


def _ids(case: tuple) -> str:
    bs, d, h, hkv, _ = case
    return f"bs{bs}-d{d}-h{h}-kv{hkv}"


def _inputs(case: tuple, make_paged_cache, seed: int = 0):
    block_size, head_dim, num_heads, num_kv_heads, chunks = case
    q_lens = [q for q, _ in chunks]
    paged = make_paged_cache([c for _, c in chunks], block_size, num_kv_heads, head_dim, F32, CPU)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(sum(q_lens) + head_dim + seed)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    return (query, paged.k_cache, paged.v_cache, paged.block_tables, starts, paged.context_lens, head_dim**-0.5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_matches_reference(case, threads, make_paged_cache, poison_allocations) -> None:
    args = _inputs(case, make_paged_cache)
    expected = reference.paged_prefill_attention(*args)
    got = with_threads(threads, cpu_native.paged_prefill_attention, *args)
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("window", [1, 7, 16, 50])
@pytest.mark.parametrize("case", CASES[:3], ids=[_ids(c) for c in CASES[:3]])
def test_sliding_window_matches_reference(case, window, make_paged_cache, poison_allocations) -> None:
    args = _inputs(case, make_paged_cache, seed=window)
    expected = reference.paged_prefill_attention(*args, sliding_window=window)
    got = with_threads(2, cpu_native.paged_prefill_attention, *args, sliding_window=window)
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)
    if window < 16:  # the window changed something, so the comparison above saw it
        assert not torch.allclose(got, reference.paged_prefill_attention(*args), atol=1e-3)


@pytest.mark.parametrize("window", [None, 9])
def test_sinks_match_reference(window, make_paged_cache, poison_allocations) -> None:
    case = CASES[0]
    args = _inputs(case, make_paged_cache, seed=3)
    sinks = torch.randn(case[2], generator=torch.Generator().manual_seed(5)) * 2.0
    expected = reference.paged_prefill_attention(*args, sliding_window=window, sinks=sinks)
    got = cpu_native.paged_prefill_attention(*args, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)
    assert not torch.allclose(got, reference.paged_prefill_attention(*args, sliding_window=window), atol=1e-3)


def test_strided_query_rows_and_own_kv_arguments(make_paged_cache) -> None:
    """The decoder's q is a view of the fused projection's rows; it also passes the chunk's
    own K/V (the reference's shortcut), which the kernel does not need."""
    query, k_cache, v_cache, tables, starts, lens, scale = _inputs(CASES[1], make_paged_cache)
    wide = torch.randn(query.shape[0], query[0].numel() + 48)
    wide[:, : query[0].numel()] = query.reshape(query.shape[0], -1)
    strided = wide[:, : query[0].numel()].view(query.shape)
    assert not strided.is_contiguous()
    expected = reference.paged_prefill_attention(query, k_cache, v_cache, tables, starts, lens, scale)
    got = cpu_native.paged_prefill_attention(strided, k_cache, v_cache, tables, starts, lens, scale,
                                             key=torch.zeros(1), value=torch.zeros(1))  # fmt: skip
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


def test_other_layouts_take_the_reference(make_paged_cache) -> None:
    query, k_cache, v_cache, tables, starts, lens, scale = _inputs(CASES[0], make_paged_cache)
    bf16 = (query.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), tables, starts, lens, scale)
    assert torch.equal(cpu_native.paged_prefill_attention(*bf16), reference.paged_prefill_attention(*bf16))


def test_no_queries_and_bad_offsets(make_paged_cache) -> None:
    query, k_cache, v_cache, tables, starts, lens, scale = _inputs(CASES[0], make_paged_cache)
    empty = cpu_native.paged_prefill_attention(query[:0], k_cache, v_cache, tables[:1], torch.zeros(2, dtype=torch.int32),
                                               torch.zeros(1, dtype=torch.int32), scale)  # fmt: skip
    assert empty.shape == (0, *query.shape[1:])
    with pytest.raises(ValueError, match="query_start_loc"):
        cpu_native.paged_prefill_attention(query, k_cache, v_cache, tables, starts[:-1], lens, scale)
    with pytest.raises(ValueError, match="must hold its chunk"):
        cpu_native.paged_prefill_attention(query, k_cache, v_cache, tables, starts, lens - 1, scale)


def test_long_chunks_take_the_reference_the_rest_the_kernel(make_paged_cache, monkeypatch, poison_allocations) -> None:
    monkeypatch.setattr(cpu_prefill, "NATIVE_MAX_QUERIES", 16)
    args = _inputs(CASES[0], make_paged_cache)  # chunks of 93, 1, 16, 5, 0 and 20 queries
    expected = reference.paged_prefill_attention(*args)
    seen: list[int] = []
    real = reference.paged_prefill_attention

    def spy(query, *rest, **kwargs):
        seen.append(query.shape[0])
        return real(query, *rest, **kwargs)

    monkeypatch.setattr(reference, "paged_prefill_attention", spy)
    got = cpu_native.paged_prefill_attention(*args)
    assert seen == [93, 20]  # one call per long chunk; the four short ones ran in the kernel
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


def test_has_the_reference_signature() -> None:
    assert inspect.signature(cpu_native.paged_prefill_attention) == inspect.signature(reference.paged_prefill_attention)


def _poison_past_contexts(k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                          lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Copies of the caches with every row no sequence's context holds set to NaN."""
    block_size = k_cache.shape[1]
    used = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for s, n in enumerate(lens.tolist()):
        for t in range(n):
            used[tables[s, t // block_size], t % block_size] = True
    k, v = k_cache.clone(), v_cache.clone()
    k[~used], v[~used] = float("nan"), float("nan")
    return k, v


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_reads_nothing_past_the_contexts(case, make_paged_cache) -> None:
    query, k_cache, v_cache, tables, starts, lens, scale = _inputs(case, make_paged_cache, seed=9)
    expected = reference.paged_prefill_attention(query, k_cache, v_cache, tables, starts, lens, scale, sliding_window=11)
    k_nan, v_nan = _poison_past_contexts(k_cache, v_cache, tables, lens)
    got = cpu_native.paged_prefill_attention(query, k_nan, v_nan, tables, starts, lens, scale, sliding_window=11)
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(not has_cpu_flag("avx512f"), reason="the default build is already the 8-wide one here")
@pytest.mark.parametrize("window", [None, 13])
def test_eight_wide_build_matches_reference(window, make_paged_cache, monkeypatch) -> None:
    """The same source built without AVX-512 (8-key vectors, what an AVX2 machine runs)."""
    monkeypatch.setattr(cpu_prefill, "NATIVE_MAX_QUERIES", 10**6)  # the long chunks too
    lib, where = cpu_native.compile_library(cpu_native.SOURCE, "prefill_attention_8wide", cpu_prefill.SIGNATURES,
                                            ("-lm",), ("-mno-avx512f",))  # fmt: skip
    assert lib is not None, where
    attention = cpu_prefill.bound_to(lambda: lib)
    for case in CASES:
        args = _inputs(case, make_paged_cache, seed=4)
        sinks = torch.randn(case[2], generator=torch.Generator().manual_seed(2))
        expected = reference.paged_prefill_attention(*args, sliding_window=window, sinks=sinks)
        torch.testing.assert_close(attention(*args, sliding_window=window, sinks=sinks), expected, rtol=2e-5, atol=2e-5)
