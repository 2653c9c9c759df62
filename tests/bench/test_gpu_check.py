"""``make gpu-check`` keeps working without a GPU: its dry run exercises every step of the
harness at toy sizes on the CPU and writes the report; a failing step is reported, never
raised, and never stops the steps after it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu import check as gpu_check
from bench.gpu.report import render_markdown

pytestmark = pytest.mark.slow

STEP_NAMES = ["environment", "compile check", "kernel tests", "engine tests on CUDA", "kernel bench",
              "engine step", "served burst"]  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is what a CPU machine runs")
def test_dry_run_exercises_every_step(tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu.check", "--dry-run", "--out", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (json_path,) = out.glob("*.json")
    report = json.loads(json_path.read_text())
    assert report["dry_run"] is True
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == STEP_NAMES
    assert all(s["status"] == "pass" for s in steps.values()), {n: s["summary"] for n, s in steps.items()}
    assert "collected" in steps["kernel tests"]["summary"]  # collection only, in a dry run
    engine = steps["engine step"]["data"]
    modes = {(r["batch"], r["graphs"]) for r in engine["rows"]}
    assert modes == {(1, False), (2, False), (1, True), (2, True)}  # eager and the stand-in graphs
    assert {r["batch"] for r in engine["rows"] if r["async"] and r["graphs"]} == {1, 2}  # and overlapped
    burst = steps["served burst"]["data"]
    assert burst["num_errors"] == 0 and burst["sync"]["num_errors"] == 0  # async scheduling, then synchronous
    assert burst["gpu_busy_fraction"] is None  # no GPU, no busy figure
    markdown = json_path.with_suffix(".md").read_text()
    assert "dry run of the harness on the CPU" in markdown and "### Served burst" in markdown


def test_a_failing_step_is_reported_and_the_rest_run(tmp_path: Path) -> None:
    def broken(ctx: gpu_check.CheckContext) -> gpu_check.StepResult:
        raise RuntimeError("the device fell off the bus")

    def fine(ctx: gpu_check.CheckContext) -> gpu_check.StepResult:
        return gpu_check.StepResult("fine", "pass", summary="ok")

    ctx = gpu_check.CheckContext(out_dir=tmp_path, work_dir=tmp_path, dry_run=True, quick=True)
    results = gpu_check.run_steps(ctx, (broken, fine))
    assert [(r.name, r.status) for r in results] == [("broken", "fail"), ("fine", "pass")]
    assert "fell off the bus" in results[0].summary and "Traceback" in results[0].data["traceback"]
    md, _ = gpu_check.write_report(ctx, results)
    assert "| broken | fail |" in md.read_text()


def test_the_committed_gpu_report_renders() -> None:
    """The report under bench/results/gpu/ is the renderer's output for its own JSON."""
    reports = list((Path(__file__).parents[2] / "bench" / "results" / "gpu").glob("*.json"))
    assert reports
    for json_path in reports:
        payload = json.loads(json_path.read_text())
        assert json_path.with_suffix(".md").read_text() == render_markdown(payload)


def test_a_missed_target_reads_missed_though_its_step_ran() -> None:
    """A step's "pass" means it ran; the targets table says whether its figure reached the goal."""
    payload = {"dry_run": False, "date": "d", "steps": [
        {"name": "engine step", "status": "pass", "seconds": 1, "summary": "s",
         "data": {"rows": [], "targets": {"1": {"x_roofline": 3.1, "bound": 2.0, "met": False},
                                          "64": {"x_roofline": 1.2, "bound": 1.5, "met": True}}}},
        {"name": "served burst", "status": "pass", "seconds": 1, "summary": "s",
         "data": {"model": "m", "requests": 1, "max_tokens": 1, "output_tok_per_s": 1.0, "num_errors": 0,
                  "gpu_busy_fraction": 0.11, "busy_target": 0.85}}]}  # fmt: skip
    md = render_markdown(payload)
    assert "| decode step at batch 1 with CUDA graphs, x roofline | <= 2.0x | 3.10x | MISSED |" in md
    assert "| decode step at batch 64 with CUDA graphs, x roofline | <= 1.5x | 1.20x | met |" in md
    assert "| GPU busy in the served burst | >= 85% | 11% | MISSED |" in md
