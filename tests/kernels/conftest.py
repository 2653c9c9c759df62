"""Fixtures for the kernel tests: device choice, Triton's interpreter, poisoned allocations.

Without CUDA the Triton kernels run in Triton's interpreter on the CPU; the variable must be
set before any kernel module is imported (``triton.jit`` reads it when it decorates), which
is why it is set here, at collection time, and the test modules import kernels lazily.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Kernels run where Triton runs: CUDA when present, else the interpreter on the CPU.
KERNEL_DEVICES = ["cuda"] if HAS_CUDA else ["cpu"]
TOLERANCES = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 1e-2, "rtol": 1e-2},
    # The interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest even), so
    # one extra bf16 ulp is normal here.
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The ``gpu`` marker for the kernel tests that need the device, so ``make gpu-check``
    runs only those (``-m gpu``): on CUDA every test of a kernel on the ``device`` fixture, and
    anywhere the tests skipped without CUDA. (A session-wide hook: it picks its own items.)"""
    here = Path(__file__).parent
    for item in items:
        if here not in Path(str(item.path)).parents:
            continue
        needs_cuda = any(str(m.kwargs.get("reason", "")).lower().startswith("needs cuda")
                         for m in item.iter_markers("skipif"))  # fmt: skip
        if needs_cuda or (HAS_CUDA and "device" in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture
def assert_close() -> Callable[..., None]:
    """Compare a kernel's output with the reference's at tolerances fitting the dtype
    (``precision``: the lowest-precision dtype the computation rounded to, if narrower)."""

    def check(
        got: torch.Tensor, expected: torch.Tensor, precision: torch.dtype | None = None
    ) -> None:
        assert got.dtype == expected.dtype and got.shape == expected.shape
        torch.testing.assert_close(got, expected, **TOLERANCES[precision or expected.dtype])

    return check


@pytest.fixture(params=KERNEL_DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    pytest.importorskip("triton")
    return torch.device(request.param)


@pytest.fixture
def poison_allocations(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every float tensor from ``torch.empty``/``empty_like`` starts as NaN during the test,
    so any output or workspace element a kernel fails to write shows up in the comparison."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))
    yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny seeded qwen3 demo model (llama-family, plus per-head qk RMSNorm), made once."""
    from inflight.runtime.demo.model import make_demo_model

    return Path(
        make_demo_model(tmp_path_factory.mktemp("qwen3-tiny"), arch="qwen3", size="tiny", seed=1)
    )


@dataclass(frozen=True, slots=True)
class PagedCache:
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor  # [num_seqs] int32


@pytest.fixture
def make_paged_cache() -> Callable[..., PagedCache]:
    """Random K/V in shuffled blocks (plus spare blocks the tables never name) for the given
    context lengths; unused table entries point at random blocks, as the contract allows."""

    def make(
        context_lens: list[int],
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> PagedCache:
        gen = torch.Generator().manual_seed(sum(context_lens) * 31 + block_size + head_dim)
        needed = [-(-n // block_size) for n in context_lens]
        width = max(needed) + 1
        num_blocks = sum(needed) + 3
        order = torch.randperm(num_blocks, generator=gen)
        table = torch.randint(0, num_blocks, (len(context_lens), width), generator=gen)
        used = 0
        for s, n in enumerate(needed):
            table[s, :n] = order[used : used + n]
            used += n
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k = torch.randn(shape, generator=gen).to(dtype)
        v = torch.randn(shape, generator=gen).to(dtype)
        lens = torch.tensor(context_lens, dtype=torch.int32)
        return PagedCache(k.to(device), v.to(device), table.int().to(device), lens.to(device))

    return make


@pytest.fixture
def native_built() -> None:
    """Skip without a C compiler; else the native CPU kernels must build (modules opt in with
    ``pytestmark = pytest.mark.usefixtures("native_built")``)."""
    import shutil

    from inflight.kernels import cpu_native

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine")
    lib, where = cpu_native.load_library()
    assert lib is not None, where
