"""The emulator's request log (``kmock_log.RequestLog``): every request stays readable, in order,
to the tests and to the RBAC check, while kmock's own matching list holds only what is being
served (so a request does not cost more than the last; the figures are in
docs/operator-conditions.md, not asserted here)."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.operator.kmock_harness import api_server, uncovered_requests

CONFIGMAPS = "/api/v1/namespaces/default/configmaps"


def test_every_request_is_logged_in_order_and_only_in_flight_ones_are_matched() -> None:
    async def scenario() -> None:
        async with api_server() as cluster:
            await cluster.create(CONFIGMAPS, {"metadata": {"name": "c"}, "data": {}})
            for i in range(40):
                await cluster.get(f"{CONFIGMAPS}/c?i={i}")
            sent = list(cluster.api)
            gets = [r for r in sent if r.method.value == "GET" and str(r.url.path) == f"{CONFIGMAPS}/c"]
            assert [r.params["i"] for r in gets] == [str(i) for i in range(40)]
            assert sent[0].resource.plural == "customresourcedefinitions"  # the harness's first request
            assert cluster.requests_to("GET", f"{CONFIGMAPS}/c") == 40
            assert list(cluster.api._requests) == []  # nothing in flight: kmock matches against nothing old

            async with aiohttp.ClientSession(headers={"User-Agent": "kopf/1"}) as session:  # as the operator
                watch = asyncio.create_task(session.get(f"{cluster.api_url}{CONFIGMAPS}?watch=true"))
                await asyncio.sleep(0.3)
                assert [r.params.get("watch") for r in cluster.api._requests] == ["true"]  # a streaming watch
                async with session.get(f"{cluster.api_url}/api/v1/namespaces/default/secrets/x") as resp:
                    assert resp.status == 404
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)
            # The RBAC check reads the whole log: the operator may not read Secrets in a model's namespace.
            assert uncovered_requests(cluster.api) == ["get core/secrets"]

    asyncio.run(asyncio.wait_for(scenario(), 60))
