"""Two operator replicas against one kmock API server: only the Lease holder acts, the other
waits (its liveness endpoint answering) and takes over when the holder stops or stops renewing.
"""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.request
from typing import Any

import pytest

from inflight.operator import leader
from inflight.operator.kube import LEASES, KubeClient
from tests.operator.helpers import EXAMPLES, load_example
from tests.operator.kmock_harness import (
    OPERATOR_NAMESPACE,
    Cluster,
    api_server,
    start_operator_thread,
    uncovered_requests,
    wait_for,
)

# Renewed every third of it: a CI box under load can stall a thread for a second or two.
LEASE = {"lease_name": "inflight-operator", "lease_seconds": 4.0}
NAME = "llama-minimal"
DEPLOY = f"/apis/apps/v1/namespaces/default/deployments/{NAME}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _holder(cluster: Cluster) -> str | None:
    lease = await cluster.get(f"/apis/coordination.k8s.io/v1/namespaces/{OPERATOR_NAMESPACE}/leases/inflight-operator")
    return ((lease or {}).get("spec") or {}).get("holderIdentity")


def test_only_the_lease_holder_acts_and_the_standby_takes_over_when_it_stops() -> None:
    async def scenario() -> None:
        async with api_server() as cluster:
            first = start_operator_thread(cluster, identity="replica-a", **LEASE)
            assert await first.wait_ready(10)
            assert await _holder(cluster) == "replica-a"
            port = _free_port()
            second = start_operator_thread(cluster, identity="replica-b", liveness_port=port, **LEASE)
            try:
                await cluster.create_cr(load_example(next(p for p in EXAMPLES if p.stem == "minimal")))
                await wait_for(lambda: cluster.child("deployments", NAME), what="deployment from the leader")
                await asyncio.sleep(4.5)  # longer than the lease: the leader keeps renewing it
                assert not second.ready.is_set(), "the standby started acting while the leader renewed"
                assert await _holder(cluster) == "replica-a"
                body = await asyncio.to_thread(_get_text, f"http://127.0.0.1:{port}/healthz")
                assert '"standby": true' in body  # the standby's liveness probe passes

                await first.shutdown()  # releases the lease on the way out
                assert await second.wait_ready(10)
                assert await _holder(cluster) == "replica-b"
                await cluster.request("DELETE", DEPLOY)
                await wait_for(lambda: cluster.child("deployments", NAME), what="the new leader repairs drift")
                assert not uncovered_requests(cluster.api), uncovered_requests(cluster.api)
            finally:
                await second.shutdown()
                await first.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def _get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_holder_that_stops_renewing_is_replaced_after_the_lease_and_then_loses() -> None:
    async def scenario() -> None:
        async with api_server() as cluster:
            import kopf

            kube = KubeClient(kopf.ConnectionInfo(server=cluster.api_url, insecure=True))
            try:
                config: dict[str, Any] = {"name": "lease", "namespace": "default", "duration_s": 10.0}
                clock_a, clock_b = _Clock(), _Clock()
                a = leader.LeaderElector(lambda: kube, leader.LeaseConfig(identity="a", **config), clock=clock_a)
                b = leader.LeaderElector(lambda: kube, leader.LeaseConfig(identity="b", **config), clock=clock_b)
                assert await a.try_acquire_or_renew()
                assert not await b.try_acquire_or_renew()  # b starts observing a's record
                clock_b.now += 9.0
                assert not await b.try_acquire_or_renew()  # not expired by b's own clock
                assert await a.try_acquire_or_renew()  # a renews: the record changes
                clock_b.now += 9.0
                assert not await b.try_acquire_or_renew()  # b saw the change: its wait starts over
                clock_b.now += 10.0  # a stopped renewing (hung, partitioned)
                assert await b.try_acquire_or_renew()
                lease = await kube.get(LEASES, "default", "lease")
                assert lease["spec"]["holderIdentity"] == "b" and lease["spec"]["leaseTransitions"] == 1
                assert not await a.try_acquire_or_renew()  # a comes back: it is not the leader
                assert not a.is_leader and b.is_leader

                lost: list[bool] = []
                a_config = leader.LeaseConfig(identity="a", renew_every_s=0.01, **config)
                stale = leader.LeaderElector(lambda: kube, a_config)
                stale.is_leader = True
                await asyncio.wait_for(stale.keep(lambda: lost.append(True)), 5)
                assert lost == [True]  # a renewal that fails calls on_lost once and stops
            finally:
                await kube.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_two_candidates_writing_the_same_read_never_both_win() -> None:
    async def scenario() -> None:
        async with api_server() as cluster:
            import kopf

            kube = KubeClient(kopf.ConnectionInfo(server=cluster.api_url, insecure=True))
            try:
                config: dict[str, Any] = {"name": "lease", "namespace": "default", "duration_s": 10.0}
                holder = leader.LeaderElector(lambda: kube, leader.LeaseConfig(identity="old", **config))
                assert await holder.try_acquire_or_renew()
                await holder.release()  # free: both candidates may try to take it at once
                candidates = [leader.LeaderElector(lambda: kube, leader.LeaseConfig(identity=i, **config))
                              for i in ("x", "y", "z")]
                won = await asyncio.gather(*(c.try_acquire_or_renew() for c in candidates))
                assert sum(won) == 1, won
            finally:
                await kube.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


@pytest.mark.parametrize("raw", ["x", "70000"])
def test_bad_liveness_port_env_is_refused(raw: str) -> None:
    from inflight.operator.context import OperatorConfig

    with pytest.raises(ValueError, match="INFLIGHT_OPERATOR_LIVENESS_PORT"):
        OperatorConfig.from_env({"INFLIGHT_OPERATOR_LIVENESS_PORT": raw})


def test_hanging_renewals_never_leave_two_leaders_acting() -> None:
    """The leader's Lease writes hang unanswered: it stops acting before the standby may take
    over, so no write of the old leader reaches the API server after the new leader's first."""
    from tests.operator.kmock_hang import hanging_api_server, start_replica, two_leader_window

    # A longer lease than LEASE: the old leader stops at 2/3 of it, and its shutdown (a thread
    # stopping kopf here, an exit in production) has the last third to finish on a loaded box.
    lease = {**LEASE, "lease_seconds": 6.0}

    async def scenario() -> None:
        async with hanging_api_server() as (cluster, api):
            first = start_replica(cluster, "replica-a", **lease)
            assert await first.wait_ready(10)
            second = start_replica(cluster, "replica-b", **lease)
            try:
                await cluster.create_cr(load_example(next(p for p in EXAMPLES if p.stem == "minimal")))
                await wait_for(lambda: cluster.child("deployments", NAME), what="deployment from the leader")
                api.hang_lease_writes.add("replica-a")
                await wait_for(lambda: _is_holder(cluster, "replica-b"), timeout=30, what="the standby takes over")
                assert await second.wait_ready(10)
                # A spec change both replicas would act on if both were running.
                await cluster.patch_cr(NAME, {"spec": {"replicas": 2}})
                await wait_for(lambda: _replicas_are(cluster, 2), what="the new leader applies the edit")
                await asyncio.to_thread(first.thread.join, 15)
                assert "replica-a" in api.hung  # the hang was exercised
                acts = list(api.acts)
                assert any(a.replica == "replica-a" for a in acts) and any(a.replica == "replica-b" for a in acts)
                window = two_leader_window(acts, "replica-a", "replica-b")
                assert window == 0.0, f"both replicas wrote for {window:.1f} s"
                assert not first.thread.is_alive(), "the old leader kept running after it lost the lease"
            finally:
                await second.shutdown()
                await first.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 90))


async def _is_holder(cluster: Cluster, identity: str) -> bool:
    return await _holder(cluster) == identity


async def _replicas_are(cluster: Cluster, n: int) -> bool:
    deployment = await cluster.child("deployments", NAME)
    return deployment is not None and deployment["spec"].get("replicas") == n


class _HangingKube:
    """A KubeClient whose every call hangs after ``answers`` calls were answered."""

    def __init__(self, answers: int) -> None:
        self.answers = answers
        self.lease: dict[str, Any] | None = None

    async def get(self, *_: Any) -> dict[str, Any] | None:
        return await self._answer(self.lease)

    async def create(self, _kind: Any, _ns: str, body: dict[str, Any]) -> dict[str, Any]:
        self.lease = {**body, "metadata": {**body["metadata"], "resourceVersion": "1"}}
        return await self._answer(self.lease)

    async def patch(self, _kind: Any, _ns: str, _name: str, body: dict[str, Any]) -> dict[str, Any]:
        assert self.lease is not None
        self.lease = {**self.lease, "spec": body["spec"]}
        return await self._answer(self.lease)

    async def _answer(self, value: Any) -> Any:
        if self.answers <= 0:
            await asyncio.Event().wait()  # never answered
        self.answers -= 1
        return value


def test_a_hanging_renewal_ends_leadership_at_the_renew_deadline() -> None:
    async def scenario() -> None:
        kube = _HangingKube(answers=2)  # the first round (GET + create) is answered, then nothing
        config = leader.LeaseConfig(name="l", namespace="ns", identity="a", duration_s=0.6, renew_every_s=0.1)
        elector = leader.LeaderElector(lambda: kube, config)  # type: ignore[arg-type, return-value]
        assert await elector.try_acquire_or_renew() and elector.holds()
        seen: list[tuple[bool, float]] = []
        await asyncio.wait_for(elector.keep(lambda: seen.append((elector.holds(), time.monotonic()))), 10)
        assert len(seen) == 1 and seen[0][0] is False  # on_lost once, and the gate is already shut
        # The standby can take the lease only a full duration after it saw the last record; the
        # old leader stopped at its renew deadline, a third of the lease before that.
        assert elector.valid_until <= seen[0][1]
        assert config.deadline_s == pytest.approx(0.4)

    asyncio.run(scenario())


@pytest.mark.parametrize("kwargs", [{"renew_deadline_s": 15.0}, {"renew_every_s": 12.0}, {"duration_s": 0}])
def test_lease_timings_that_could_split_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="LeaseConfig"):
        leader.LeaseConfig(name="l", namespace="ns", identity="a", **kwargs)
