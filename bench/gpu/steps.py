"""The gpu-check's steps and what they share: the context every step reads
(:class:`CheckContext`), a step's record (:class:`StepResult`), and each step as a module-level
function (a child process imports it by name): the environment, the compile check, the
``gpu``-marked tests, the kernel bench, the engine step and the served burst. The order, the
parts, the timeouts and the report are :mod:`bench.gpu.check`'s.
"""

from __future__ import annotations

import json
import platform
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from bench.gpu.children import run_logged

REPO_ROOT = Path(__file__).resolve().parents[2]
PYTEST_WORKERS = 4  # pytest-xdist workers sharing the one GPU, where xdist is installed
COMPILE_DTYPES = ("bf16",)  # what the engine runs on a GPU; --compile-dtypes bf16,fp16,fp32 for all
GPU_TESTS = ["-m", "gpu", "tests/kernels", "tests/runtime/test_engine_matches_transformers.py",
             "tests/runtime/test_decode_graphs.py", "tests/engine/test_host_tier_engine.py",
             "tests/runtime/test_sampler_batched.py", "tests/runtime/test_sampler_async.py",
             "tests/runtime/test_decode_graphs_logits.py", "tests/runtime/test_spec_rejection.py",
             "tests/runtime/test_penalty_state.py", "tests/runtime/test_async_speculative.py"]  # fmt: skip
# gpu-marked tests the loan's step leaves out, and why (tests/bench/test_gpu_check.py holds every
# gpu-marked file to GPU_TESTS or here)
GPU_TESTS_LEFT_OUT = {
    "tests/engine/test_deepseek_v2.py": "MLA and MoE kernels compile for minutes: past the step's 150 s",
    "tests/engine/test_deepseek_v3.py": "MLA and MoE kernels compile for minutes: past the step's 150 s",
    "tests/runtime/test_moe_matches_transformers.py": "the fused MoE kernel's compiles: past the step's 150 s",
    "tests/lora/test_lora_matches_peft.py": "peft is not on the GPU machine (it would travel as a wheel)",
}


@dataclass(frozen=True, slots=True)
class CheckContext:
    """What every step may read."""

    out_dir: Path
    work_dir: Path  # generated models, logs
    dry_run: bool
    quick: bool
    compile_dtypes: tuple[str, ...] = COMPILE_DTYPES
    timeout_s: float = 600.0  # the running step's own limit (its subprocesses stay inside it)

    def to_json(self) -> str:
        return json.dumps({f.name: str(v) if isinstance(v := getattr(self, f.name), Path) else v
                           for f in fields(self)})  # fmt: skip

    @classmethod
    def from_json(cls, text: str) -> CheckContext:
        d = json.loads(text)
        return cls(**{**d, "out_dir": Path(d["out_dir"]), "work_dir": Path(d["work_dir"]),
                      "compile_dtypes": tuple(d["compile_dtypes"])})  # fmt: skip


@dataclass(slots=True)
class StepResult:
    name: str
    status: str  # "pass" | "fail" | "timeout" | "skip"
    seconds: float = 0.0
    summary: str = ""
    data: dict[str, Any] = field(default_factory=dict)


StepFn = Callable[[CheckContext], StepResult]


@dataclass(frozen=True, slots=True)
class Step:
    """One step: a module-level function (the child process imports it by name) and its limit."""

    name: str
    fn: StepFn
    timeout_s: float


def env_step(ctx: CheckContext) -> StepResult:
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


def compile_step(ctx: CheckContext) -> StepResult:
    log = ctx.work_dir / "compile_check.log"
    env = {"TRITON_INTERPRET": "0"}
    dtypes = ctx.compile_dtypes[:1] if ctx.dry_run else ctx.compile_dtypes  # one dtype proves the harness
    results = []
    for dtype in dtypes:
        cmd = [sys.executable, "-m", "bench.gpu.compile_check", "--arch", "90", "--dtype", dtype]
        rc, text = run_logged(cmd, log, max(10.0, ctx.timeout_s / len(dtypes) - 5), env)
        results.append((dtype, rc, text))
    failed = [d for d, rc, _ in results if rc != 0]
    summary = "sm_90: " + ", ".join(f"{d} {'ok' if rc == 0 else 'timed out' if rc == 124 else 'FAILED'}"
                                    for d, rc, _ in results)  # fmt: skip
    return StepResult("compile check", "fail" if failed else "pass", summary=summary,
                      data={"output": {d: t for d, _, t in results}})  # fmt: skip


def run_pytest(ctx: CheckContext, name: str, selection: list[str]) -> StepResult:
    """``pytest selection`` on CUDA, or only its collection (dry run), inside the step's limit."""
    log = ctx.work_dir / f"pytest-{re.sub(r'[^a-z0-9]+', '-', name)}.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection]
    if ctx.dry_run:
        cmd.append("--collect-only")
    elif _importable("xdist"):
        cmd += ["-n", str(PYTEST_WORKERS)]
    rc, text = run_logged(cmd, log, max(10.0, ctx.timeout_s - 10))
    failures = [ln for ln in text.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    ok = rc == 0 or (ctx.dry_run and rc == 5)
    summary = text.strip().splitlines()[-1] if text.strip() else f"exit {rc}"
    return StepResult(name, "timeout" if rc == 124 else "pass" if ok else "fail", summary=summary,
                      data={"exit_code": rc, "failures": failures[:40], "tail": text[-2500:]})  # fmt: skip


def gpu_tests_step(ctx: CheckContext) -> StepResult:
    """Only the ``gpu``-marked tests: kernels on CUDA, engine tokens vs transformers, graphs vs eager."""
    return run_pytest(ctx, "gpu tests", GPU_TESTS)


def kernel_bench_step(ctx: CheckContext) -> StepResult:
    from bench.gpu import kernels as gpu_kernels

    report = gpu_kernels.run_kernel_bench(quick=ctx.quick, dry_run=ctx.dry_run)
    failed = [c["kernel"] + "/" + c["dtype"] for c in report["checks"] if not c["ok"]]
    broken = [f"batch {r['batch']} context {r['context']}" for r in report["decode"] if r.get("error")]
    target = report.get("decode_target")
    copy = report.get("copy_gb_per_s")
    summary = f"copy {copy:.0f} GB/s" if copy else f"copy bandwidth FAILED ({report.get('copy_error')})"
    if target:
        summary += f"; decode attention worst {100 * target['worst_fraction']:.0f}% of copy at batch 64, context 2k-8k"
    graph = report.get("decode_graph_width") or {}
    if "speedup" in graph:
        summary += (f"; graph-width decode {100 * graph['per_row_fraction_of_copy']:.0f}% of copy, "
                    f"{graph['speedup']:.2f}x the width-sized splits")
    elif "error" in graph:
        broken.append(f"graph-width row ({graph['error'][:80]})")
    if failed:
        summary += f"; FAILED checks: {', '.join(failed)}"
    if broken:
        summary += f"; decode points that raised: {', '.join(broken)}"
    return StepResult("kernel bench", "fail" if failed or broken or not copy else "pass", summary=summary, data=report)


def engine_step(ctx: CheckContext) -> StepResult:
    """The decode step vs its roofline, and the simulated device's profile fitted to it."""
    from bench.gpu import engine as gpu_engine
    from bench.gpu import sim_fit

    report = gpu_engine.run_engine_bench(ctx.work_dir, ctx.quick, ctx.dry_run)
    summary = report["summary"]
    try:
        fitted = sim_fit.write_profile(report, ctx.out_dir, dry_run=ctx.dry_run)
        report["sim_profile"] = fitted
        summary += f"; sim profile {Path(fitted['path']).name}"
    except Exception as exc:  # the engine's figures stand without the profile
        report["sim_profile"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        summary += f"; sim profile FAILED ({type(exc).__name__}: {exc})"[:200]
    return StepResult("engine step", "pass" if "path" in report["sim_profile"] else "fail", summary=summary,
                      data=report)  # fmt: skip


def burst_step(ctx: CheckContext) -> StepResult:
    from bench.gpu import burst as gpu_burst

    report = gpu_burst.run_burst(ctx.work_dir, quick=ctx.quick, dry_run=ctx.dry_run,
                                 timeout_s=max(10.0, ctx.timeout_s - 5))  # fmt: skip
    status = "fail" if report["num_errors"] else "pass"
    return StepResult("served burst", status, summary=report["summary"], data=report)


# Each part fits one ~5-minute command (docs/gpu.md): the limits add up to 300 s.
