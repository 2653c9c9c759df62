"""Admin values are bounded like every other config value, and /metrics never fails on a value
(issue 46, finding 7).

The admin key used to set ``max_num_sequences`` to a 400-digit integer: the engine took it, and
every /metrics scrape answered 500 (``OverflowError``) until someone reset it, blinding the
autoscaler. Now ``/admin/config`` refuses anything outside ``EngineConfig``'s own ranges with a
400 in the OpenAI error format naming the field and the range, the live config unchanged; and a
scrape leaves out (and logs once) a value that no float can hold instead of failing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from inflight.runtime.config import MAX_CONFIG_INT, EngineConfig
from inflight.runtime.outputs import EngineStats, TenantStats
from inflight.runtime.server.metrics import ServerMetrics
from inflight.runtime.server.state import STATE
from tests.hostile.suite import MODEL
from tests.server.server_helpers import LiveServer, http, parse_metrics

ADMIN_KEY = "bounds-admin-key"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
HUGE = int("9" * 400)  # the value: valid JSON, past any float


@pytest.fixture(scope="module")
def admin_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The two-process server with an admin key (no inference key: /metrics is open)."""
    from inflight.runtime.demo.model import make_demo_model
    from inflight.runtime.server import ServerSettings

    model_dir = make_demo_model(tmp_path_factory.mktemp("admin-model") / "demo", size="tiny")
    config = EngineConfig(max_num_sequences=4, num_kv_blocks=64, max_model_len=256, max_queue_len=16)
    live = LiveServer(model_dir, config, ServerSettings(model_name=MODEL, admin_api_key=ADMIN_KEY),
                      engine_process=True).start()
    yield live
    live.stop()


def _live_config(server: LiveServer) -> dict[str, Any]:
    reply = http("GET", f"{server.url}/admin/config", headers=AUTH)
    assert reply.status == 200, reply.text
    return reply.json()


REFUSED: list[tuple[str, object, str]] = [
    ("max_num_sequences", HUGE, f"<= {MAX_CONFIG_INT}"),
    ("max_num_sequences", MAX_CONFIG_INT + 1, f"<= {MAX_CONFIG_INT}"),
    ("max_num_tokens", 10**30, f"<= {MAX_CONFIG_INT}"),
    ("max_queue_len", 2**63, f"<= {MAX_CONFIG_INT}"),
    ("max_num_sequences", 0, ">= 1"),
    ("max_num_tokens", -5, ">= 1"),
    ("max_queue_len", -1, ">= 0"),
    ("max_num_sequences", 2.5, "must be an integer"),
    ("max_num_sequences", 4.0, "must be an integer"),
    ("max_queue_len", True, "must be an integer"),
    ("max_num_tokens", "512", "must be an integer"),
    ("max_num_sequences", None, "must be an integer"),
    ("max_queue_len", [8], "must be an integer"),
]


@pytest.mark.parametrize(("field", "value", "says"), REFUSED, ids=[f"{f}={str(v)[:12]}" for f, v, _ in REFUSED])
def test_an_out_of_range_admin_value_is_a_400_naming_the_field_and_range(
        admin_server: LiveServer, field: str, value: object, says: str) -> None:
    before = _live_config(admin_server)
    reply = http("POST", f"{admin_server.url}/admin/config", {field: value}, AUTH)
    assert reply.status == 400, reply.text[:300]
    error = reply.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error", error
    assert field in error["message"] and says in error["message"], error["message"]
    assert len(error["message"]) < 300 and "9" * 40 not in error["message"]  # no 400 digits echoed
    assert _live_config(admin_server) == before


def test_a_refused_value_leaves_the_other_changes_of_its_body_unapplied(admin_server: LiveServer) -> None:
    before = _live_config(admin_server)
    reply = http("POST", f"{admin_server.url}/admin/config", {"max_queue_len": 3, "max_num_sequences": HUGE}, AUTH)
    assert reply.status == 400 and reply.json()["error"]["param"] == "max_num_sequences"
    assert _live_config(admin_server) == before


def test_the_top_of_the_range_is_accepted_and_scraped(admin_server: LiveServer) -> None:
    url = admin_server.url
    before = _live_config(admin_server)
    try:
        reply = http("POST", f"{url}/admin/config", {"max_num_sequences": MAX_CONFIG_INT}, AUTH)
        assert reply.status == 200 and reply.json()["max_num_sequences"] == MAX_CONFIG_INT, reply.text
        scrape = http("GET", f"{url}/metrics")
        assert scrape.status == 200
        assert parse_metrics(scrape.text)["inflight:max_num_sequences"] == MAX_CONFIG_INT
    finally:
        http("POST", f"{url}/admin/config", {"max_num_sequences": before["max_num_sequences"]}, AUTH)
    assert _live_config(admin_server) == before


def _absurd(stats: EngineStats) -> EngineStats:
    """A snapshot no float can fully hold (the engine would never send it: injected)."""
    return dataclasses.replace(stats, max_num_sequences=HUGE, num_preemptions=HUGE, num_used_kv_blocks=HUGE,
                               spec_accepted_per_position=(1, HUGE, 3))


def test_metrics_answer_200_whatever_value_the_engine_reports(admin_server: LiveServer,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    client = admin_server.app[STATE].engine
    real = client.stats()
    assert real is not None
    monkeypatch.setattr(client, "stats", lambda: _absurd(real))
    for _ in range(2):
        scrape = http("GET", f"{admin_server.url}/metrics")
        assert scrape.status == 200, scrape.text[:300]
        values = parse_metrics(scrape.text)
        assert values["inflight:num_requests_running"] == real.num_running  # the rest is reported
        assert values["inflight:generation_tokens_total"] == real.num_generation_tokens
        for left_out in ("inflight:max_num_sequences", "inflight:num_preemptions_total", "inflight:kv_cache_usage_perc"):
            assert left_out not in values
    assert _live_config(admin_server)["max_num_sequences"] == 4


def _stats(**changes: Any) -> EngineStats:
    base = EngineStats(num_running=1, num_waiting=2, num_kv_blocks=8, num_used_kv_blocks=4, num_preemptions=0,
                       prefix_cache_queries=0, prefix_cache_hits=0, num_prompt_tokens=5, num_generation_tokens=7,
                       num_tokens_last_step=1, num_steps=3, max_num_sequences=4)
    return dataclasses.replace(base, **changes)


def test_a_scrape_leaves_out_what_no_float_can_hold_and_logs_it_once(caplog: pytest.LogCaptureFixture) -> None:
    tenants = TenantStats(labels=("alice", "bob"), num_running=(1, HUGE), num_waiting=(0, 0),
                          prompt_tokens=(3, 4), generation_tokens=(HUGE, 6))
    stats = _stats(max_num_sequences=HUGE, num_waiting="many", spec_accepted_per_position=(2, HUGE), tenants=tenants)
    metrics = ServerMetrics("m", lambda: stats)
    with caplog.at_level(logging.WARNING, logger="inflight.server.metrics"):
        first, second = parse_metrics(metrics.render().decode()), parse_metrics(metrics.render().decode())
    def ours(scrape: dict[str, float]) -> dict[str, float]:  # process_* and python_* move between scrapes
        return {k: v for k, v in scrape.items() if k.startswith("inflight:")}

    assert ours(first) == ours(second)
    assert first["inflight:num_requests_running"] == 1 and first["inflight:generation_tokens_total"] == 7
    assert "inflight:max_num_sequences" not in first and "inflight:num_requests_waiting" not in first
    assert first['inflight:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"}'] == 2
    assert not any('position="1"' in key for key in first)
    assert first['inflight:tenant_num_requests_running{model_name="m",tenant="alice"}'] == 1
    assert not any('tenant_num_requests_running{model_name="m",tenant="bob"' in key for key in first)
    left_out = sorted(r.getMessage().split(": ")[0].removeprefix("/metrics leaves out ") for r in caplog.records)
    assert left_out == ["inflight:max_num_sequences", "inflight:num_requests_waiting",
                        "inflight:spec_decode_num_accepted_tokens_per_pos", "inflight:tenant_generation_tokens_total",
                        "inflight:tenant_num_requests_running"], left_out  # each once, over two scrapes


def test_a_scrape_answers_when_the_snapshot_itself_fails() -> None:
    def broken() -> EngineStats:
        raise RuntimeError("snapshot failed")

    metrics = ServerMetrics("m", broken)
    metrics.observe_rejected("queue_full")
    text = metrics.render().decode()
    assert 'inflight:request_rejected_total{model_name="m",reason="queue_full"} 1.0' in text
    assert "inflight:num_requests_running" not in text
