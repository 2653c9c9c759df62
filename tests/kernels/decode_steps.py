"""Run a small engine's decode steps twice, on the bundle under test and on a per-op bundle, and
hand each pair to a check: the engine-level half of the one-call decode block and stack tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from inflight.kernels.ops import KernelOps

Caches = list[tuple[torch.Tensor, torch.Tensor]]
# (logits-side output under test, per-op output, caches after the step under test, per-op caches)
Check = Callable[[torch.Tensor, torch.Tensor, Caches, Caches], None]


def check_decode_steps(engine: Any, per_op_ops: KernelOps, check: Check) -> None:
    """Serve three greedy requests of 4 tokens. Before each pure-decode forward, the same step runs
    per op (``per_op_ops``) on copies of the KV caches; then the real forward runs, and ``check``
    compares the two outputs and the two sets of caches."""
    from inflight.runtime.sampling_params import SamplingParams

    runner = engine.runner
    model_forward = runner.model.forward

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        meta = args[4]
        if meta.num_prefills != 0:
            return model_forward(*args, **kwargs)
        caches = [(k.clone(), v.clone()) for k, v in args[3]]
        per_op = model_forward(*args[:3], caches, meta, per_op_ops)
        out = model_forward(*args, **kwargs)
        check(out, per_op, args[3], caches)
        return out

    runner.model.forward = forward
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i, 9, 11, 13, 17 + i], params)
    while engine.has_unfinished_requests():
        engine.step()
