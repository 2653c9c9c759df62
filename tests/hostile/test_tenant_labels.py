"""Issue 46, finding 9: ``/metrics`` named tenants. Without a key it listed raw ``user`` values
(e-mail addresses) with their usage as ``tenant`` labels, and its 64 label slots went to the
first 64 tenants for the life of the process.

Now a tenant is a group (key, address or gateway tenant id; never ``user``), its label is a
keyed digest unless ``--metrics-tenants`` names it (then every unnamed tenant is "other"), a
digest series held by an idle tenant is given up to a newcomer, and the number of series stays
bounded. Checked on the meter and through a live server's open ``/metrics``. Counts, never times."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.request import Request
from inflight.runtime.core.tenant_stats import MAX_TRACKED_TENANTS, OTHER_TENANT, TenantMeter
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.server import ServerSettings
from tests.server.server_helpers import MODEL_NAME, LiveServer, http, is_idle, wait_until

TENANT_HEADER = "x-gateway-inference-fairness-id"  # llm-d's
DIGEST_LABEL = re.compile(r"t-[0-9a-f]{12}")
PERSONAL = ["alice@example.com", "bob.smith@example.org", 'x"} 1\ninflight:fake_total{tenant="y', "тенант"]
GATEWAY_IDS = ["alice@example.com", "bob.smith@example.org"]  # what a gateway may name tenants by
PARAMS = SamplingParams(max_tokens=2)


def test_the_meter_labels_name_nobody() -> None:
    meter = TenantMeter()
    for group in PERSONAL:
        label = meter.label(f"{group}/{group}")
        assert DIGEST_LABEL.fullmatch(label) and group not in label
    assert meter.label("a") == meter.label("a/any-user") != TenantMeter().label("a")  # keyed: per meter
    named = TenantMeter(("team-a",))
    assert named.label("team-a/alice@example.com") == "team-a"
    assert {named.label(f"{g}/x") for g in PERSONAL} == {OTHER_TENANT}


def test_an_idle_tenant_gives_its_series_up_and_nothing_is_lost() -> None:
    meter = TenantMeter(max_tenants=2)
    meter.count("a", 3, 1)
    meter.count("b", 3, 2)
    busy = [Request("b1", [1], PARAMS, tenant="b")]
    meter.snapshot(busy, [])  # a has nothing running or waiting: it is idle now
    meter.count("c", 3, 4)  # a newcomer while both series are held: it takes a's
    snap = meter.snapshot(busy, [Request("c1", [1], PARAMS, tenant="c")])
    by_label = dict(zip(snap.labels, snap.generation_tokens, strict=True))
    assert set(by_label) == {meter.label("b"), meter.label("c"), OTHER_TENANT}
    assert by_label[OTHER_TENANT] == 1 and sum(by_label.values()) == 7 and sum(snap.prompt_tokens) == 9
    meter.count("d", 0, 8)  # b and c are busy: d has no series to take
    assert meter.snapshot(busy, [Request("c1", [1], PARAMS, tenant="c")]).labels == snap.labels


def _server(model_dir: Path, metrics_tenants: str | None) -> LiveServer:
    config = EngineConfig(scheduler_policy="fair", max_num_sequences=8, num_kv_blocks=96, max_model_len=256,
                          max_queue_len=256, metrics_tenants=metrics_tenants)  # fmt: skip
    return LiveServer(model_dir, config, ServerSettings(model_name=MODEL_NAME, tenant_header=TENANT_HEADER)).start()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from inflight.runtime.demo.model import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("labels-model") / "demo", size="tiny")


@pytest.fixture(scope="module")
def digest_server(model_dir: Path) -> Iterator[LiveServer]:
    live = _server(model_dir, None)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def named_server(model_dir: Path) -> Iterator[LiveServer]:
    live = _server(model_dir, "team-a")
    yield live
    live.stop()


def _complete(server: LiveServer, tenant: str | None, user: str) -> None:
    headers = {TENANT_HEADER: tenant} if tenant is not None else {}
    body = {"model": MODEL_NAME, "prompt": "def add(a, b):", "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "user": user}  # fmt: skip
    reply = http("POST", f"{server.url}/v1/completions", body, headers=headers)
    assert reply.status == 200, reply.text


def _scrape(server: LiveServer) -> tuple[str, dict[str, float]]:
    """The open /metrics text and its generated tokens per tenant label."""
    assert wait_until(lambda: is_idle(server.url), 30)
    text = http("GET", f"{server.url}/metrics").text
    generated = {s.labels["tenant"]: s.value for f in text_string_to_metric_families(text)
                 if f.name == "inflight:tenant_generation_tokens" for s in f.samples}  # fmt: skip
    return text, generated


def test_open_metrics_carry_no_user_and_no_tenant_name(digest_server: LiveServer) -> None:
    for user in PERSONAL:
        _complete(digest_server, None, user)  # no gateway header: the caller's address is the tenant
        for tenant in GATEWAY_IDS:  # e-mails as the gateway's tenant ids
            _complete(digest_server, tenant, user)
    text, generated = _scrape(digest_server)
    assert not any(part in text for part in ("example.com", "example.org", "тенант", "127.0.0.1", "fake"))
    assert all(DIGEST_LABEL.fullmatch(label) for label in generated if label != OTHER_TENANT)
    assert len(generated) == 1 + len(GATEWAY_IDS) + 1  # the address, the two gateway tenants, "other"
    assert generated[OTHER_TENANT] == 0 and sum(generated.values()) == 2 * len(PERSONAL) * (1 + len(GATEWAY_IDS))


def test_the_series_stay_bounded(digest_server: LiveServer) -> None:
    for i in range(MAX_TRACKED_TENANTS + 16):
        _complete(digest_server, f"gateway-tenant-{i}", "u")
    _, generated = _scrape(digest_server)
    assert len(generated) == MAX_TRACKED_TENANTS + 1  # idle series were recycled, never more


def test_named_tenants_get_readable_series_and_the_rest_is_other(named_server: LiveServer) -> None:
    _complete(named_server, "team-a", "alice@example.com")
    for tenant in GATEWAY_IDS:
        _complete(named_server, tenant, "carol@example.com")
    _complete(named_server, None, "dave@example.com")
    text, generated = _scrape(named_server)
    assert generated == {"team-a": 2, OTHER_TENANT: 2 * (len(GATEWAY_IDS) + 1)}
    assert "example.com" not in text and "example.org" not in text
