"""Reports: the markdown results table, the throughput-latency PNG and the JSON record.

Takes already-combined results (median and min-max per metric, per system and workload)
and writes them under ``bench/results/``. Ratios are against a named peer system. The plot
uses matplotlib's Agg backend (no display). Knows nothing about how results were measured.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from inflight.bench.stats import Spread

Row = Mapping[str, Spread]  # metric name -> median (min-max)

TABLE_COLUMNS = (
    ("output_tok_s", "output tok/s", 1.0, "{:.0f}"),
    ("total_tok_s", "total tok/s", 1.0, "{:.0f}"),
    ("ttft_p50_s", "TTFT p50 ms", 1e3, "{:.0f}"),
    ("ttft_p99_s", "TTFT p99 ms", 1e3, "{:.0f}"),
    ("tpot_p50_s", "TPOT p50 ms", 1e3, "{:.1f}"),
    ("tpot_p99_s", "TPOT p99 ms", 1e3, "{:.1f}"),
    ("e2e_p50_s", "e2e p50 s", 1.0, "{:.2f}"),
    ("e2e_p99_s", "e2e p99 s", 1.0, "{:.2f}"),
    ("errors", "errors", 1.0, "{:.0f}"),
)


def fmt_spread(s: Spread, scale: float = 1.0, pattern: str = "{:.1f}") -> str:
    if any(math.isnan(v) for v in (s.median, s.lo, s.hi)):
        return "n/a"
    med, lo, hi = (pattern.format(v * scale) for v in (s.median, s.lo, s.hi))
    return med if lo == hi else f"{med} ({lo}-{hi})"


def _ratio(row: Row, peer: Row | None, metric: str) -> str:
    if peer is None or not peer[metric].median:
        return "-"
    return f"{row[metric].median / peer[metric].median:.2f}x"


def results_table(rows: Mapping[str, Row], peer_name: str | None) -> str:
    """Markdown: one line per system, medians with (min-max), output and TTFT ratios vs the peer."""
    peer = rows.get(peer_name) if peer_name else None
    head = ["system", *(c[1] for c in TABLE_COLUMNS), "out tok/s vs peer", "TTFT p99 vs peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in rows.items():
        cells = [fmt_spread(row[key], scale, pattern) for key, _title, scale, pattern in TABLE_COLUMNS]
        ratios = [_ratio(row, peer, "output_tok_s"), _ratio(row, peer, "ttft_p99_s")]
        lines.append("| " + " | ".join([name, *cells, *ratios]) + " |")
    return "\n".join(lines)


def simple_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def plot_curves(curves: Mapping[str, Sequence[Row]], path: Path, title: str) -> None:
    """Two panels: output tok/s against p99 TTFT and against p50 TPOT, one line per system.

    ``curves[system]`` holds one row per load point, in order of increasing offered load.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for name, points in curves.items():
        pts = list(points)
        tput = [p["output_tok_s"].median for p in pts]
        for ax, key in zip(axes, ("ttft_p99_s", "tpot_p50_s"), strict=True):
            ax.plot([p[key].median * 1e3 for p in pts], tput, marker="o", label=name)
    for ax, label in zip(axes, ("p99 time to first token (ms, log)", "p50 time per output token (ms)"),
                         strict=True):
        ax.set_xlabel(label)
        ax.set_ylabel("output tokens/s")
        ax.grid(True, alpha=0.3)
    axes[0].set_xscale("log")
    axes[1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def spreads_to_json(row: Row) -> dict[str, dict[str, float]]:
    return {k: {"median": v.median, "min": v.lo, "max": v.hi} for k, v in row.items()}


def write_json(path: Path, record: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
