"""bfloat16 products on oneDNN-packed weights (``INFLIGHT_CPU_PACK_FORMAT=onednn-bf16``,
inflight/kernels/cpu_packed.py): each product is within bfloat16's rounding of the float32 one
and no closer than float32 formats are (it really is bfloat16), the bias is added in float32, the
weights take half the bytes, an engine on them answers close to the float32 engine's logits, and
a CPU or torch that cannot run oneDNN's bfloat16 products is refused, never run as float32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from inflight.kernels import cpu_packed, cpu_prepack
from inflight.kernels.cpu_packed import PackedLinearWeight, pack_linear_weight, packed_linear
from tests.kernels.threads import with_threads

FMT = "onednn-bf16"
needs_bf16 = pytest.mark.skipif(not cpu_packed.packing_available(FMT),
                                reason="this torch or CPU has no oneDNN bfloat16 products")  # fmt: skip


def _relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).abs().max() / exact.abs().max())


@needs_bf16
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_row_count_is_a_bfloat16_product_of_the_float_weight(threads: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(7 + threads)
    weight = torch.randn(1000, 200, generator=gen) * 0.05
    bias = torch.randn(1000, generator=gen) * 3.0 if with_bias else None
    packed = pack_linear_weight(weight, fmt=FMT)
    assert packed is not None and packed.fmt == FMT and packed.shape == weight.shape
    assert packed.nbytes == weight.numel() * 2 and not packed.has_float_copy and packed.stack_rows == 0
    rounded = weight.bfloat16().double()
    for rows in (1, 3, 8, 37, 64, 256, 512):
        x = torch.randn(rows, 200, generator=gen)
        got = with_threads(threads, packed_linear, x, packed, bias)
        assert got.dtype == torch.float32 and got.shape == (rows, 1000)
        # what bfloat16 inputs and weights give, accumulated wide and rounded to bfloat16 (oneDNN's
        # output type), the bias added after
        product = (x.bfloat16().double() @ rounded.T).bfloat16().double()
        want = product + (0 if bias is None else bias.double())
        assert _relative_error(got, want) < 8e-3  # an ulp or two of bfloat16 where the sums round apart
        exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
        assert 1e-6 < _relative_error(got, exact) < 3e-2  # bfloat16's error, not float32's (~1e-7)


@needs_bf16
def test_the_bias_is_added_in_float32() -> None:
    """A bias far larger than the product keeps its float32 bits: rounding it to bfloat16 would
    move it by up to 2^-8 of itself."""
    weight = torch.full((4, 8), 1.0 / 1024)  # exact in bfloat16: the products are 8 / 1024
    bias = torch.tensor([1000.125, -2000.0625, 3.0009765625, 12345.5])
    packed = pack_linear_weight(weight, fmt=FMT)
    assert packed is not None
    got = packed_linear(torch.ones(2, 8), packed, bias)
    assert torch.equal(got, (bias + 8 / 1024).expand(2, 4))
    assert not torch.equal(bias.bfloat16().float(), bias)  # the test can fail: bfloat16 would move it


@needs_bf16
def test_prepack_swaps_every_float_weight_and_keeps_no_float_copies(monkeypatch) -> None:
    monkeypatch.setenv("INFLIGHT_CPU_PACK_FORMAT", FMT)
    monkeypatch.setenv("INFLIGHT_CPU_FLOAT_COPY", "1")  # bfloat16 products at every row count even so
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64, bias=False))
    line = cpu_prepack.prepack_detail(model, "cpu-native", torch.device("cpu"), torch.float32)
    assert "2 linears prepacked for oneDNN, bfloat16 products [INFLIGHT_CPU_PACK_FORMAT]" in line
    assert "float copies freed" in line
    assert all(isinstance(m.weight, PackedLinearWeight) and m.weight.fmt == FMT and not m.weight.has_float_copy
               for m in model)  # fmt: skip


def test_a_cpu_without_bfloat16_products_is_refused_not_run_as_float32(monkeypatch) -> None:
    monkeypatch.setenv("INFLIGHT_CPU_PACK_FORMAT", FMT)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert not cpu_packed.packing_available(FMT)
    model = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(ValueError, match="cannot run oneDNN's bfloat16 products"):
        cpu_prepack.prepack_detail(model, "cpu-native", torch.device("cpu"), torch.float32)
    assert isinstance(model[0].weight, nn.Parameter)


@needs_bf16
def test_an_engine_on_bfloat16_products_answers_near_the_float32_engine(tiny_model_dir, monkeypatch) -> None:
    """The same prompt's last-position logits through every layer: bfloat16 products move them by
    bfloat16's rounding, not more, and every linear of the model took the format."""
    from inflight.runtime.config import EngineConfig
    from inflight.runtime.core.engine import LLMEngine
    from inflight.runtime.sampling_params import SamplingParams

    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=32, max_num_sequences=4)
    logprobs = {}
    for fmt in ("mkl", FMT):
        monkeypatch.setenv("INFLIGHT_CPU_PACK_FORMAT", fmt)
        engine = LLMEngine.from_model_dir(tiny_model_dir, config)
        try:
            linears = [m for m in engine.runner.model.modules() if isinstance(getattr(m, "weight", None),
                                                                              PackedLinearWeight)]  # fmt: skip
            assert linears and all(m.weight.fmt == fmt for m in linears)
            engine.add_request("r", [5, 9, 11, 3, 7, 2], SamplingParams(max_tokens=1, temperature=0, logprobs=8))
            out = []
            while engine.has_unfinished_requests():
                out += engine.step()
            entry = out[-1].new_logprobs[0]
            logprobs[fmt] = dict(entry.top)
        finally:
            engine.close()
    shared = set(logprobs["mkl"]) & set(logprobs[FMT])
    assert len(shared) >= 6  # the same top tokens, nearly all
    assert max(abs(logprobs["mkl"][t] - logprobs[FMT][t]) for t in shared) < 0.1


@needs_bf16
def test_a_tied_head_is_packed_and_the_embedding_keeps_its_float_table() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.head = nn.Linear(16, 50, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    table = model.embed.weight.detach().clone()
    summary = cpu_prepack.prepack_linears(model, keep_float=False, fmt=FMT)
    assert summary.num_packed == 1 and not summary.shared
    assert isinstance(model.head.weight, PackedLinearWeight) and model.head.weight.fmt == FMT
    assert isinstance(model.embed.weight, nn.Parameter) and torch.equal(model.embed.weight, table)
    x = torch.randn(5, 16)
    exact = x.double() @ table.double().T
    assert _relative_error(packed_linear(x, model.head.weight), exact) < 3e-2


def test_a_bfloat16_engine_on_the_cpu_says_its_kernels_are_the_references() -> None:
    """``--dtype bfloat16`` on the CPU bypasses the native kernels (float32 only): the load line
    says so and names the faster route, rather than leaving ``kernels: cpu-native`` to mislead."""
    model = nn.Sequential(nn.Linear(16, 16).to(torch.bfloat16))
    line = cpu_prepack.prepack_detail(model, "cpu-native", torch.device("cpu"), torch.bfloat16)
    assert "torch reference kernels" in line and "serves bfloat16" in line and "onednn-bf16" in line
    assert isinstance(model[0].weight, nn.Parameter)  # nothing packed
    assert cpu_prepack.prepack_detail(model, "torch", torch.device("cpu"), torch.bfloat16) == ""
