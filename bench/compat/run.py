"""``make compat``: real outside clients against a served model, one table.

    python -m bench.compat.run [--model smollm2|demo|DIR] [--num-docs 24] [--skip TOOL ...]

Installs lm-eval, guidellm and the openai client, each in its own environment under
``--work-dir`` (:mod:`bench.compat.envs`), serves the model with ``inflight serve`` on
127.0.0.1 (SmolLM2-135M-Instruct as ``make run`` serves it, by default), then runs:

* the openai client: a chat, the same chat streamed, ``models.retrieve``
  (:mod:`bench.compat.openai_run`);
* a short guidellm run, its headline figures (:mod:`bench.compat.guidellm_run`);
* lm-eval, loglikelihood (multiple choice) and generate-until on a local task, through
  ``local-completions`` against the server and through lm-eval's own ``hf`` backend on the same
  weights (the server is stopped first): accuracies, the largest loglikelihood difference,
  identical generations (:mod:`bench.compat.lm_eval_run`).

Prints one table and writes it to ``--results-dir``/compat.md (and compat.json). Exits 1 if a
check failed or a tool could not be installed. Knows how the pieces are put together, not how
any one of them works.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.compat import envs as compat_envs
from bench.compat import guidellm_run as compat_guidellm
from bench.compat import lm_eval_run as compat_lm_eval
from bench.compat.envs import GUIDELLM, LM_EVAL, OPENAI, ToolEnv
from inflight.bench.report import simple_table
from inflight.bench.systems import HOST, free_port, http_ok

logger = logging.getLogger("inflight.bench")

READY_TIMEOUT_S = 300.0
TOOL_TIMEOUT_S = 1800.0
SMOLLM2_NAME = "smollm2-135m-instruct"


@dataclass(frozen=True, slots=True)
class CompatRow:
    """One line of the table: which client, which check, what came back, pass or fail."""

    tool: str
    check: str
    result: str
    ok: bool


@dataclass(frozen=True, slots=True)
class CompatOptions:
    work_dir: Path
    results_dir: Path
    models_dir: Path
    model: str = "smollm2"  # "smollm2", "demo" or a model directory
    num_docs: int = 24
    load: compat_guidellm.GuidellmLoad = field(default_factory=compat_guidellm.GuidellmLoad)
    skip: tuple[str, ...] = ()


def build_table(rows: list[CompatRow], header_note: str = "") -> str:
    """The markdown table ``make compat`` prints, one row per check."""
    table = simple_table(("client", "check", "result", "ok"),
                         [(r.tool, r.check, r.result.replace("|", "\\|").replace("\n", "\\n"),
                           "PASS" if r.ok else "FAIL") for r in rows])
    passed = sum(r.ok for r in rows)
    lines = [header_note, ""] if header_note else []
    return "\n".join([*lines, table, "", f"{passed}/{len(rows)} checks passed."])


def server_command(model_dir: Path, served_name: str, port: int) -> list[str]:
    """``inflight serve`` as ``make run`` starts it (a smaller KV cache, room for lm-eval's 4 at once)."""
    config = json.loads((model_dir / "config.json").read_text())
    max_model_len = min(2048, int(config.get("max_position_embeddings", 2048)))
    return [sys.executable, "-m", "inflight.runtime", "serve", str(model_dir), "--served-model-name", served_name,
            "--host", HOST, "--port", str(port), "--num-kv-blocks", "512", "--max-model-len", str(max_model_len),
            "--max-num-seqs", "8"]


class CompatServer:
    """``inflight serve`` in a subprocess on a free port; use as a context manager."""

    def __init__(self, model_dir: Path, served_name: str, log_path: Path) -> None:
        self.model_dir, self.served_name, self.log_path = model_dir, served_name, log_path
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def __enter__(self) -> CompatServer:
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(server_command(self.model_dir, self.served_name, self.port), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not http_ok(self.url + "/ready"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-1500:]
                raise RuntimeError(f"inflight serve did not become ready; {self.log_path} ends:\n{tail}")
            time.sleep(0.5)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


def tool_env() -> dict[str, str]:
    """The environment the outside tools run in: offline for model hubs, this checkout importable."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(compat_envs.REPO_ROOT))
    return env


def _run_tool(cmd: list[str], log: Path) -> subprocess.CompletedProcess[str]:
    logger.info("$ %s  (log: %s)", " ".join(cmd), log)
    done = subprocess.run(cmd, capture_output=True, text=True, env=tool_env(), timeout=TOOL_TIMEOUT_S, check=False)
    log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")
    return done


def run_openai(work_dir: Path, server: CompatServer) -> list[CompatRow]:
    python = str(compat_envs.env_python(work_dir, OPENAI))
    cmd = [python, "-m", "bench.compat.openai_run", "--base-url", server.url, "--model", server.served_name]
    done = _run_tool(cmd, work_dir / "openai.log")
    if done.returncode != 0:
        return [CompatRow(f"openai {OPENAI.version}", "client run", f"exit {done.returncode}: {done.stderr[-300:]}",
                          False)]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return [CompatRow(f"openai {out['openai_version']}", c["check"], c["result"], c["ok"]) for c in out["checks"]]


def run_guidellm(work_dir: Path, server: CompatServer, model_dir: Path,
                 load: compat_guidellm.GuidellmLoad) -> list[CompatRow]:
    out_json = work_dir / "guidellm.json"
    out_json.unlink(missing_ok=True)
    exe = str(compat_envs.env_executable(work_dir, GUIDELLM))
    done = _run_tool(compat_guidellm.command(exe, server.url, server.served_name, model_dir, out_json, load),
                     work_dir / "guidellm.log")
    name = f"guidellm {GUIDELLM.version}"
    check = (f"concurrent x{load.concurrency}, {load.num_requests} chat requests "
             f"({load.prompt_tokens} in / {load.output_tokens} out tokens)")
    if done.returncode != 0 or not out_json.is_file():
        return [CompatRow(name, check, f"exit {done.returncode}: see {work_dir / 'guidellm.log'}", False)]
    figures = compat_guidellm.headline(json.loads(out_json.read_text()))
    return [CompatRow(name, check, figures.describe(load), figures.ok)]


def lm_eval_rows(comparison: compat_lm_eval.LmEvalComparison, seconds: tuple[float, float]) -> list[CompatRow]:
    c, name = comparison, f"lm-eval {LM_EVAL.version}"
    timing = f"hf {seconds[0]:.0f} s, local-completions {seconds[1]:.0f} s"
    return [
        CompatRow(name, f"loglikelihood, local-completions vs hf ({c.num_docs} questions, {c.num_loglikelihoods} "
                        "loglikelihoods)",
                  f"acc {c.acc_ours:.3f} vs {c.acc_hf:.3f}; max loglikelihood difference "
                  f"{c.max_loglikelihood_diff:.1e} (target <= {compat_lm_eval.TOLERANCE:.0e}); {timing}",
                  c.loglikelihood_ok),
        CompatRow(name, f"generate-until, local-completions vs hf ({c.num_docs} questions, greedy)",
                  f"exact_match {c.exact_match_ours:.3f} vs {c.exact_match_hf:.3f}; identical generations "
                  f"{c.same_generations}/{c.num_docs}", c.generate_ok),
    ]


def _lm_eval(work_dir: Path, tag: str, cmd: list[str], out_dir: Path) -> tuple[compat_lm_eval.LmEvalRun | str, float]:
    start = time.perf_counter()
    done = _run_tool(cmd, work_dir / f"lm-eval-{tag}.log")
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        return f"{tag}: exit {done.returncode}, see {work_dir / f'lm-eval-{tag}.log'}", seconds
    return compat_lm_eval.read_run(out_dir), seconds


def resolve_model(options: CompatOptions) -> tuple[Path, str]:
    """The model directory to serve and the name it is served as."""
    if options.model == "smollm2":
        from inflight.runtime.model.gguf_smollm2 import ensure_smollm2

        return ensure_smollm2(options.models_dir, logger.info), SMOLLM2_NAME
    if options.model == "demo":
        from inflight.runtime.demo.model import make_demo_model

        path = options.models_dir / "demo"
        return (path if (path / "config.json").is_file() else make_demo_model(path)), "demo"
    path = Path(options.model)
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {options.model}: not smollm2, demo or a model directory with a config.json")
    return path, path.name


def install_tools(options: CompatOptions) -> tuple[list[ToolEnv], list[CompatRow]]:
    ready, failed = [], []
    for tool in compat_envs.TOOLS:
        if tool.name in options.skip:
            continue
        try:
            compat_envs.ensure_env(options.work_dir, tool)
            ready.append(tool)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            failed.append(CompatRow(f"{tool.name} {tool.version}", "install", str(exc), False))
    return ready, failed


def run(options: CompatOptions) -> list[CompatRow]:
    """Every check, in order; a tool that cannot be installed is a failed row, not an exception."""
    options.work_dir.mkdir(parents=True, exist_ok=True)
    tools, rows = install_tools(options)
    model_dir, served_name = resolve_model(options)
    with tempfile.TemporaryDirectory(dir=options.work_dir) as tmp:
        tmp_path = Path(tmp)
        task_dir = compat_lm_eval.write_tasks(tmp_path / "tasks", options.num_docs)
        lm_eval = str(compat_envs.env_executable(options.work_dir, LM_EVAL))
        ours: compat_lm_eval.LmEvalRun | str = ""
        ours_s = 0.0
        with CompatServer(model_dir, served_name, options.work_dir / "server.log") as server:
            logger.info("serving %s as %s on %s", model_dir, served_name, server.url)
            if OPENAI in tools:
                rows += run_openai(options.work_dir, server)
            if GUIDELLM in tools:
                rows += run_guidellm(options.work_dir, server, model_dir, options.load)
            if LM_EVAL in tools:
                cmd = compat_lm_eval.local_completions_command(lm_eval, served_name, server.url, model_dir, task_dir,
                                                               tmp_path / "out-ours")
                ours, ours_s = _lm_eval(options.work_dir, "local-completions", cmd, tmp_path / "out-ours")
        if LM_EVAL in tools:
            cmd = compat_lm_eval.hf_command(lm_eval, model_dir, task_dir, tmp_path / "out-hf")
            hf, hf_s = _lm_eval(options.work_dir, "hf", cmd, tmp_path / "out-hf")
            if isinstance(hf, str) or isinstance(ours, str):
                why = "; ".join(x for x in (hf, ours) if isinstance(x, str))
                rows.append(CompatRow(f"lm-eval {LM_EVAL.version}", "local-completions vs hf", why, False))
            else:
                rows += lm_eval_rows(compat_lm_eval.compare(hf, ours), (hf_s, ours_s))
    return rows


def write_results(rows: list[CompatRow], options: CompatOptions, note: str) -> str:
    table = build_table(rows, note)
    options.results_dir.mkdir(parents=True, exist_ok=True)
    (options.results_dir / "compat.md").write_text("## Compatibility: outside clients against `inflight serve`\n\n"
                                                   f"`make compat` (`python -m bench.compat.run`).\n\n{table}\n")
    (options.results_dir / "compat.json").write_text(json.dumps(
        {"note": note, "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compat.run", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (default), demo, or a model directory")
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--work-dir", type=Path, default=Path("bench/.work/compat"),
                        help="the tools' environments and logs (gitignored)")
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--num-docs", type=int, default=24, help=f"lm-eval questions (1-{len(compat_lm_eval.CAPITALS)})")
    parser.add_argument("--guidellm-requests", type=int, default=32)
    parser.add_argument("--skip", nargs="*", default=[], choices=[t.name for t in compat_envs.TOOLS])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    options = CompatOptions(work_dir=args.work_dir.resolve(), results_dir=args.results_dir,
                            models_dir=args.models_dir.resolve(), model=args.model, num_docs=args.num_docs,
                            load=compat_guidellm.GuidellmLoad(num_requests=args.guidellm_requests),
                            skip=tuple(args.skip))
    start = time.monotonic()
    rows = run(options)
    import torch

    note = (f"Model: {options.model}, float32 on the CPU ({os.cpu_count()} cores, torch {torch.__version__}); "
            f"{time.monotonic() - start:.0f} s in all.")
    print("\n" + write_results(rows, options, note))
    return 0 if rows and all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
