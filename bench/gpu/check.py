"""``make gpu-check`` (``python -m bench.gpu.check``): the GPU path proven in one command.

Runs, in order, on a bare offline GPU machine (the wheels it lacks travel in ``.whl/``, see
``docs/gpu.md``): the environment, the Triton compile check, every kernel test and the
engine's token-exact tests on CUDA (``-m gpu``), the kernel benchmark (correctness on fresh
inputs, decode-attention bandwidth against the measured copy bandwidth), the engine decode
step against its roofline with and without CUDA graphs, and a served burst that samples how
busy the GPU is. Writes one markdown and one JSON report naming the device.

Without CUDA it is a dry run of the harness itself: the pytest steps only collect, the
benchmarks run at toy sizes on the CPU, and the report says "dry run" and goes to a scratch
directory (``tests/bench/test_gpu_check.py`` keeps this working). Each step is bounded in
time and a failing step never stops the ones after it. Owns the step list, the timeouts and
the report; the measurements live in :mod:`bench.gpu.kernels`,
:mod:`bench.gpu.engine` and :mod:`bench.gpu.burst`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

DEFAULT_OUT = Path("bench/results/gpu")
PYTEST_WORKERS = 4  # pytest-xdist workers sharing the one GPU, where xdist is installed


@dataclass(frozen=True, slots=True)
class CheckContext:
    """What every step may read."""

    out_dir: Path
    work_dir: Path  # generated models, logs
    dry_run: bool
    quick: bool


@dataclass(slots=True)
class StepResult:
    name: str
    status: str  # "pass" | "fail" | "skip"
    seconds: float = 0.0
    summary: str = ""
    data: dict[str, Any] = field(default_factory=dict)


StepFn = Callable[[CheckContext], StepResult]


def _env_step(ctx: CheckContext) -> StepResult:
    import triton

    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda,
    }  # fmt: skip
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, sms=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}")  # fmt: skip
    else:
        info["device"] = f"CPU ({platform.processor() or platform.machine()}), dry run"
    missing = [m for m in ("llguidance", "gguf") if not _importable(m)]
    info["missing_engine_modules"] = missing
    status = "fail" if missing else "pass"
    summary = ", ".join(f"{k} {v}" for k, v in info.items() if k != "missing_engine_modules")
    if missing:
        summary += f"; the engine cannot load without {', '.join(missing)} (carry .whl/, docs/gpu.md)"
    return StepResult("environment", status, summary=summary, data=info)


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def _run(cmd: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``cmd`` with its output in ``log``; (exit code, the output's last 4000 chars)."""
    full_env = {**os.environ, **(env or {})}
    with open(log, "wb") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=full_env,
                                timeout=timeout_s, check=False).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = 124
    text = log.read_text(errors="replace")
    if rc == 124:
        text += f"\n[gpu-check: killed after {timeout_s:.0f} s]"
    return rc, text[-4000:]


def _compile_step(ctx: CheckContext) -> StepResult:
    log = ctx.work_dir / "compile_check.log"
    env = {"TRITON_INTERPRET": "0"}
    results = []
    for dtype in ("bf16", "fp16", "fp32"):
        cmd = [sys.executable, "-m", "bench.gpu.compile_check", "--arch", "90", "--dtype", dtype]
        rc, text = _run(cmd, log, 300, env)
        results.append((dtype, rc, text))
        if ctx.dry_run:
            break  # one dtype proves the harness
    failed = [d for d, rc, _ in results if rc != 0]
    summary = "sm_90: " + ", ".join(f"{d} {'ok' if rc == 0 else 'FAILED'}" for d, rc, _ in results)
    return StepResult("compile check", "fail" if failed else "pass", summary=summary,
                      data={"output": {d: t for d, _, t in results}})  # fmt: skip


def pytest_step(name: str, selection: list[str], timeout_s: float) -> StepFn:
    """A step that runs ``pytest selection`` (on CUDA) or only collects it (dry run)."""

    def step(ctx: CheckContext) -> StepResult:
        log = ctx.work_dir / f"pytest-{re.sub(r'[^a-z0-9]+', '-', name)}.log"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection]
        if ctx.dry_run:
            cmd.append("--collect-only")
        elif _importable("xdist"):
            cmd += ["-n", str(PYTEST_WORKERS)]
        rc, text = _run(cmd, log, timeout_s)
        failures = [ln for ln in text.splitlines() if ln.startswith(("FAILED", "ERROR"))]
        ok = rc == 0 or (ctx.dry_run and rc == 5)
        summary = text.strip().splitlines()[-1] if text.strip() else f"exit {rc}"
        return StepResult(name, "pass" if ok else "fail", summary=summary,
                          data={"exit_code": rc, "failures": failures[:40],
                                "tail": text[-2500:]})  # fmt: skip

    step.__name__ = name
    return step


def _kernel_bench_step(ctx: CheckContext) -> StepResult:
    from bench.gpu import kernels as gpu_kernels

    report = gpu_kernels.run_kernel_bench(quick=ctx.quick, dry_run=ctx.dry_run)
    failed = [c["kernel"] + "/" + c["dtype"] for c in report["checks"] if not c["ok"]]
    target = report.get("decode_target")
    summary = f"copy {report['copy_gb_per_s']:.0f} GB/s"
    if target:
        summary += f"; decode attention worst {100 * target['worst_fraction']:.0f}% of copy at batch 64, context 2k-8k"
    if failed:
        summary += f"; FAILED checks: {', '.join(failed)}"
    return StepResult("kernel bench", "fail" if failed else "pass", summary=summary, data=report)


def _engine_step(ctx: CheckContext) -> StepResult:
    """In a child process, so its KV caches and graphs free the GPU for the served burst."""
    out = ctx.work_dir / "engine.json"
    cmd = [sys.executable, "-m", "bench.gpu.engine", "--json", str(out), "--work-dir", str(ctx.work_dir)]
    cmd += ["--quick"] * ctx.quick + ["--dry-run"] * ctx.dry_run
    rc, text = _run(cmd, ctx.work_dir / "engine.log", 420)
    print(text[-3000:])
    if rc != 0 or not out.exists():
        return StepResult("engine step", "fail", summary=f"exit {rc}: {text.strip().splitlines()[-1:]}",
                          data={"tail": text[-3000:]})  # fmt: skip
    report = json.loads(out.read_text())
    return StepResult("engine step", "pass", summary=report["summary"], data=report)


def _burst_step(ctx: CheckContext) -> StepResult:
    from bench.gpu import burst as gpu_burst

    report = gpu_burst.run_burst(ctx.work_dir, quick=ctx.quick, dry_run=ctx.dry_run)
    status = "fail" if report["num_errors"] else "pass"
    return StepResult("served burst", status, summary=report["summary"], data=report)


STEPS: tuple[StepFn, ...] = (
    _env_step,
    _compile_step,
    pytest_step("kernel tests", ["tests/kernels"], 420),
    pytest_step("engine tests on CUDA", ["-m", "gpu", "tests/runtime/test_engine_matches_transformers.py",
                                         "tests/runtime/test_decode_graphs.py"], 420),
    _kernel_bench_step,
    _engine_step,
    _burst_step,
)


def run_steps(ctx: CheckContext, steps: tuple[StepFn, ...] = STEPS, only: set[str] | None = None) -> list[StepResult]:
    """Run each step (a failure is recorded, never raised) and print one line per step."""
    results = []
    for step in steps:
        name = step.__name__.strip("_").removesuffix("_step").replace("_", " ")
        if only and name not in only:
            continue
        start = time.perf_counter()
        print(f"\n== gpu-check: {name} ==", flush=True)
        try:
            result = step(ctx)
        except Exception as exc:  # one broken step must not hide the others' results
            result = StepResult(name, "fail", summary=f"{type(exc).__name__}: {exc}"[:300],
                                data={"traceback": traceback.format_exc()[-4000:]})  # fmt: skip
        result.seconds = time.perf_counter() - start
        print(f"-- {result.status.upper()} {result.name} ({result.seconds:.0f} s): {result.summary}", flush=True)
        results.append(result)
    return results


def device_slug(results: list[StepResult]) -> str:
    device = next((r.data.get("device", "") for r in results if r.name == "environment"), "")
    if not device:
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu-dry-run"
    return re.sub(r"[^a-z0-9]+", "-", str(device).lower()).strip("-")


def write_report(ctx: CheckContext, results: list[StepResult]) -> tuple[Path, Path]:
    """``<device>.md`` and ``<device>.json`` in ``ctx.out_dir``."""
    from bench.gpu.report import render_markdown

    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    slug = device_slug(results)
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    payload = {"date": stamp, "dry_run": ctx.dry_run, "quick": ctx.quick,
               "steps": [asdict(r) for r in results]}  # fmt: skip
    json_path = ctx.out_dir / f"{slug}.json"
    md_path = ctx.out_dir / f"{slug}.md"
    json_path.write_text(json.dumps(payload, indent=2, default=str))
    md_path.write_text(render_markdown(payload))
    return md_path, json_path


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu.check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"report directory (default {DEFAULT_OUT} on a GPU, a scratch one in a dry run)")
    parser.add_argument("--quick", action="store_true", help="smaller tables (a few minutes less)")
    parser.add_argument("--dry-run", action="store_true", help="exercise the harness on the CPU")
    parser.add_argument("--only", action="append", default=None,
                        help="run only this step (repeatable): env, compile, kernel tests, "
                             "engine tests on CUDA, kernel bench, engine, burst")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    dry_run = args.dry_run or not torch.cuda.is_available()
    if dry_run and not args.dry_run:
        print("gpu-check: no CUDA device visible, so this is a dry run of the harness on the CPU "
              "(nothing here measures a GPU).", flush=True)  # fmt: skip
    if dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    work = Path(tempfile.mkdtemp(prefix="inflight-gpu-check-"))
    out = args.out or (work / "report" if dry_run else DEFAULT_OUT)
    ctx = CheckContext(out_dir=out, work_dir=work, dry_run=dry_run, quick=args.quick)
    results = run_steps(ctx, only=set(args.only) if args.only else None)
    md, js = write_report(ctx, results)
    print("\n" + "\n".join(f"{r.status.upper():<5} {r.name:<22} {r.seconds:>5.0f} s  {r.summary}" for r in results))
    print(f"\nreport: {md} and {js}; logs in {work}")
    return 1 if any(r.status == "fail" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
