"""CPU decode step A/B: ms per step of N decodes on the bench models, variants side by side in one process.

    python -m bench.cpu.step [--models small medium] [--variants default unpacked]
        [--rounds 5] [--batch 64] [--steps 10] [--alt-attention FILE] [--profile] [--json FILE]

Each variant is an in-process engine on ``models/bench-<size>`` (made on first use), loaded
once, float32, native CPU kernels, the engine's own thread and lane choices. A variant is
``default`` or modifiers joined by ``+``:

* ``unpacked``: loaded with ``INFLIGHT_CPU_PREPACK=0`` (float linear weights: ``F.linear`` and
  the few-row kernel) instead of MKL-packed ones;
* ``alt-attn``: decode attention from ``--alt-attention FILE``, a C file with the same
  ``inflight_paged_decode_attention_f32`` (e.g. an older ``cpu_kernels.c``: ``git show
  REV:inflight/kernels/cpu_kernels.c > FILE``), built beside the current one;
* ``no-lanes``: loaded with ``INFLIGHT_CPU_LANES=0``;
* ``no-copy``: loaded with ``INFLIGHT_CPU_FLOAT_COPY=0`` (packed weights keep no float copy, so
  few-row products run on MKL's packed GEMM too; ``copy``: ``=1``, a float copy on any CPU);
* ``mkl``, ``onednn``: loaded with ``INFLIGHT_CPU_PACK_FORMAT`` set so (the linear weights
  packed for MKL's or oneDNN's GEMM, whatever this CPU's default);
* ``one-thread``: loaded with ``INFLIGHT_CPU_THREADS=1`` (one core does everything: no lanes,
  and the figure moves less when another process holds the other cores);
* ``split-attn``: the decode attention block as separate kernel calls (split, rotary, KV store,
  attention) instead of the one call of :mod:`inflight.kernels.decode_block`;
* ``per-layer``: a pure-decode step's layers op by op (eight calls a layer) instead of the whole
  stack in one call (:mod:`inflight.kernels.decode_stack`).

A run: ``batch`` sequences with random ``--prompt-len``-token prompts are prefilled, one
decode step runs untimed, then ``steps`` decode steps are timed one by one (``LLMEngine.step``,
token ids only); its figure is the median step. Every round runs every model and variant,
variants in a rotated order; the report gives the median (min-max) over rounds and each
variant's ratio to the first (the median of the per-round ratios). ``--profile`` adds one run
per variant with every ``KernelOps`` call timed: milliseconds per step per op (linears split by
layer), summed over the threads that ran them and divided by the decode lanes; "rest" is the
step minus the ops (embedding, residual adds, Python, scheduling, sampling). With decode lanes
it also replays one lane of a step alone on the main thread (``lane alone`` columns: what each
op costs without the other lane holding the GIL and sharing the caches; its "rest" has no
scheduling or sampling) and counts the Python-level calls per decoder layer of a lane (Python
functions, and C functions called from Python: each torch op or allocation among them is a
point where a lane drops the GIL and may wait to get it back). The machine is shared and
noisy: read the ratios, not the absolute figures. Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inflight.runtime.config import EngineConfig  # inflight.runtime sets passive OpenMP waits before torch loads
from inflight.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from inflight.runtime.core.engine import LLMEngine

MODIFIERS = ("unpacked", "alt-attn", "no-lanes", "one-thread", "split-attn", "per-layer", "no-copy", "copy", "mkl",
             "onednn")
OP_FIELDS = ("linear", "paged_decode_attention", "paged_prefill_attention", "rms_norm", "rotary_embedding",
             "store_kv_cache", "silu_and_mul", "decode_attention_block", "decode_layer_stack")
LINEAR_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


def parse_variant(name: str) -> frozenset[str]:
    mods = frozenset() if name == "default" else frozenset(name.split("+"))
    unknown = mods - set(MODIFIERS)
    if unknown:
        raise ValueError(f"unknown variant modifier(s) {sorted(unknown)}; use default or {'+'.join(MODIFIERS)}")
    return mods


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def alt_attention(source: Path) -> Callable[..., torch.Tensor]:
    """``paged_decode_attention`` running ``source``'s C kernel (same signature as the current one)."""
    from inflight.kernels import cpu_native

    return cpu_native.decode_attention_from(source)


def load_engine(model_dir: Path, mods: frozenset[str], batch: int, max_len: int,
                alt: Callable[..., torch.Tensor] | None) -> LLMEngine:
    from inflight.runtime.core.engine import LLMEngine

    env = {}
    if "unpacked" in mods:
        env["INFLIGHT_CPU_PREPACK"] = "0"
    if "no-lanes" in mods:
        env["INFLIGHT_CPU_LANES"] = "0"
    if "no-copy" in mods or "copy" in mods:
        env["INFLIGHT_CPU_FLOAT_COPY"] = "0" if "no-copy" in mods else "1"
    if "one-thread" in mods:
        env["INFLIGHT_CPU_THREADS"] = "1"
    for fmt in ("mkl", "onednn"):
        if fmt in mods:
            env["INFLIGHT_CPU_PACK_FORMAT"] = fmt
    config = EngineConfig(max_num_sequences=batch, max_model_len=max_len, block_size=16, dtype="float32",
                          num_kv_blocks=batch * -(-max_len // 16) + 8, device="cpu", kernel_backend="auto")
    with _env(env):
        engine = LLMEngine.from_model_dir(model_dir, config)
    if "alt-attn" in mods:
        if alt is None:
            raise ValueError("variant alt-attn needs --alt-attention FILE")
        engine.runner.ops = dataclasses.replace(engine.runner.ops, paged_decode_attention=alt)
    if "split-attn" in mods:
        engine.runner.ops = dataclasses.replace(engine.runner.ops, decode_attention_block=None)
    if "per-layer" in mods:
        engine.runner.ops = dataclasses.replace(engine.runner.ops, decode_layer_stack=None)
    engine.warmup()
    return engine


class OpTimer:
    """Wraps an engine's kernel bundle to sum the seconds spent in each op (and linear layer)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds: dict[str, float] = {}
        self.threads: set[int] = set()
        self._lock = threading.Lock()
        self._engine = engine
        self._original = engine.runner.ops
        names = {}
        for name, module in engine.runner.model.named_modules():
            if name.rsplit(".", 1)[-1] in LINEAR_NAMES:
                names[id(module.weight)] = "linear." + name.rsplit(".", 1)[-1]
        wrapped = {f: self._wrap(f, getattr(self._original, f), names if f == "linear" else None)
                   for f in OP_FIELDS if getattr(self._original, f) is not None}
        engine.runner.ops = dataclasses.replace(self._original, **wrapped)

    def _wrap(self, field: str, fn: Callable[..., Any], names: dict[int, str] | None) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                key = names.get(id(args[1]), "linear.other") if names is not None else field
                with self._lock:
                    self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0
                    self.threads.add(threading.get_ident())

        return timed

    def reset(self) -> None:
        self.seconds, self.threads = {}, set()

    def close(self) -> None:
        self._engine.runner.ops = self._original


def time_decode(engine: LLMEngine, prompts: list[list[int]], steps: int, tag: str,
                timer: OpTimer | None = None) -> dict[str, Any]:
    """Prefill ``prompts``, one untimed decode step, then ``steps`` timed decode steps."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for req_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(req_id, list(prompt), params)
    sched = engine.scheduler
    while sched.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()
    engine.step()
    times: list[float] = []
    ops: list[dict[str, float]] = []
    for _ in range(steps):
        if timer is not None:
            timer.reset()
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        if timer is not None:
            lanes = max(1, len(timer.threads))
            ops.append({k: 1e3 * v / lanes for k, v in timer.seconds.items()})
    if sched.num_running != len(prompts):
        raise RuntimeError(f"expected {len(prompts)} running sequences, had {sched.num_running}")
    for req_id in ids:
        engine.abort_request(req_id)
    while engine.has_unfinished_requests():
        engine.step()
    out: dict[str, Any] = {"step_ms": 1e3 * statistics.median(times)}
    if ops:
        keys = sorted({k for o in ops for k in o})
        out["ops_ms"] = {k: statistics.median([o.get(k, 0.0) for o in ops]) for k in keys}
        out["ops_ms"]["rest"] = out["step_ms"] - sum(out["ops_ms"].values())
    return out


def lane_alone(engine: LLMEngine, prompts: list[list[int]], reps: int) -> dict[str, Any] | None:
    """One lane of a real decode step replayed alone on this thread, inside that step (so its
    KV is live; the replay rewrites the lane's slots with the same values): ms per op, "rest"
    and "step" (medians of ``reps``), and "calls", the Python-level calls per decoder layer
    (the lane's calls / layers). None when the engine runs no decode lanes."""
    from inflight.runtime.worker.cpu.lanes import lane_meta

    lanes = getattr(engine.runner, "_lanes", None)  # the runner's DecodeLanes, when it runs lanes
    if lanes is None:
        return None
    found: list[dict[str, Any]] = []
    forward = lanes.forward

    def replay(input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, sample_indices: torch.Tensor,
               logits_fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        if not found:
            rows = lanes.step_lanes(meta)[0]
            args = (input_ids[rows], positions[rows], lane_meta(meta, rows))
            found.append(_time_lane(engine, logits_fn, args, reps))
        return forward(input_ids, positions, meta, sample_indices, logits_fn)

    lanes.forward = replay
    try:
        time_decode(engine, prompts, 1, "lane-alone")
    finally:
        del lanes.forward  # the instance attribute goes; the method is back
    return found[0] if found else None


def _time_lane(engine: LLMEngine, logits_fn: Callable[..., torch.Tensor], args: tuple[Any, ...],
               reps: int) -> dict[str, Any]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runs: list[dict[str, float]] = []
    try:
        with torch.inference_mode():
            logits_fn(*args)
            calls = {"python": 0, "c": 0}

            def count(frame: Any, event: str, arg: Any) -> None:
                if event in ("call", "c_call"):
                    calls["python" if event == "call" else "c"] += 1

            sys.setprofile(count)
            try:
                logits_fn(*args)
            finally:
                sys.setprofile(None)
            timer = OpTimer(engine)
            try:
                for _ in range(reps):
                    timer.reset()
                    t0 = time.perf_counter()
                    logits_fn(*args)
                    step = 1e3 * (time.perf_counter() - t0)
                    ops = {k: 1e3 * v for k, v in timer.seconds.items()}
                    runs.append({**ops, "rest": step - sum(ops.values()), "step": step})
            finally:
                timer.close()
    finally:
        torch.set_num_threads(threads)
    out: dict[str, Any] = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0]}
    layers = engine.runner.spec.num_layers
    out["calls"] = {k: v / layers for k, v in calls.items()}
    return out


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _fmt(s: dict[str, float], digits: int = 1) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def profile_table(profiles: dict[str, dict[str, float]]) -> list[str]:
    """Markdown rows: one op per row, one variant per column (ms per step)."""
    variants = list(profiles)
    keys = sorted({k for p in profiles.values() for k in p if k not in ("rest", "step")}, key=lambda k: (k[:6] != "linear", k))
    lines = ["| ms per step | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
    for key in [*keys, "rest", "step"]:
        lines.append(f"| {key} | " + " | ".join(f"{profiles[v].get(key, 0.0):.2f}" for v in variants) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["small", "medium"], choices=["small", "medium"])
    parser.add_argument("--variants", nargs="+", default=["default", "unpacked"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--alt-attention", type=Path, default=None)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    import torch

    from inflight.bench.suite import SuiteOptions, bench_model

    mods = {v: parse_variant(v) for v in args.variants}
    alt = alt_attention(args.alt_attention) if args.alt_attention else None
    load_start, start = os.getloadavg()[0], time.perf_counter()
    max_len = args.prompt_len + args.steps + 32
    engines: dict[tuple[str, str], LLMEngine] = {}
    prompts: dict[str, list[list[int]]] = {}
    for size in args.models:
        model_dir = bench_model(SuiteOptions(models_dir=args.models_dir), size)
        for variant in args.variants:
            engines[(size, variant)] = load_engine(model_dir, mods[variant], args.batch, max_len, alt)
        vocab = engines[(size, args.variants[0])].runner.spec.vocab_size
        rng = random.Random(size)
        prompts[size] = [[rng.randrange(8, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    print(f"{len(engines)} engines loaded ({time.perf_counter() - start:.0f} s); threads {torch.get_num_threads()}, "
          f"cores {len(os.sched_getaffinity(0))}, load average {load_start:.2f}", flush=True)
    runs: dict[tuple[str, str], list[float]] = {key: [] for key in engines}
    for rnd in range(args.rounds):
        for size in args.models:
            shift = rnd % len(args.variants)
            for variant in args.variants[shift:] + args.variants[:shift]:
                res = time_decode(engines[(size, variant)], prompts[size], args.steps, f"r{rnd}")
                runs[(size, variant)].append(res["step_ms"])
                print(f"round {rnd + 1} {size} {variant}: {res['step_ms']:.2f} ms/step", flush=True)
    report: dict[str, Any] = {"batch": args.batch, "steps": args.steps, "prompt_len": args.prompt_len,
                              "rounds": args.rounds, "loadavg_start": load_start, "results": {}}
    print(f"\n{args.batch} decodes, ms per step, median (min-max) of {args.rounds} rounds; ratio = first variant / this")
    for size in args.models:
        base = runs[(size, args.variants[0])]
        for variant in args.variants:
            ms = runs[(size, variant)]
            ratio = _spread([b / m for b, m in zip(base, ms, strict=True)])
            report["results"][f"{size}/{variant}"] = {"step_ms": _spread(ms), "speedup_vs_first": ratio, "runs": ms}
            print(f"  {size:6s} {variant:24s} {_fmt(_spread(ms), 2):>22s}   x{_fmt(ratio, 2)}")
    if args.profile:
        for size in args.models:
            profiles, calls = {}, {}
            for variant in args.variants:
                alone = lane_alone(engines[(size, variant)], prompts[size], args.steps)
                timer = OpTimer(engines[(size, variant)])
                res = time_decode(engines[(size, variant)], prompts[size], args.steps, "profile", timer)
                timer.close()
                profiles[variant] = {**res["ops_ms"], "step": res["step_ms"]}
                if alone is not None:
                    calls[variant] = alone.pop("calls")
                    profiles[f"{variant}, lane alone"] = alone
            report["results"][f"{size}/profile"] = profiles
            report["results"][f"{size}/calls_per_layer"] = calls
            print(f"\nprofile, {size} model, {args.batch} decodes (ops summed over lanes / lanes)")
            print("\n".join(profile_table(profiles)))
            for variant, c in calls.items():
                print(f"  {variant}: per decoder layer of a lane, {c['python']:.1f} Python function calls, "
                      f"{c['c']:.1f} C function calls")
    report["loadavg_end"] = os.getloadavg()[0]
    report["elapsed_s"] = time.perf_counter() - start
    print(f"\nload average {load_start:.2f} -> {report['loadavg_end']:.2f}, {report['elapsed_s']:.0f} s")
    for engine in engines.values():
        engine.runner.close()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
