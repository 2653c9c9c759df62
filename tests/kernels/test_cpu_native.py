"""The native CPU kernels (inflight/kernels/cpu_kernels.c) against their torch references,
and the dispatcher's choice between them.

Every machine that runs this suite has a C compiler (the CI image does), so a failed build
fails here instead of quietly leaving the CPU on the slower reference path.
"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from inflight.kernels import cpu_linear, cpu_native, cpu_weight_layout, reference
from inflight.kernels.dispatch import KERNEL_BACKENDS, TORCH_OPS, get_kernel_ops
from inflight.runtime.config import KERNEL_BACKENDS as CONFIG_KERNEL_BACKENDS
from tests.kernels.cpu_flags import has_cpu_flag
from tests.kernels.threads import with_threads

F32 = torch.float32
CPU = torch.device("cpu")

# (block_size, head_dim, num_heads, num_kv_heads, context_lens)
DECODE_CASES = [
    (16, 32, 8, 4, [1, 16, 33, 7]),
    (16, 64, 4, 4, [17, 48, 5]),
    (32, 128, 8, 1, [1, 96, 64, 33]),
    (16, 80, 14, 2, [5, 33, 250]),  # head_dim not a power of two, group of 7 (Qwen2.5-0.5B-like)
    (8, 64, 32, 8, [300]),
]


pytestmark = pytest.mark.usefixtures("native_built")


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"bs{c[0]}-d{c[1]}-h{c[2]}-kv{c[3]}")
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_matches_reference(case, threads, make_paged_cache, poison_allocations) -> None:
    block_size, head_dim, num_heads, num_kv_heads, lens = case
    paged = make_paged_cache(lens, block_size, num_kv_heads, head_dim, F32, CPU)
    query = torch.randn(len(lens), num_heads, head_dim, generator=torch.Generator().manual_seed(head_dim))
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, head_dim**-0.5)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_native.paged_decode_attention(*args)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(got, reference.paged_decode_attention(*args), atol=2e-6, rtol=2e-5)


def test_decode_attention_other_dtypes_and_empty_batch_use_the_reference(make_paged_cache) -> None:
    paged = make_paged_cache([20, 3], 16, 2, 64, torch.bfloat16, CPU)
    query = torch.randn(2, 4, 64).to(torch.bfloat16)
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 0.125)
    assert torch.equal(cpu_native.paged_decode_attention(*args), reference.paged_decode_attention(*args))
    empty = cpu_native.paged_decode_attention(
        torch.empty(0, 4, 64), paged.k_cache.float(), paged.v_cache.float(),
        torch.empty(0, 2, dtype=torch.int32), torch.empty(0, dtype=torch.int32), 0.125)
    assert empty.shape == (0, 4, 64)


def _qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int):
    """Strided q/k/v views of one fused projection output, as the decoder makes them."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=torch.Generator().manual_seed(num_tokens))
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (q.reshape(num_tokens, num_heads, head_dim), k.reshape(num_tokens, num_kv_heads, head_dim),
            v.reshape(num_tokens, num_kv_heads, head_dim))


def test_store_kv_cache_is_exact_and_skips_negative_slots() -> None:
    _, k, v = _qkv(7, 4, 2, 32)
    slots = torch.tensor([3, -1, 17, 0, 40, -1, 5])
    caches = [torch.zeros(4, 16, 2, 32) for _ in range(4)]
    cpu_native.store_kv_cache(k, v, caches[0], caches[1], slots)
    reference.store_kv_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("threads", [1, 2])
def test_a_prefill_sized_store_and_rotary_split_over_threads_exactly(threads: int) -> None:
    """2048 tokens cross both kernels' threading threshold: the same bits as the reference."""
    q, k, v = _qkv(2048, 8, 4, 64)
    slots = torch.randperm(4096, generator=torch.Generator().manual_seed(1))[:2048]
    slots[::7] = -1
    caches = [torch.zeros(256, 16, 4, 64) for _ in range(4)]
    cos_sin = torch.randn(512, 64, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(2048) % 512
    with_threads(threads, cpu_native.store_kv_cache, k, v, caches[0], caches[1], slots)
    got_q, got_k = with_threads(threads, cpu_native.rotary_embedding, positions, q, k, cos_sin)
    reference.store_kv_cache(k, v, caches[2], caches[3], slots)
    want_q, want_k = reference.rotary_embedding(positions, q, k, cos_sin)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 5, 70])  # 70 crosses the kernel's threading threshold
def test_rms_norm_matches_reference(with_residual: bool, num_tokens: int, poison_allocations) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    wide = torch.randn(num_tokens, 3 * 96, generator=gen)
    x = wide[:, 96:192]  # a strided view, as a split of a fused output is
    weight = torch.randn(96, generator=gen)
    residual = torch.randn(num_tokens, 96, generator=gen) if with_residual else None
    got, got_res = cpu_native.rms_norm(x, weight, 1e-6, residual)
    want, want_res = reference.rms_norm(x, weight, 1e-6, residual)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert torch.equal(got_res, want_res)


def test_rms_norm_per_head_and_other_dtypes_use_the_reference() -> None:
    q, _, _ = _qkv(3, 4, 2, 32)
    weight = torch.randn(32)
    assert torch.equal(cpu_native.rms_norm(q, weight, 1e-6)[0], reference.rms_norm(q, weight, 1e-6)[0])
    x = torch.randn(3, 32).to(torch.bfloat16)
    assert torch.equal(cpu_native.rms_norm(x, weight.bfloat16(), 1e-6)[0],
                       reference.rms_norm(x, weight.bfloat16(), 1e-6)[0])


@pytest.mark.parametrize("rotary_dim", [32, 16])  # full, and partial rotary (features past it copied)
def test_rotary_embedding_is_exact(rotary_dim: int, poison_allocations) -> None:
    q, k, _ = _qkv(6, 4, 2, 32)
    cos_sin = torch.randn(64, rotary_dim)
    positions = torch.tensor([0, 5, 63, 2, 2, 40])
    got_q, got_k = cpu_native.rotary_embedding(positions, q, k, cos_sin)
    want_q, want_k = reference.rotary_embedding(positions, q, k, cos_sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_dispatch_picks_native_on_the_cpu_and_refuses_it_elsewhere() -> None:
    assert KERNEL_BACKENDS is CONFIG_KERNEL_BACKENDS  # one tuple (kernels/backends.py) for the config and dispatch
    assert get_kernel_ops("auto", CPU).name == "cpu-native"
    assert get_kernel_ops("cpu", CPU).name == "cpu-native"
    assert get_kernel_ops("torch", CPU) is TORCH_OPS
    with pytest.raises(ValueError, match="CPU only"):
        get_kernel_ops("cpu", torch.device("cuda"))
    with pytest.raises(ValueError, match="one of auto, torch, triton, cpu"):
        get_kernel_ops("native", CPU)


def test_without_a_compiler_auto_warns_and_uses_torch_and_cpu_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("INFLIGHT_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    cpu_native.load_library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="inflight.kernels.dispatch"):
            assert get_kernel_ops("auto", CPU) is TORCH_OPS
        assert "no C compiler found" in caplog.text
        with pytest.raises(ValueError, match="cannot be built: no C compiler"):
            get_kernel_ops("cpu", CPU)
    finally:
        cpu_native.load_library.cache_clear()


def test_a_failing_compiler_is_reported_and_leaves_no_library(monkeypatch, tmp_path) -> None:
    bad = tmp_path / "bad-cc"
    bad.write_text("#!/bin/sh\necho 'cc: internal error' >&2\nexit 1\n")
    bad.chmod(0o755)
    monkeypatch.setenv("INFLIGHT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(bad))
    cpu_native.load_library.cache_clear()
    try:
        lib, why = cpu_native.load_library()
        assert lib is None and "internal error" in why
        assert not list((tmp_path / "cache").rglob("*.so"))
    finally:
        cpu_native.load_library.cache_clear()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 8, 9])  # 4-row blocks, remainders, past the limit
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_m_linear_matches_reference(threads: int, num_rows: int, with_bias: bool, poison_allocations) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, 200, generator=gen)  # in_features not a multiple of the vector width
    weight = torch.randn(1000, 200, generator=gen)  # enough work to use the threads
    bias = torch.randn(1000, generator=gen) if with_bias else None
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_native.linear(x, weight, bias)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(got, reference.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("num_rows", "out_features"), [(1, 1000), (5, 16), (6, 1000), (7, 33), (13, 1000),
                                                        (64, 300), (100, 17)])  # tiles of 6 and their remainders
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_linear_matches_a_float64_product(threads: int, num_rows: int, out_features: int, with_bias: bool,
                                                poison_allocations) -> None:
    """The panel kernel (cpu_panel_linear.h) on a weight in column panels: every tile height and
    a last panel part-filled (out_features not a multiple of 16), with and without a bias, the
    output written only where it belongs (poisoned allocations would show anything left)."""
    gen = torch.Generator().manual_seed(num_rows * 1000 + out_features)
    x = torch.randn(num_rows, 200, generator=gen)  # in_features not a multiple of the vector width
    weight = torch.randn(out_features, 200, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    panels = cpu_weight_layout.to_panels(weight)
    assert panels.shape == (-(-out_features // 16), 200, 16)
    assert torch.equal(cpu_weight_layout.from_panels(panels, out_features), weight)
    got = with_threads(threads, cpu_linear.panel_rows, cpu_native._lib(), x, panels, out_features, bias, threads)
    want = reference.linear(x.double(), weight.double(), None if bias is None else bias.double()).float()
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-5)


def test_panel_linear_rows_do_not_depend_on_their_batch() -> None:
    """Each output is one chain of multiply-adds over the inputs in order, whatever the tile a row
    lands in, the row count or the threads: a row alone gives the bits it gives in any batch."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(23, 96, generator=gen)
    weight, bias = torch.randn(700, 96, generator=gen), torch.randn(700, generator=gen)
    panels = cpu_weight_layout.to_panels(weight)
    whole = with_threads(2, cpu_linear.panel_rows, cpu_native._lib(), x, panels, 700, bias, 2)
    for r in (0, 5, 6, 17, 22):
        alone = with_threads(1, cpu_linear.panel_rows, cpu_native._lib(), x[r : r + 1].contiguous(), panels, 700, bias, 1)
        assert torch.equal(alone[0], whole[r])
    part = with_threads(1, cpu_linear.panel_rows, cpu_native._lib(), x[4:15].contiguous(), panels, 700, bias, 1)
    assert torch.equal(part, whole[4:15])


@pytest.mark.skipif(not has_cpu_flag("avx512f"), reason="the default build is already the 8-wide one here")
def test_panel_linear_eight_wide_build_gives_the_same_bits() -> None:
    """The panel kernel built without AVX-512 (8-float vectors, tiles of 6 rows: what an AVX2
    machine runs) against the default build (16-float vectors, tiles of 12): each output is the
    same chain of fused multiply-adds, so every row count and thread count agrees bit for bit."""
    name = "inflight_panel_linear_f32"
    lib, where = cpu_native.compile_library(cpu_native.SOURCE, "panel_mno-avx512f", {name: cpu_native._SIGNATURES[name]},
                                            ("-lm",), ("-mno-avx512f",))  # fmt: skip
    assert lib is not None, where
    gen = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(300, 200, generator=gen), torch.randn(300, generator=gen)
    panels = cpu_weight_layout.to_panels(weight)
    for rows in (1, 5, 6, 7, 12, 13, 25, 64):
        x = torch.randn(rows, 200, generator=gen)
        for threads in (1, 2):
            eight = with_threads(threads, cpu_linear.panel_rows, lib, x, panels, 300, bias, threads)
            default = with_threads(threads, cpu_linear.panel_rows, cpu_native._lib(), x, panels, 300, bias, threads)
            assert torch.equal(eight, default), (rows, threads)


def test_small_m_linear_other_layouts_use_the_reference() -> None:
    x = torch.randn(6, 64)[:, :32]  # not contiguous
    weight = torch.randn(16, 32)
    assert torch.equal(cpu_native.linear(x, weight), reference.linear(x, weight))
    xb, wb = torch.randn(2, 32).bfloat16(), weight.bfloat16()
    assert torch.equal(cpu_native.linear(xb, wb), reference.linear(xb, wb))
