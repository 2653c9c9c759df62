"""The integer-dot GGUF kernel (8-bit activation) against its torch reference and the float reference.

Every compiled path (scalar, avx2, vnni where the CPU has them) is forced in turn. Against
``quant_q8_reference`` (the same 8-bit activation, then the dequantized float dot) the kernel
differs only in the float summation order of per-block terms: ``|got - ref| <= 64 * eps32 *
(|W| @ |x8|)`` per output. Against the float reference ``quant_reference.quant_linear`` the
extra error is the activation rounding, ``|x - x8| <= amax_b / 254`` in block b, so
``|got - float_ref| <= sum_b amax_b / 254 * sum |W_b|`` plus the same float slack.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inflight.kernels import cpu_quant_q8, quant_reference
from inflight.kernels.quant_reference import QuantizedWeight
from tests.kernels.threads import with_threads

gguf_quants = pytest.importorskip("gguf.quants")
QTYPES = ("Q4_0", "Q4_1", "Q8_0")
EPS32 = torch.finfo(torch.float32).eps


def _paths() -> tuple[str, ...]:
    lib, why = cpu_quant_q8.load_library()
    if lib is None:
        pytest.skip(f"no native build: {why}")
    return cpu_quant_q8.available_paths()


def _packed(qtype: str, out_features: int, in_features: int, seed: int) -> QuantizedWeight:
    from gguf import GGMLQuantizationType

    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.1
    blocks = gguf_quants.quantize(w, GGMLQuantizationType[qtype])  # [out, row_bytes] uint8
    return QuantizedWeight(qtype, torch.from_numpy(np.ascontiguousarray(blocks)), in_features)


def _activations(num_rows: int, in_features: int, seed: int) -> torch.Tensor:  # [num_rows, in_features]
    """Gaussian rows with an outlier, all-zero blocks and a tiny block (``in_features >= 96``)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, in_features, generator=gen)
    x[0, 3] = 60.0  # an outlier: its block's other values round coarsely
    x[-1, 32:64] = 0.0
    x[num_rows // 2, :32] = 0.0  # d = 0 must not divide by zero
    x[num_rows // 2, 64:96] *= 1e-30  # a tiny block
    return x


def _bounds(x: torch.Tensor, weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(float slack, activation-rounding bound), each [num_rows, out_features]."""
    w = quant_reference.dequantize(weight)  # [out, in]
    q, d = cpu_quant_q8.quantize_activation(x)
    x8 = (q.float().reshape(x.shape[0], -1, 32) * d.unsqueeze(-1)).reshape(x.shape)
    slack = 64 * EPS32 * (x8.abs() @ w.abs().t()) + 1e-30
    amax = x.reshape(x.shape[0], -1, 32).abs().amax(-1)  # [rows, nb]
    w_l1 = w.abs().reshape(w.shape[0], -1, 32).sum(-1)  # [out, nb]
    return slack, (amax / 254.0) @ w_l1.t() * (1 + 1e-5)


@pytest.mark.parametrize("path", ["scalar", "avx2", "vnni"])
def test_native_activation_quantization_is_bit_identical(path: str) -> None:
    if path not in _paths():
        pytest.skip(f"{path} not compiled on this CPU")
    x = _activations(5, 576, seed=1)
    x[2, 128:160] = torch.arange(32) - 15.5  # d = 1 below: every value is a tie, rounded half to even
    x[2, 159] = 127.0
    q, d = cpu_quant_q8.quantize_activation(x)
    q_native, d_native = cpu_quant_q8.quantize_activation_native(x, path)
    assert torch.equal(q_native, q) and torch.equal(d_native, d)
    assert q.abs().max() <= 127 and d[2, 0] == 0 and torch.all(q[2, :32] == 0)
    assert d[2, 4] == 1.0 and q[2, 128:132].tolist() == [-16, -14, -14, -12]


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("path", ["scalar", "avx2", "vnni"])
def test_q8_linear_matches_q8_reference_and_float_bound(qtype: str, path: str) -> None:
    if path not in _paths():
        pytest.skip(f"{path} not compiled on this CPU")
    for out_features, in_features in ((37, 96), (77, 576)):
        weight = _packed(qtype, out_features, in_features, seed=out_features)
        bias = torch.randn(out_features, generator=torch.Generator().manual_seed(0))
        for num_rows in range(1, 9):
            x = _activations(num_rows, in_features, seed=num_rows)
            slack, rounding = _bounds(x, weight)
            b = bias if num_rows % 2 else None
            got = cpu_quant_q8.quant_linear_q8(x, weight, b, path=path)
            assert got.shape == (num_rows, out_features) and torch.isfinite(got).all()
            spec = cpu_quant_q8.quant_q8_reference(x, weight, b)
            assert torch.all((got - spec).abs() <= slack), (num_rows, (got - spec).abs().max())
            exact = quant_reference.quant_linear(x, weight, b)
            assert torch.all((got - exact).abs() <= rounding + 2 * slack), (num_rows, (got - exact).abs().max())


@pytest.mark.parametrize("qtype", QTYPES)
def test_zero_activation_gives_the_bias_and_threads_agree(qtype: str) -> None:
    _paths()
    weight = _packed(qtype, 301, 576, seed=3)  # big enough for the threaded branch
    bias = torch.randn(301)
    assert torch.equal(cpu_quant_q8.quant_linear_q8(torch.zeros(3, 576), weight, bias), bias.expand(3, 301))
    x = _activations(8, 576, seed=4)
    one = with_threads(1, cpu_quant_q8.quant_linear_q8, x, weight, bias)
    two = with_threads(2, cpu_quant_q8.quant_linear_q8, x, weight, bias)
    assert torch.equal(one, two)  # each output is summed by one thread, in one order


def test_what_the_c_code_does_not_take_runs_the_reference() -> None:
    weight = _packed("Q4_1", 16, 64, seed=5)
    x = torch.randn(2, 64, dtype=torch.float64)
    torch.testing.assert_close(cpu_quant_q8.quant_linear_q8(x, weight),
                               cpu_quant_q8.quant_q8_reference(x, weight))


def test_bad_input_is_refused() -> None:
    weight = _packed("Q8_0", 16, 64, seed=6)
    with pytest.raises(ValueError, match="x must be"):
        cpu_quant_q8.quant_linear_q8(torch.zeros(64), weight)
    with pytest.raises(ValueError, match="x must be"):
        cpu_quant_q8.quant_linear_q8(torch.zeros(2, 96), weight)
    with pytest.raises(ValueError, match="bias must be"):
        cpu_quant_q8.quant_linear_q8(torch.zeros(2, 64), weight, torch.zeros(15))
    if _paths():
        with pytest.raises(ValueError, match="not in this build"):
            cpu_quant_q8.quant_linear_q8(torch.zeros(2, 64), weight, path="neon")
