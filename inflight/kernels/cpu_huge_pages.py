"""The CPU KV cache on transparent huge pages (``madvise(MADV_HUGEPAGE)`` before its first touch).

A decode step's attention reads every running sequence's cache blocks where the block pool put
them: a block of the host model is 8 KiB of K and 8 of V per layer, and a burst's sequences get
their blocks interleaved, so at 256 rows of 140-token contexts one layer's read touches ~9,000
distinct 4 KiB pages, several times what the L2 TLB maps, and most blocks begin with a page walk.
On 2 MiB pages the same read touches ~20. Measured on the 2-core Xeon, the native decode
attention of 256 sequences x 140 tokens (2 KV heads of 64, blocks in random order, one thread):
1.81 -> 1.56 ms a layer (-14%), where blocks in order take 1.42 -> 1.37.

Most Linux distributions leave transparent huge pages to ``madvise`` (``enabled`` says
``[madvise]``), so a process gets them only where it asks. :func:`zeros_on_huge_pages` asks for
the 2 MiB-aligned inside of the tensor's memory and then zeroes it, so the zeroing faults in huge
pages where the kernel has them (it falls back to small pages silently where it has not: the
memory and the results are the same, only the TLB misses differ). Nothing is asked off Linux,
where ``enabled`` says ``[never]``, or with ``INFLIGHT_CPU_HUGE_PAGES=0``. Knows nothing about
models or caches beyond the tensors it is given.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from functools import lru_cache
from pathlib import Path

import torch

from inflight import env_vars

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20  # x86-64's and (with 4 KiB base pages) aarch64's PMD size
MADV_HUGEPAGE = 14  # Linux, every architecture
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP_ENABLED) -> str:
    """The kernel's transparent huge page mode: ``always``, ``madvise`` or ``never`` (the bracketed
    word of ``path``), or ``absent`` where there is no such file (not Linux, a kernel without THP)."""
    try:
        text = path.read_text()
    except OSError:
        return "absent"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "absent"


@lru_cache(maxsize=1)
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def wanted() -> str | None:
    """Why huge pages are not asked for in this process (None: they are)."""
    if (env_vars.read_int("INFLIGHT_CPU_HUGE_PAGES") or 0) == 0:
        return "INFLIGHT_CPU_HUGE_PAGES=0"
    if not sys.platform.startswith("linux"):
        return "not Linux"
    mode = thp_mode()
    if mode not in ("always", "madvise"):
        return f"transparent huge pages {mode}"
    if _madvise() is None:
        return "no madvise in the C library"
    return None


def advise(tensor: torch.Tensor) -> int:
    """Ask for huge pages over the 2 MiB-aligned inside of ``tensor``'s memory (CPU, contiguous);
    the bytes asked for (0 where the tensor holds no whole huge page, or the kernel refused)."""
    fn = _madvise()
    if fn is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return 0
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if last <= first:
        return 0
    if fn(first, last - first, MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        return 0
    return last - first


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor of ``shape``, on huge pages where the kernel gives them (see the module
    docstring): allocated, advised, then zeroed, so the zeroing is its pages' first touch."""
    tensor = torch.empty(shape, dtype=dtype)
    if wanted() is None:
        advise(tensor)
    return tensor.zero_()


def cache_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV cache tensor: on huge pages on the CPU (:func:`zeros_on_huge_pages`), plain
    ``torch.zeros`` on any other device."""
    if device.type == "cpu":
        return zeros_on_huge_pages(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def huge_pages_sentence() -> str:
    """What the CPU KV cache gets, for the start-up log."""
    why_not = wanted()
    return "on transparent huge pages" if why_not is None else f"on small pages ({why_not})"
