"""Per-tenant metrics of the fair policy, through a real server whose engine core runs in its
own process (so the figures cross the process boundary in the step stats): two tenants (named
by a gateway's header, and by ``--metrics-tenants``) counted exactly, hostile ``user`` strings
and tenant ids never reaching a label, and however many tenants send requests, only the named
ones and "other". Digest labels and their bound: tests/hostile/test_tenant_labels.py. Counts,
never times."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.tenant_stats import MAX_TENANT_LABEL_CHARS, MAX_TRACKED_TENANTS, OTHER_TENANT
from inflight.runtime.server import ServerSettings
from tests.server.server_helpers import MODEL_NAME, LiveServer, http, is_idle, wait_until

TENANT_METRICS = ("inflight:tenant_num_requests_running", "inflight:tenant_num_requests_waiting",
                  "inflight:tenant_prompt_tokens", "inflight:tenant_generation_tokens")  # fmt: skip
SAFE_LABEL = re.compile(rf"[A-Za-z0-9_.:@/+=-]{{1,{MAX_TENANT_LABEL_CHARS}}}")
TENANT_HEADER = "x-tenant-id"


@pytest.fixture(scope="module")
def fair_server(demo_model_dir: Path) -> Iterator[LiveServer]:
    config = EngineConfig(scheduler_policy="fair", max_num_sequences=8, num_kv_blocks=96, max_model_len=256,
                          max_queue_len=256, metrics_tenants="alice,bob")  # fmt: skip
    settings = ServerSettings(model_name=MODEL_NAME, tenant_header=TENANT_HEADER)
    live = LiveServer(demo_model_dir, config, settings, engine_process=True).start()
    yield live
    live.stop()


def _complete(server: LiveServer, tenant: str | None, max_tokens: int, n: int = 1, user: str | None = None) -> dict:
    body = {"model": MODEL_NAME, "prompt": "def add(a, b):", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "n": n}  # fmt: skip
    if user is not None:
        body["user"] = user
    headers = {TENANT_HEADER: tenant} if tenant is not None else {}
    reply = http("POST", f"{server.url}/v1/completions", body, headers=headers)
    assert reply.status == 200, reply.text
    return reply.json()["usage"]


def _tenant_series(server: LiveServer) -> dict[str, dict[str, float]]:
    """{family name: {tenant label: value}}, parsed by prometheus_client's own parser (so a
    label that broke the text format would fail here)."""
    assert wait_until(lambda: is_idle(server.url), 30)
    text = http("GET", f"{server.url}/metrics").text
    series: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("inflight:tenant_"):
            for sample in family.samples:
                assert sample.labels["model_name"] == MODEL_NAME
                series.setdefault(family.name, {})[sample.labels["tenant"]] = sample.value
        else:
            for sample in family.samples:
                assert "tenant" not in sample.labels, sample
    assert set(series) == set(TENANT_METRICS)
    return series


def test_two_tenants_are_counted_apart(fair_server: LiveServer) -> None:
    alice = [_complete(fair_server, "alice", 5) for _ in range(2)]
    bob = _complete(fair_server, "bob", 3, n=2)
    series = _tenant_series(fair_server)
    generated = series["inflight:tenant_generation_tokens"]
    prompts = series["inflight:tenant_prompt_tokens"]
    assert generated["alice"] == 10 and generated["bob"] == 6 == bob["completion_tokens"]
    assert prompts["alice"] == sum(u["prompt_tokens"] for u in alice)
    assert prompts["bob"] == 2 * bob["prompt_tokens"]  # each of the n choices computes its prompt
    for gauge in ("inflight:tenant_num_requests_running", "inflight:tenant_num_requests_waiting"):
        assert series[gauge]["alice"] == series[gauge]["bob"] == 0
    assert generated.get(OTHER_TENANT) == 0


HOSTILE = [
    'x"} 1\ninflight:fake_total{tenant="y',  # tries to end the label and forge a series
    "line\nbreak\\back\rslash",
    "\x00\x1b[31mred",
    "тенант-日本",
    "A" * 10_000,
    " ",
]


def test_hostile_user_strings_never_become_labels(fair_server: LiveServer) -> None:
    for user in HOSTILE:
        _complete(fair_server, None, 1, user=user)
        _complete(fair_server, "alice", 1, user=user)  # users divide a tenant; they are never labels
    for tenant in ("A" * 200, "x%2F/y", "Bob"):  # unnamed gateway tenant ids
        _complete(fair_server, tenant, 1)
    series = _tenant_series(fair_server)
    labels = set(series["inflight:tenant_generation_tokens"])
    assert labels == {"alice", "bob", OTHER_TENANT} and all(SAFE_LABEL.fullmatch(label) for label in labels)
    text = http("GET", f"{fair_server.url}/metrics").text
    assert not any(line.startswith("inflight:fake") for line in text.splitlines())  # no forged series


def test_only_the_named_tenants_have_series(fair_server: LiveServer) -> None:
    before = _tenant_series(fair_server)["inflight:tenant_generation_tokens"][OTHER_TENANT]
    tenants = [f"tenant-{i}" for i in range(MAX_TRACKED_TENANTS + 8)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda tenant: _complete(fair_server, tenant, 2), tenants))
    series = _tenant_series(fair_server)
    generated = series["inflight:tenant_generation_tokens"]
    assert set(generated) == {"alice", "bob", OTHER_TENANT}
    assert generated[OTHER_TENANT] == before + 2 * len(tenants)
    engine_total = http("GET", f"{fair_server.url}/metrics").text
    total = next(s.value for f in text_string_to_metric_families(engine_total)
                 if f.name == "inflight:generation_tokens" for s in f.samples)  # fmt: skip
    assert sum(generated.values()) == total  # nothing lost, nothing counted twice
