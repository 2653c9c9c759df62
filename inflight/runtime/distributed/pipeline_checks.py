"""What does not combine with pipeline parallelism (``pipeline_parallel_size > 1``), and why.

Called from :meth:`inflight.runtime.config.EngineConfig.validate` so a refused combination fails
before any process starts, with a message that names both settings and the reason. Imports
nothing heavy (no torch). Knows nothing about processes.
"""

from __future__ import annotations

from typing import Any

# setting that clashes -> why the stages cannot serve it yet
_REASONS: tuple[tuple[str, str], ...] = (
    ("speculative_config", "the drafter and the verify step need the whole model's logits on the engine rank at "
                           "every proposal; they are not split into stages"),
    ("enable_lora", "LoRA adapters are loaded into the slots of every tensor-parallel rank, not yet into the "
                    "stage that holds each layer"),
    ("kv_offloading_size", "the host tier copies the engine rank's KV cache; the other stages' layers live in "
                           "other processes"),
)


def check_pipeline_config(config: Any) -> None:
    """``ValueError`` for a setting that does not run with pipeline stages (``config`` is an
    :class:`~inflight.runtime.config.EngineConfig` with ``pipeline_parallel_size > 1``)."""
    size = config.pipeline_parallel_size
    for name, why in _REASONS:
        value = getattr(config, name)
        if value not in (None, False):
            raise ValueError(f"pipeline_parallel_size {size} cannot be combined with {name}: {why}; "
                             f"drop one of them.")
    if config.scheduler_policy == "fair":
        raise ValueError("scheduler_policy fair cannot be combined with pipeline_parallel_size > 1 yet (it preempts "
                         "to rebalance slots, and a request in a step in flight cannot be preempted); use fcfs or "
                         "priority.")
    if config.device == "sim":
        raise ValueError("device sim runs no pipeline stages (it loads no weights); drop pipeline_parallel_size.")
    if config.runner == "pooling":
        raise ValueError("the pooling runner runs on one rank; drop pipeline_parallel_size or use runner generate.")
    if config.async_scheduling is True:
        raise ValueError("async_scheduling cannot be combined with pipeline_parallel_size > 1 yet (the engine "
                         "rank waits for the last stage's logits each step); turn one of them off.")
