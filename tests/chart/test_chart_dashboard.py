"""The Grafana dashboard ConfigMap holds valid dashboard JSON whose queries use only the
runtime's metric names from docs/CONTRACTS.md and cover what an SRE watches."""

from __future__ import annotations

import json
from typing import Any

from chart_support import METRIC, contract_metrics, one

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _dashboard(objects) -> dict[str, Any]:
    configmap = one(objects("all-on"), "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    (text,) = configmap["data"].values()
    return json.loads(text)


def _exprs_by_title(dashboard: dict[str, Any]) -> dict[str, list[str]]:
    return {p["title"]: [t["expr"] for t in p["targets"]] for p in dashboard["panels"]}


def _base_name(metric: str) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        if metric.endswith(suffix):
            return metric[: -len(suffix)]
    return metric


def test_queries_use_only_contract_metrics(objects) -> None:
    known = contract_metrics()
    exprs = [e for es in _exprs_by_title(_dashboard(objects)).values() for e in es]
    used = {_base_name(m) for e in exprs for m in METRIC.findall(e)}
    assert used - known == set(), f"metrics not in CONTRACTS.md: {sorted(used - known)}"


def test_panels_cover_what_an_sre_watches(objects) -> None:
    dashboard = _dashboard(objects)
    exprs = "\n".join(e for es in _exprs_by_title(dashboard).values() for e in es)
    for metric in (
        "inflight:kv_cache_usage_perc",
        "inflight:num_requests_waiting",
        "inflight:num_requests_running",
        "inflight:generation_tokens_total",
        "inflight:num_preemptions_total",
    ):
        assert metric in exprs, metric
    for histogram in ("inflight:time_to_first_token_seconds", "inflight:inter_token_latency_seconds"):
        for quantile in ("0.5", "0.99"):
            assert f"histogram_quantile({quantile}, sum by (le) (rate({histogram}_bucket" in exprs
    assert any("replica" in title.lower() for title in _exprs_by_title(dashboard))


def test_panels_are_laid_out_and_unique(objects) -> None:
    panels = _dashboard(objects)["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in panels]
    assert len(set(cells)) == len(cells)
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"])
