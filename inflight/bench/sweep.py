"""The tuning sweep an SRE would run: KV block size x ``max_num_tokens`` on one burst.

Each cell builds an in-process :class:`LLMEngine` with that configuration (everything else
default), submits the same burst (the prompts tokenized by the engine) at once, and steps
until it drains; it reports output tokens/s and time-to-first-token / per-token latency
from the engine's own request timestamps. In-process, so the HTTP layer's cost is left out
and cells stay cheap. Knows nothing about servers or files.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from inflight.bench.client import RequestSpec
from inflight.bench.stats import percentile
from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.sampling_params import SamplingParams

DEFAULT_BLOCK_SIZES = (8, 16, 32)
DEFAULT_MAX_NUM_TOKENS = (256, 512, 2048)


@dataclass(frozen=True, slots=True)
class SweepCell:
    block_size: int
    max_num_tokens: int
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    num_steps: int


def run_cell(model_dir: Path, specs: list[RequestSpec], block_size: int, max_num_tokens: int,
             max_num_sequences: int) -> SweepCell:
    config = EngineConfig(block_size=block_size, max_num_tokens=max_num_tokens,
                          max_num_sequences=max_num_sequences, max_model_len=1024)
    engine = LLMEngine.from_model_dir(model_dir, config)
    engine.warmup()
    start = time.monotonic()
    for i, spec in enumerate(specs):
        params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(f"s{i}", engine.encode_prompt(spec.prompt), params, arrival_time=start)
    ttft, tpot, num_out = [], [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            num_out += len(out.new_token_ids)
            if out.finished and out.times is not None and out.times.first_token is not None:
                first = out.times.first_token - start
                ttft.append(first)
                if out.num_output_tokens > 1:
                    tpot.append((out.times.finished - out.times.first_token) / (out.num_output_tokens - 1))
    wall = time.monotonic() - start
    return SweepCell(block_size, max_num_tokens, num_out / wall, 1e3 * percentile(ttft, 50),
                     1e3 * percentile(ttft, 99), 1e3 * percentile(tpot, 50), engine.stats().num_steps)


def run_sweep(model_dir: Path, specs: list[RequestSpec], block_sizes: tuple[int, ...],
              max_num_tokens: tuple[int, ...], max_num_sequences: int) -> list[SweepCell]:
    return [run_cell(model_dir, specs, bs, mnt, max_num_sequences) for bs in block_sizes for mnt in max_num_tokens]


TABLE_HEADER = ("block size", "max_num_tokens", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                "steps")


def table_rows(cells: list[SweepCell]) -> list[list[str]]:
    return [[str(c.block_size), str(c.max_num_tokens), f"{c.output_tok_s:.0f}", f"{c.ttft_p50_ms:.0f}",
             f"{c.ttft_p99_ms:.0f}", f"{c.tpot_p50_ms:.1f}", str(c.num_steps)] for c in cells]
