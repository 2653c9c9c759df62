"""What routing costs on the CPU: a decode step of a random Qwen3-MoE against the dense Qwen3 of the same active size.

    python -m bench.studies.moe_step [--rounds 5] [--batches 1 64] [--experts 32] [--out bench/results]

Builds two random float32 models with the demo-model maker in a temporary directory (deleted
at the end): a Qwen3-MoE (every layer an expert layer, top-k routing with ``norm_topk_prob``)
and the dense Qwen3 with the same hidden size, layers, heads and vocabulary whose MLP is as
wide as the MoE's active experts together (``top_k * moe_intermediate_size``), so both spend
the same matmul FLOPs per token. Both are loaded at once as in-process engines on the CPU
(``kernel_backend`` auto: the native CPU kernels; expert layers through
``KernelOps.fused_moe``'s torch reference, which sorts the (token, expert) pairs by expert and
runs two matmuls per active expert). For each batch size, ``batch`` sequences with short
random prompts are prefilled, one decode step is run untimed, then ``steps`` decode steps are
timed one by one (``LLMEngine.step``, token ids only); a run's figure is the median step.
MoE and dense runs are interleaved, ``rounds`` times, in a rotated order; the report gives
the median and (min-max) over rounds, the MoE/dense ratio per batch size (median of the
per-round ratios), and the share of the MoE step spent inside ``fused_moe`` (its time summed
over the decode lanes that ran the step, divided by the number of lanes).

Writes ``moe_step.json`` and ``moe_step.md`` under ``--out``. The figures depend on the
machine (cores, memory bandwidth, what else runs); nothing here is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.demo.model import SIZES, make_demo_model
from inflight.runtime.sampling_params import SamplingParams

PROMPT_LEN = 8
MAX_MODEL_LEN = 64
SIZE = "0.5b"  # hidden 1024, 16 heads (8 KV heads, head_dim 128), vocabulary 16384; saved in bfloat16


@dataclasses.dataclass(frozen=True, slots=True)
class Shape:
    layers: int
    experts: int
    top_k: int
    moe_intermediate: int

    @property
    def dense_intermediate(self) -> int:
        return self.top_k * self.moe_intermediate


def build_models(root: Path, shape: Shape, seed: int) -> tuple[Path, Path]:
    """The random Qwen3-MoE and the dense Qwen3 of the same active size, under ``root``."""
    layer_types = ["full_attention"] * shape.layers
    moe = make_demo_model(
        root / "moe", arch="qwen3_moe", size=SIZE, seed=seed, eos=False,
        config_overrides=dict(
            num_hidden_layers=shape.layers, num_experts=shape.experts, num_experts_per_tok=shape.top_k,
            moe_intermediate_size=shape.moe_intermediate, intermediate_size=shape.dense_intermediate,
            mlp_only_layers=[], decoder_sparse_step=1,
        ),
    )
    dense = make_demo_model(
        root / "dense", arch="qwen3", size=SIZE, seed=seed, eos=False,
        config_overrides=dict(num_hidden_layers=shape.layers, intermediate_size=shape.dense_intermediate,
                              layer_types=layer_types),
    )
    return moe, dense


def parameter_counts(engine: LLMEngine, shape: Shape) -> dict[str, int]:
    """Total parameters held, and those one token uses (``top_k`` of the experts' weights)."""
    from inflight.runtime.model.quantized import num_weights

    total = num_weights(engine.runner.model)  # prepacked linear weights are not parameters
    expert = sum(p.numel() for name, p in engine.runner.model.named_parameters() if ".experts." in name)
    active = total - expert + expert * shape.top_k // shape.experts
    return {"total": total, "active": active, "expert": expert}


class MoeTimer:
    """Wraps the engine's ``fused_moe`` to sum the seconds spent in it (over every thread)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()
        inner = engine.runner.ops.fused_moe

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                with self._lock:
                    self.seconds += time.perf_counter() - t0

        engine.runner.ops = dataclasses.replace(engine.runner.ops, fused_moe=timed)


def load_engine(model_dir: Path, max_batch: int) -> LLMEngine:
    blocks_per_seq = -(-MAX_MODEL_LEN // 16)
    config = EngineConfig(max_num_sequences=max_batch, max_model_len=MAX_MODEL_LEN, block_size=16,
                          num_kv_blocks=max_batch * blocks_per_seq + 8, dtype="float32", device="cpu",
                          kernel_backend="auto")
    engine = LLMEngine.from_model_dir(model_dir, config)
    engine.warmup()
    return engine


def _num_lanes(engine: LLMEngine, batch: int) -> int:
    lanes = engine.runner._lanes  # noqa: SLF001 - a benchmark reads which path the step took
    if lanes is None:
        return 1
    return lanes.num_lanes if batch >= lanes.num_lanes * 4 else 1  # cpu_lanes.MIN_ROWS_PER_LANE


def time_decode(engine: LLMEngine, batch: int, steps: int, prompts: list[list[int]], tag: str,
                timer: MoeTimer | None) -> dict[str, Any]:
    """Prefill ``batch`` prompts, one untimed decode step, then ``steps`` timed decode steps."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for req_id, prompt in zip(ids, prompts[:batch], strict=True):
        engine.add_request(req_id, list(prompt), params)
    sched = engine.scheduler
    while sched.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()
    engine.step()
    times, moe = [], []
    for _ in range(steps):
        if timer is not None:
            timer.seconds = 0.0
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        if timer is not None:
            moe.append(timer.seconds)
    if sched.num_running != batch:
        raise RuntimeError(f"expected {batch} running sequences, had {sched.num_running}")
    for req_id in ids:
        engine.abort_request(req_id)
    while engine.has_unfinished_requests():
        engine.step()
    out: dict[str, Any] = {"step_ms": statistics.median(times) * 1e3, "steps_ms": [t * 1e3 for t in times]}
    if timer is not None:
        lanes = _num_lanes(engine, batch)
        out["fused_moe_ms"] = statistics.median(moe) * 1e3 / lanes
        out["lanes"] = lanes
    return out


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _fmt(s: dict[str, float], digits: int = 1) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def write_markdown(path: Path, report: dict[str, Any]) -> None:
    shape, counts = report["shape"], report["parameters"]
    lines = [
        "## MoE decode step: Qwen3-MoE vs the dense Qwen3 of the same active size (CPU, float32)",
        "",
        f"`python -m bench.studies.moe_step` ({report['elapsed_s']:.0f} s). Random demo models, float32, CPU, "
        f"`kernel_backend` auto ({report['kernels']}); {report['machine']['cores']} cores, load average at the "
        f"start {report['machine']['loadavg_start']}, at the end {report['machine']['loadavg_end']}.",
        "",
        "| | Qwen3-MoE | dense Qwen3 |",
        "|---|---|---|",
        f"| hidden / layers / heads (KV) / head_dim | {shape['hidden']} / {shape['layers']} / {shape['heads']} "
        f"({shape['kv_heads']}) / {shape['head_dim']} | same |",
        f"| vocabulary (untied LM head) | {shape['vocab']} | same |",
        f"| MLP | {shape['experts']} experts, top-{shape['top_k']}, expert width {shape['moe_intermediate']}, "
        f"every layer | SwiGLU width {shape['dense_intermediate']} (= top-k x expert width) |",
        f"| parameters held | {counts['moe']['total'] / 1e6:.1f}M ({counts['moe']['total'] * 4 / 2**30:.2f} GiB) | "
        f"{counts['dense']['total'] / 1e6:.1f}M ({counts['dense']['total'] * 4 / 2**30:.2f} GiB) |",
        f"| parameters per token (active) | {counts['moe']['active'] / 1e6:.1f}M | {counts['dense']['active'] / 1e6:.1f}M |",
        "",
        f"Each run: `batch` sequences, {PROMPT_LEN}-token random prompts, prefilled, one untimed decode step, then "
        "the timed decode steps (`LLMEngine.step`, token ids only); a run's figure is its median step. "
        f"{report['rounds']} rounds, MoE and dense interleaved in a rotated order; median (min-max) over rounds. "
        "MoE/dense is the median of the per-round ratios. The fused_moe column is the time inside "
        "`KernelOps.fused_moe` (the expert matmuls, the sort/gather/weighted sum; not the router matmul), "
        "summed over the decode lanes that ran the step and divided by their number.",
        "",
        "| batch | steps timed | MoE ms/step | dense ms/step | MoE/dense | MoE: in fused_moe, ms (share) |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        moe, dense, ratio = row["moe_ms"], row["dense_ms"], row["ratio"]
        share = row["fused_moe_ms"]["median"] / moe["median"]
        lines.append(f"| {row['batch']} | {row['steps']} | {_fmt(moe)} | {_fmt(dense)} | {_fmt(ratio, 2)} | "
                     f"{_fmt(row['fused_moe_ms'])} ({100 * share:.0f}%) |")
    lines += ["", *report["notes"], ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, nargs="+", default=[12, 6],
                        help="decode steps timed per run, one per batch size (the last repeats)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--moe-intermediate", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    shape = Shape(args.layers, args.experts, args.top_k, args.moe_intermediate)
    steps_for = {b: args.steps[min(i, len(args.steps) - 1)] for i, b in enumerate(args.batches)}
    load_start = os.getloadavg()[0]
    start = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="inflight-moe-step-"))
    try:
        moe_dir, dense_dir = build_models(root, shape, args.seed)
        print(f"models written ({time.perf_counter() - start:.0f} s)", flush=True)
        engines = {"moe": load_engine(moe_dir, max(args.batches)), "dense": load_engine(dense_dir, max(args.batches))}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"engines loaded ({time.perf_counter() - start:.0f} s)", flush=True)
    counts = {name: parameter_counts(engine, shape) for name, engine in engines.items()}
    for name, c in counts.items():
        print(f"{name}: {c['total'] / 1e6:.1f}M parameters held, {c['active'] / 1e6:.1f}M per token", flush=True)
    timer = MoeTimer(engines["moe"])
    vocab = engines["moe"].runner.spec.vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(8, vocab) for _ in range(PROMPT_LEN)] for _ in range(max(args.batches))]
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    order = ["moe", "dense"]
    for rnd in range(args.rounds):
        for batch in args.batches:
            names = order if (rnd + args.batches.index(batch)) % 2 == 0 else order[::-1]
            for name in names:
                res = time_decode(engines[name], batch, steps_for[batch], prompts, f"r{rnd}b{batch}",
                                  timer if name == "moe" else None)
                runs.setdefault((name, batch), []).append(res)
                extra = f", fused_moe {res['fused_moe_ms']:.1f} ms" if "fused_moe_ms" in res else ""
                print(f"round {rnd + 1} batch {batch} {name}: {res['step_ms']:.1f} ms/step{extra}", flush=True)
    results = []
    for batch in args.batches:
        moe, dense = runs[("moe", batch)], runs[("dense", batch)]
        results.append({
            "batch": batch, "steps": steps_for[batch],
            "moe_ms": _spread([r["step_ms"] for r in moe]), "dense_ms": _spread([r["step_ms"] for r in dense]),
            "ratio": _spread([m["step_ms"] / d["step_ms"] for m, d in zip(moe, dense, strict=True)]),
            "fused_moe_ms": _spread([r["fused_moe_ms"] for r in moe]), "moe_lanes": moe[0]["lanes"],
            "runs": {"moe": moe, "dense": dense},
        })
    import torch  # after inflight.runtime, which sets OMP_WAIT_POLICY before torch loads

    preset = SIZES[SIZE]
    spec = engines["moe"].runner.spec
    notes = [
        "What this means:",
        "",
        f"* The machine has {len(os.sched_getaffinity(0))} cores and is shared (other jobs, e.g. a test suite, "
        "may run alongside): absolute figures move with its load; only the side-by-side ratios are meant to be "
        "read, and their range shows how much the load moved them.",
        f"* {shape.experts} experts (64 would put the float32 MoE far over ~6 GB at this active size): with "
        f"top-{shape.top_k}, the MoE holds {shape.experts // shape.top_k}x the expert weights a token uses "
        "(Qwen3-30B-A3B: 128 experts, top-8, 16x).",
    ]
    for row in results:
        b = row["batch"]
        per_expert = b * shape.top_k / shape.experts
        lanes = row["moe_lanes"]
        lane_txt = (f"; the step runs in {lanes} decode lanes of ~{b // lanes} rows, so each expert matmul sees "
                    f"~{per_expert / lanes:.0f} rows" if lanes > 1 else "")
        if b == 1:
            notes.append(f"* Batch 1: {shape.top_k} of {shape.experts} experts per layer, two matmuls of one row "
                         "each (plus the routing: router matmul, softmax/top-k, sort, gather, index_add); "
                         "both models read about the same weight bytes per token.")
        else:
            touched = shape.experts * (1 - (1 - shape.top_k / shape.experts) ** b)
            notes.append(f"* Batch {b}: {b} x {shape.top_k} / {shape.experts} = {per_expert:.0f} tokens per expert "
                         f"on average (~{touched:.0f} of {shape.experts} experts touched per layer){lane_txt}: the "
                         "expert GEMMs are small, and the step reads nearly all the expert weights "
                         f"({shape.experts // shape.top_k}x the dense MLP's bytes) against the dense model's "
                         f"{b}-row matmuls (each lane reads the weights it touches for its own rows).")
    report = {
        "shape": {"hidden": preset.hidden_size, "layers": shape.layers, "heads": preset.num_heads,
                  "kv_heads": preset.num_kv_heads, "head_dim": spec.head_dim, "vocab": spec.vocab_size,
                  "experts": shape.experts, "top_k": shape.top_k, "moe_intermediate": shape.moe_intermediate,
                  "dense_intermediate": shape.dense_intermediate},
        "parameters": counts, "rounds": args.rounds, "prompt_len": PROMPT_LEN, "results": results,
        "kernels": engines["moe"].runner.ops.name,
        "machine": {"cores": len(os.sched_getaffinity(0)), "platform": platform.platform(),
                    "torch": torch.__version__, "loadavg_start": round(load_start, 2),
                    "loadavg_end": round(os.getloadavg()[0], 2)},
        "elapsed_s": time.perf_counter() - start, "notes": notes,
    }
    for engine in engines.values():
        engine.runner.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe_step.json").write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(args.out / "moe_step.md", report)
    for row in results:
        print(f"batch {row['batch']}: MoE {_fmt(row['moe_ms'])} ms, dense {_fmt(row['dense_ms'])} ms, "
              f"MoE/dense {_fmt(row['ratio'], 2)}")
    print(f"wrote {args.out / 'moe_step.md'} and moe_step.json ({report['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
