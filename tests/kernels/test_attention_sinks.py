"""Attention sinks (gpt-oss): a learned logit per query head that joins every softmax's
denominator with no value. The reference against a brute-force softmax over ``[scores, sink]``
written out by hand, and the native CPU decode kernel and the Triton decode/prefill kernels
(Triton's interpreter on the CPU) against the reference, with and without a sliding window and
with forced decode splits (the sink must join once, in the merge). Without sinks every kernel
is unchanged (``sinks=None`` is bit-identical to not passing it).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from inflight.kernels import reference

F32, BF16 = torch.float32, torch.bfloat16
CPU = torch.device("cpu")


def _brute_force(query, paged, starts, window, sinks):  # [num_tokens, H, D], token by token
    out = torch.empty_like(query, dtype=torch.float32)
    block_size, num_kv_heads, head_dim = paged.k_cache.shape[1], paged.k_cache.shape[2], query.shape[2]
    group = query.shape[1] // num_kv_heads
    for s, ctx in enumerate(paged.context_lens.tolist()):
        blocks = paged.block_tables[s, : -(-ctx // block_size)].long()
        keys = paged.k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float().repeat_interleave(group, 1)
        values = paged.v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float().repeat_interleave(group, 1)
        q_begin, q_end = starts[s], starts[s + 1]
        for i, t in enumerate(range(q_begin, q_end)):
            pos = ctx - (q_end - q_begin) + i
            k_pos = torch.arange(ctx)
            visible = (k_pos <= pos) & ((k_pos > pos - window) if window else True)
            for h in range(query.shape[1]):
                scores = (keys[visible, h] @ query[t, h].float()) * head_dim**-0.5  # [visible keys]
                exps = torch.exp(torch.cat([scores, sinks[h : h + 1].float()]).double())
                weights = (exps[:-1] / exps.sum()).float()  # the sink's share is dropped
                out[t, h] = weights @ values[visible, h]
    return out.to(query.dtype)


def _sinks(num_heads: int, seed: int) -> torch.Tensor:
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2.0  # some above the scores


@pytest.mark.parametrize("window", [None, 5, 23])
def test_reference_matches_a_brute_force_softmax_with_sinks(window, make_paged_cache) -> None:
    paged = make_paged_cache([1, 16, 40, 77], 16, 2, 32, F32, CPU)
    gen = torch.Generator().manual_seed(7)
    sinks = _sinks(4, 1)
    query = torch.randn(4, 4, 32, generator=gen)
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 32**-0.5)
    expected = _brute_force(query, paged, [0, 1, 2, 3, 4], window, sinks)
    torch.testing.assert_close(reference.paged_decode_attention(*args, window, sinks), expected)
    assert not torch.allclose(reference.paged_decode_attention(*args, window), expected)  # the sink matters

    q_lens = [1, 16, 9, 30]  # a decode, a whole prompt, two later chunks
    starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    chunk_q = torch.randn(sum(q_lens), 4, 32, generator=gen)
    got = reference.paged_prefill_attention(
        chunk_q, paged.k_cache, paged.v_cache, paged.block_tables, torch.tensor(starts, dtype=torch.int32),
        paged.context_lens, 32**-0.5, sliding_window=window, sinks=sinks,
    )  # fmt: skip
    torch.testing.assert_close(got, _brute_force(chunk_q, paged, starts, window, sinks))


def test_no_sinks_is_bit_identical(make_paged_cache) -> None:
    paged = make_paged_cache([7, 33], 16, 2, 32, F32, CPU)
    query = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(0))
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 0.2)
    assert torch.equal(reference.paged_decode_attention(*args, None, None), reference.paged_decode_attention(*args))


# (block_size, head_dim, num_heads, num_kv_heads, context_lens, window)
NATIVE_CASES = [
    (16, 64, 8, 2, [1, 16, 33, 7], None),
    (8, 32, 4, 4, [5, 33, 90], 21),  # window starting mid-block
]


@pytest.mark.parametrize("case", NATIVE_CASES, ids=lambda c: f"bs{c[0]}-d{c[1]}-w{c[5]}")
def test_native_cpu_decode_matches_reference(case, make_paged_cache, poison_allocations) -> None:
    from inflight.kernels import cpu_native

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine")
    assert cpu_native.load_library()[0] is not None
    block_size, head_dim, num_heads, num_kv_heads, lens, window = case
    paged = make_paged_cache(lens, block_size, num_kv_heads, head_dim, F32, CPU)
    query = torch.randn(len(lens), num_heads, head_dim, generator=torch.Generator().manual_seed(head_dim))
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, head_dim**-0.5)
    sinks = _sinks(num_heads, 2)
    expected = reference.paged_decode_attention(*args, window, sinks)
    torch.testing.assert_close(cpu_native.paged_decode_attention(*args, window, sinks), expected, atol=2e-6, rtol=2e-5)
    assert torch.equal(cpu_native.paged_decode_attention(*args, window, None), cpu_native.paged_decode_attention(*args, window))


# (block_size, head_dim, num_heads, num_kv_heads, dtype, context_lens, window, forced split plan)
TRITON_DECODE_CASES = [
    (16, 64, 4, 2, F32, [1, 16, 33, 70], None, None),  # one split: the sink joins at the end
    (16, 64, 8, 2, F32, [1, 96, 64, 33], 20, (4, 16)),  # splits (some empty): the sink joins in the merge
    (32, 64, 4, 1, BF16, [65, 2, 32], None, (2, 32)),
]


@pytest.mark.parametrize("case", TRITON_DECODE_CASES, ids=lambda c: f"bs{c[0]}-w{c[6]}-split{c[7]}")
def test_triton_decode_matches_reference(case, device, make_paged_cache, poison_allocations, assert_close) -> None:
    from inflight.kernels.triton_decode_attention import (
        decode_with_plan,
        paged_decode_attention,
        split_plan,
    )

    block_size, head_dim, num_heads, num_kv_heads, dtype, lens, window, split = case
    paged = make_paged_cache(lens, block_size, num_kv_heads, head_dim, dtype, device)
    gen = torch.Generator().manual_seed(len(lens))
    query = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, head_dim**-0.5)
    sinks = _sinks(num_heads, 3).to(device)
    expected = reference.paged_decode_attention(*args, window, sinks)
    if split is None:
        got = paged_decode_attention(*args, window, sinks)
    else:
        plan = split_plan(paged.block_tables.shape[1] * block_size, split[0], split[1])
        got = decode_with_plan(*args, plan, window, sinks)
    assert_close(got, expected)


# (block_size, head_dim, num_heads, num_kv_heads, dtype, [(q_len, context_len)], window, tiles)
TRITON_PREFILL_CASES = [
    (16, 64, 4, 2, F32, [(1, 1), (16, 16), (5, 37), (0, 9), (20, 52)], None, (16, 16)),
    (16, 64, 4, 4, F32, [(48, 48), (9, 41)], 8, (16, 16)),
    (32, 64, 4, 1, BF16, [(40, 64)], None, (16, 16)),
]


@pytest.mark.parametrize("case", TRITON_PREFILL_CASES, ids=lambda c: f"bs{c[0]}-w{c[6]}-{c[4]}")
def test_triton_prefill_matches_reference(case, device, make_paged_cache, poison_allocations, assert_close) -> None:
    from inflight.kernels.triton_prefill_attention import PrefillConfig, prefill_with_config

    block_size, head_dim, num_heads, num_kv_heads, dtype, chunks, window, tiles = case
    q_lens = [q for q, _ in chunks]
    paged = make_paged_cache([c for _, c in chunks], block_size, num_kv_heads, head_dim, dtype, device)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(sum(q_lens))
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables, starts.to(device),
            paged.context_lens, head_dim**-0.5)  # fmt: skip
    sinks = _sinks(num_heads, 4).to(device)
    expected = reference.paged_prefill_attention(*args, sliding_window=window, sinks=sinks)
    got = prefill_with_config(*args, PrefillConfig(block_m=tiles[0], block_n=tiles[1]), window, sinks)
    assert_close(got, expected)



def _generate(model_dir, backend: str, device: torch.device) -> dict[str, list[int]]:
    from inflight.runtime.config import EngineConfig
    from inflight.runtime.core.engine import LLMEngine
    from inflight.runtime.sampling_params import SamplingParams

    config = EngineConfig(kernel_backend=backend, device=device.type, dtype="float32", block_size=16,
                          num_kv_blocks=32, max_num_tokens=12)  # fmt: skip
    engine = LLMEngine.from_model_dir(model_dir, config)
    prompts = [[5] * 3, [6] * 11, [9] * 20, [9] * 20]  # ragged, chunked, past the window, a shared prefix
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    assert engine.stats().prefix_cache_hits > 0
    return tokens


@pytest.mark.slow
def test_gpt_oss_engine_on_triton_matches_torch_backend(tmp_path, device) -> None:
    """A gpt-oss engine on the Triton kernels (sinks in decode and prefill, biased clamped
    experts; the interpreter on the CPU) generates what it does on the torch references."""
    from inflight.runtime.demo.model import make_demo_model

    overrides = {"sliding_window": 8, "swiglu_limit": 1.0}
    model_dir = make_demo_model(tmp_path, "gpt_oss", seed=2, config_overrides=overrides)
    assert _generate(model_dir, "triton", device) == _generate(model_dir, "torch", device)
