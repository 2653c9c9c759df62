"""Where a model runner runs: its device and dtype, and the CPU's thread policy.

``resolve_device`` / ``resolve_dtype`` turn the config's ``auto`` into a device and a dtype;
``cpu_thread_counts`` says how many intra-op threads a small and a big CPU step use,
``big_step`` which steps are big (``rows_outweigh_host`` also gates the decode lanes), and
``cpu_lanes`` how many decode lanes (:mod:`inflight.runtime.worker.cpu.lanes`) the CPU path
splits a pure-decode step into. Pure functions of the environment; knows nothing about models.
"""

from __future__ import annotations

import os

import torch

from inflight import env_vars
from inflight.runtime.worker.cpu.lanes import FLOPS_PER_KV_BYTE
from inflight.runtime.worker.cuda_driver import cuda_problem, read_cuda_host

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# A step whose weight matmuls touch at least this many parameter x token products (~0.1
# GFLOP) runs on every core; tinier steps (a few decodes of a tiny model) keep one core for
# the event loop, since waking a second OpenMP thread per op costs about what it saves.
BIG_STEP_PARAM_TOKENS = 50_000_000
# ... unless the step's work per streamed row (two FLOPs a weight and token, FLOPS_PER_KV_BYTE a
# byte of cache its decode rows' attention reads) is below this: a row whose forward costs about
# what the host spends streaming its token (~40 us of front end and core on one core) is served
# faster with a core left to the host than with the forward split over every core. Measured on
# a 2-core Xeon, served bursts, one thread against two (bench/results/host_path.md): the host
# model (1M weights, ~5M FLOPs a row at 270-token contexts) 256 streams x 256 tokens +16-19%
# tok/s with one; the small model (7M weights, ~17-23M a row) 256 x 128 -13% and the medium
# (61M) 64 x 64 -30% with one.
ROW_FLOPS_FOR_EVERY_CORE = 10_000_000


def resolve_device(name: str, rank: int = 0, world_size: int = 1) -> torch.device:
    """The device of tensor-parallel ``rank``: ``cuda:rank`` on CUDA, the CPU otherwise. CUDA
    asked for but unusable (a driver too old for torch's CUDA build, no GPU given) is a
    ``ValueError`` saying why (:mod:`inflight.runtime.worker.cuda_driver`)."""
    if name in ("auto", "cuda") and not torch.cuda.is_available():
        problem = cuda_problem(name, read_cuda_host())
        if problem is not None:
            raise ValueError(problem)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and world_size > 1:
        if torch.cuda.device_count() < world_size:
            raise ValueError(
                f"tensor_parallel_size {world_size} needs {world_size} GPUs; "
                f"{torch.cuda.device_count()} visible."
            )
        return torch.device("cuda", rank)
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return checkpoint_dtype if checkpoint_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    return torch.float32


def cpu_thread_counts() -> tuple[int, int]:
    """Intra-op threads for small and for big steps on the CPU path.

    ``INFLIGHT_CPU_THREADS``, else ``OMP_NUM_THREADS``, fixes both. Otherwise small steps use
    one fewer than the usable cores and big steps use every core, but only when OpenMP waits
    passively (``OMP_WAIT_POLICY=PASSIVE``, which ``inflight.runtime`` sets before torch loads):
    with spinning waits every op's barrier stalls on a thread the OS has descheduled for the
    event loop (5-7x slower steps measured on a 2-core machine under a burst). Measured with
    the server under a 64-request burst on a 2-core machine, against one thread: small (7M)
    model +11% output tok/s and p99 TTFT 1.3 s instead of 2.2 s; medium (61M) +34% and 9.0 s
    instead of 14.9 s; TPOT p50 at 4 requests/s unchanged (16 ms). A higher threshold (1e9,
    2e8) measured in between.
    """
    for value in (env_vars.read_str("INFLIGHT_CPU_THREADS") or "", os.environ.get("OMP_NUM_THREADS", "")):
        if value.isdigit() and int(value) > 0:
            return int(value), int(value)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    small = max(1, usable - 1)
    passive = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
    return small, usable if passive else small


def big_step(num_tokens: int, num_params: int, num_streamed: int | None = None,
             decode_context_lens: torch.Tensor | None = None, kv_bytes_per_token: int = 0) -> bool:
    """Whether a CPU step of ``num_tokens`` runs on every core: big enough
    (``BIG_STEP_PARAM_TOKENS``) and with rows that outweigh the host's work for them
    (:func:`rows_outweigh_host`)."""
    return num_tokens * num_params >= BIG_STEP_PARAM_TOKENS and rows_outweigh_host(
        num_tokens, num_params, num_streamed, decode_context_lens, kv_bytes_per_token)


def rows_outweigh_host(num_tokens: int, num_params: int, num_streamed: int | None,
                       decode_context_lens: torch.Tensor | None, kv_bytes_per_token: int) -> bool:
    """Whether a step's work per streamed row reaches ``ROW_FLOPS_FOR_EVERY_CORE``, so that every
    core (whole, or in decode lanes) serves it better than a core left to the host.
    ``num_streamed``: the rows whose tokens the step samples (None or 0: a step whose outputs are
    not streamed token by token, e.g. a pooling pass: True); the decode rows' contexts are read
    only when the weights alone fall short."""
    if not num_streamed:
        return True
    floor = ROW_FLOPS_FOR_EVERY_CORE * num_streamed
    flops = 2.0 * num_tokens * num_params
    if flops >= floor or decode_context_lens is None or decode_context_lens.numel() == 0:
        return flops >= floor
    return flops + FLOPS_PER_KV_BYTE * kv_bytes_per_token * int(decode_context_lens.sum()) >= floor


def cpu_lanes(big_step_threads: int, products_split: bool = False) -> int:
    """Decode lanes on the CPU (:mod:`inflight.runtime.worker.cpu.lanes`): ``INFLIGHT_CPU_LANES`` if
    set (0 or 1: off); else none when the model's products are already split over the threads
    in column blocks (MKL's packed weights, :func:`inflight.kernels.cpu_weight_layout.column_starts`),
    where a whole step beat two lanes at every row count (a 2-core Xeon, ms a step, whole /
    lanes: bench-medium at 12 / 24 / 48 / 64 decodes 29.0 / 35.7, 45.4 / 54.0, 66.8 / 76.1, 72.6 /
    78.6; bench-small at 8 / 16 / 32 / 64 decodes 3.3 / 3.7, 4.4 / 5.0, 9.3 / 10.5, 14.6 / 15.2:
    each lane streamed every weight, the whole step streams each once); else one per thread a
    big step may use."""
    value = env_vars.read_str("INFLIGHT_CPU_LANES") or ""
    if value.isdigit():
        return int(value)
    return 0 if products_split else big_step_threads


def cpu_threads() -> int:
    """Intra-op threads of a small CPU step (see :func:`cpu_thread_counts`)."""
    return cpu_thread_counts()[0]
