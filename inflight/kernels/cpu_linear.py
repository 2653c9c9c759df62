"""The native CPU kernels' ``linear``: which kernel multiplies a row block by a weight.

A weight prepacked at load (:mod:`.cpu_packed`) takes its packed GEMM: MKL's column blocks spread
over the threads from C (``cpu_decode_stack.h``'s ``inflight_packed_gemm_f32``), else torch's op
(:func:`~inflight.kernels.cpu_packed.packed_linear`); or, where it kept a float copy, products
of few rows take the panel kernel (``cpu_panel_linear.h``) or the few-row kernel on it. A float
weight takes the few-row kernel up to :data:`SMALL_M_ROWS_ONE_THREAD` /
:data:`SMALL_M_ROWS_MANY_THREADS` rows, else ``F.linear``. Every function takes the loaded
library (``cpu_native.load_library``); :func:`bound_to` binds ``linear`` to it. Knows nothing
about the model.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

from inflight.kernels import cpu_stack, reference
from inflight.kernels.cpu_packed import PackedLinearWeight, packed_linear

# Rows up to which the streaming linear beats torch's GEMM (measured on 2 cores: 2.3-2.5x at
# 1-2 rows on one thread, 1.6x at 4; even at 8 rows on one thread; 1.6x at 8 rows on two).
SMALL_M_ROWS_ONE_THREAD = 4
SMALL_M_ROWS_MANY_THREADS = 8


def linear(
    lib: ctypes.CDLL,
    x: torch.Tensor,  # [num_rows, in_features]
    weight: torch.Tensor | PackedLinearWeight,  # [out_features, in_features]
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [num_rows, out_features]
    """``x @ weight.T + bias`` on the kernel that suits ``weight`` and ``x``'s rows (see the
    module docstring); the spec is ``reference.linear`` on the float weight."""
    threads = torch.get_num_threads()
    if isinstance(weight, PackedLinearWeight):
        if x.dim() == 2:
            panels = weight.panels_for(x.shape[0])
            if panels is not None and few_rows_ok(x, panels, bias):
                return panel_rows(lib, x, panels, weight.shape[0], bias, threads)
            rows = weight.float_copy_for(x.shape[0])
            if rows is not None and few_rows_ok(x, rows, bias):
                return few_rows(lib, x, rows, bias, threads)
            if (weight.mkl_table is not None and 0 < x.shape[0] and x.shape[1] == weight.shape[1]
                    and few_rows_ok(x, x, bias)):
                out = mkl_blocks(lib, x, weight, bias, threads)
                if out is not None:
                    return out
        return packed_linear(x, weight, bias)
    limit = SMALL_M_ROWS_ONE_THREAD if threads == 1 else SMALL_M_ROWS_MANY_THREADS
    if not (x.dim() == 2 and x.shape[0] <= limit and few_rows_ok(x, weight, bias)):
        return reference.linear(x, weight, bias)
    return few_rows(lib, x, weight, bias, threads)


def bound_to(library: Callable[[], ctypes.CDLL]) -> Callable[..., torch.Tensor]:
    """:func:`linear` running ``library()``'s kernels (loaded on first call)."""

    def bound_linear(x: torch.Tensor, weight: torch.Tensor | PackedLinearWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(library(), x, weight, bias)

    return bound_linear


def mkl_blocks(lib: ctypes.CDLL, x: torch.Tensor, weight: PackedLinearWeight, bias: torch.Tensor | None,
               threads: int) -> torch.Tensor | None:
    """MKL's packed GEMM on a weight packed in column blocks, the blocks spread over the threads
    (cpu_decode_stack.h's ``inflight_packed_gemm_f32``); None where torch's ``cblas_sgemm_compute``
    cannot be reached from C (the caller then takes ``packed_linear``)."""
    gemm = cpu_stack.gemm_compute(lib)
    if gemm is None or weight.mkl_table is None:
        return None
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    lib.inflight_packed_gemm_f32(gemm, x.data_ptr(), weight.mkl_table.data_ptr(),
                                 None if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0],
                                 weight.shape[0], x.shape[1], threads)
    return out


def few_rows_ok(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """float32 CPU operands, contiguous: what the C kernels read."""
    return (x.dtype == weight.dtype == torch.float32 and x.is_contiguous() and weight.is_contiguous()
            and x.device.type == "cpu" and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())))


def few_rows(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             threads: int) -> torch.Tensor:
    """The few-row kernel on a row-major ``[out, in]`` weight."""
    return _row_kernel(lib.inflight_small_m_linear_f32, x, weight, weight.shape[0], bias, threads)


def panel_rows(lib: ctypes.CDLL, x: torch.Tensor, panels: torch.Tensor, out_features: int,
               bias: torch.Tensor | None, threads: int) -> torch.Tensor:
    """The panel kernel on a weight in column panels (``cpu_weight_layout.to_panels``)."""
    return _row_kernel(lib.inflight_panel_linear_f32, x, panels, out_features, bias, threads)


def _row_kernel(kernel: Any, x: torch.Tensor, weight: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                threads: int) -> torch.Tensor:
    """``x @ W^T + bias`` through ``kernel`` (the two few-row kernels share their signature)."""
    num_rows, in_features = x.shape
    out = torch.empty((num_rows, out_features), dtype=torch.float32)
    kernel(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
           num_rows, out_features, in_features, threads)
    return out
