"""``python -m bench.studies.supervision``: how fast supervision acts across the process boundary.

On a real ``inflight serve`` (the small bench model, 127.0.0.1), with streams in flight (each
has had its first token), repetitions run in turn over three scenarios:

* **core SIGKILL**: the engine core is SIGKILLed; time from the kill until every client has its
  answer (an ``engine_dead`` error event in its stream, or a 503), and until the front end has
  exited, with its exit code (1 expected);
* **front end SIGKILL** (and the same with ``--tensor-parallel-size 2``): the front end is
  SIGKILLed; time until every process it started (the engine core, multiprocessing's resource
  tracker and the tensor-parallel worker) is gone. A process still there after
  ``ORPHAN_WAIT_S`` is counted as an orphan, then killed.

Optionally (``--hostile N``) it runs ``python -m tests.hostile N`` (the hostile-traffic suite,
served by an engine-core process) and puts its summary in the report. Writes
``supervision.md`` / ``.json`` under the results directory. Knows the server only as a process
tree and an HTTP API.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from inflight.bench import report
from inflight.bench.suite import SuiteOptions, bench_model
from inflight.bench.systems import RunningServer, SystemSpec

logger = logging.getLogger("bench.studies.supervision")

NUM_STREAMS = 16
STREAM_TOKENS = 1500  # far more than the few seconds a run lasts: every stream is in flight at the kill
ORPHAN_WAIT_S = 30.0
POLL_S = 0.002
ROLES = (("inflight.runtime.distributed.worker", "TP worker"), ("spawn_main", "engine core"),
         ("resource_tracker", "resource tracker"))  # fmt: skip


@dataclass(frozen=True, slots=True)
class Scenario:
    """Who is killed (``core`` or ``front end``) and the server's extra flags."""

    name: str
    victim: str
    flags: tuple[str, ...] = ()


SCENARIOS = (Scenario("core SIGKILL", "core"),
             Scenario("front end SIGKILL", "front end"),
             Scenario("front end SIGKILL, TP=2", "front end", ("--tensor-parallel-size", "2")))  # fmt: skip


@dataclass(slots=True)
class Trial:
    """One kill: seconds after it for each client's answer and each process's end."""

    scenario: str
    answers: list[tuple[str, float]] = field(default_factory=list)  # (outcome, seconds after the kill)
    gone_s: dict[str, float] = field(default_factory=dict)  # "role pid" -> seconds after the kill
    orphans: list[str] = field(default_factory=list)
    exit_code: int | None = None
    exit_s: float | None = None  # the front end's exit (core SIGKILL only)


def _role(cmdline: list[str]) -> str:
    text = " ".join(cmdline)
    return next((role for marker, role in ROLES if marker in text), "other")


def _tree(pid: int) -> dict[int, str]:
    """pid -> role of every process under ``pid``."""
    import psutil

    out = {}
    for child in psutil.Process(pid).children(recursive=True):
        try:
            out[child.pid] = _role(child.cmdline())
        except psutil.Error:
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has exited


async def _stream(session: aiohttp.ClientSession, url: str, started: asyncio.Queue[None]) -> tuple[str, float]:
    """One long stream: (how it ended, monotonic time it ended). Puts on ``started`` at its first chunk."""
    body = {"model": "bench", "prompt": "def main():", "max_tokens": STREAM_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    code, done, first = None, False, True
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                return f"status {resp.status}", time.monotonic()
            async for raw in resp.content:
                if first and raw.startswith(b"data:"):
                    first = False
                    started.put_nowait(None)
                if raw.startswith(b"data:") and b'"error"' in raw:
                    code = json.loads(raw[5:]).get("error", {}).get("code")
                done = done or raw.startswith(b"data: [DONE]")
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return "cut", time.monotonic()
    if code:
        return f"error {code}", time.monotonic()
    return ("completed" if done else "cut"), time.monotonic()  # no [DONE]: cut short


async def _watch(pids: dict[int, str], gone: dict[str, float], deadline: float) -> None:
    """Record the monotonic time each pid ends (polling), until all have or the deadline passes."""
    left = dict(pids)
    while left and time.monotonic() < deadline:
        for pid in [p for p in left if not _alive(p)]:
            gone[f"{left.pop(pid)} {pid}"] = time.monotonic()
        await asyncio.sleep(POLL_S)


async def _kill_in_flight(server: RunningServer, scenario: Scenario, num_streams: int) -> Trial:
    assert server.proc is not None
    tree = _tree(server.proc.pid)
    (core,) = [pid for pid, role in tree.items() if role == "engine core"]
    trial = Trial(scenario.name)
    started: asyncio.Queue[None] = asyncio.Queue()
    timeout = aiohttp.ClientTimeout(total=ORPHAN_WAIT_S + 60)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        clients = [asyncio.create_task(_stream(session, server.url, started)) for _ in range(num_streams)]
        for _ in range(num_streams):
            await asyncio.wait_for(started.get(), 120)
        if scenario.victim == "core":
            watched, victim = {server.proc.pid: "front end"}, core
        else:
            watched, victim = tree, server.proc.pid
        gone: dict[str, float] = {}
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        watch = asyncio.create_task(_watch(watched, gone, killed + ORPHAN_WAIT_S))
        answers = await asyncio.gather(*clients)
        await watch
    trial.answers = [(outcome, at - killed) for outcome, at in answers]
    trial.gone_s = {name: at - killed for name, at in gone.items()}
    trial.orphans = [f"{role} {pid}" for pid, role in watched.items() if _alive(pid)]
    for name in trial.orphans:
        os.kill(int(name.rsplit(" ", 1)[1]), signal.SIGKILL)  # leave nothing behind the bench
    if scenario.victim == "core":
        trial.exit_code = server.proc.wait(5)
        trial.exit_s = trial.gone_s.get(f"front end {server.proc.pid}")
    return trial


def run_trials(model_dir: Path, reps: int, num_streams: int, log_dir: Path) -> list[Trial]:
    log_dir.mkdir(parents=True, exist_ok=True)
    trials = []
    for rep in range(reps):
        for scenario in SCENARIOS:
            spec = SystemSpec(scenario.name, "inflight", scenario.flags)
            log = log_dir / f"{scenario.name.replace(' ', '_').replace(',', '')}_{rep}.log"
            with RunningServer(spec, model_dir, log) as server:
                trial = asyncio.run(_kill_in_flight(server, scenario, num_streams))
            logger.info("%s rep %d: %s", scenario.name, rep, trial)
            trials.append(trial)
    return trials


def run_hostile(num_examples: int) -> dict[str, object]:
    """``python -m tests.hostile N`` from the repository root: its printed summary and wall time."""
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tests.hostile", str(num_examples)], capture_output=True,
                          text=True, check=False)  # fmt: skip
    lines = done.stdout.splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("malformed requests tried")), None)
    summary = lines[first:] if first is not None else (done.stdout + done.stderr).splitlines()[-20:]
    return {"examples": num_examples, "exit_code": done.returncode, "seconds": time.monotonic() - t0,
            "summary": [line for line in summary if line.strip()]}


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{1e3 * statistics.median(values):.0f} ({1e3 * min(values):.0f}-{1e3 * max(values):.0f})"


def _per_scenario(trials: list[Trial], name: str, pick: Callable[[Trial], list[float]]) -> list[float]:
    return [v for t in trials if t.scenario == name for v in pick(t)]


def render(trials: list[Trial], reps: int, num_streams: int, hostile: dict[str, object] | None) -> str:
    rows = []
    for s in SCENARIOS:
        mine = [t for t in trials if t.scenario == s.name]
        outcomes = Counter(o for t in mine for o, _ in t.answers)
        last_answer = _per_scenario(trials, s.name, lambda t: [max(at for _, at in t.answers)])
        if s.victim == "core":
            ended = _per_scenario(trials, s.name, lambda t: [t.exit_s] if t.exit_s is not None else [])
            what = "front end exited, codes " + ",".join(str(t.exit_code) for t in mine)
        else:
            ended = _per_scenario(trials, s.name, lambda t: [max(t.gone_s.values())] if t.gone_s else [])
            roles = sorted({name.rsplit(" ", 1)[0] for t in mine for name in t.gone_s})
            what = "all gone: " + ", ".join(roles)
        rows.append([s.name, ", ".join(f"{n} {o}" for o, n in outcomes.most_common()), _spread(last_answer),
                     _spread(ended), what, sum(len(t.orphans) for t in mine)])
    table = report.simple_table(["scenario", "client answers", "last client answered, ms", "ended, ms",
                                 "what ended", "orphans"], rows)  # fmt: skip
    core_by_role = {}
    for s in SCENARIOS[1:]:
        for role in ("engine core", "TP worker", "resource tracker"):
            values = _per_scenario(trials, s.name, lambda t, r=role: [v for k, v in t.gone_s.items() if k.startswith(r)])
            if values:
                core_by_role[f"{s.name}: {role}"] = _spread(values)
    by_role = "\n".join(f"* {name}: {spread} ms" for name, spread in core_by_role.items())
    text = (f"# Supervision across the process boundary\n\n`inflight serve`, small bench model, this CPU; "
            f"{num_streams} streams in flight ({STREAM_TOKENS} tokens asked, each had its first token) at the "
            f"SIGKILL; {reps} repetitions per scenario, in turn; median (min-max) ms after the kill. Process "
            f"ends are polled every {1e3 * POLL_S:.0f} ms; an orphan is a process still there "
            f"{ORPHAN_WAIT_S:.0f} s after the kill.\n\n{table}\n\nAfter a front-end SIGKILL, per process:\n\n"
            f"{by_role}\n\nThe core dies with its parent (`PR_SET_PDEATHSIG`); a TP worker polls its parent pid "
            "every 0.5 s (`distributed/worker.py`), so it follows the core up to 0.5 s later, plus its own "
            "exit.\n")  # fmt: skip
    if hostile is not None:
        summary = "\n".join(f"    {line}" for line in hostile["summary"])  # type: ignore[union-attr]
        text += (f"\n## Hostile suite in engine-core mode\n\n`python -m tests.hostile {hostile['examples']}` "
                 f"(exit code {hostile['exit_code']}, {hostile['seconds']:.0f} s wall):\n\n{summary}\n")  # fmt: skip
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.studies.supervision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--streams", type=int, default=NUM_STREAMS)
    parser.add_argument("--hostile", type=int, default=0, metavar="N",
                        help="also run `python -m tests.hostile N` (from the repository root); 0: skip")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model_dir = bench_model(SuiteOptions(results_dir=args.results_dir, models_dir=args.models_dir), "small")
    trials = run_trials(model_dir, args.reps, args.streams, Path("bench/.work/supervision_logs"))
    hostile = run_hostile(args.hostile) if args.hostile > 0 else None
    text = render(trials, args.reps, args.streams, hostile)
    print("\n" + text)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "supervision.md").write_text(text)
    report.write_json(args.results_dir / "supervision.json", {
        "num_streams": args.streams, "reps": args.reps, "hostile": hostile,
        "trials": [{"scenario": t.scenario, "answers": t.answers, "gone_s": t.gone_s, "orphans": t.orphans,
                    "exit_code": t.exit_code, "exit_s": t.exit_s} for t in trials],
    })  # fmt: skip
    bad = [t for t in trials if t.orphans or (t.exit_code is not None and t.exit_code == 0)]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
