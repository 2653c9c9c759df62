"""Capture and replay of a step function: CUDA graphs on the GPU, a recording stand-in on the CPU.

A :class:`GraphBackend` turns a zero-argument function that reads and writes only fixed
("static") tensors into a replay callable. :class:`CudaGraphBackend` is the only code that
touches ``torch.cuda.CUDAGraph``: all captures share one memory pool and one side stream,
and each is preceded by an eager warm-up run (Triton compiles, cuBLAS picks its kernels).
:class:`RecordingGraphBackend` is what the CPU tests use: "capture" runs the function once
and "replay" runs it again, both under :func:`no_host_sync`, so everything around capture
and replay (size selection, padding, buffer reuse, token equality with eager) is tested
without a GPU, and any host sync inside the captured region fails the test as it would
break a real capture. Knows nothing about models or batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods that read device memory on the host: inside a CUDA graph capture each one
# is an error (or a silent stall outside it).
_HOST_SYNCS = frozenset({
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
    torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
    torch.Tensor.nonzero, torch.nonzero, torch.Tensor.unique, torch.unique, torch.masked_select,
    torch.Tensor.masked_select,
})  # fmt: skip


class HostSyncError(RuntimeError):
    """A captured region read a tensor's value on the host."""


class _HostSyncGuard(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if (func in _HOST_SYNCS or (func is torch.Tensor.to and _to_cpu(args, kwargs or {}))
                or (func is torch.Tensor.__getitem__ and _bool_index(args))):
            name = getattr(func, "__name__", str(func))
            raise HostSyncError(f"host sync ({name}) inside a captured region: a CUDA graph cannot hold it")
        return func(*args, **(kwargs or {}))


def _to_cpu(args: tuple, kwargs: dict) -> bool:
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


def _bool_index(args: tuple) -> bool:
    """``t[mask]`` with a boolean tensor: the result's size is data, read on the host."""
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Fail (:class:`HostSyncError`) on any host read of a tensor's value inside the block."""
    with _HostSyncGuard():
        yield


class GraphBackend(Protocol):
    """Turns a static-buffer step function into a replay callable."""

    name: str

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Warm up and capture ``fn``; the returned callable replays it."""
        ...

    def memory_bytes(self) -> int:
        """Device memory the captures hold (0 where nothing is reserved)."""
        ...


class CudaGraphBackend:
    """``torch.cuda.CUDAGraph`` captures sharing one memory pool (capture the largest first)."""

    name = "cuda"

    def __init__(self, device: torch.device, warmup_runs: int = 2) -> None:
        self.device = device
        self.warmup_runs = warmup_runs
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device)
        self._graphs: list[torch.cuda.CUDAGraph] = []
        self._memory_before = torch.cuda.memory_reserved(device)

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for _ in range(self.warmup_runs):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
            fn()
        torch.cuda.synchronize(self.device)
        self._graphs.append(graph)
        return graph.replay

    def memory_bytes(self) -> int:
        return max(0, torch.cuda.memory_reserved(self.device) - self._memory_before)


class RecordingGraphBackend:
    """The CPU stand-in: records each function; replay re-runs it, under :func:`no_host_sync`."""

    name = "recording"

    def __init__(self) -> None:
        self.captured: list[Callable[[], None]] = []
        self.num_replays = 0

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        with no_host_sync():
            fn()  # the warm-up run, as on CUDA
        self.captured.append(fn)

        def replay() -> None:
            self.num_replays += 1
            with no_host_sync():
                fn()

        return replay

    def memory_bytes(self) -> int:
        return 0
