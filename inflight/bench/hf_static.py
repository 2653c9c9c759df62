"""The naive self-hoster: plain ``transformers`` ``generate`` over fixed, padded batches.

Requests are taken in arrival order in batches of ``batch_size``, left-padded to the longest
prompt, and generated greedily for the longest ``max_tokens`` in the batch; the next batch
starts when the whole batch is done. A stopping-criteria hook timestamps every decoding
step, which gives each request its time to first token, inter-token gaps and end-to-end
latency up to its own ``max_tokens`` (extra tokens a request did not ask for are wasted work,
as they are for a real static batch). Runs in-process, burst workloads only (every request
has arrived at time 0). Knows nothing about servers or reports.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from inflight.bench.client import RequestResult, RequestSpec, RunResult


class _StepClock:
    """A ``StoppingCriteria``-shaped callable that records when each decoding step ends."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def load(model_dir: Path) -> tuple[Any, Any]:
    """(model, tokenizer) as a self-hoster would load them: fp32 on the CPU, left padding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.padding_side = "left"
    from inflight.runtime.model.float_export import float_checkpoint_dir

    reference_dir = float_checkpoint_dir(model_dir)  # transformers needs every tensor in safetensors
    model = AutoModelForCausalLM.from_pretrained(str(reference_dir), dtype=torch.float32).eval()
    return model, tokenizer


def _run_batch(model: Any, tokenizer: Any, batch: list[RequestSpec], start: float) -> list[RequestResult]:
    from transformers import StoppingCriteriaList

    enc = tokenizer([s.prompt for s in batch], return_tensors="pt", padding=True)
    clock = _StepClock()
    with torch.inference_mode():
        model.generate(
            **enc, max_new_tokens=max(s.max_tokens for s in batch), min_new_tokens=max(s.max_tokens for s in batch),
            do_sample=False, pad_token_id=tokenizer.pad_token_id, stopping_criteria=StoppingCriteriaList([clock]),
        )
    results = []
    for row, spec in enumerate(batch):
        steps = clock.times[: spec.max_tokens]
        results.append(RequestResult(
            ttft_s=steps[0] - start, e2e_s=steps[-1] - start,
            gaps_s=[b - a for a, b in zip(steps, steps[1:], strict=False)],
            num_prompt_tokens=int(enc["attention_mask"][row].sum()), num_output_tokens=len(steps),
        ))
    return results


def run_static_generate(model: Any, tokenizer: Any, specs: list[RequestSpec], batch_size: int) -> RunResult:
    """Serve a burst with static batches of ``batch_size``; latencies count from the burst's start."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 (got {batch_size})")
    start = time.perf_counter()
    results: list[RequestResult] = []
    for i in range(0, len(specs), batch_size):
        results.extend(_run_batch(model, tokenizer, specs[i : i + batch_size], start))
    return RunResult(tuple(results), time.perf_counter() - start)


def warm_up(model: Any, tokenizer: Any) -> None:
    run_static_generate(model, tokenizer, [RequestSpec("warm up", 2)], 1)
