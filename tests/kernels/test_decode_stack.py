"""A pure-decode step's whole layer stack in one native call (inflight/kernels/cpu_stack.py,
cpu_decode_stack.h) against its torch reference (inflight/kernels/decode_stack.py): GQA, q/k/v
and other biases, qk-norm, sliding windows, sinks, skipped slots, one and two threads; the
packed GEMM against torch's _mkl_linear bit for bit; what the stack refuses (oneDNN-packed
weights above the rows their float copies take); and the decoder's logits and KV caches with the
stack against its per-op path, in both packed formats."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inflight.kernels import cpu_native, cpu_packed, cpu_stack, decode_stack
from inflight.kernels.decode_block import AttentionLayer, DecodeRows
from inflight.kernels.decode_stack import DecodeStack, StackLayer

from .decode_steps import check_decode_steps
from .threads import with_threads

pytestmark = [pytest.mark.usefixtures("native_built"),
              pytest.mark.skipif(not cpu_packed.mkl_packing_available(), reason="torch built without MKL")]


def _packed(gen: torch.Generator, out_features: int, in_features: int,
            keep_float: bool = False, fmt: str = "mkl") -> cpu_packed.PackedLinearWeight:  # fmt: skip
    w = cpu_packed.pack_linear_weight(torch.randn(out_features, in_features, generator=gen) * in_features**-0.5,
                                      keep_float, fmt)  # fmt: skip
    assert w is not None
    return w


def _vec(gen: torch.Generator, size: int) -> torch.Tensor:
    return torch.rand(size, generator=gen) + 0.5


def _stack(paged, num_layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, *,
           bias: bool = False, qk_norm: bool = False, window: int | None = None, sinks: bool = False,
           rot_dim: int | None = None, seed: int = 0, keep_float: bool = False, fmt: str = "mkl") -> DecodeStack:
    gen = torch.Generator().manual_seed(seed)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    cos_sin = torch.randn(400, rot_dim or head_dim, generator=gen)

    def b(n: int) -> torch.Tensor | None:
        return torch.randn(n, generator=gen) * 0.1 if bias else None

    layers = []
    for i in range(num_layers):
        attention = AttentionLayer(
            heads, kv_heads, head_dim, head_dim**-0.5, window if i % 2 == 0 else None,
            torch.randn(heads, generator=gen) if sinks else None,
            _vec(gen, head_dim) if qk_norm else None, _vec(gen, head_dim) if qk_norm else None, 1e-5,
        )  # fmt: skip
        kv = (paged.k_cache.clone() + 0.01 * i, paged.v_cache.clone() - 0.01 * i)
        layers.append(StackLayer(
            _vec(gen, hidden), 1e-6, _packed(gen, q_size + 2 * kv_size, hidden, keep_float, fmt),
            b(q_size + 2 * kv_size), attention, cos_sin, kv, _packed(gen, hidden, q_size, keep_float, fmt), b(hidden),
            _vec(gen, hidden), 1e-5, _packed(gen, 2 * inter, hidden, keep_float, fmt), b(2 * inter),
            _packed(gen, hidden, inter, keep_float, fmt), b(hidden),
        ))  # fmt: skip
    stack = DecodeStack.build(layers, _vec(gen, hidden), 1e-6)
    assert stack is not None
    return stack


def _copy(stack: DecodeStack) -> DecodeStack:
    """The same weights over copies of the KV caches."""
    layers = [dataclasses.replace(layer, kv_cache=tuple(c.clone() for c in layer.kv_cache)) for layer in stack.layers]
    return DecodeStack(tuple(layers), stack.final_norm, stack.final_eps)


def _rows(lens: list[int], tables: torch.Tensor, block_size: int, skip: int | None = None) -> DecodeRows:
    slots = [int(tables[s, (n - 1) // block_size]) * block_size + (n - 1) % block_size for s, n in enumerate(lens)]
    if skip is not None:
        slots[skip] = -1
    return DecodeRows.of(torch.tensor([n - 1 for n in lens]), torch.tensor(slots), tables,
                         torch.tensor(lens, dtype=torch.int32))  # fmt: skip


# (layers, hidden, heads, kv_heads, head_dim, intermediate, context lens, options)
CASES = [
    (2, 64, 4, 2, 16, 96, [1, 16, 17, 40], {}),
    (3, 48, 6, 2, 16, 40, [5, 33, 70], {"bias": True}),  # qwen2: q/k/v (and other) biases
    (2, 64, 4, 4, 16, 72, [3, 30, 64], {"qk_norm": True}),  # qwen3
    (2, 96, 4, 1, 24, 100, [2, 40, 90, 17], {"window": 9, "sinks": True, "rot_dim": 16}),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}" for k in c[7]) or "plain")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("keep_float", "fmt"), [(False, "mkl"), (True, "mkl"), (True, "onednn")],
                         ids=["packed", "float-copy", "onednn-float-copy"])
def test_native_stack_matches_the_reference(case, threads, keep_float, fmt, make_paged_cache,
                                            poison_allocations) -> None:  # fmt: skip
    num_layers, hidden, heads, kv_heads, head_dim, inter, lens, options = case
    paged = make_paged_cache(lens, 16, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    stack = _stack(paged, num_layers, hidden, heads, kv_heads, head_dim, inter, keep_float=keep_float, fmt=fmt,
                   **options)  # fmt: skip
    other = _copy(stack)
    rows = _rows(lens, paged.block_tables, 16, skip=1)
    x = torch.randn(len(lens), hidden, generator=torch.Generator().manual_seed(3))
    got = with_threads(threads, cpu_native.decode_layer_stack, x, rows, stack)
    want = decode_stack.decode_layer_stack(x, rows, other)
    assert got is not None and got.shape == (len(lens), hidden)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(stack.layers, other.layers, strict=True):
        for a, b in zip(mine.kv_cache, theirs.kv_cache, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_packed_gemm_is_torchs_mkl_linear_bit_for_bit_in_every_column_block_split() -> None:
    lib, _ = cpu_native.load_library()
    fn = cpu_stack.gemm_compute(lib)
    assert fn is not None
    gen = torch.Generator().manual_seed(1)
    float_weight = torch.randn(300, 70, generator=gen)
    whole = cpu_packed.pack_linear_weight(float_weight)
    assert whole is not None and len(whole.packed) == 1
    for blocks in (1, 2, 3):
        weight = cpu_packed.pack_linear_weight(float_weight, num_blocks=blocks)
        assert weight is not None and len(weight.packed) == blocks
        for threads in (1, 2, 3):
            for rows in (1, 2, 7, 32, 64, 600):  # 600: prompt-sized, in row chunks
                for bias in (None, torch.randn(300, generator=gen)):
                    x = torch.randn(rows, 70, generator=gen)
                    out = torch.empty(rows, 300)
                    lib.inflight_packed_gemm_f32(fn, x.data_ptr(), cpu_stack._packed_addr(weight),
                                                 None if bias is None else bias.data_ptr(), out.data_ptr(), rows,
                                                 300, 70, threads)
                    assert torch.equal(out, cpu_packed.packed_linear(x, weight, bias))
                    torch.testing.assert_close(out, cpu_packed.packed_linear(x, whole, bias), atol=1e-5, rtol=1e-5)


def test_what_the_stack_refuses(make_paged_cache) -> None:
    paged = make_paged_cache([5, 20], 16, 2, 16, torch.float32, torch.device("cpu"))
    stack = _stack(paged, 1, 64, 4, 2, 16, 32)
    layer = stack.layers[0]
    float_weight = dataclasses.replace(layer, o_proj=torch.randn(64, 64))  # a weight that did not pack
    assert DecodeStack.build([float_weight], stack.final_norm, 1e-6) is None
    half_cache = dataclasses.replace(layer, kv_cache=tuple(c.half() for c in layer.kv_cache))
    assert DecodeStack.build([half_cache], stack.final_norm, 1e-6) is None
    assert DecodeStack.build([], stack.final_norm, 1e-6) is None
    rows = _rows([5, 20], paged.block_tables, 16)
    strided = torch.randn(2, 128)[:, ::2]
    assert cpu_native.decode_layer_stack(strided, rows, stack) is None  # the decoder then runs per op
    assert cpu_native.decode_layer_stack(torch.randn(2, 64).double(), rows, stack) is None


@pytest.mark.skipif(not cpu_packed.onednn_packing_available(), reason="torch built without oneDNN")
def test_onednn_weights_take_the_stack_only_on_their_float_copies(make_paged_cache) -> None:
    """The native call cannot multiply by oneDNN's layout: without float copies there is no stack,
    and with them (in panels) it takes steps of at most PANEL_MAX_ROWS rows (more: None, and the
    decoder runs per op); MKL weights take any step."""
    limit = cpu_packed.PANEL_MAX_ROWS
    lens = [3 + 2 * i for i in range(limit + 1)]
    paged = make_paged_cache(lens, 16, 2, 16, torch.float32, torch.device("cpu"))
    layer = _stack(paged, 1, 64, 4, 2, 16, 32, keep_float=True, fmt="onednn").layers[0]
    no_copy = dataclasses.replace(layer, o_proj=_packed(torch.Generator().manual_seed(5), 64, 64, False, "onednn"))
    assert DecodeStack.build([no_copy], torch.ones(64), 1e-6) is None
    x = torch.randn(limit + 1, 64, generator=torch.Generator().manual_seed(4))
    for fmt, max_rows in (("onednn", limit), ("mkl", None)):
        stack = _stack(paged, 2, 64, 4, 2, 16, 32, keep_float=True, fmt=fmt)
        assert stack.max_rows == max_rows and stack.has_mkl_weights == (fmt == "mkl")
        for n in (1, limit, limit + 1):
            rows = _rows(lens[:n], paged.block_tables[:n], 16)
            got = cpu_native.decode_layer_stack(x[:n].contiguous(), rows, _copy(stack))
            want = decode_stack.decode_layer_stack(x[:n].contiguous(), rows, _copy(stack))
            if max_rows is not None and n > max_rows:
                assert got is None
            else:
                assert got is not None
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "mistral"])
@pytest.mark.parametrize(("float_copy", "fmt"), [("0", "mkl"), ("1", "mkl"), ("1", "onednn")])
def test_decoder_logits_match_with_and_without_the_stack(arch, float_copy, fmt, tmp_path, monkeypatch) -> None:
    """Decode steps of a tiny model through the one-call stack equal the per-op path (same kernels),
    with MKL-packed weights alone and with their float copies (few-row products on those), and
    with oneDNN-packed weights and their float copies (the stack then takes only those products)."""
    from inflight.runtime.config import EngineConfig
    from inflight.runtime.core.engine import LLMEngine
    from inflight.runtime.demo.model import make_demo_model

    monkeypatch.setenv("INFLIGHT_CPU_FLOAT_COPY", float_copy)
    monkeypatch.setenv("INFLIGHT_CPU_PACK_FORMAT", fmt)
    model_dir = make_demo_model(tmp_path / arch, arch=arch, size="tiny", seed=2)
    config = EngineConfig(max_num_sequences=4, max_model_len=64, block_size=16, dtype="float32",
                          num_kv_blocks=32, device="cpu", kernel_backend="cpu")  # fmt: skip
    engine = LLMEngine.from_model_dir(model_dir, config)
    runner = engine.runner
    try:
        assert runner.ops.decode_layer_stack is not None
        down = runner.model.layers[0].mlp.down_proj.weight
        assert (down.panels is not None) == (float_copy == "1") and down.fmt == fmt
        calls: list[bool] = []

        def counted(*args):
            out = cpu_native.decode_layer_stack(*args)
            calls.append(out is not None)
            return out

        ops = runner.ops = dataclasses.replace(runner.ops, decode_layer_stack=counted)
        taken: list[float] = []

        def check(out, per_op, caches, per_op_caches) -> None:
            assert calls.pop() is True  # the stack ran, as one call
            taken.append(float((out - per_op).abs().max()))
            for (k, v), (per_op_k, per_op_v) in zip(caches, per_op_caches, strict=True):
                assert torch.equal(k, per_op_k) and torch.equal(v, per_op_v)

        check_decode_steps(engine, dataclasses.replace(ops, decode_layer_stack=None), check)
        assert taken and not calls and max(taken) == 0.0  # the same kernels in the same order: bit for bit
    finally:
        runner.close()
