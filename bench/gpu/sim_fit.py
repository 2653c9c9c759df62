"""The simulated device's profile (``--sim-profile``) fitted to a ``make gpu-check`` engine step.

The engine step times graphed decode steps at several batch sizes; :func:`fit_profile` takes
two of them (64 and the largest, as the default profile took the H100's 64 and 256), prices
attention from the model's K/V bytes per token at 90% of the measured copy bandwidth, and puts
a line through the rest: ``base_ms`` its intercept, ``decode_row_ms`` its slope. The file it
writes keeps :class:`~inflight.runtime.worker.sim_device.SimProfile`'s format (its fields,
plus notes under ``_`` keys, which the loader skips). Knows the engine step only by its report.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

ATTENTION_FRACTION_OF_COPY = 0.9  # decode attention reaches ~90% of copy bandwidth at long contexts


def fit_profile(report: dict[str, Any]) -> tuple[dict[str, float], str]:
    """(SimProfile fields, how they were fitted) from an engine-step report's rows."""
    from inflight.runtime.worker.sim_device import SimProfile

    rows = [r for r in report["rows"] if not r.get("async")]
    graphed = [r for r in rows if r.get("graphs")]
    mode = "graphed" if len({r["batch"] for r in graphed}) >= 2 else "eager"
    by_batch = {r["batch"]: r for r in (graphed if mode == "graphed" else rows)}
    batches = sorted(by_batch)
    if len(batches) < 2:
        raise ValueError(f"a fit needs decode steps at two batch sizes (got {batches})")
    hi = batches[-1]
    lo = 64 if 64 in batches and hi != 64 else batches[0]
    copy = report.get("copy_gb_per_s")
    att_per_1k = 0.0
    kv_per_token = None
    if copy and by_batch[hi].get("context_tokens"):
        kv_per_token = by_batch[hi]["kv_mb"] * 1e6 / by_batch[hi]["context_tokens"]
        att_per_1k = 1e3 * 1000 * kv_per_token / (ATTENTION_FRACTION_OF_COPY * copy * 1e9)

    def net(batch: int) -> float:  # the step without its attention reads
        r = by_batch[batch]
        return r["step_ms"] - att_per_1k * r.get("context_tokens", 0) / 1000

    slope = (net(hi) - net(lo)) / (hi - lo)
    base = net(lo) - slope * lo
    profile = {"base_ms": max(0.0, base), "decode_row_ms": max(0.0, slope),
               "prefill_token_ms": SimProfile().prefill_token_ms, "attention_ms_per_1k_context": att_per_1k,
               "host_copy_gb_per_s": SimProfile().host_copy_gb_per_s}  # fmt: skip
    how = (f"{mode} decode steps at batch {lo} ({by_batch[lo]['step_ms']:.2f} ms) and {hi} "
           f"({by_batch[hi]['step_ms']:.2f} ms), attention "
           + (f"{kv_per_token / 1024:.1f} KiB/token at {100 * ATTENTION_FRACTION_OF_COPY:.0f}% of {copy:.0f} GB/s"
              if kv_per_token else "not priced (no copy bandwidth)")
           + ", prefill_token_ms and host_copy_gb_per_s the defaults")  # fmt: skip
    return profile, how


def write_profile(report: dict[str, Any], out_dir: Path, dry_run: bool, device: str | None = None) -> dict[str, Any]:
    """Write ``sim-profile-<device>.json`` in ``out_dir``; what was written, for the report."""
    from inflight.runtime.worker.sim_device import SimProfile

    profile, how = fit_profile(report)
    if device is None:
        import torch

        device = "cpu-dry-run" if dry_run or not torch.cuda.is_available() else torch.cuda.get_device_name(0)
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    source = (f"DRY RUN on the CPU ({stamp}): toy CPU figures that prove the harness, not a GPU's step times"
              if dry_run else f"make gpu-check on {device}, {stamp}")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"sim-profile-{slug}.json"
    path.write_text(json.dumps({"_source": source, "_fit": how, "_dry_run": dry_run, **profile}, indent=2) + "\n")
    SimProfile.load(path)  # the simulator reads what was written
    return {"path": str(path), "file": path.name, "dry_run": dry_run, "profile": profile, "fit": how}
