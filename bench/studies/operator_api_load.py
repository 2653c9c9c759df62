"""API requests per InferenceDeployment per timer tick, at steady state, against the kmock emulator.

Starts the kmock API server and a real kopf operator in this process (``tests.operator.kmock_harness``),
creates N InferenceDeployments (the ``minimal`` example, renamed), waits until every one has had its
first ticks, then counts, over a window, the requests the operator sent (kmock keeps every request;
the harness's own, made with kmock's client, are left out) and the ticks that ran (the
``inflight_operator_status_writes_total`` counter counts one per completed tick, written or not).
Run once with the children read by GETs every tick (``watch_children=False``, the code before
the watch-fed cache) and once from the cache, side by side in one run, at 10 and 100 CRs.

    .venv/bin/python -m bench.studies.operator_api_load [--crs 10 100] [--window 8] [--tick 1]

Prints requests per CR per tick by verb (GET, LIST, WATCH, POST, PATCH, status PATCH) and the
ratio cache / polling, and writes the same table to ``operator_api_load.md`` / ``.json`` under the
results directory. Long-running watches count once, when opened. A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

from inflight.bench import report
from inflight.operator.operator_metrics import STATUS_WRITES
from tests.operator.helpers import EXAMPLES, load_example
from tests.operator.kmock_harness import Cluster, api_server, start_operator, wait_for


def _ticks() -> float:
    return sum(STATUS_WRITES.labels(result=r)._value.get() for r in ("written", "unchanged"))


def _category(request: Any) -> str:
    path = str(request.url.path)
    method = request.method.value
    if method == "PATCH" and path.endswith("/status") and "inferencedeployments" in path:
        return "status PATCH"
    if method == "GET":
        if request.params.get("watch") in ("true", "1", "True"):
            return "WATCH"
        return "GET" if request.name else "LIST"
    return method


def _operator_requests(cluster: Cluster) -> list[Any]:
    return [r for r in list(cluster.api) if "kmock" not in r.headers.get("User-Agent", "")]


async def _measure(num_crs: int, tick: float, window: float, watch: bool) -> dict[str, float]:
    doc = load_example(next(p for p in EXAMPLES if p.stem == "minimal"))
    async with api_server() as cluster:
        operator = start_operator(cluster, tick, watch_children=watch)
        try:
            await asyncio.wait_for(operator.ready.wait(), 30)
            for i in range(num_crs):
                cr = copy.deepcopy(doc)
                cr["metadata"]["name"] = f"m{i:03d}"
                await cluster.create_cr(cr)

            async def all_ticking() -> bool:
                crs = await cluster.request("GET", "/apis/inflight.dev/v1alpha1/namespaces/default/inferencedeployments")
                return all("readyReplicas" in (cr.get("status") or {}) for cr in crs["items"]) and \
                    len(crs["items"]) == num_crs

            await wait_for(all_ticking, timeout=120 + num_crs, what="every CR's first ticks")
            await asyncio.sleep(3 * tick)  # past the first full checks
            sent, ticks0, t0 = len(_operator_requests(cluster)), _ticks(), time.monotonic()
            await asyncio.sleep(window)
            window_requests = _operator_requests(cluster)[sent:]
            ticks = _ticks() - ticks0
            elapsed = time.monotonic() - t0
        finally:
            await operator.shutdown()
    counts = Counter(_category(r) for r in window_requests)
    out = {k: v / max(ticks, 1) for k, v in counts.items()}
    out["all"] = len(window_requests) / max(ticks, 1)
    out["ticks/s"] = ticks / elapsed
    out["requests/s"] = len(window_requests) / elapsed
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--crs", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--window", type=float, default=8.0, help="seconds counted at steady state")
    parser.add_argument("--tick", type=float, default=1.0, help="the timer's interval (seconds)")
    parser.add_argument("--modes", nargs="+", choices=["polling", "watch"], default=["polling", "watch"])
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("kopf").setLevel(logging.ERROR)
    cols = ["all", "GET", "LIST", "WATCH", "POST", "PATCH", "status PATCH"]
    lines = [f"API requests per CR per tick (tick {args.tick:g} s, window {args.window:g} s)",
             f"{'CRs':>4} {'mode':>8} " + " ".join(f"{c:>12}" for c in cols) + f" {'requests/s':>11} {'ticks/s':>8}"]
    print("\n".join(lines))
    figures: dict[str, dict[str, dict[str, float]]] = {}
    for num in args.crs:
        rows = {}
        for watch in [m == "watch" for m in args.modes]:
            rows[watch] = asyncio.run(_measure(num, args.tick, args.window, watch))
            row = rows[watch]
            figures.setdefault(str(num), {})["watch" if watch else "polling"] = row
            lines.append(f"{num:>4} {'watch' if watch else 'polling':>8} " + " ".join(f"{row.get(c, 0.0):>12.3f}" for c in cols)
                         + f" {row['requests/s']:>11.1f} {row['ticks/s']:>8.1f}")
            print(lines[-1])
        if len(rows) < 2:
            continue
        ratio = rows[True]["all"] / rows[False]["all"] if rows[False]["all"] else float("nan")
        lines.append(f"{num:>4} {'ratio':>8} {ratio:>12.3f}  (requests per CR per tick, watch / polling)")
        print(lines[-1])
    text = ("# Operator API load: polling vs watch-fed caches, side by side in one run\n\n"
            "`python -m bench.studies.operator_api_load` against the kmock emulator, `minimal` CRs, steady state.\n\n"
            "```\n" + "\n".join(lines) + "\n```\n")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "operator_api_load.md").write_text(text)
    report.write_json(args.results_dir / "operator_api_load.json",
                      {"tick_s": args.tick, "window_s": args.window, "per_cr_per_tick": figures})


if __name__ == "__main__":
    main()
