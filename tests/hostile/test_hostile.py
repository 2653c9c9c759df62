"""The hostile-traffic suite, bounded in time: hundreds of distinct malformed and poisoned
requests, vanishing and slow clients, and a burst of healthy streams with poison among them.
Every malformed request gets its expected 4xx, no 5xx, no hang, no leaked KV block, and the
greedy reference completion is unchanged after every phase. ``python -m tests.hostile``
prints the same figures."""

from __future__ import annotations

import asyncio

from tests.hostile.suite import API_KEY, NUM_HEALTHY_STREAMS, run
from tests.server.server_helpers import LiveServer

SUITE_TIMEOUT_S = 180


def test_hostile_traffic(hostile_server: LiveServer) -> None:
    report = asyncio.run(asyncio.wait_for(run(hostile_server.url, hostile_server.port, API_KEY), SUITE_TIMEOUT_S))
    print("\n" + "\n".join(report.lines()))
    assert len(report.distinct) >= 200
    assert report.wrong == [] and report.right == report.tried
    assert report.server_errors == 0 and report.hangs == 0
    assert report.leaked_blocks and set(report.leaked_blocks) == {0}
    assert report.reference_unchanged and all(report.reference_unchanged)
    assert report.healthy_streams_completed == NUM_HEALTHY_STREAMS
    assert report.poison_among_streams > 0
