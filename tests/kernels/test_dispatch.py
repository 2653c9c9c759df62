"""Kernel dispatch: which bundle runs where, and that both bundles share the signatures."""

from __future__ import annotations

import inspect

import pytest
import torch

from inflight.kernels import reference
from inflight.kernels.dispatch import TORCH_OPS, get_kernel_ops

OPS = (
    "store_kv_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_embedding",
)


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFLIGHT_KERNEL_BACKEND", raising=False)


def test_auto_picks_the_native_kernels_on_cpu() -> None:  # more in test_cpu_native.py
    assert get_kernel_ops("auto", torch.device("cpu")).name == "cpu-native"


def test_torch_forced_everywhere() -> None:
    assert get_kernel_ops("torch", torch.device("cuda")) is TORCH_OPS


def test_env_overrides_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFLIGHT_KERNEL_BACKEND", "torch")
    assert get_kernel_ops("triton", torch.device("cuda")) is TORCH_OPS


def test_unknown_backend_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="one of auto, torch, triton, cpu"):
        get_kernel_ops("cuda", torch.device("cpu"))


def test_triton_forced_on_cpu_without_interpreter_is_a_value_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_kernel_ops("triton", torch.device("cpu"))


def test_triton_bundle_has_reference_signatures(device: torch.device) -> None:
    ops = get_kernel_ops("triton", device)
    assert ops.name == "triton"
    for op in OPS:
        expected = inspect.signature(getattr(reference, op))
        assert inspect.signature(getattr(ops, op)) == expected, op
        assert getattr(TORCH_OPS, op) is getattr(reference, op)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_picks_triton_on_cuda() -> None:
    assert get_kernel_ops("auto", torch.device("cuda")).name == "triton"
