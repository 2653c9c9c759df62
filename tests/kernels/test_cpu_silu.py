"""The native fused ``silu_and_mul`` (inflight/kernels/cpu_kernels.c) against its torch reference:
shapes around the vector width, decode and prefill row counts on one and two threads, strided
rows, the whole range of gate values (where its exp polynomial and torch's overflow meet) and
NaN/inf, which must come out where torch's do."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import cpu_native, reference
from tests.kernels.threads import with_threads

pytestmark = pytest.mark.usefixtures("native_built")

# A few ulp of float32 (the polynomial exp is within ~2 ulp, torch's within ~1); the absolute
# floor covers gates near -88.7, where silu is ~1e-36 and torch's exp overflows a hair apart.
RTOL, ATOL = 1e-6, 1e-35


@pytest.mark.parametrize("num_rows", [1, 3, 64])
@pytest.mark.parametrize("d", [1, 7, 16, 17, 200, 1536])  # under, at and past the vector width (8 or 16)
def test_silu_and_mul_matches_reference(num_rows: int, d: int, poison_allocations) -> None:
    gen = torch.Generator().manual_seed(num_rows * 10_000 + d)
    gate_up = torch.randn(num_rows, 2 * d, generator=gen) * 6
    got = cpu_native.silu_and_mul(gate_up)
    assert got.shape == (num_rows, d) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference.silu_and_mul(gate_up), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("threads", [1, 2])
def test_silu_and_mul_big_enough_to_thread_and_strided_rows(threads: int, poison_allocations) -> None:
    gen = torch.Generator().manual_seed(threads)
    wide = torch.randn(256, 2 * 1000 + 24, generator=gen) * 4  # past the size that takes threads
    gate_up = wide[:, 5:2005]  # rows 2024 floats apart, gate then up in the middle
    got = with_threads(threads, cpu_native.silu_and_mul, gate_up)
    torch.testing.assert_close(got, reference.silu_and_mul(gate_up), rtol=RTOL, atol=ATOL)


def test_silu_over_the_whole_range_is_within_a_few_ulp() -> None:
    mags = torch.logspace(-30, 38, 20_000)
    gate = torch.cat([torch.linspace(-100.0, 100.0, 400_001), mags, -mags,
                      torch.linspace(-88.8, -88.6, 2_001)])  # where exp(-g) overflows
    gate_up = torch.cat([gate, torch.ones_like(gate)]).unsqueeze(0)
    got = cpu_native.silu_and_mul(gate_up)[0]
    expected = reference.silu_and_mul(gate_up)[0]
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    truth = gate.double() * torch.sigmoid(gate.double())
    normal = gate.abs() <= 87  # silu(g) a normal float: the relative error means something
    assert ((got[normal].double() - truth[normal]).abs() <= 4e-7 * truth[normal].abs()).all()
    assert torch.equal(torch.signbit(got), torch.signbit(expected))  # -0 where torch gives -0


def test_silu_nan_and_inf_come_out_as_in_torch() -> None:
    inf, nan = float("inf"), float("nan")
    gate = torch.tensor([nan, inf, -inf, 0.0, -0.0, -200.0, 200.0, 1.0, nan, inf, -200.0, 3.0, -3.0])
    up = torch.tensor([1.0, 1.0, 1.0, inf, 1.0, 1.0, -inf, nan, 0.0, 0.0, inf, inf, -inf])
    gate_up = torch.cat([gate, up]).unsqueeze(0)
    got, expected = cpu_native.silu_and_mul(gate_up), reference.silu_and_mul(gate_up)
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(got), torch.signbit(expected))


def test_silu_and_mul_other_dtypes_layouts_and_empty() -> None:
    bf16 = torch.randn(4, 64).bfloat16()
    assert torch.equal(cpu_native.silu_and_mul(bf16), reference.silu_and_mul(bf16))
    columns = torch.randn(64, 4).t()  # feature stride != 1
    assert torch.equal(cpu_native.silu_and_mul(columns), reference.silu_and_mul(columns))
    three_d = torch.randn(2, 3, 8)
    assert torch.equal(cpu_native.silu_and_mul(three_d), reference.silu_and_mul(three_d))
    assert cpu_native.silu_and_mul(torch.empty(0, 32)).shape == (0, 16)


def test_eight_wide_build_matches_reference() -> None:
    """The same source built without AVX-512 (8-lane vectors, what an AVX2 machine runs)."""
    name = "inflight_silu_and_mul_f32"
    lib, where = cpu_native.compile_library(cpu_native.SOURCE, "silu_mno-avx512f", {name: cpu_native._SIGNATURES[name]},
                                            ("-lm",), ("-mno-avx512f",))
    assert lib is not None, where
    mags = torch.logspace(-30, 38, 2_000)
    gate = torch.cat([torch.linspace(-100.0, 100.0, 20_001), mags, -mags, torch.tensor([float("nan"), float("inf")])])
    for d in (gate.numel() // 16 * 16, gate.numel(), 13):  # whole vectors, a tail, under one vector
        gate_up = torch.cat([gate[:d], torch.randn(d)]).unsqueeze(0)
        got = torch.full((1, d), float("nan"))
        getattr(lib, name)(gate_up.data_ptr(), gate_up.stride(0), got.data_ptr(), 1, d, 1)
        torch.testing.assert_close(got, reference.silu_and_mul(gate_up), rtol=RTOL, atol=ATOL, equal_nan=True)


def test_the_cpu_bundle_runs_the_native_silu() -> None:
    assert cpu_native.CPU_OPS.silu_and_mul is cpu_native.silu_and_mul
