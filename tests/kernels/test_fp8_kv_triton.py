"""The Triton KV store, decode and prefill attention over fp8 caches against the torch reference
(Triton's interpreter on the CPU; the GPU check collects them on CUDA through ``device``)."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import fp8_kv, reference

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
F32, BF16 = torch.float32, torch.bfloat16


def _fp8_caches(make_paged_cache, lens, block_size, num_kv_heads, head_dim, dtype, scales, device):
    paged = make_paged_cache(lens, block_size, num_kv_heads, head_dim, F32, torch.device("cpu"))
    k = fp8_kv.quantize(paged.k_cache * 40 * scales[0], dtype, scales[0]).to(device)
    v = fp8_kv.quantize(paged.v_cache * 40 * scales[1], dtype, scales[1]).to(device)
    return paged, k, v


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_store_writes_the_references_bytes(device, dtype) -> None:
    from inflight.kernels.triton_kv_store import store_kv_cache

    gen = torch.Generator().manual_seed(7)
    key = torch.randn(40, 2, 24, generator=gen) * 30
    value = torch.randn(40, 2, 24, generator=gen) * 0.01  # mostly the format's subnormals at this scale
    key[0, 0, :4] = torch.tensor([1e6, -1e6, 0.0, -0.0])  # saturates; zeros keep their sign
    slots = torch.randperm(80, generator=gen)[:40]
    slots[3] = -1
    caches = [torch.zeros(10, 8, 2, 24, dtype=dtype) for _ in range(2)]
    reference.store_kv_cache(key, value, *caches, slots, k_scale=0.3, v_scale=0.001)
    got = [torch.zeros(10, 8, 2, 24, dtype=dtype, device=device) for _ in range(2)]
    store_kv_cache(key.to(device), value.to(device), *got, slots.to(device), k_scale=0.3, v_scale=0.001)
    for want, have in zip(caches, got, strict=True):
        assert torch.equal(have.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize(("q_dtype", "window", "splits"), [(F32, None, None), (F32, 11, (3, 16)), (BF16, None, None)])
def test_decode_over_fp8_matches_the_reference(make_paged_cache, device, dtype, q_dtype, window, splits) -> None:
    from inflight.kernels.triton_decode_attention import decode_with_plan, paged_decode_attention, split_plan

    lens, heads = [1, 16, 45], 4
    paged, k8, v8 = _fp8_caches(make_paged_cache, lens, 16, 2, 32, dtype, (0.05, 0.2), device)
    query = torch.randn(len(lens), heads, 32, generator=torch.Generator().manual_seed(8)).to(q_dtype)
    args = (query, k8.cpu(), v8.cpu(), paged.block_tables, paged.context_lens, 32**-0.5, window)
    want = reference.paged_decode_attention(*args, k_scale=0.05, v_scale=0.2)
    dev_args = (query.to(device), k8, v8, paged.block_tables.to(device), paged.context_lens.to(device), 32**-0.5)
    if splits is None:
        got = paged_decode_attention(*dev_args, window, k_scale=0.05, v_scale=0.2)
    else:
        plan = split_plan(paged.block_tables.shape[1] * 16, *splits)
        got = decode_with_plan(*dev_args, plan, window, k_scale=0.05, v_scale=0.2)
    tol = {"atol": 1e-4, "rtol": 1e-4} if q_dtype == F32 else {"atol": 5e-2, "rtol": 5e-2}
    torch.testing.assert_close(got.cpu(), want, **tol)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("window", [None, 9])
def test_prefill_over_fp8_matches_the_reference(make_paged_cache, device, dtype, window) -> None:
    from inflight.kernels.triton_prefill_attention import paged_prefill_attention

    lens, q_lens, heads, kv_heads, d = [20, 33], [20, 6], 4, 2, 32
    paged, k8, v8 = _fp8_caches(make_paged_cache, lens, 8, kv_heads, d, dtype, (0.1, 0.3), device)
    query = torch.randn(sum(q_lens), heads, d, generator=torch.Generator().manual_seed(9))
    starts = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
    args = (paged.block_tables, starts, paged.context_lens, d**-0.5)
    want = reference.paged_prefill_attention(query, k8.cpu(), v8.cpu(), *args, sliding_window=window,
                                             k_scale=0.1, v_scale=0.3)  # fmt: skip
    got = paged_prefill_attention(query.to(device), k8, v8, *(a.to(device) for a in args[:3]), args[3],
                                  sliding_window=window, k_scale=0.1, v_scale=0.3)  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_engine_on_triton_with_an_fp8_cache_generates_what_the_references_do(tiny_model_dir, device) -> None:
    from inflight.runtime.config import EngineConfig
    from inflight.runtime.core.engine import LLMEngine
    from inflight.runtime.sampling_params import SamplingParams

    tokens = []
    for backend in ("triton", "torch"):
        config = EngineConfig(kernel_backend=backend, device=device.type, dtype="float32", block_size=16,
                              num_kv_blocks=64, max_num_tokens=24, kv_cache_dtype="fp8", calculate_kv_scales=True)
        engine = LLMEngine.from_model_dir(tiny_model_dir, config)
        assert engine.runner.ops.name == backend and engine.runner.kv_caches[0][0].dtype == E4M3
        for i, prompt in enumerate([[5] * 3, [6] * 17, [9] * 40, [9] * 40]):  # ragged, chunked, shared prefix
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        out: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out.setdefault(o.req_id, []).extend(o.new_token_ids)
        assert engine.stats().prefix_cache_hits > 0
        engine.close()
        tokens.append(out)
    assert tokens[0] == tokens[1]
