"""Choosing a kernel implementation: Triton on CUDA, the torch reference elsewhere.

``get_kernel_ops(backend, device)`` returns a frozen bundle of callables with the signatures
of :mod:`inflight.kernels.reference`. ``backend`` is ``"auto"`` (Triton when the device is
CUDA and Triton imports, else torch), ``"torch"`` (force the reference) or ``"triton"``
(force Triton; a clear error if it cannot run here). The setting comes from
``EngineConfig.kernel_backend``; ``INFLIGHT_KERNEL_BACKEND`` overrides it for experiments.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from inflight.kernels import reference


@dataclass(frozen=True, slots=True)
class KernelOps:
    """The kernels the model calls, all with the reference signatures."""

    name: str
    store_kv_cache: Callable[..., None]
    paged_decode_attention: Callable[..., torch.Tensor]
    paged_prefill_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]


TORCH_OPS = KernelOps(
    name="torch",
    store_kv_cache=reference.store_kv_cache,
    paged_decode_attention=reference.paged_decode_attention,
    paged_prefill_attention=reference.paged_prefill_attention,
    rms_norm=reference.rms_norm,
    rotary_embedding=reference.rotary_embedding,
)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def get_kernel_ops(backend: str, device: torch.device) -> KernelOps:
    """The kernel bundle for ``backend`` on ``device`` (see module docstring)."""
    backend = os.environ.get("INFLIGHT_KERNEL_BACKEND", backend)
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"kernel backend must be auto, torch or triton (got {backend!r}).")
    if backend == "torch" or (backend == "auto" and (device.type != "cuda" or not triton_available())):
        return TORCH_OPS
    if not triton_available():
        raise ValueError("kernel_backend=triton needs the triton package; install it or use torch.")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        raise ValueError(
            "kernel_backend=triton needs a CUDA device (or TRITON_INTERPRET=1 for the slow "
            "interpreter); use kernel_backend=torch on the CPU."
        )
    from inflight.kernels.triton_ops import TRITON_OPS

    return TRITON_OPS
