"""Issue 46, finding 2: tenants anyone could mint. Under ``--scheduler-policy fair`` a tenant was
the request's own ``user``, and the global queue bound was never checked: 800 requests with a
fresh ``user`` each were all accepted, and the victim's first token never came.

Now a tenant's group is what the server checked (the API key, the peer address, or a trusted
gateway's header) and ``user`` only divides its own group's share; the global bound holds under
fair as under fcfs; a flooding group leaves the queue's last places to groups with nothing
waiting; strangers beyond the tenant bound share one overflow group that established tenants
are never pushed into. Shown with the engine directly (the Sybil flood step by step) and through
a live server whose engine is held still while the flood arrives (a gate on its step, so what
is admitted never depends on how fast anything runs). Steps and statuses are counted, never
times."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.core.fairness import OVERFLOW, FairShare, tenant_name
from inflight.runtime.core.request import Request
from inflight.runtime.outputs import QueueFullError
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.server import ServerSettings
from inflight.runtime.server.principal import key_digest
from inflight.runtime.server.state import STATE
from tests.server.server_helpers import MODEL_NAME, LiveServer

NUM_SYBILS = 800
MAX_NUM_SEQUENCES = 2
MAX_QUEUE_LEN = 16
ATTACKER_KEY = "attacker-key"
VICTIM_KEY = "victim-key"  # the server's second inference key (--priority-api-key)
LONG = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
FLOOD_TIMEOUT_S = 120.0  # only so that a failing test cannot hang the suite


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from inflight.runtime.demo.model import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("sybil-model") / "demo", size="tiny")


def _fair_config(**knobs: Any) -> EngineConfig:
    return EngineConfig(**{"device": "cpu", "num_kv_blocks": 96, "max_model_len": 256, "scheduler_policy": "fair",
                           "max_num_sequences": MAX_NUM_SEQUENCES, "max_queue_len": MAX_QUEUE_LEN, **knobs})  # fmt: skip


def test_800_sybil_users_hold_the_bound_and_the_victim_boards(model_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(model_dir, _fair_config())
    attacker = "key:" + key_digest(ATTACKER_KEY)
    victim = tenant_name("key:" + key_digest(VICTIM_KEY), "alice")
    accepted = refused = 0

    def flood(start: int, count: int) -> None:
        nonlocal accepted, refused
        for i in range(start, start + count):
            try:
                engine.add_request(f"sybil-{i}", [5, 6, 7 + i % 50], LONG, tenant=tenant_name(attacker, f"u{i}"))
                accepted += 1
            except QueueFullError:
                refused += 1
            stats = engine.stats()
            assert stats.num_running + stats.num_waiting <= MAX_NUM_SEQUENCES + MAX_QUEUE_LEN  # the global bound

    flood(0, NUM_SYBILS)
    assert accepted <= MAX_NUM_SEQUENCES + MAX_QUEUE_LEN and refused >= NUM_SYBILS - accepted
    engine.add_request("victim", [9, 10, 11], SHORT, tenant=victim)  # admitted: no QueueFullError
    steps, first_token_at = 0, None
    while first_token_at is None:  # the flood goes on, 40 fresh users a step
        flood(NUM_SYBILS + 40 * steps, 40)
        for out in engine.step():
            if out.req_id == "victim" and out.new_token_ids:
                first_token_at = steps
        steps += 1
        assert steps <= 8, "the victim got no token while the Sybils were served"
    assert first_token_at <= 1
    assert refused > 0.9 * (NUM_SYBILS + 40 * steps)


def test_strangers_beyond_the_bound_share_one_overflow_tenant() -> None:
    fair = FairShare(max_tenants=4, max_members=2)
    fair.add(fair.resolve("key:alice"))  # established before the flood
    names = []
    for i in range(NUM_SYBILS):  # 800 peer addresses, each a group of its own if it could
        names.append(fair.resolve(f"addr:10.0.{i // 250}.{i % 250}"))
        fair.add(names[-1])
    assert len(fair.active) == 4 + 1 and fair.active[OVERFLOW] == NUM_SYBILS - 3
    assert fair.resolve("key:alice") == "key:alice"  # never pushed out by the strangers
    assert fair.resolve("key:bob") == tenant_name(OVERFLOW, OVERFLOW)  # its members are bounded too
    running = [Request(f"s{i}", [1], SHORT, arrival_seq=i, tenant=name) for i, name in enumerate(names[-4:])]
    for i, r in enumerate(running):
        r.admitted_seq = i
    alice = Request("alice", [1], SHORT, arrival_seq=900, tenant="key:alice")
    victim = FairShare.slot_victim(alice, running, 4, [alice])
    assert victim is not None and victim.tenant.startswith(OVERFLOW)  # every slot held by strangers: one is hers
    for i in range(5):  # users within one group: two get a share each, the rest share one
        fair.add(fair.resolve(tenant_name("key:alice", f"user-{i}")))
    assert fair.resolve(tenant_name("key:alice", "user-9")) == tenant_name("key:alice", OVERFLOW)


def test_the_kept_places_go_to_tenants_with_nothing_waiting() -> None:
    fair = FairShare()
    flood = [Request(f"s{i}", [1], SHORT, arrival_seq=i, tenant=f"key:a/u{i}") for i in range(14)]
    for r in flood:
        fair.add(r.tenant)
    # 14 of 16 places taken, the last 2 kept: the flooding group gets none of them
    assert fair.queue_refusal("key:a/fresh-user", flood, 1, 0, MAX_QUEUE_LEN) is not None
    assert fair.queue_refusal("key:b/alice", flood, 1, 0, MAX_QUEUE_LEN) is None  # one each to others
    assert fair.queue_refusal("key:b/alice", flood, 2, 0, MAX_QUEUE_LEN) is not None  # but only one
    assert fair.queue_refusal("key:b/alice", flood, 2, 1, MAX_QUEUE_LEN) is None  # one boards at once


# -- through a live server, its engine held still while requests arrive ----------------------


@pytest.fixture(scope="module")
def keyed_fair_server(model_dir: Path) -> Iterator[LiveServer]:
    settings = ServerSettings(model_name=MODEL_NAME, api_key=ATTACKER_KEY, priority_api_key=VICTIM_KEY,
                              max_pending_tokenizations=1024)  # fmt: skip
    live = LiveServer(model_dir, _fair_config(), settings).start()
    yield live
    live.stop()


class Gate:
    """Holds the server's engine between steps (each step does nothing until opened), and
    records the tenants each real step admits."""

    def __init__(self, live: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.engine = live.app[STATE].engine.engine
        self.open = threading.Event()
        self.admitted: list[list[str]] = []
        step, schedule = self.engine.step, self.engine.scheduler.schedule

        def gated_step() -> Any:
            if not self.open.is_set():
                self.open.wait(0.01)
                return []
            return step()

        def recorded_schedule() -> Any:
            out = schedule()
            if out.admitted:
                self.admitted.append([r.tenant for r in out.admitted])
            return out

        monkeypatch.setattr(self.engine, "step", gated_step)
        monkeypatch.setattr(self.engine.scheduler, "schedule", recorded_schedule)

    def num_waiting(self) -> int:
        return self.engine.stats().num_waiting

    def waiting_tenants(self) -> list[str]:
        return [r.tenant for r in list(self.engine.scheduler.waiting)]


async def _post(session: aiohttp.ClientSession, url: str, key: str, user: str) -> tuple[int, dict]:
    body = {"model": MODEL_NAME, "prompt": "def add(a, b):", "max_tokens": 2, "temperature": 0,
            "ignore_eos": True, "user": user}  # fmt: skip
    async with session.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
        return resp.status, await resp.json()


async def _until(predicate: Any) -> None:
    while not predicate():
        await asyncio.sleep(0.02)


async def _sybil_run(url: str, gate: Gate) -> tuple[list[int], int, dict]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
        flood = [asyncio.create_task(_post(session, url, ATTACKER_KEY, f"sybil-{i}")) for i in range(NUM_SYBILS)]
        # settled: every Sybil request answered (429) or waiting in the engine
        bound = MAX_NUM_SEQUENCES + MAX_QUEUE_LEN
        await _until(lambda: sum(t.done() for t in flood) + gate.num_waiting() >= NUM_SYBILS
                     or gate.num_waiting() > bound)  # fmt: skip
        assert gate.num_waiting() <= bound  # the global bound held
        victim = asyncio.create_task(_post(session, url, VICTIM_KEY, "alice"))
        await _until(lambda: victim.done() or gate.num_waiting() > NUM_SYBILS - sum(t.done() for t in flood))
        assert not victim.done(), victim.result()  # admitted, not refused
        num_waiting = gate.num_waiting()
        gate.open.set()
        status, body = await victim
        statuses = [status for status, _ in await asyncio.gather(*flood)]
    return statuses, num_waiting, {"status": status, **body}


def test_a_sybil_flood_through_the_server_holds_the_bound(
    keyed_fair_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(keyed_fair_server, monkeypatch)
    statuses, num_waiting, victim = asyncio.run(asyncio.wait_for(_sybil_run(keyed_fair_server.url, gate),
                                                                 FLOOD_TIMEOUT_S))  # fmt: skip
    assert set(statuses) <= {200, 429}
    assert statuses.count(200) + 1 == num_waiting <= MAX_NUM_SEQUENCES + MAX_QUEUE_LEN  # the global bound held
    assert statuses.count(429) >= NUM_SYBILS - (MAX_NUM_SEQUENCES + MAX_QUEUE_LEN)
    assert victim["status"] == 200 and victim["usage"]["completion_tokens"] == 2
    victim_tenant = tenant_name("key:" + key_digest(VICTIM_KEY), "alice")
    assert victim_tenant in gate.admitted[0]  # she boards at the first step, beside the flood


async def _spoof_run(url: str, gate: Gate) -> tuple[list[int], set[str]]:
    async with aiohttp.ClientSession() as session:
        spoofed = [asyncio.create_task(_post(session, url, ATTACKER_KEY, "alice")) for _ in range(6)]
        await _until(lambda: gate.num_waiting() == 6)
        own = [asyncio.create_task(_post(session, url, VICTIM_KEY, "alice")) for _ in range(2)]
        await _until(lambda: gate.num_waiting() == 8)
        tenants = set(gate.waiting_tenants())
        gate.open.set()
        return [status for status, _ in await asyncio.gather(*spoofed, *own)], tenants


def test_spoofing_a_user_does_not_spend_another_keys_share(
    keyed_fair_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = Gate(keyed_fair_server, monkeypatch)
    statuses, tenants = asyncio.run(asyncio.wait_for(_spoof_run(keyed_fair_server.url, gate), FLOOD_TIMEOUT_S))
    assert statuses == [200] * 8
    spoofer = tenant_name("key:" + key_digest(ATTACKER_KEY), "alice")
    alice = tenant_name("key:" + key_digest(VICTIM_KEY), "alice")
    assert tenants == {spoofer, alice}
    # the spoofer's "alice" is its own; the real alice's first request boards at the first step,
    # ahead of the spoofer's earlier five (one slot each)
    assert sorted(gate.admitted[0]) == sorted([spoofer, alice])
