"""The fair policy's per-tenant counts (inflight.runtime.core.tenant_stats): a tenant's group is
labelled by a keyed digest, or by its name when ``--metrics-tenants`` names it; a bounded
number of digest series (the rest under "other"); the requests of each tenant running and
waiting; and a fair engine whose per-tenant tokens add up to its totals. The server side (the
same figures on /metrics, across the process boundary) is tested in
tests/server/test_metrics_tenants.py; labels that name nobody in tests/hostile/test_tenant_labels.py."""

from __future__ import annotations

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.core.request import Request
from inflight.runtime.core.tenant_stats import MAX_TENANT_LABEL_CHARS, TenantMeter, parse_metrics_tenants
from inflight.runtime.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_metrics_tenants_are_parsed_and_checked() -> None:
    assert parse_metrics_tenants(None) == parse_metrics_tenants(" ") == ()
    assert parse_metrics_tenants("alice, key:0123abcd,addr:10.0.0.7") == ("alice", "key:0123abcd", "addr:10.0.0.7")
    for bad in ("alice,,bob", "team/alice", "other", "t-123", 'x"}', "b" * (MAX_TENANT_LABEL_CHARS + 1),
                "alice,alice"):  # fmt: skip
        with pytest.raises(ValueError, match="metrics_tenants"):
            parse_metrics_tenants(bad)
    with pytest.raises(ValueError, match="metrics_tenants"):
        EngineConfig(metrics_tenants="a/b")


def test_tenants_beyond_the_cap_share_other() -> None:
    meter = TenantMeter(max_tenants=2)
    a, b = meter.label("a"), meter.label("b/some-user")  # a group's users share its series
    for tenant, generated in [("a", 1), ("b", 2), ("c", 4), ("d", 8), ("a/x", 16), ("other", 32)]:
        meter.count(tenant, 10, generated)
    running = [Request("r1", [1], PARAMS, tenant="a"), Request("r2", [1], PARAMS, tenant="z")]
    waiting = [Request("w1", [1], PARAMS, tenant="b"), Request("w2", [1], PARAMS, tenant="b/u"),
               Request("w3", [1], PARAMS, tenant="y")]  # fmt: skip
    snap = meter.snapshot(running, waiting)
    assert snap.labels == (a, b, "other") and a.startswith("t-") and a != b
    assert snap.generation_tokens == (17, 2, 44)  # c, d and a group named "other" are counted as other
    assert snap.prompt_tokens == (20, 10, 30)
    assert snap.num_running == (1, 0, 1) and snap.num_waiting == (0, 2, 1)
    for i in range(1000):  # many more distinct groups while a and b are busy: still three labels
        meter.count(f"user-{i}", 0, 1)
    assert meter.snapshot(running, waiting).labels == (a, b, "other")


def test_a_fair_engine_counts_tokens_per_tenant(llama_dir) -> None:
    config = EngineConfig(device="cpu", num_kv_blocks=64, max_num_sequences=4, scheduler_policy="fair",
                          metrics_tenants="a,b")  # fmt: skip
    engine = LLMEngine.from_model_dir(llama_dir, config)
    for i, tenant in enumerate(["a", "a", "b"]):
        engine.add_request(str(i), [5, 6, 7 + i], PARAMS, tenant=tenant)
    waited = engine.stats().tenants
    assert waited is not None and waited.num_waiting[waited.labels.index("a")] == 2
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    tenants = stats.tenants
    assert tenants is not None
    by_label = dict(zip(tenants.labels, tenants.generation_tokens, strict=True))
    assert by_label == {"a": 8, "b": 4, "other": 0}
    assert sum(tenants.generation_tokens) == stats.num_generation_tokens
    assert sum(tenants.prompt_tokens) == stats.num_prompt_tokens == 9
    assert sum(tenants.num_running) == sum(tenants.num_waiting) == 0
    assert LLMEngine.from_model_dir(llama_dir, config.replace(scheduler_policy="fcfs")).stats().tenants is None
