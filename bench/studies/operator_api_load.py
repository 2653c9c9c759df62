"""API requests per InferenceDeployment per timer tick: the real operator against the kmock emulator.

Creates N InferenceDeployments (half the minimal example, half the autoscaled one, with no pods),
waits until every one is applied, then counts for a window of ticks every request the operator
sends (the emulator keeps each; the study's own requests are left out) and the ticks themselves
(one read of each model's Deployment per tick). Prints requests per CR per tick, by verb and
resource, and how many of them wrote the status.

    python -m bench.studies.operator_api_load --crs 10 100 --tick 1.0 --ticks 10

Runs against whatever ``inflight`` is importable, so the same script measures an older tree.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import copy
import json
import time
from typing import Any

from tests.operator.helpers import EXAMPLES, load_example
from tests.operator.kmock_harness import CR_PATH, Cluster, api_server, start_operator


def _docs(num_crs: int) -> list[dict[str, Any]]:
    minimal = load_example(next(p for p in EXAMPLES if p.stem == "minimal"))
    scaled = load_example(next(p for p in EXAMPLES if p.stem == "autoscaled"))
    docs = []
    for i in range(num_crs):
        doc = copy.deepcopy(minimal if i % 2 == 0 else scaled)
        doc["metadata"]["name"] = f"model-{i:03d}"
        docs.append(doc)
    return docs


def _operator_requests(cluster: Cluster) -> list[Any]:
    return [r for r in list(cluster.api) if "kmock" not in r.headers.get("User-Agent", "")]


def _tick_reads(requests: list[Any], names: list[str]) -> int:
    paths = {f"/apis/apps/v1/namespaces/default/deployments/{n}" for n in names}
    return sum(1 for r in requests if r.method.value == "GET" and str(r.url.path) in paths)


def _label(request: Any) -> str:
    res = request.resource
    plural = res.plural if res is not None else str(request.url.path)
    sub = f"/{request.subresource}" if getattr(request, "subresource", None) else ""
    return f"{request.method.value} {plural}{sub}"


async def measure(num_crs: int, tick_s: float, num_ticks: int) -> dict[str, Any]:
    async with api_server() as cluster:
        operator = start_operator(cluster, tick_s)
        try:
            await asyncio.wait_for(operator.ready.wait(), 30)
            docs = _docs(num_crs)
            for doc in docs:
                await cluster.create(CR_PATH.format(ns="default"), doc)
            names = [d["metadata"]["name"] for d in docs]
            deadline = time.monotonic() + 600
            while True:  # every CR applied (one list per poll: the study must not be the load)
                crs = (await cluster.get(CR_PATH.format(ns="default")) or {}).get("items") or []
                applied = sum(1 for c in crs if (c.get("status") or {}).get("observedGeneration") == 1)
                if applied == len(names):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the operator applied {applied} of {len(names)} CRs within 600 s")
                await asyncio.sleep(2.0)
            await asyncio.sleep(3 * tick_s)
            start = len(_operator_requests(cluster))
            await asyncio.sleep(num_ticks * tick_s)
            window = _operator_requests(cluster)[start:]
        finally:
            await operator.shutdown()
    ticks = _tick_reads(window, names)
    by_kind = collections.Counter(_label(r) for r in window)
    per = {k: round(v / max(ticks, 1), 3) for k, v in sorted(by_kind.items())}
    status_writes = by_kind.get("PATCH inferencedeployments/status", 0)
    return {
        "crs": num_crs, "tick_s": tick_s, "ticks": ticks, "requests": len(window),
        "requests_per_cr_per_tick": round(len(window) / max(ticks, 1), 3),
        "status_writes_per_cr_per_tick": round(status_writes / max(ticks, 1), 3),
        "by_request_per_cr_per_tick": per,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crs", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--tick", type=float, default=1.0, help="the operator's tick, seconds")
    parser.add_argument("--ticks", type=int, default=10, help="ticks in the measured window")
    args = parser.parse_args()
    for num_crs in args.crs:
        print(json.dumps(asyncio.run(measure(num_crs, args.tick, args.ticks))), flush=True)


if __name__ == "__main__":
    main()
