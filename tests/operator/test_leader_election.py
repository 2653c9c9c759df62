"""Two operator replicas against one kmock API server: only the Lease holder acts, the other
waits (its liveness endpoint answering) and takes over when the holder stops or stops renewing.
"""

from __future__ import annotations

import asyncio
import socket
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
