"""StepWorker: the one thread that runs an engine's device work, in the order it is submitted.

With async scheduling (:mod:`inflight.runtime.core.async_steps`) the engine thread is the *host*: it
schedules, packs inputs and turns sampled tokens into outputs, while this thread runs the
forward passes and the sampling, one job after another. Because every job runs on this one
thread, in submission order, a job sees everything the jobs before it wrote (KV cache slots,
sampled token tensors), exactly as kernels queued on one CUDA stream do; a KV block freed on
the host and handed to a later step is only written after every earlier step has run. On a
GPU the thread is where a step's launches happen, and it never waits on the device: a step's
sampling only starts its tokens' copy to the host (``Sampler.start_sample``), so the thread
launches step N+1 while N still runs, and the engine thread waits on the copy when it needs
N's tokens; on the CPU it is the stand-in that lets tests see the overlap and its one-step lag.
Knows nothing about the engine.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


class StepWorker:
    """A single-thread executor for device jobs (see module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "inflight-step", self._start)
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        self._thread = threading.current_thread()
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # the current device is per thread

    def submit(self, fn: Callable[..., T], *args: object) -> concurrent.futures.Future[T]:
        """Run ``fn(*args)`` after every job submitted before it."""
        return self._pool.submit(_in_inference_mode, fn, *args)

    @property
    def on_worker(self) -> bool:
        """Whether the caller is the worker thread (what a job runs on)."""
        return threading.current_thread() is self._thread

    def close(self) -> None:
        """Let the jobs submitted so far finish, then stop the thread (idempotent)."""
        self._pool.shutdown(wait=True)


def _in_inference_mode(fn: Callable[..., T], *args: object) -> T:
    with torch.inference_mode():  # thread-local: the engine thread's mode does not carry over
        return fn(*args)
