"""The CPU bundle's multi-LoRA delta: ``lora_delta`` with the reference's signature
(:func:`inflight.kernels.lora_reference.lora_delta`), in fewer calls than its loop.

On the CPU a LoRA delta is a few small matmuls, so its cost is the number of torch calls (each
some microseconds, times every targeted projection of every layer of every step) and the row
gather/scatter into a column slice of a fused output, more than the arithmetic. Two shapes:

* **few rows** (a decode step, up to :data:`NATIVE_MAX_ROWS`, float32): one call of
  ``lora_cpu.c`` (each present slot's B transposed once, then per row the rank dot products
  and the axpys into its row of ``out``), built by the compile function :func:`bound_to` is
  given (cpu_native's: its compiler, flags and cache, keyed by this source), so this module
  imports no backend.
* **many rows** (prefill chunks): a prompt's rows sit together in the packed batch, so the
  rows fall into few runs of one slot; each run is two matmuls written straight into its
  rows of ``out`` (``addmm_`` on the view): no gather, no scatter. A batch broken into more
  than :data:`MAX_RUNS` runs, and anything the C code does not take (another dtype, an odd
  layout, no compiler), takes the reference's grouped path.

Products and the sum run in float32 as in the reference (an ``out`` of another dtype is
rounded once); only the summation order differs. Slots are checked as the reference does.
Knows nothing about adapters.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch

from inflight.kernels import lora_reference
from inflight.kernels.lora_reference import check_lora_inputs

SOURCE = Path(__file__).with_name("lora_cpu.c")
NATIVE_MAX_ROWS = 256  # up to this many rows: the one-call C kernel (decode steps)
MAX_RUNS = 64  # more runs of one slot than this: the reference's grouped path
_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {"inflight_lora_delta_f32": (_int, [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64] + [_i64] * 5 + [_int])}


def _native_ok(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    return (x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1 and out.stride(1) == 1
            and a.is_contiguous() and b.is_contiguous())  # fmt: skip


def _native(lib: ctypes.CDLL, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
            out: torch.Tensor) -> None:  # fmt: skip
    slots = slots.to(torch.int32).contiguous()
    num_slots, rank, in_features = a.shape
    status = lib.inflight_lora_delta_f32(
        x.data_ptr(), x.stride(0), a.data_ptr(), b.data_ptr(), slots.data_ptr(), out.data_ptr(), out.stride(0),
        x.shape[0], in_features, out.shape[1], rank, num_slots, torch.get_num_threads(),
    )  # fmt: skip
    if status == -1:
        raise ValueError(f"lora_delta: token_slots must lie in [-1, {num_slots}) (there are {num_slots} slots).")
    if status != 0:
        raise MemoryError("lora_delta: the native kernel could not allocate its scratch.")


def _runs(slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, end, slot) of each run of one slot, the runs without an adapter left out."""
    starts = torch.cat([slots.new_zeros(1), torch.nonzero(slots[1:] != slots[:-1]).flatten() + 1])
    bounds = starts.tolist() + [slots.shape[0]]
    values = slots[starts].tolist()
    return [(s, e, v) for s, e, v in zip(bounds[:-1], bounds[1:], values, strict=True) if v >= 0]


def _by_runs(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, runs: list[tuple[int, int, int]],
             out: torch.Tensor) -> None:  # fmt: skip
    for start, end, s in runs:
        shrunk = x[start:end].float() @ a[s].float().T  # [run, rank]
        if out.dtype == torch.float32:
            out[start:end].addmm_(shrunk, b[s].T)
        else:
            rows = out[start:end]
            rows.copy_(rows.float() + shrunk @ b[s].float().T)


def _torch_path(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
                out: torch.Tensor) -> None:  # fmt: skip
    """Runs of one slot straight into ``out``; the reference's grouped path past :data:`MAX_RUNS`."""
    num_slots = a.shape[0]
    slots = token_slots.long()
    lowest, highest = torch.aminmax(slots)
    if int(lowest) < -1 or int(highest) >= num_slots:
        raise ValueError(f"lora_delta: token_slots must lie in [-1, {num_slots}) (there are {num_slots} slots).")
    runs = _runs(slots)
    if len(runs) > MAX_RUNS:
        lora_reference.lora_delta(x, a, b, token_slots, out)
    else:
        _by_runs(x, a, b, runs, out)


def bound_to(compile_library: Callable[..., tuple[ctypes.CDLL | None, str]]) -> Callable[..., None]:
    """``lora_delta`` whose C kernel ``compile_library(SOURCE, stem, signatures)`` builds and
    loads on first use (:func:`inflight.kernels.cpu_native.compile_library`: the same compiler,
    flags and cache as the other native kernels); without it every call takes the torch path."""

    @lru_cache(maxsize=1)
    def load() -> ctypes.CDLL | None:
        return compile_library(SOURCE, "lora_cpu", _SIGNATURES)[0]

    def lora_delta(
        x: torch.Tensor,  # [num_tokens, in_features]
        a: torch.Tensor,  # [num_slots, rank, in_features]: each slot's LoRA A
        b: torch.Tensor,  # [num_slots, out_features, rank]: each slot's LoRA B, scaling folded in
        token_slots: torch.Tensor,  # [num_tokens] int32: each row's slot, -1 for none
        out: torch.Tensor,  # [num_tokens, out_features], any strides: updated in place
    ) -> None:
        """``out[t] += (x[t] @ a[s].T) @ b[s].T`` for each row ``t`` with slot ``s >= 0``
        (see :func:`inflight.kernels.lora_reference.lora_delta`)."""
        check_lora_inputs(x, a, b, token_slots, out)
        if x.shape[0] == 0:
            return
        if x.shape[0] <= NATIVE_MAX_ROWS and _native_ok(x, a, b, out):
            lib = load()
            if lib is not None:
                _native(lib, x, a, b, token_slots, out)
                return
        _torch_path(x, a, b, token_slots, out)

    return lora_delta
