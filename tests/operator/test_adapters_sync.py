"""The pure part of live LoRA loading (issue 49): what to load/unload on a pod, when its readiness
gate is current, status.adapters and the AdaptersReady condition, and reading the runtime's answers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from inflight.operator import adapter_client, adapters
from inflight.operator.adapters import Plan, PodResult, plan
from inflight.operator.render_adapters import READINESS_GATE
from tests.operator.helpers import make_spec


@pytest.mark.parametrize(("wanted", "loaded", "expected"), [
    ({}, {}, Plan((), ())),
    ({"a": "/p/a"}, {}, Plan((), (("a", "/p/a"),))),
    ({"a": "/p/a"}, {"a": "/p/a"}, Plan((), ())),
    ({}, {"a": "/p/a"}, Plan(("a",), ())),  # removed from the spec (or loaded by hand): unloaded
    ({"a": "/p/a2"}, {"a": "/p/a"}, Plan(("a",), (("a", "/p/a2"),))),  # moved: unload, then load
    ({"b": "/b", "a": "/a"}, {"c": "/c"}, Plan(("c",), (("a", "/a"), ("b", "/b")))),
])
def test_plan(wanted: dict[str, str], loaded: dict[str, str], expected: Plan) -> None:
    assert plan(wanted, loaded) == expected


def _pod(restarts: int, gate: str | None, message: str = "") -> dict[str, Any]:
    conditions = [{"type": "ContainersReady", "status": "True"}]
    if gate is not None:
        conditions.append({"type": READINESS_GATE, "status": gate, "message": message})
    return {"metadata": {"name": "p"}, "spec": {"readinessGates": [{"conditionType": READINESS_GATE}]}, "status": {
        "phase": "Running", "conditions": conditions,
        "containerStatuses": [{"name": "runtime", "restartCount": restarts}]}}


def test_the_gate_is_current_only_for_the_container_it_was_set_for() -> None:
    set_for_0 = adapters.gate_message(0, 2, 2)
    assert adapters.gate_is_current(_pod(0, "True", set_for_0))
    assert not adapters.gate_is_current(_pod(1, "True", set_for_0))  # restarted since: load again
    assert not adapters.gate_is_current(_pod(0, "False", set_for_0))
    assert not adapters.gate_is_current(_pod(0, None))
    assert adapters.runtime_ready(_pod(0, None)) and adapters.has_gate(_pod(0, None))
    assert not adapters.has_gate({"spec": {}})  # rendered before LoRA was on: left alone
    gone = _pod(0, None)
    gone["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert not adapters.runtime_ready(gone)


def _spec() -> Any:
    return make_spec({"adapters": [{"name": n, "source": {"pvc": {"claimName": "c", "path": n}}}
                                   for n in ("sql", "chat")]})


@pytest.mark.parametrize(("results", "status", "reason"), [
    ([PodResult("p0", frozenset({"sql", "chat"}), {}, None)], True, "AllLoaded"),
    ([PodResult("p0", frozenset({"sql", "chat"}), {}, None), PodResult("p1", frozenset({"sql"}), {}, None)],
     False, "Loading"),
    ([PodResult("p0", frozenset({"sql"}), {"chat": "bad shapes"}, None)], False, "LoadFailed"),
    ([PodResult("p0", frozenset(), {}, "p0: GET /v1/models: HTTP 401")], False, "PodUnreachable"),
    ([], False, "NoPods"),
])
def test_summary(results: list[PodResult], status: bool, reason: str) -> None:
    rows, cond = adapters.summarize(_spec(), results, {"chat": "bad shapes"} if reason == "LoadFailed" else {})
    assert (cond.type, cond.status, cond.reason) == ("AdaptersReady", status, reason)
    assert [r["name"] for r in rows] == ["sql", "chat"]
    assert all(r["totalPods"] == len(results) for r in rows)
    if reason == "LoadFailed":
        assert "adapter chat was refused: bad shapes" in cond.message
        assert rows[1] == {"name": "chat", "totalPods": 1, "loadedPods": 0, "lastError": "bad shapes"}
        assert rows[0]["loadedPods"] == 1 and "lastError" not in rows[0]


@pytest.mark.parametrize(("body", "text"), [
    ('{"error": {"message": "rank 64 > max_lora_rank 16", "type": "invalid_request_error"}}',
     "rank 64 > max_lora_rank 16"),
    ("Success: LoRA adapter 'a' added successfully.", "Success: LoRA adapter 'a' added successfully."),
    ('{"message": "plain"}', "plain"),
    ("x" * 1000, "x" * 300),
])
def test_error_text(body: str, text: str) -> None:
    assert adapter_client.error_text(body) == text


def test_no_sync_without_lora() -> None:
    spec = make_spec({})
    assert asyncio.run(adapters.sync(None, spec, adapters.AdapterState(), [], {})) is None  # type: ignore[arg-type]


def test_a_refused_adapter_is_retried_on_a_pod_only_after_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []
    held: dict[str, str] = {"old": "/adapters/pvc/c/old"}

    async def list_adapters(*_: Any) -> dict[str, str]:
        return dict(held)

    async def load(_s: Any, _t: Any, name: str, path: str, *_: Any) -> str | None:
        calls.append(("load", name))
        if name == "bad":
            return "shapes do not fit"
        held[name] = path
        return None

    async def unload(_s: Any, _t: Any, name: str, *_: Any) -> None:
        calls.append(("unload", name))
        held.pop(name)

    monkeypatch.setattr(adapter_client, "list_adapters", list_adapters)
    monkeypatch.setattr(adapter_client, "load", load)
    monkeypatch.setattr(adapter_client, "unload", unload)
    target = adapters.metrics_scrape.PodTarget("p0", "http://x")
    wanted = {"good": "/adapters/pvc/c/good", "bad": "/adapters/pvc/c/bad"}
    memory = adapters.AdapterState()

    def once(now: float) -> PodResult:
        return asyncio.run(adapters._sync_pod(None, target, wanted, "k", 1.0, memory, now))  # type: ignore[arg-type]

    first = once(100.0)
    assert calls == [("unload", "old"), ("load", "bad"), ("load", "good")]
    assert first.loaded == {"good"} and first.refused == {"bad": "shapes do not fit"} and first.error is None
    calls.clear()
    assert once(100.0 + adapters.RETRY_REFUSED_S - 1).refused == {"bad": "shapes do not fit"}
    assert calls == []  # held back: no load storm on every tick
    once(100.0 + adapters.RETRY_REFUSED_S)
    assert calls == [("load", "bad")]
