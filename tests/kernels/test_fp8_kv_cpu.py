"""fp8 KV caches: the torch reference's semantics (quantize on store, ``stored * scale`` on read)
and the native CPU kernels (store, decode and prefill attention) against it."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import cpu_native, fp8_kv, reference
from tests.kernels.threads import torch_threads

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [E4M3, E5M2]
CPU = torch.device("cpu")


def _fp8_paged(make_paged_cache, lens, block_size, num_kv_heads, head_dim, dtype, k_scale, v_scale):
    """A float paged cache (values spread over the fp8 range at these scales) and its fp8 copy."""
    paged = make_paged_cache(lens, block_size, num_kv_heads, head_dim, torch.float32, CPU)
    k, v = paged.k_cache * 40 * k_scale, paged.v_cache * 40 * v_scale
    return paged, fp8_kv.quantize(k, dtype, k_scale), fp8_kv.quantize(v, dtype, v_scale)


@pytest.mark.parametrize("dtype", FP8)
def test_quantize_saturates_rounds_to_nearest_and_dequantizes_within_fp8_rounding(dtype) -> None:
    fmt = fp8_kv.FORMATS[dtype]
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 100
    x[:4] = torch.tensor([1e9, -1e9, 0.0, 1e-12])
    scale = 0.37
    stored = fp8_kv.quantize(x, dtype, scale)
    back = fp8_kv.dequantize(stored, scale)
    assert stored.dtype == dtype and back.dtype == torch.float32
    assert back[0].item() == pytest.approx(fmt.max_value * scale) and back[1].item() == pytest.approx(-fmt.max_value * scale)
    inside = (x.abs() / scale) <= fmt.max_value
    # nearest: within half a step of the format (2^-(mantissa_bits + 1) relative, or half the
    # smallest subnormal step absolute)
    sub_step = 2.0 ** (1 - fmt.bias - fmt.mantissa_bits) * scale
    err = (back - x).abs()[inside]
    bound = x.abs()[inside] * 2.0 ** -(fmt.mantissa_bits + 1) + sub_step / 2
    assert bool((err <= bound * (1 + 1e-6)).all())
    assert torch.equal(fp8_kv.decode_table(dtype)[stored.view(torch.uint8).long()] * scale, back)


def test_a_float_cache_is_never_scaled_and_an_fp8_one_reads_stored_times_scale(make_paged_cache) -> None:
    paged, k8, v8 = _fp8_paged(make_paged_cache, [20, 7], 8, 2, 32, E4M3, 0.5, 2.0)
    query = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(1))
    args = (paged.block_tables, paged.context_lens, 32**-0.5)
    got = reference.paged_decode_attention(query, k8, v8, *args, k_scale=0.5, v_scale=2.0)
    want = reference.paged_decode_attention(query, k8.float() * 0.5, v8.float() * 2.0, *args)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    f32 = reference.paged_decode_attention(query, paged.k_cache, paged.v_cache, *args)
    assert torch.equal(reference.paged_decode_attention(query, paged.k_cache, paged.v_cache, *args,
                                                        k_scale=3.0, v_scale=3.0), f32)  # fmt: skip


@pytest.mark.parametrize("dtype", FP8)
def test_reference_store_quantizes_into_the_slots(dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    key, value = torch.randn(5, 2, 16, generator=gen) * 3, torch.randn(5, 2, 16, generator=gen) * 3
    k_cache, v_cache = torch.zeros(4, 4, 2, 16, dtype=dtype), torch.zeros(4, 4, 2, 16, dtype=dtype)
    slots = torch.tensor([3, -1, 0, 15, 9])
    reference.store_kv_cache(key, value, k_cache, v_cache, slots, k_scale=0.25, v_scale=torch.tensor(0.5))
    flat_k, flat_v = k_cache.view(16, 2, 16), v_cache.view(16, 2, 16)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot].view(torch.uint8), fp8_kv.quantize(key[t], dtype, 0.25).view(torch.uint8))
            assert torch.equal(flat_v[slot].view(torch.uint8), fp8_kv.quantize(value[t], dtype, 0.5).view(torch.uint8))
    assert int(flat_k[1].view(torch.uint8).count_nonzero()) == 0


pytestmark_native = pytest.mark.usefixtures("native_built")


@pytestmark_native
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("threads", [1, 2])
def test_native_store_writes_the_references_bytes(dtype, threads) -> None:
    gen = torch.Generator().manual_seed(3)
    num_tokens = 300
    qkv = torch.randn(num_tokens, 3 * 4 * 32, generator=gen) * 50  # k and v are strided views of it
    qkv[0, 128:160] = torch.tensor([1e6, -1e6, 0.0, -0.0] * 8)
    key, value = qkv[:, 128:256].view(num_tokens, 4, 32), qkv[:, 256:].view(num_tokens, 4, 32)
    slots = torch.randperm(64 * 8, generator=gen)[:num_tokens]
    slots[5] = -1
    caches = [torch.zeros(64, 8, 4, 32, dtype=dtype) for _ in range(4)]
    reference.store_kv_cache(key, value, caches[0], caches[1], slots, k_scale=0.7, v_scale=0.03)
    with torch_threads(threads):
        cpu_native.store_kv_cache(key, value, caches[2], caches[3], slots, k_scale=0.7, v_scale=0.03)
    assert torch.equal(caches[2].view(torch.uint8), caches[0].view(torch.uint8))
    assert torch.equal(caches[3].view(torch.uint8), caches[1].view(torch.uint8))


@pytestmark_native
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize(("window", "sinks"), [(None, False), (13, False), (None, True)])
def test_native_decode_attention_over_fp8_matches_the_reference(make_paged_cache, poison_allocations, dtype,
                                                                window, sinks) -> None:  # fmt: skip
    lens, heads = [1, 16, 33, 70], 8
    paged, k8, v8 = _fp8_paged(make_paged_cache, lens, 16, 2, 64, dtype, 0.05, 0.2)
    query = torch.randn(len(lens), heads, 64, generator=torch.Generator().manual_seed(4))
    sink = torch.randn(heads) if sinks else None
    args = (query, k8, v8, paged.block_tables, paged.context_lens, 64**-0.5, window, sink)
    want = reference.paged_decode_attention(*args, k_scale=0.05, v_scale=0.2)
    for threads in (1, 2):
        with torch_threads(threads):
            got = cpu_native.paged_decode_attention(*args, k_scale=0.05, v_scale=0.2)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)  # values up to ~10: float sum order


@pytestmark_native
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("window", [None, 20])
def test_native_prefill_attention_over_fp8_matches_the_reference(make_paged_cache, poison_allocations, dtype,
                                                                 window) -> None:  # fmt: skip
    lens, q_lens, heads, kv_heads, d = [40, 17, 64], [40, 5, 30], 8, 4, 32
    paged, k8, v8 = _fp8_paged(make_paged_cache, lens, 16, kv_heads, d, dtype, 0.1, 0.1)
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(sum(q_lens), heads, d, generator=gen)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    # the whole prompt's own K/V (sequence 0: no cached prefix), as the decoder passes them: the
    # cache holds them rounded, and attention must see them rounded either way
    key = torch.randn(sum(q_lens), kv_heads, d, generator=gen) * 4
    value = torch.randn(sum(q_lens), kv_heads, d, generator=gen) * 4
    slots = torch.cat([paged.block_tables[s, torch.arange(lens[s] - q_lens[s], lens[s]) // 16].long() * 16
                       + torch.arange(lens[s] - q_lens[s], lens[s]) % 16 for s in range(3)])  # fmt: skip
    reference.store_kv_cache(key, value, k8, v8, slots, k_scale=0.1, v_scale=0.1)
    args = (query, k8, v8, paged.block_tables, starts, paged.context_lens, d**-0.5, key, value, window)
    want = reference.paged_prefill_attention(*args, k_scale=0.1, v_scale=0.1)
    from_cache = reference.paged_prefill_attention(*args[:7], None, None, window, k_scale=0.1, v_scale=0.1)
    torch.testing.assert_close(want, from_cache, atol=1e-6, rtol=1e-5)
    got = cpu_native.paged_prefill_attention(*args, k_scale=0.1, v_scale=0.1)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)


@pytestmark_native
def test_native_fp8_kernels_take_the_reference_for_other_query_layouts(make_paged_cache) -> None:
    paged, k8, v8 = _fp8_paged(make_paged_cache, [9, 30], 8, 2, 16, E4M3, 1.0, 1.0)
    query = torch.randn(2, 16, 4).transpose(1, 2)  # heads not packed
    args = (query, k8, v8, paged.block_tables, paged.context_lens, 0.25)
    torch.testing.assert_close(cpu_native.paged_decode_attention(*args, k_scale=2.0),
                               reference.paged_decode_attention(*args, k_scale=2.0), atol=0, rtol=0)  # fmt: skip


def test_the_one_call_decode_block_refuses_fp8_caches() -> None:
    """The decoder runs an fp8 cache layer by layer; the one-call block says so instead of
    storing without the layer's scales."""
    from inflight.kernels import decode_block

    cache = torch.zeros(2, 4, 1, 8, dtype=E4M3)
    rows = decode_block.DecodeRows.of(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                                      torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))  # fmt: skip
    layer = decode_block.AttentionLayer(2, 1, 8, 0.3)
    with pytest.raises(ValueError, match="fp8 cache runs layer by layer"):
        decode_block.decode_attention_block(torch.zeros(1, 32), rows, torch.zeros(4, 8), (cache, cache), layer)
