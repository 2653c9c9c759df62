"""The engine's statistics: one :class:`~inflight.runtime.outputs.EngineStats` built from the
scheduler, the KV pool and its host tier, the output processor, the prefill backlog and the
speculation counters of an :class:`~inflight.runtime.core.engine.LLMEngine` (and with per-group
KV tables each group's blocks held, :mod:`.kv_groups`), with the LoRA
adapters of its running and waiting requests when LoRA is on (:func:`with_lora_stats`), through
its public read-only properties. Reads only.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from inflight.runtime.core.kv_groups import GroupedKVCacheManager
from inflight.runtime.outputs import EngineStats

if TYPE_CHECKING:
    from inflight.runtime.core.engine import LLMEngine


def engine_stats(engine: LLMEngine) -> EngineStats:
    """The engine's counters and gauges, as the front ends, /metrics and the autoscaler read them."""
    out, tenants, spec = engine.output_processor, engine.output_processor.tenants, engine.spec_stats
    return with_lora_stats(engine, EngineStats(
        num_running=engine.scheduler.num_running,
        num_waiting=engine.scheduler.num_waiting,
        num_kv_blocks=engine.pool.num_blocks,
        num_used_kv_blocks=engine.pool.num_used_blocks,
        num_preemptions=engine.scheduler.num_preemptions,
        prefix_cache_queries=engine.kv.prefix_cache_queries,
        prefix_cache_hits=engine.kv.prefix_cache_hits,
        **_host_tier_stats(engine),
        **_kv_group_stats(engine),
        num_prompt_tokens=out.num_prompt_tokens,
        num_generation_tokens=out.num_generation_tokens,
        num_tokens_last_step=engine.num_tokens_last_step,
        num_steps=engine.num_steps,
        device_busy_seconds=engine.runner.device_busy_seconds,
        num_prefill_backlog_tokens=engine.prefill.num_backlog_tokens,
        num_prefill_computed_tokens=engine.prefill.num_computed_tokens,
        prefill_tokens_per_second=engine.prefill.tokens_per_second,
        max_num_sequences=engine.config.max_num_sequences,
        spec_num_drafts=spec.num_drafts,
        spec_num_draft_tokens=spec.num_draft_tokens,
        spec_num_accepted_tokens=spec.num_accepted_tokens,
        spec_accepted_per_position=tuple(spec.accepted_per_position),
        tenants=(tenants.snapshot(engine.scheduler.running, engine.scheduler.waiting)
                 if tenants is not None else None),
    ))


def with_lora_stats(engine: Any, stats: EngineStats) -> EngineStats:
    """``stats`` with the adapters of running and waiting requests (as they are when LoRA is off)."""
    if not engine.config.enable_lora:
        return stats
    running, waiting = engine.lora_stats()
    return dataclasses.replace(stats, running_lora_adapters=tuple(running), waiting_lora_adapters=tuple(waiting))


def _host_tier_stats(engine: LLMEngine) -> dict[str, int]:
    """The host tier's EngineStats fields (none without one)."""
    tier, host_kv = engine.kv.host_tier, engine.host_kv
    if tier is None or host_kv is None:
        return {}
    return {"num_host_kv_blocks": tier.num_slots, "num_used_host_kv_blocks": tier.num_used_slots,
            "external_prefix_cache_queries": tier.queries, "external_prefix_cache_hits": tier.hits,
            "kv_offload_stored_blocks": host_kv.num_copied_out, "kv_offload_loaded_blocks": host_kv.num_copied_in,
            "kv_offload_bytes": host_kv.num_copied_bytes, "kv_offload_dropped_blocks": tier.num_dropped_blocks}


def _kv_group_stats(engine: LLMEngine) -> dict[str, tuple]:
    """Per-group KV tables' EngineStats fields: each group's name and blocks held (none with one table)."""
    kv = engine.kv
    if not isinstance(kv, GroupedKVCacheManager):
        return {}
    return {"kv_group_names": kv.group_names(), "kv_blocks_held_by_group": kv.blocks_held_by_group(engine.scheduler.running)}
