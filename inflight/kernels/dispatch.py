"""Choosing a kernel implementation: Triton on CUDA, native C kernels on the CPU.

``get_kernel_ops(backend, device)`` returns a frozen bundle of callables with the signatures
of :mod:`inflight.kernels.reference` (the bundle type, ``KernelOps``, lives in the leaf
:mod:`inflight.kernels.ops` and is re-exported here). ``backend`` is ``"auto"`` (Triton when
the device is CUDA and Triton imports; on the CPU the native kernels of :mod:`inflight.kernels.cpu_native`
when they build, else the torch reference with a warning saying why), ``"torch"`` (force the
reference), ``"triton"`` or ``"cpu"`` (force one; a clear error if it cannot run here). The
setting comes from ``EngineConfig.kernel_backend``; ``INFLIGHT_KERNEL_BACKEND`` overrides it
for experiments, with a warning when the two differ. :func:`with_quantized_linear` wraps a
bundle's ``linear`` so it also takes packed weights, each type on the kernel
:func:`packed_linear_backend` picks (the table in :func:`packed_linear_kernels`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import lru_cache

import torch

from inflight import env_vars
from inflight.kernels.backends import KERNEL_BACKENDS
from inflight.kernels.ops import TORCH_OPS, KernelOps

__all__ = ["KERNEL_BACKENDS", "TORCH_OPS", "KernelOps", "get_kernel_ops", "packed_linear_backend",
           "packed_linear_kernels", "triton_available", "with_quantized_linear"]

logger = logging.getLogger(__name__)




def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def get_kernel_ops(backend: str, device: torch.device) -> KernelOps:
    """The kernel bundle for ``backend`` on ``device`` (see module docstring)."""
    override = env_vars.read_str("INFLIGHT_KERNEL_BACKEND")
    if override is not None and override != backend:
        logger.warning("INFLIGHT_KERNEL_BACKEND=%s overrides the configured kernel backend %r", override, backend)
    backend = backend if override is None else override
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"kernel backend must be one of {', '.join(KERNEL_BACKENDS)} (got {backend!r}).")
    if backend == "cpu" or (backend == "auto" and device.type == "cpu"):
        return _cpu_ops(device, forced=backend == "cpu")
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


def _cpu_ops(device: torch.device, forced: bool) -> KernelOps:
    from inflight.kernels import cpu_native

    if device.type != "cpu":
        raise ValueError(f"kernel_backend=cpu runs on the CPU only (device is {device.type}).")
    lib, where = cpu_native.load_library()
    if lib is not None:
        return cpu_native.CPU_OPS
    if forced:
        raise ValueError(f"kernel_backend=cpu: the native CPU kernels cannot be built: {where}.")
    logger.warning("native CPU kernels unavailable (%s); using the slower torch reference kernels", where)
    return TORCH_OPS


def packed_linear_kernels() -> dict[type, tuple[Callable[..., torch.Tensor], ...]]:
    """Packed weight type -> its ``(reference, cpu, triton)`` linear kernels, each
    ``(x, weight, bias) -> out`` with the float ``linear``'s signature. ``cpu`` and
    ``triton`` may be ``None`` (no such kernel: the reference runs, and
    :func:`packed_linear_backend` says so). The one place a new packed format is wired in."""
    return _packed_table()


@lru_cache(maxsize=1)
def _packed_table() -> dict[type, tuple[Callable[..., torch.Tensor], ...]]:
    from inflight.kernels import cpu_intq, cpu_quant, intq_reference, quant_reference

    triton_quant_linear = triton_intq_linear = None
    if triton_available():  # never import Triton where it is not installed
        from inflight.kernels.triton_intq import intq_linear as triton_intq_linear
        from inflight.kernels.triton_quant import quant_linear as triton_quant_linear
    return {
        quant_reference.QuantizedWeight: (quant_reference.quant_linear, cpu_quant.quant_linear, triton_quant_linear),
        intq_reference.IntQuantWeight: (intq_reference.intq_linear, cpu_intq.intq_linear, triton_intq_linear),
    }


def packed_linear_backend(ops_name: str, weight: object, device: torch.device) -> str:
    """Which kernel ``with_quantized_linear(ops).linear`` runs for ``weight`` on ``device``:
    ``"cpu"``, ``"triton"`` or ``"torch"`` (the dequantize-then-matmul reference)."""
    kernels = _packed_table().get(type(weight))
    if kernels is None:
        raise TypeError(f"no linear kernel for packed weight type {type(weight).__name__}")
    return _backend(ops_name, kernels, device)


def _backend(ops_name: str, kernels: tuple[Callable[..., torch.Tensor] | None, ...], device: torch.device) -> str:
    if ops_name == "torch":
        return "torch"
    if device.type == "cpu" and kernels[1] is not None:
        return "cpu"
    if device.type != "cpu" and kernels[2] is not None:
        return "triton"
    return "torch"


def with_quantized_linear(ops: KernelOps) -> KernelOps:
    """``ops`` whose ``linear`` also takes packed (quantized) weights: each type in
    :func:`packed_linear_kernels`, on the kernel :func:`packed_linear_backend` picks. Float
    weights go to ``ops.linear`` unchanged. Only a model that holds packed weights needs this."""
    import dataclasses

    table = _packed_table()
    base = ops.linear
    slot = {"torch": 0, "cpu": 1, "triton": 2}

    def linear(x: torch.Tensor, weight: object, bias: torch.Tensor | None = None) -> torch.Tensor:
        kernels = table.get(type(weight))
        if kernels is None:
            return base(x, weight, bias)
        return kernels[slot[_backend(ops.name, kernels, x.device)]](x, weight, bias)

    return dataclasses.replace(ops, name=f"{ops.name}+packed", linear=linear)
