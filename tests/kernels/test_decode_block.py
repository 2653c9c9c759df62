"""The decode attention block in one call (inflight/kernels/decode_block.py): the native kernel
against its torch reference (block edges, GQA groups, odd head sizes, partial rotary, qk-norm,
sliding windows, sinks, skipped slots, rows of one sequence that read each other's K/V), the
reference against the per-op kernels it stands for, and the decoder's logits with and without it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inflight.kernels import cpu_native, decode_block, reference
from inflight.kernels.decode_block import AttentionLayer, DecodeRows
from inflight.kernels.ops import TORCH_OPS

from .decode_steps import check_decode_steps
from .threads import with_threads

pytestmark = pytest.mark.usefixtures("native_built")

# (block_size, head_dim, num_heads, num_kv_heads, context_lens, rot_dim)
CASES = [
    (16, 32, 8, 4, [1, 16, 17, 33], 32),  # bench-small's shape, contexts at block edges
    (16, 64, 8, 4, [15, 32, 48, 130], 64),  # bench-medium's shape
    (16, 80, 14, 2, [5, 33, 250], 80),  # head_dim not a power of two, groups of 7
    (32, 128, 8, 1, [1, 64, 65], 64),  # partial rotary, one KV head
    (8, 64, 4, 4, [9, 300], 64),  # no GQA
]


def _rows_for(lens: list[int], tables: torch.Tensor, block_size: int, skip: int | None = None) -> DecodeRows:
    """Each sequence's last token (position len - 1) written to its slot; ``skip``: that row's slot is -1."""
    slots = [int(tables[s, (n - 1) // block_size]) * block_size + (n - 1) % block_size for s, n in enumerate(lens)]
    if skip is not None:
        slots[skip] = -1
    return DecodeRows.of(torch.tensor([n - 1 for n in lens]), torch.tensor(slots), tables,
                         torch.tensor(lens, dtype=torch.int32))  # fmt: skip


def _run_both(qkv, rows, cos_sin, paged, layer, threads=1):
    """(native out, k, v caches after; reference out, k, v caches after), each on its own cache copy."""
    caches = [(paged.k_cache.clone(), paged.v_cache.clone()) for _ in range(2)]
    got = with_threads(threads, cpu_native.decode_attention_block, qkv, rows, cos_sin, caches[0], layer)
    want = decode_block.decode_attention_block(qkv, rows, cos_sin, caches[1], layer)
    return (got, *caches[0]), (want, *caches[1])


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"bs{c[0]}-d{c[1]}-h{c[2]}-kv{c[3]}-rot{c[5]}")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_native_block_matches_the_reference(case, threads, qk_norm, make_paged_cache, poison_allocations) -> None:
    block_size, head_dim, num_heads, num_kv_heads, lens, rot_dim = case
    paged = make_paged_cache(lens, block_size, num_kv_heads, head_dim, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(head_dim + len(lens))
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(len(lens), width + 24, generator=gen)[:, 7 : 7 + width]  # a row stride of its own
    cos_sin = torch.randn(max(lens) + 3, rot_dim, generator=gen)
    norms = (torch.rand(head_dim, generator=gen) + 0.5, torch.rand(head_dim, generator=gen) + 0.5) if qk_norm else (None, None)
    layer = AttentionLayer(num_heads, num_kv_heads, head_dim, head_dim**-0.5, q_norm=norms[0], k_norm=norms[1])
    (got, gk, gv), (want, wk, wv) = _run_both(qkv, _rows_for(lens, paged.block_tables, block_size), cos_sin, paged,
                                              layer, threads)  # fmt: skip
    assert got.shape == (len(lens), num_heads * head_dim)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    if qk_norm:  # the norm's sum runs in another order than torch's
        torch.testing.assert_close(gk, wk, atol=1e-6, rtol=1e-6)
    else:  # rotary without fused multiply-adds, as torch computes it
        assert torch.equal(gk, wk)
    assert torch.equal(gv, wv)


@pytest.mark.parametrize("threads", [1, 2])
def test_windows_sinks_and_skipped_slots(threads, make_paged_cache) -> None:
    lens, block_size, head_dim = [3, 40, 17, 70], 16, 64
    paged = make_paged_cache(lens, block_size, 2, head_dim, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(len(lens), (8 + 4) * head_dim, generator=gen)
    cos_sin = torch.randn(80, head_dim, generator=gen)
    layer = AttentionLayer(8, 2, head_dim, 0.1, sliding_window=17, sinks=torch.randn(8, generator=gen))
    rows = _rows_for(lens, paged.block_tables, block_size, skip=2)  # row 2's K/V not stored
    (got, gk, gv), (want, wk, wv) = _run_both(qkv, rows, cos_sin, paged, layer, threads)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    assert torch.equal(gk, wk) and torch.equal(gv, wv)


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_of_one_sequence_see_each_others_keys(threads, make_paged_cache) -> None:
    """A speculating sequence's rows are decode rows of one table: row i reads rows < i of this
    step, so every row's K/V must be stored before any row attends."""
    block_size, head_dim, start = 16, 32, 14  # the rows cross a block edge (positions 14..19)
    paged = make_paged_cache([start + 6], block_size, 4, head_dim, torch.float32, torch.device("cpu"))
    table = paged.block_tables[:1].expand(6, -1).contiguous()
    lens = [start + 1 + i for i in range(6)]
    gen = torch.Generator().manual_seed(11)
    qkv = torch.randn(6, (8 + 8) * head_dim, generator=gen)
    layer = AttentionLayer(8, 4, head_dim, head_dim**-0.5)
    (got, gk, gv), (want, wk, wv) = _run_both(qkv, _rows_for(lens, table, block_size), torch.randn(32, head_dim),
                                              paged, layer, threads)  # fmt: skip
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-5)
    assert torch.equal(gk, wk) and torch.equal(gv, wv)


def test_the_reference_is_the_per_op_path(make_paged_cache) -> None:
    lens, block_size, head_dim = [5, 16, 33], 16, 32
    paged = make_paged_cache(lens, block_size, 2, head_dim, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(3, 8 * head_dim, generator=gen)
    cos_sin = torch.randn(40, head_dim, generator=gen)
    norm = torch.rand(head_dim, generator=gen)
    layer = AttentionLayer(4, 2, head_dim, 0.2, sliding_window=9, q_norm=norm, k_norm=norm.flip(0), norm_eps=1e-5)
    rows = _rows_for(lens, paged.block_tables, block_size)
    k_cache, v_cache = paged.k_cache.clone(), paged.v_cache.clone()
    got = decode_block.decode_attention_block(qkv, rows, cos_sin, (k_cache, v_cache), layer)
    q, k, v = qkv.split([4 * head_dim, 2 * head_dim, 2 * head_dim], dim=-1)
    q = reference.rms_norm(q.reshape(3, 4, head_dim), norm, 1e-5)[0]
    k = reference.rms_norm(k.reshape(3, 2, head_dim), norm.flip(0), 1e-5)[0]
    q, k = reference.rotary_embedding(rows.positions, q, k, cos_sin)
    reference.store_kv_cache(k, v.reshape(3, 2, head_dim), paged.k_cache, paged.v_cache, rows.slot_mapping)
    want = reference.paged_decode_attention(q, paged.k_cache, paged.v_cache, rows.block_tables,
                                            rows.context_lens, 0.2, 9)  # fmt: skip
    assert torch.equal(got, want.reshape(3, -1))
    assert torch.equal(k_cache, paged.k_cache) and torch.equal(v_cache, paged.v_cache)


def test_other_dtypes_and_layouts_take_the_reference_and_an_empty_batch_is_empty(make_paged_cache) -> None:
    paged = make_paged_cache([20, 3], 16, 2, 32, torch.bfloat16, torch.device("cpu"))
    rows = _rows_for([20, 3], paged.block_tables, 16)
    qkv = torch.randn(2, 8 * 32).to(torch.bfloat16)
    layer = AttentionLayer(4, 2, 32, 0.125)
    (got, gk, _), (want, wk, _) = _run_both(qkv, rows, torch.randn(30, 32), paged, layer)
    assert torch.equal(got, want) and torch.equal(gk, wk)
    f32 = make_paged_cache([20, 3], 16, 2, 32, torch.float32, torch.device("cpu"))
    empty_rows = DecodeRows.of(*(torch.empty(0, dtype=torch.int64) for _ in range(2)),
                               torch.empty(0, 2, dtype=torch.int32), torch.empty(0, dtype=torch.int32))  # fmt: skip
    out = cpu_native.decode_attention_block(torch.empty(0, 8 * 32), empty_rows, torch.randn(30, 32),
                                            (f32.k_cache, f32.v_cache), layer)  # fmt: skip
    assert out.shape == (0, 4 * 32)


def test_rows_are_converted_once_and_left_alone_when_already_right() -> None:
    positions, slots = torch.arange(4), torch.arange(4)
    tables, lens = torch.zeros(4, 2, dtype=torch.int32), torch.ones(4, dtype=torch.int32)
    rows = DecodeRows.of(positions, slots, tables, lens)
    assert rows.positions is positions and rows.block_tables is tables and rows.context_lens is lens
    converted = DecodeRows.of(positions.int(), slots, tables.long().t().contiguous().t(), lens.long())
    assert converted.positions.dtype == torch.int64 and converted.context_lens.dtype == torch.int32
    assert converted.block_tables.dtype == torch.int32 and converted.block_tables.is_contiguous()


def test_bundles_carry_the_block_where_they_have_one() -> None:
    assert TORCH_OPS.decode_attention_block is decode_block.decode_attention_block
    assert cpu_native.CPU_OPS.decode_attention_block is cpu_native.decode_attention_block


@pytest.mark.parametrize("ops_name", ["cpu", "torch"])
def test_decoder_logits_match_with_and_without_the_block(ops_name, tiny_model_dir) -> None:
    """A tiny Qwen3 (qk-norm) decode step through the one-call block equals the per-op path."""
    from inflight.runtime.config import EngineConfig
    from inflight.runtime.core.engine import LLMEngine

    config = EngineConfig(max_num_sequences=4, max_model_len=64, block_size=16, dtype="float32",
                          num_kv_blocks=32, device="cpu", kernel_backend=ops_name)  # fmt: skip
    engine = LLMEngine.from_model_dir(tiny_model_dir, config)
    runner = engine.runner
    try:
        block_ops = runner.ops
        assert block_ops.decode_attention_block is not None
        seen: list[torch.Tensor] = []

        def check(out, per_op, caches, per_op_caches) -> None:
            seen.append((out - per_op).abs().max())
            for (k, v), (per_op_k, per_op_v) in zip(caches, per_op_caches, strict=True):
                torch.testing.assert_close(k, per_op_k, atol=1e-6, rtol=1e-6)  # qk-norm sums in another order
                assert torch.equal(v, per_op_v)

        check_decode_steps(engine, dataclasses.replace(block_ops, decode_attention_block=None), check)
        assert seen and max(float(d) for d in seen) < 1e-5
    finally:
        runner.close()
