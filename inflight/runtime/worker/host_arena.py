"""One host allocation carved into tensor views: the host KV tier's pool
(:mod:`inflight.runtime.worker.kv_copies`), page-locked on CUDA as one range.

PyTorch's pinned host allocator rounds each allocation up to a power of two, so a pool pinned
one tensor per layer could pin up to twice the bytes asked for. Here the views' sizes are laid
out end to end (each start aligned to :data:`ALIGNMENT` bytes, :func:`plan_layout`, a pure
function), one plain allocation holds them, and on CUDA that one range is page-locked with
``cudaHostRegister``: the bytes pinned are the layout's, to the page. The range is unregistered
(after the device has finished every queued copy) when the arena is collected. Knows nothing
about KV caches, blocks or copies.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

ALIGNMENT = 256  # bytes: every view starts on this boundary (any element size divides it)
PAGE = 4096  # the registered range starts on a page


@dataclass(frozen=True, slots=True)
class Layout:
    """Where each view lies in the arena: ``offsets[i]`` bytes from its start, ``sizes[i]`` long."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int  # the arena's length: the last view's end


def plan_layout(sizes: Sequence[int], alignment: int = ALIGNMENT) -> Layout:
    """Views of ``sizes`` bytes end to end, each start rounded up to ``alignment`` (a power of two);
    with every size a multiple of ``alignment`` the arena is exactly their sum."""
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment {alignment} is not a power of two")
    offsets, end = [], 0
    for size in sizes:
        if size < 0:
            raise ValueError(f"a view of {size} bytes")
        start = (end + alignment - 1) // alignment * alignment
        offsets.append(start)
        end = start + size
    return Layout(tuple(offsets), tuple(sizes), end)


class HostArena:
    """``views[i]``: an empty host tensor of ``shapes[i]`` and ``dtypes[i]``, all in one allocation
    laid out by :func:`plan_layout`; ``pin_for``: the CUDA device whose copies it serves, to
    page-lock the allocation for (``None``: plain host memory)."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype],
                 pin_for: torch.device | None = None) -> None:  # fmt: skip
        if len(shapes) != len(dtypes):
            raise ValueError(f"{len(shapes)} shapes but {len(dtypes)} dtypes")
        sizes = [_numel(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in zip(shapes, dtypes, strict=True)]
        self.layout = plan_layout(sizes)
        raw = torch.empty(self.layout.nbytes + PAGE, dtype=torch.uint8)  # the slack puts the start on a page
        start = -raw.data_ptr() % PAGE
        self._bytes = raw[start : start + self.layout.nbytes]  # [nbytes] uint8, page-aligned
        self.views = [
            self._bytes[offset : offset + size].view(dtype).view(shape)
            for offset, size, shape, dtype in zip(self.layout.offsets, sizes, shapes, dtypes, strict=True)
        ]
        self.pinned = False
        if pin_for is not None and self.layout.nbytes:
            _register(self._bytes)
            self.pinned = True
            weakref.finalize(self, _unregister, self._bytes, pin_for).atexit = False

    @property
    def nbytes(self) -> int:
        """Bytes the views span (what is page-locked when pinned)."""
        return self.layout.nbytes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def _register(buffer: torch.Tensor) -> None:
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    if err != cudart.cudaError.success:
        raise RuntimeError(f"page-locking the host KV pool ({buffer.numel()} bytes) failed: "
                           f"{cudart.cudaGetErrorString(err)}; lower kv_offloading_size or raise the "
                           "locked-memory limit (ulimit -l).")


def _unregister(buffer: torch.Tensor, device: torch.device) -> None:
    torch.cuda.synchronize(device)  # no copy queued on any of its streams may still use the range
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
