"""The CPU's fp32 matmul rate, the model's parameter count, and the machine facts for reports.

``matmul_rate`` times square fp32 matmuls at every thread count from 1 to the usable cores
and keeps the best (on a busy machine fewer threads can be faster); the serving roofline is
``rate / (2 x parameters)`` tokens per second, since a token costs about two FLOPs per
parameter. Knows nothing about servers or the engine.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class MatmulRate:
    best_gflops: float
    best_threads: int
    by_threads: dict[int, float]  # median GFLOP/s per thread count
    size: int


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def matmul_rate(size: int = 1024, reps: int = 5, iters: int = 10) -> MatmulRate:
    """Median GFLOP/s of ``[size, size] @ [size, size]`` fp32 for each thread count; the best."""
    before = torch.get_num_threads()
    a, b = torch.randn(size, size), torch.randn(size, size)
    by_threads: dict[int, float] = {}
    try:
        for threads in range(1, usable_cores() + 1):
            torch.set_num_threads(threads)
            a @ b  # noqa: B018 - warm-up
            rates = []
            for _ in range(reps):
                t0 = time.perf_counter()
                for _ in range(iters):
                    a @ b  # noqa: B018
                rates.append(2 * size**3 * iters / (time.perf_counter() - t0) / 1e9)
            by_threads[threads] = statistics.median(rates)
    finally:
        torch.set_num_threads(before)
    best = max(by_threads, key=lambda t: by_threads[t])
    return MatmulRate(by_threads[best], best, by_threads, size)


def num_parameters(model_dir: Path) -> int:
    """Unique parameters in the checkpoint (tied embeddings counted once), from the safetensors."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                shape = f.get_slice(name).get_shape()
                count = 1
                for dim in shape:
                    count *= dim
                total += count
    return total


def roofline_tok_s(rate: MatmulRate, num_params: int) -> float:
    return rate.best_gflops * 1e9 / (2 * num_params)


def machine_facts(model_dirs: dict[str, Path]) -> dict[str, Any]:
    """Cores, torch threads (what the engine picks), versions, and each model's size."""
    from inflight.runtime.worker.cpu.device_setup import cpu_threads

    models = {}
    for name, path in model_dirs.items():
        config = json.loads((path / "config.json").read_text())
        models[name] = {"parameters": num_parameters(path), "hidden_size": config.get("hidden_size"),
                        "num_layers": config.get("num_hidden_layers"), "vocab_size": config.get("vocab_size")}
    return {
        "cpu": platform.processor() or platform.machine(), "cpu_model": _cpu_model(),
        "usable_cores": usable_cores(), "os_cpu_count": os.cpu_count(),
        "engine_torch_threads": cpu_threads(), "torch_default_threads": torch.get_num_threads(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(), "torch": torch.__version__, "transformers": _version("transformers"),
        "models": models,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def rate_to_dict(rate: MatmulRate) -> dict[str, Any]:
    return asdict(rate)
