"""Run a kernel with torch's intra-op thread count set, and put it back afterwards (the native
CPU kernels read it to choose between their one-thread and OpenMP paths)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

T = TypeVar("T")


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def with_threads(threads: int, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    """``fn(*args, **kwargs)`` on ``threads`` torch threads."""
    with torch_threads(threads):
        return fn(*args, **kwargs)
