"""The native CPU decode attention's tiling against the torch reference.

The kernel scores every query head against a tile of cached tokens at a time (a
vector's width: 16 with AVX-512, else 8) and folds the tile's partial vectors into one vector of
scores (``cpu_vecf.h``), so the edges that matter are: group sizes (1, 4, 8 query heads per KV
head), head sizes that are and are not multiples of the width, contexts that end inside a tile
or a block or exactly on their edges, blocks smaller and larger than a tile, sliding windows
that start mid-tile, and sinks. The rows past each context and the blocks no table names hold
NaN here: a lane the kernel failed to mask would show up in the output.
"""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import cpu_native, reference
from tests.kernels.cpu_flags import has_cpu_flag
from tests.kernels.threads import with_threads

F32 = torch.float32
CPU = torch.device("cpu")
EDGE_LENS = [1, 2, 15, 16, 17, 31, 32, 33, 47, 129, 200]

# (block_size, head_dim, num_heads, num_kv_heads)
TILING_CASES = [
    (16, 64, 8, 8),  # group of 1 (MHA)
    (16, 64, 16, 4),  # group of 4
    (16, 128, 32, 4),  # group of 8, the largest head size with its own copy
    (32, 128, 8, 2),  # group of 4, two tiles a block
    (128, 64, 16, 2),  # group of 8, eight tiles a block (vLLM's CPU block size)
    (8, 64, 8, 2),  # blocks smaller than a tile
    (1, 32, 4, 1),  # one token a block
    (16, 40, 6, 3),  # head size not a multiple of 16: the scalar tail
    (32, 96, 4, 4),  # a head size with no copy of its own
]


pytestmark = pytest.mark.usefixtures("native_built")


def _poisoned(k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
              lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the caches with NaN in every row no context reaches."""
    block_size = k_cache.shape[1]
    live = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for table, n in zip(tables.tolist(), lens.tolist(), strict=True):
        for pos in range(n):
            live[table[pos // block_size], pos % block_size] = True
    k, v = k_cache.clone(), v_cache.clone()
    k[~live] = float("nan")
    v[~live] = float("nan")
    return k, v


def _run(threads: int, *args, **kwargs) -> torch.Tensor:
    return with_threads(threads, cpu_native.paged_decode_attention, *args, **kwargs)


@pytest.mark.parametrize("case", TILING_CASES, ids=lambda c: f"bs{c[0]}-d{c[1]}-g{c[2] // c[3]}")
@pytest.mark.parametrize("threads", [1, 2])
def test_tiles_match_reference_at_every_edge(case, threads, make_paged_cache, poison_allocations) -> None:
    block_size, head_dim, num_heads, num_kv_heads = case
    paged = make_paged_cache(EDGE_LENS, block_size, num_kv_heads, head_dim, F32, CPU)
    query = torch.randn(len(EDGE_LENS), num_heads, head_dim, generator=torch.Generator().manual_seed(7))
    rest = (paged.block_tables, paged.context_lens, head_dim**-0.5)
    expected = reference.paged_decode_attention(query, paged.k_cache, paged.v_cache, *rest)
    k_nan, v_nan = _poisoned(paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens)
    got = _run(threads, query, k_nan, v_nan, *rest)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40, 100])
@pytest.mark.parametrize("case", [(16, 64, 8, 2), (32, 128, 8, 1), (8, 40, 4, 4)], ids=lambda c: f"bs{c[0]}-d{c[1]}")
def test_windows_starting_mid_tile_and_sinks(case, window, make_paged_cache, poison_allocations) -> None:
    block_size, head_dim, num_heads, num_kv_heads = case
    paged = make_paged_cache(EDGE_LENS, block_size, num_kv_heads, head_dim, F32, CPU)
    gen = torch.Generator().manual_seed(window)
    query = torch.randn(len(EDGE_LENS), num_heads, head_dim, generator=gen)
    sinks = torch.randn(num_heads, generator=gen)
    rest = (paged.block_tables, paged.context_lens, head_dim**-0.5)
    k_nan, v_nan = _poisoned(paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens)
    for s in (None, sinks):
        expected = reference.paged_decode_attention(query, paged.k_cache, paged.v_cache, *rest, window, s)
        got = _run(2, query, k_nan, v_nan, *rest, window, s)
        torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("scale", [1.0, -4.0])
def test_large_scores_stay_finite_and_exact(scale: float, make_paged_cache) -> None:
    """Scores hundreds apart: the running max moves between tiles and blocks and the smaller
    exponentials underflow to zero (the polynomial exp clamps at -87) without NaN or inf. With
    a negative scale on positive dot products every score is far below zero, so a padding lane
    that kept a score of 0 would become the max and flatten the softmax."""
    paged = make_paged_cache([70, 200, 33], 16, 2, 64, F32, CPU)
    k_cache, v_cache = paged.k_cache.abs(), paged.v_cache
    query = torch.rand(3, 4, 64, generator=torch.Generator().manual_seed(3)) * 3.0
    args = (query, k_cache, v_cache, paged.block_tables, paged.context_lens, scale)
    got = _run(1, *args)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, reference.paged_decode_attention(*args), atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not has_cpu_flag("avx512f"), reason="the default build is already the 8-wide one here")
@pytest.mark.parametrize("case", TILING_CASES, ids=lambda c: f"bs{c[0]}-d{c[1]}-g{c[2] // c[3]}")
def test_eight_wide_build_matches_reference(case, make_paged_cache) -> None:
    """The same source built without AVX-512 (8-token tiles, what an AVX2 machine runs)."""
    attention = cpu_native.decode_attention_from(cpu_native.SOURCE, ("-mno-avx512f",))
    block_size, head_dim, num_heads, num_kv_heads = case
    paged = make_paged_cache(EDGE_LENS, block_size, num_kv_heads, head_dim, F32, CPU)
    gen = torch.Generator().manual_seed(11)
    query = torch.randn(len(EDGE_LENS), num_heads, head_dim, generator=gen)
    sinks = torch.randn(num_heads, generator=gen)
    rest = (paged.block_tables, paged.context_lens, head_dim**-0.5)
    k_nan, v_nan = _poisoned(paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens)
    for window, s in ((None, None), (21, sinks)):
        expected = reference.paged_decode_attention(query, paged.k_cache, paged.v_cache, *rest, window, s)
        torch.testing.assert_close(attention(query, k_nan, v_nan, *rest, window, s), expected, atol=2e-6, rtol=2e-5)
