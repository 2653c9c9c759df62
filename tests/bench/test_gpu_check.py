"""``make gpu-check`` keeps working without a GPU: its dry run exercises both parts of the
harness at toy sizes on the CPU and writes the report and the simulator's profile; a failing
or hanging step is reported, never raised, and never stops the steps after it; the report is
rewritten after every step; one failing kernel leaves the rest of the kernel bench. No test
here asserts on a time."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from bench.gpu import check as gpu_check
from bench.gpu.report import render_markdown
from inflight.runtime.worker.sim_device import SimProfile

pytestmark = pytest.mark.slow

STEP_NAMES = ["environment", "compile check", "gpu tests", "kernel bench", "engine step", "served burst"]
PART_STEPS = {"kernels": ["environment", "compile check", "kernel bench", "engine step"],
              "serve": ["environment", "gpu tests", "served burst"]}  # fmt: skip


def _dry_run(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench.gpu.check", "--dry-run", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=1200, check=False)  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is what a CPU machine runs")
def test_dry_run_part_kernels(tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = _dry_run(out, "--part", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (json_path,) = out.glob("*-kernels.json")
    report = json.loads(json_path.read_text())
    assert report["dry_run"] is True and report["part"] == "kernels" and "running" not in report
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == PART_STEPS["kernels"]
    assert all(s["status"] == "pass" for s in steps.values()), {n: s["summary"] for n, s in steps.items()}
    assert list(steps["compile check"]["data"]["output"]) == ["bf16"]  # bf16 only unless asked
    bench = steps["kernel bench"]["data"]
    assert bench["checks"] and bench["decode"] and bench["copy_gb_per_s"]
    engine = steps["engine step"]["data"]
    modes = {(r["batch"], r["graphs"]) for r in engine["rows"]}
    assert modes == {(1, False), (2, False), (1, True), (2, True)}  # eager and the stand-in graphs
    assert {r["batch"] for r in engine["rows"] if r["async"] and r["graphs"]} == {1, 2}  # and overlapped
    # The simulated device's profile, fitted to the graphed steps, marked a dry run, loadable.
    sim = engine["sim_profile"]
    assert sim["dry_run"] is True and sim["file"] == "sim-profile-cpu-dry-run.json"
    written = json.loads((out / sim["file"]).read_text())
    assert written["_dry_run"] is True and "DRY RUN" in written["_source"]
    profile = SimProfile.load(out / sim["file"])
    assert asdict(profile) == sim["profile"]
    markdown = json_path.with_suffix(".md").read_text()
    assert "dry run of the harness on the CPU" in markdown and "DRY RUN: CPU figures" in markdown


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is what a CPU machine runs")
def test_dry_run_part_serve(tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = _dry_run(out, "--part", "serve")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (json_path,) = out.glob("*-serve.json")
    steps = {s["name"]: s for s in json.loads(json_path.read_text())["steps"]}
    assert list(steps) == PART_STEPS["serve"]
    assert all(s["status"] == "pass" for s in steps.values()), {n: s["summary"] for n, s in steps.items()}
    assert "collected" in steps["gpu tests"]["summary"]  # collection only, in a dry run ...
    assert "deselected" in steps["gpu tests"]["summary"]  # ... of the gpu-marked tests alone
    burst = steps["served burst"]["data"]
    assert burst["num_errors"] == 0 and burst["sync"]["num_errors"] == 0  # async scheduling, then synchronous
    assert burst["gpu_busy_fraction"] is None  # no GPU, no busy figure
    assert "### Served burst" in json_path.with_suffix(".md").read_text()


def test_parts_cover_every_step_inside_five_minutes() -> None:
    """The two commands of a GPU loan: every step in one of them, each part's limits <= 300 s."""
    assert {n for names in gpu_check.PARTS.values() for n in names} == set(gpu_check.STEPS) == set(STEP_NAMES)
    for part in gpu_check.PARTS:
        steps = gpu_check.select_steps(part, None, dry_run=False)
        assert sum(s.timeout_s for s in steps) <= 300, part
    assert [s.name for s in gpu_check.select_steps("1", ["engine"], dry_run=False)] == ["engine step"]


# Steps for the tests below: module-level, since each step runs in a child process that imports it.
def broken_step(ctx: gpu_check.CheckContext) -> gpu_check.StepResult:
    raise RuntimeError("the device fell off the bus")


def fine_step(ctx: gpu_check.CheckContext) -> gpu_check.StepResult:
    return gpu_check.StepResult("fine", "pass", summary="ok", data={"timeout_s": ctx.timeout_s})


def hanging_step(ctx: gpu_check.CheckContext) -> gpu_check.StepResult:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])  # a server, say
    (ctx.work_dir / "hanging-child.pid").write_text(str(child.pid))
    threading.Event().wait()  # never returns
    raise AssertionError("unreachable")


def _ctx(tmp_path: Path) -> gpu_check.CheckContext:
    return gpu_check.CheckContext(out_dir=tmp_path / "out", work_dir=tmp_path, dry_run=True, quick=True)


def test_a_hanging_step_is_killed_recorded_and_the_next_runs(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    steps = [gpu_check.Step("hangs", hanging_step, 20), gpu_check.Step("fine", fine_step, 60)]
    results = gpu_check.run_steps(ctx, steps)
    assert [(r.name, r.status) for r in results] == [("hangs", "timeout"), ("fine", "pass")]
    assert "20 s limit" in results[0].summary
    pid = int((tmp_path / "hanging-child.pid").read_text())
    assert not _alive(pid)  # the step's own children went with it


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_a_failing_step_is_reported_the_rest_run_and_the_report_is_rewritten_after_every_step(
    tmp_path: Path,
) -> None:
    """One run of three steps (each a child process) for both: the failing one in the middle."""
    ctx = _ctx(tmp_path)
    seen: list[tuple[list[tuple[str, str]], str | None, str]] = []

    def progress(results: list[gpu_check.StepResult], running: str | None) -> None:
        if results:
            md, js = gpu_check.write_report(ctx, results, "kernels", running)
            payload = json.loads(js.read_text())
            seen.append(([(s["name"], s["status"]) for s in payload["steps"]], payload.get("running"), md.read_text()))

    steps = [gpu_check.Step("first", fine_step, 60), gpu_check.Step("second", broken_step, 60),
             gpu_check.Step("third", fine_step, 60)]  # fmt: skip
    results = gpu_check.run_steps(ctx, steps, on_progress=progress)
    assert [(names, running) for names, running, _ in seen] == [
        ([("first", "pass")], "second"),
        ([("first", "pass"), ("second", "fail")], "third"),
        ([("first", "pass"), ("second", "fail"), ("third", "pass")], None),
    ]
    assert "`second` step is running" in seen[0][2] and "is running" not in seen[-1][2]
    assert sorted(p.name for p in ctx.out_dir.iterdir()) == ["cpu-dry-run-kernels.json", "cpu-dry-run-kernels.md"]
    # the failure is recorded with its reason and traceback, and the step after it ran
    assert "fell off the bus" in results[1].summary and "Traceback" in results[1].data["traceback"]
    assert results[2].data["timeout_s"] == 60  # the step knows its own limit
    md, _ = gpu_check.write_report(ctx, results)
    assert "| second | fail |" in md.read_text()


def test_one_kernel_failing_leaves_the_rest_of_the_kernel_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel check or a decode point that raises is its own row; copy bandwidth and the
    decode table still come out."""
    from bench.gpu import checks as gpu_checks
    from bench.gpu import kernels as gpu_kernels

    def exploding(ops: object, dtype: torch.dtype, device: str) -> gpu_checks.CheckResult:
        raise RuntimeError("illegal memory access")

    def fake_decode(batch: int, context: int, shape: object, timer: object) -> tuple[float, int]:
        if (batch, context) == (2, 16):
            raise RuntimeError("out of resources: shared memory")
        return 0.01 * batch, 1

    monkeypatch.setattr(gpu_checks, "CHECKS", (gpu_checks._check_silu_and_mul, exploding, gpu_checks._check_rms_norm))
    monkeypatch.setattr(gpu_kernels, "time_decode", fake_decode)
    report = gpu_kernels.run_kernel_bench(dry_run=True)
    assert [(c["kernel"], c["ok"], c.get("error")) for c in report["checks"]] == [
        ("silu_and_mul", True, None), ("exploding", False, "RuntimeError: illegal memory access"),
        ("rms_norm(+residual)", True, None)]  # fmt: skip
    assert report["copy_gb_per_s"] > 0
    points = {(r["batch"], r["context"]): r for r in report["decode"]}
    assert set(points) == {(1, 16), (1, 40), (2, 16), (2, 40)}
    assert "shared memory" in points[(2, 16)]["error"] and points[(2, 40)]["gb_per_s"] > 0
    payload = {"dry_run": True, "date": "d", "steps": [
        {"name": "kernel bench", "status": "fail", "seconds": 1, "summary": "s", "data": report}]}
    md = render_markdown(payload)
    assert "| FAIL: RuntimeError: illegal memory access |" in md
    assert "| 2 | 16 | | FAILED: RuntimeError: out of resources: shared memory | | |" in md


def test_the_sim_profile_fit_recovers_a_line() -> None:
    """Steps of base + row x batch + attention: the fit gives back base and row."""
    from bench.gpu.sim_fit import fit_profile

    kv_per_token, copy_gb = 12288, 3000.0
    att_per_1k = 1e3 * 1000 * kv_per_token / (0.9 * copy_gb * 1e9)
    rows = []
    for batch in (1, 64, 256):
        context = batch * 340
        step = 2.0 + 0.03 * batch + att_per_1k * context / 1000
        rows += [{"batch": batch, "graphs": graphs, "async": False, "step_ms": step + (0 if graphs else 20),
                  "kv_mb": context * kv_per_token / 1e6, "context_tokens": context} for graphs in (False, True)]
    profile, how = fit_profile({"rows": rows, "copy_gb_per_s": copy_gb})
    assert profile["base_ms"] == pytest.approx(2.0) and profile["decode_row_ms"] == pytest.approx(0.03)
    assert profile["attention_ms_per_1k_context"] == pytest.approx(att_per_1k)
    assert "graphed decode steps at batch 64" in how and "and 256" in how
    SimProfile(**profile)  # the simulator's own checks accept it


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


def test_every_gpu_marked_test_file_is_run_or_left_out_with_a_reason() -> None:
    """A test marked ``gpu`` (or parametrized over ``on_devices(..., "cuda")``) that the loan's
    pytest step does not name never runs anywhere: each such file is in ``GPU_TESTS`` or in
    ``GPU_TESTS_LEFT_OUT`` with its reason."""
    from bench.gpu.steps import GPU_TESTS, GPU_TESTS_LEFT_OUT

    root = Path(__file__).resolve().parents[2]
    named = [p for p in GPU_TESTS if p.startswith("tests/")]
    marked = sorted(str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py") if p != Path(__file__)
                    and ("mark.gpu" in (text := p.read_text()) or 'on_devices("cpu", "cuda")' in text))  # fmt: skip
    assert marked
    missing = [p for p in marked if not any(p == n or p.startswith(n.rstrip("/") + "/") for n in named)
               and p not in GPU_TESTS_LEFT_OUT]  # fmt: skip
    assert not missing, f"gpu-marked tests that make gpu-check never runs: {missing}"
    assert all(reason for reason in GPU_TESTS_LEFT_OUT.values())
