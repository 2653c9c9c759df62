"""bfloat16 KV caches of a float32 engine (``kv_cache_dtype bfloat16``): the native CPU kernels
(store, decode attention, the one-call decode block, prefill attention) against the torch
reference, which stores ``x.to(torch.bfloat16)`` and reads the widened values; and which engines
and devices may ask for such a cache."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import cpu_native, decode_block, fp8_kv, reference
from inflight.kernels.decode_block import AttentionLayer, DecodeRows
from tests.kernels.threads import torch_threads

BF16 = torch.bfloat16
CPU = torch.device("cpu")
native = pytest.mark.usefixtures("native_built")


def _bf16_paged(make_paged_cache, lens, block_size, num_kv_heads, head_dim):
    paged = make_paged_cache(lens, block_size, num_kv_heads, head_dim, torch.float32, CPU)
    return paged, (paged.k_cache * 3).to(BF16), (paged.v_cache * 3).to(BF16)


def test_the_setting_names_a_float32_engines_cpu_cache_or_a_bfloat16_engines() -> None:
    assert fp8_kv.cache_dtype("bfloat16", torch.float32, "cpu") == BF16
    assert fp8_kv.cache_dtype("bfloat16", BF16, "cuda") == BF16  # what auto gives it
    with pytest.raises(ValueError, match="runs on the CPU only"):
        fp8_kv.cache_dtype("bfloat16", torch.float32, "cuda")
    with pytest.raises(ValueError, match="takes a float32 or bfloat16 engine"):
        fp8_kv.cache_dtype("bfloat16", torch.float16, "cpu")
    with pytest.raises(ValueError, match="fp8_e5m2, bfloat16"):
        fp8_kv.cache_dtype("half", torch.float32)


@native
@pytest.mark.parametrize("threads", [1, 2])
def test_native_store_writes_torchs_rounding(threads: int) -> None:
    gen = torch.Generator().manual_seed(3)
    num_tokens = 300
    qkv = torch.randn(num_tokens, 3 * 4 * 32, generator=gen) * 50  # k and v are strided views of it
    # ties to even, the largest finite values (round to inf), subnormals, signed zeros
    qkv[0, 128:140] = torch.tensor([1.00390625, 1.01171875, -1.00390625, 3.3895314e38, -3.39e38, 1e-40, -1e-40,
                                    0.0, -0.0, float("inf"), 65504.0, 1e-30])  # fmt: skip
    qkv[1, 128:130] = float("nan")
    key, value = qkv[:, 128:256].view(num_tokens, 4, 32), qkv[:, 256:].view(num_tokens, 4, 32)
    slots = torch.randperm(64 * 8, generator=gen)[:num_tokens]
    slots[5] = -1
    caches = [torch.zeros(64, 8, 4, 32, dtype=BF16) for _ in range(4)]
    reference.store_kv_cache(key, value, caches[0], caches[1], slots)
    with torch_threads(threads):
        cpu_native.store_kv_cache(key, value, caches[2], caches[3], slots)
    got_k, want_k = caches[2].float(), caches[0].float()
    nan = want_k.isnan()
    assert int(nan.sum()) == 2 and torch.equal(got_k.isnan(), nan)  # NaN stays NaN
    assert torch.equal(caches[2].view(torch.int16)[~nan], caches[0].view(torch.int16)[~nan])
    assert torch.equal(caches[3].view(torch.int16), caches[1].view(torch.int16))
    written = torch.zeros(64 * 8, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert int(caches[2].view(64 * 8, 4 * 32)[~written].count_nonzero()) == 0  # slot -1: nothing stored


@native
@pytest.mark.parametrize(("window", "sinks"), [(None, False), (13, False), (None, True)])
def test_native_decode_attention_over_bfloat16_matches_the_reference(make_paged_cache, poison_allocations, window,
                                                                     sinks) -> None:  # fmt: skip
    lens, heads = [1, 16, 33, 70], 8
    paged, k16, v16 = _bf16_paged(make_paged_cache, lens, 16, 2, 64)
    query = torch.randn(len(lens), heads, 64, generator=torch.Generator().manual_seed(4))
    sink = torch.randn(heads) if sinks else None
    args = (query, k16, v16, paged.block_tables, paged.context_lens, 64**-0.5, window, sink)
    want = reference.paged_decode_attention(*args)
    widened = reference.paged_decode_attention(query, k16.float(), v16.float(), *args[3:])
    torch.testing.assert_close(want, widened, atol=0, rtol=0)  # the reference reads the widened values
    for threads in (1, 2):
        with torch_threads(threads):
            got = cpu_native.paged_decode_attention(*args)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@native
@pytest.mark.parametrize("qk_norm", [False, True])
def test_the_one_call_decode_block_over_bfloat16_matches_the_per_op_reference(make_paged_cache, poison_allocations,
                                                                             qk_norm) -> None:  # fmt: skip
    lens, heads, kv_heads, d = [5, 16, 40], 4, 2, 32
    paged, k16, v16 = _bf16_paged(make_paged_cache, lens, 16, kv_heads, d)
    gen = torch.Generator().manual_seed(6)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * d, generator=gen) * 2
    positions = (paged.context_lens - 1).long()
    slots = torch.stack([paged.block_tables[s, (lens[s] - 1) // 16].long() * 16 + (lens[s] - 1) % 16
                         for s in range(len(lens))])  # fmt: skip
    rows = DecodeRows.of(positions, slots, paged.block_tables, paged.context_lens)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.arange(128).float()[:, None] * inv[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).contiguous()
    norms = (torch.rand(d, generator=gen) + 0.5, torch.rand(d, generator=gen) + 0.5) if qk_norm else (None, None)
    layer = AttentionLayer(heads, kv_heads, d, d**-0.5, q_norm=norms[0], k_norm=norms[1])
    ref_caches = (k16.clone(), v16.clone())
    want = decode_block.decode_attention_block(qkv, rows, cos_sin, ref_caches, layer)
    got = cpu_native.decode_attention_block(qkv, rows, cos_sin, (k16, v16), layer)
    assert torch.equal(k16.view(torch.int16), ref_caches[0].view(torch.int16))  # the same bits stored
    assert torch.equal(v16.view(torch.int16), ref_caches[1].view(torch.int16))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@native
@pytest.mark.parametrize("window", [None, 20])
def test_native_prefill_attention_over_bfloat16_matches_the_reference(make_paged_cache, poison_allocations,
                                                                      window) -> None:  # fmt: skip
    lens, q_lens, heads, kv_heads, d = [40, 17, 64], [40, 5, 30], 8, 4, 32
    paged, k16, v16 = _bf16_paged(make_paged_cache, lens, 16, kv_heads, d)
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(sum(q_lens), heads, d, generator=gen)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    key = torch.randn(sum(q_lens), kv_heads, d, generator=gen) * 4
    value = torch.randn(sum(q_lens), kv_heads, d, generator=gen) * 4
    slots = torch.cat([paged.block_tables[s, torch.arange(lens[s] - q_lens[s], lens[s]) // 16].long() * 16
                       + torch.arange(lens[s] - q_lens[s], lens[s]) % 16 for s in range(3)])  # fmt: skip
    reference.store_kv_cache(key, value, k16, v16, slots)
    args = (query, k16, v16, paged.block_tables, starts, paged.context_lens, d**-0.5, key, value, window)
    # attention sees the chunk's own K/V as the cache holds them (rounded), given or read back
    want = reference.paged_prefill_attention(*args)
    from_cache = reference.paged_prefill_attention(*args[:7], None, None, window)
    torch.testing.assert_close(want, from_cache, atol=1e-6, rtol=1e-5)
    unrounded = reference.paged_prefill_attention(query, k16.float(), v16.float(), *args[3:])
    assert not torch.allclose(unrounded, want, atol=1e-4)  # the given K/V differ from what the cache holds
    got = cpu_native.paged_prefill_attention(*args)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
