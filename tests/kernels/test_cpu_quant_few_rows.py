"""The fused few-row GGUF linear of cpu_quant.c at 1-8 rows (a speculative verify's sizes): the
AVX-512 build and the portable build (``-mno-avx512f``) against the torch reference, and which
row counts :func:`inflight.kernels.cpu_quant.quant_linear` sends to it."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from inflight.kernels import cpu_native, cpu_quant, quant_reference
from inflight.kernels.cpu_prepack import cpuinfo_line
from inflight.kernels.quant_reference import QTYPE_IDS, QuantizedWeight

gguf_quants = pytest.importorskip("gguf.quants")
QTYPES = ("Q4_0", "Q4_1", "Q8_0")


def _packed(qtype: str, out_features: int, in_features: int, seed: int) -> QuantizedWeight:
    from gguf import GGMLQuantizationType

    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.1
    blocks = gguf_quants.quantize(w, GGMLQuantizationType[qtype])
    return QuantizedWeight(qtype, torch.from_numpy(np.ascontiguousarray(blocks)), in_features)


@pytest.fixture(scope="module", params=["native", "portable"])
def build(request: pytest.FixtureRequest) -> ctypes.CDLL:
    """The kernel as the engine builds it (-march=native) or with AVX-512 turned off."""
    flags = () if request.param == "native" else ("-mno-avx512f",)
    lib, why = cpu_native.compile_library(cpu_quant.SOURCE, f"cpu_quant_test_{request.param}", {
        "inflight_quant_linear_f32": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                                     ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                                     ctypes.c_int]),
        "inflight_quant_few_rows": (ctypes.c_int, []),
    }, extra_flags=flags)
    if lib is None:
        pytest.skip(f"no native build: {why}")
    return lib


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize(("out_features", "in_features"), [(30, 64), (7, 32), (301, 576), (576, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_row_count_matches_reference(build: ctypes.CDLL, qtype: str, out_features: int, in_features: int,
                                           threads: int) -> None:
    weight = _packed(qtype, out_features, in_features, seed=out_features)
    gen = torch.Generator().manual_seed(in_features)
    bias = torch.randn(out_features, generator=gen)
    for num_rows in (*range(1, 10), 17):  # 1-8 in one pass, then a second pass over the weight
        x = torch.randn(num_rows, in_features, generator=gen)
        for b in (None, bias):
            out = torch.full((num_rows, out_features), float("nan"))
            status = build.inflight_quant_linear_f32(
                x.data_ptr(), weight.blocks.data_ptr(), QTYPE_IDS[qtype], None if b is None else b.data_ptr(),
                out.data_ptr(), num_rows, out_features, in_features, threads)
            assert status == 0
            _assert_close_for_the_sum(out, x, weight, b)


def _assert_close_for_the_sum(out: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight,
                              bias: torch.Tensor | None) -> None:
    """``out`` equals the reference within float32 rounding of a sum of ``in_features`` products
    taken in another order: 16 ulps of the sum of the terms' magnitudes (a fixed 1e-5 failed on
    1536-term sums whose terms add to ~120 when gguf 0.19 quantized the weight a little apart)."""
    want = quant_reference.quant_linear(x, weight, bias)
    scale = x.abs() @ quant_reference.dequantize(weight).abs().T + (0 if bias is None else bias.abs())
    err = (out - want).abs()
    tol = 16 * torch.finfo(torch.float32).eps * scale
    worst = int((err - tol).argmax())
    assert bool((err <= tol).all()), f"error {err.flatten()[worst].item():.3g} where {tol.flatten()[worst].item():.3g} is allowed"


def test_build_says_how_many_rows_it_takes(build: ctypes.CDLL) -> None:
    flags = (cpuinfo_line("flags") or "").split()
    avx512 = "avx512f" in flags and "cpu_quant_test_native" in str(build._name)
    assert build.inflight_quant_few_rows() == (8 if avx512 else 4)


@pytest.mark.parametrize("qtype", QTYPES)
def test_quant_linear_sends_few_rows_to_the_fused_kernel(qtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if cpu_quant.load_library()[0] is None:
        pytest.skip("no native build")
    weight = _packed(qtype, 96, 64, seed=1)
    tiles: list[int] = []
    dequantize_rows = cpu_quant.dequantize_rows
    monkeypatch.setattr(cpu_quant, "dequantize_rows",
                        lambda w, start, end: tiles.append(end - start) or dequantize_rows(w, start, end))
    few = cpu_quant.few_rows()
    assert few in (cpu_quant.FEW_ROWS, 8)
    for num_rows, expect_tiles in ((1, False), (few, False), (few + 1, True)):
        tiles.clear()
        x = torch.randn(num_rows, 64)
        torch.testing.assert_close(cpu_quant.quant_linear(x, weight), quant_reference.quant_linear(x, weight),
                                   rtol=1e-5, atol=1e-5)
        assert bool(tiles) == expect_tiles, num_rows
