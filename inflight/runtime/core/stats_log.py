"""The periodic one-line engine stats log, as vLLM prints it while busy.

Every ``interval_s`` (10 s by default, ``INFLIGHT_STATS_LOG_INTERVAL_S`` to change) while the
engine has requests running or waiting, or computed tokens since the last line, logs one
line: running, waiting, KV cache usage, prefix-cache hit rate, and prompt / generation
throughput in tokens per second over the interval. An idle engine logs nothing. Runs in a
daemon thread beside the engine and only reads ``EngineStats`` snapshots (``stats()`` is
safe to call from any thread). Knows nothing about HTTP.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from inflight import env_vars
from inflight.runtime.outputs import EngineStats

logger = logging.getLogger("inflight.stats")
INTERVAL_ENV = "INFLIGHT_STATS_LOG_INTERVAL_S"
DEFAULT_INTERVAL_S: float = env_vars.lookup(INTERVAL_ENV).default  # type: ignore[assignment]


def interval_from_env() -> float:
    """The logging interval: ``INFLIGHT_STATS_LOG_INTERVAL_S`` when set (> 0), else 10 s."""
    raw = env_vars.read_str(INTERVAL_ENV) or ""
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_INTERVAL_S
    return value if value > 0 else DEFAULT_INTERVAL_S


def stats_line(stats: EngineStats, prompt_tps: float, generation_tps: float) -> str:
    """The one line logged per interval."""
    hit = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
    line = (f"engine: running {stats.num_running} reqs, waiting {stats.num_waiting} reqs, "
            f"KV cache usage {100 * stats.kv_cache_usage:.1f}%, prefix cache hit rate {100 * hit:.1f}%, "
            f"prompt {prompt_tps:.1f} tok/s, generation {generation_tps:.1f} tok/s")
    if stats.spec_num_draft_tokens:  # cumulative, as vLLM's spec-decode line
        accepted = stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens
        mean_len = 1 + stats.spec_num_accepted_tokens / max(stats.spec_num_drafts, 1)
        line += f", draft acceptance {100 * accepted:.1f}%, mean accepted length {mean_len:.2f}"
    return line


def _log_loop(snapshot: Callable[[], EngineStats], interval_s: float, stop: threading.Event) -> None:
    last = snapshot()
    last_at = time.monotonic()
    while not stop.wait(interval_s):
        stats = snapshot()
        now = time.monotonic()
        elapsed = max(now - last_at, 1e-9)
        prompt = stats.num_prompt_tokens - last.num_prompt_tokens
        generated = stats.num_generation_tokens - last.num_generation_tokens
        if stats.num_running or stats.num_waiting or prompt or generated:
            logger.info(stats_line(stats, prompt / elapsed, generated / elapsed))
        last, last_at = stats, now


def start_stats_log(snapshot: Callable[[], EngineStats], interval_s: float | None = None) -> threading.Event:
    """Start the logging thread; set the returned event to stop it."""
    stop = threading.Event()
    thread = threading.Thread(
        target=_log_loop, args=(snapshot, interval_s or interval_from_env(), stop),
        name="inflight-stats-log", daemon=True,
    )
    thread.start()
    return stop
