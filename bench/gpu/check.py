"""``make gpu-check`` (``python -m bench.gpu.check``): the GPU path proven inside a 15-minute loan.

Two parts, each one command of at most ~5 minutes on a bare offline GPU machine (the wheels
it lacks travel in ``.whl/``, see ``docs/gpu.md``):

- ``--part kernels`` (``make gpu-check PART=1``): the environment, the Triton compile check
  (bf16; ``--compile-dtypes`` for more), the kernel benchmark (correctness on fresh inputs,
  copy bandwidth, decode-attention bandwidth) and the engine decode step against its roofline,
  eager and with CUDA graphs; it writes the simulated device's profile for this GPU
  (``sim-profile-<device>.json``, :mod:`bench.gpu.sim_fit`).
- ``--part serve`` (``PART=2``): the environment, the ``gpu``-marked tests only (``-m gpu``:
  kernels on CUDA, engine tokens against transformers, CUDA graphs against eager) and a short
  served burst that samples how busy the GPU is.

Without ``--part`` every step runs. Each step runs in a child process under its own timeout:
a step that overruns is killed (its process tree too) and recorded as ``timeout``, a failing
one as ``fail``, and the next step runs. The report (``<device>[-<part>].md`` and ``.json``)
is rewritten in ``--out`` after every step, so a command cut short still leaves the steps
that finished.

Without CUDA it is a dry run of the harness itself: the pytest step only collects, the
benchmarks run at toy sizes on the CPU, and the report says "dry run" and goes to a scratch
directory (``tests/bench/test_gpu_check.py`` keeps this working). Owns the step list, the
timeouts and the report; the steps are :mod:`bench.gpu.steps` (run in children, :mod:`bench.gpu.children`), the measurements live in :mod:`bench.gpu.kernels`,
:mod:`bench.gpu.engine` and :mod:`bench.gpu.burst`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch

from bench.gpu.children import wait_or_kill
from bench.gpu.steps import (
    COMPILE_DTYPES,
    REPO_ROOT,
    CheckContext,
    Step,
    StepFn,
    StepResult,
    burst_step,
    compile_step,
    engine_step,
    env_step,
    gpu_tests_step,
    kernel_bench_step,
)

DEFAULT_OUT = Path("bench/results/gpu")
ENV = Step("environment", env_step, 20)
STEPS: dict[str, Step] = {s.name: s for s in (
    ENV,
    Step("compile check", compile_step, 60),
    Step("gpu tests", gpu_tests_step, 150),
    Step("kernel bench", kernel_bench_step, 80),
    Step("engine step", engine_step, 140),
    Step("served burst", burst_step, 130),
)}  # fmt: skip
PARTS: dict[str, tuple[str, ...]] = {
    "kernels": ("environment", "compile check", "kernel bench", "engine step"),
    "serve": ("environment", "gpu tests", "served burst"),
}
PART_ALIASES = {"1": "kernels", "2": "serve"}
DRY_RUN_TIMEOUT_S = 600.0  # the CPU interprets what the GPU runs: the dry run's steps are slower


def _step_ref(fn: StepFn) -> str:
    ref = f"{fn.__module__}:{fn.__qualname__}"
    if "<locals>" in ref:
        raise ValueError(f"step function {ref} must be defined at module level (a child process imports it)")
    return ref


def _resolve(ref: str) -> StepFn:
    module, _, qualname = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def run_one(step: Step, ctx: CheckContext) -> StepResult:
    """``step`` in a child process under ``step.timeout_s``: its result, or a ``timeout``
    or ``fail`` record; never raises."""
    ctx = CheckContext(**{**{f.name: getattr(ctx, f.name) for f in fields(ctx)}, "timeout_s": step.timeout_s})
    stem = re.sub(r"[^a-z0-9]+", "-", step.name.lower())
    ctx_file, result_file = ctx.work_dir / f"step-{stem}.ctx.json", ctx.work_dir / f"step-{stem}.result.json"
    result_file.unlink(missing_ok=True)
    try:
        ctx_file.write_text(ctx.to_json())
        cmd = [sys.executable, "-m", "bench.gpu.check", "--child-step", _step_ref(step.fn),
               "--child-ctx", str(ctx_file), "--child-result", str(result_file)]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
        rc = wait_or_kill(subprocess.Popen(cmd, cwd=REPO_ROOT, env=env), step.timeout_s)
    except Exception as exc:
        return StepResult(step.name, "fail", summary=f"{type(exc).__name__}: {exc}"[:300],
                          data={"traceback": traceback.format_exc()[-4000:]})  # fmt: skip
    if rc == 124:
        return StepResult(step.name, "timeout", summary=f"killed after its {step.timeout_s:.0f} s limit",
                          data={"timeout_s": step.timeout_s})  # fmt: skip
    if not result_file.exists():
        return StepResult(step.name, "fail", summary=f"the step's process exited {rc} without a result")
    result = StepResult(**json.loads(result_file.read_text()))
    result.name = step.name
    return result


def _child(ref: str, ctx_file: Path, result_file: Path) -> int:
    """Run one step in this process and write its result (a raised exception is a ``fail``)."""
    ctx = CheckContext.from_json(ctx_file.read_text())
    try:
        result = _resolve(ref)(ctx)
    except Exception as exc:
        result = StepResult(ref, "fail", summary=f"{type(exc).__name__}: {exc}"[:300],
                            data={"traceback": traceback.format_exc()[-4000:]})  # fmt: skip
    result_file.write_text(json.dumps(asdict(result), default=str))
    return 0


def run_steps(
    ctx: CheckContext, steps: list[Step] | tuple[Step, ...],
    on_progress: Callable[[list[StepResult], str | None], object] | None = None,
) -> list[StepResult]:
    """Each step in its own process under its own limit (a failure or a timeout is recorded,
    never raised); prints one line per step and calls ``on_progress(results, next step)``
    before each step and after the last (the report is rewritten there)."""
    results: list[StepResult] = []
    for step in steps:
        if on_progress:
            on_progress(results, step.name)
        print(f"\n== gpu-check: {step.name} (limit {step.timeout_s:.0f} s) ==", flush=True)
        start = time.perf_counter()
        result = run_one(step, ctx)
        result.seconds = time.perf_counter() - start
        print(f"-- {result.status.upper()} {result.name} ({result.seconds:.0f} s): {result.summary}", flush=True)
        results.append(result)
    if on_progress:
        on_progress(results, None)
    return results


def select_steps(part: str | None, only: list[str] | None, dry_run: bool) -> list[Step]:
    names = list(PARTS[PART_ALIASES.get(part, part)]) if part else list(STEPS)
    if only:  # a step's name or a word of it: env, compile, tests, kernel, engine, burst
        unknown = [o for o in only if not any(o in n for n in STEPS)]
        if unknown:
            raise SystemExit(f"gpu-check: no step {unknown}; the steps are {list(STEPS)}")
        names = [n for n in names if any(o in n for o in only)]
    steps = [STEPS[n] for n in names]
    if dry_run:
        steps = [Step(s.name, s.fn, max(s.timeout_s, DRY_RUN_TIMEOUT_S)) for s in steps]
    return steps


def device_slug(results: list[StepResult]) -> str:
    """The device's name as the steps found it (this process never opens a CUDA context)."""
    device = next((r.data["device"] for r in results if r.name == "environment" and r.data.get("device")), "")
    if not device:
        device = next((r.data["device"] for r in results if isinstance(r.data.get("device"), str)), "")
    if not device:
        device = "gpu" if torch.cuda.is_available() else "cpu-dry-run"
    return re.sub(r"[^a-z0-9]+", "-", str(device).lower()).strip("-")


def write_report(
    ctx: CheckContext, results: list[StepResult], part: str | None = None, running: str | None = None
) -> tuple[Path, Path]:
    """``<device>[-<part>].md`` and ``.json`` in ``ctx.out_dir`` (``running``: the step under
    way, when the report is written between steps)."""
    from bench.gpu.report import render_markdown

    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    slug = device_slug(results) + (f"-{part}" if part else "")
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    payload: dict[str, Any] = {"date": stamp, "dry_run": ctx.dry_run, "quick": ctx.quick,
                               "steps": [asdict(r) for r in results]}  # fmt: skip
    if part:
        payload["part"] = part
    if running:
        payload["running"] = running
    json_path = ctx.out_dir / f"{slug}.json"
    md_path = ctx.out_dir / f"{slug}.md"
    for path, text in ((json_path, json.dumps(payload, indent=2, default=str)), (md_path, render_markdown(payload))):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)  # a reader (or a cut command) never sees half a report
    return md_path, json_path


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu.check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"report directory (default {DEFAULT_OUT} on a GPU, a scratch one in a dry run)")
    parser.add_argument("--part", choices=[*PARTS, *PART_ALIASES], default=None,
                        help="kernels (1): environment, compile check, kernel bench, engine step; "
                             "serve (2): environment, gpu tests, served burst; default every step")
    parser.add_argument("--quick", action="store_true", help="smaller tables (the parts imply it)")
    parser.add_argument("--full", action="store_true", help="the full tables even with --part")
    parser.add_argument("--compile-dtypes", default=",".join(COMPILE_DTYPES),
                        help="dtypes the compile check lowers (comma-separated among bf16, fp16, fp32)")
    parser.add_argument("--dry-run", action="store_true", help="exercise the harness on the CPU")
    parser.add_argument("--only", action="append", default=None,
                        help=f"run only this step (repeatable): {', '.join(STEPS)}")
    parser.add_argument("--child-step", help=argparse.SUPPRESS)
    parser.add_argument("--child-ctx", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-result", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.child_step:
        return _child(args.child_step, args.child_ctx, args.child_result)
    dry_run = args.dry_run or not torch.cuda.is_available()
    if dry_run and not args.dry_run:
        print("gpu-check: no CUDA device visible, so this is a dry run of the harness on the CPU "
              "(nothing here measures a GPU).", flush=True)  # fmt: skip
    if dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dtypes = tuple(d.strip() for d in args.compile_dtypes.split(",") if d.strip())
    if not dtypes or set(dtypes) - {"bf16", "fp16", "fp32"}:
        raise SystemExit(f"gpu-check: --compile-dtypes takes bf16, fp16, fp32 (got {args.compile_dtypes!r})")
    part = PART_ALIASES.get(args.part, args.part)
    work = Path(tempfile.mkdtemp(prefix="inflight-gpu-check-"))
    out = (args.out or (work / "report" if dry_run else DEFAULT_OUT)).resolve()
    quick = args.quick or (part is not None and not args.full)
    ctx = CheckContext(out_dir=out, work_dir=work, dry_run=dry_run, quick=quick, compile_dtypes=dtypes)
    steps = select_steps(part, args.only, dry_run)
    print(f"gpu-check{f' part {part}' if part else ''}: {', '.join(s.name for s in steps)}; "
          f"limits add up to {sum(s.timeout_s for s in steps):.0f} s; report rewritten in {out} after each step",
          flush=True)  # fmt: skip
    paths: list[tuple[Path, Path]] = []

    def progress(results: list[StepResult], running: str | None) -> None:
        if results:  # the device's name comes from the first step
            paths.append(write_report(ctx, results, part, running))

    results = run_steps(ctx, steps, on_progress=progress)
    md, js = paths[-1] if paths else write_report(ctx, results, part)
    print("\n" + "\n".join(f"{r.status.upper():<7} {r.name:<14} {r.seconds:>5.0f} s  {r.summary}" for r in results))
    print(f"\nreport: {md} and {js}; logs in {work}")
    return 1 if any(r.status != "pass" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
