"""Multi-LoRA burst: output tok/s of one burst on the base model and spread over adapters, side by side in one process.

    python -m bench.lora_burst [--requests 32] [--max-tokens 32] [--prompt-len 64] [--adapters 8]
        [--rank 16] [--max-loras 8] [--target-modules q_proj ... down_proj] [--rounds 3] [--with-reference]
        [--model small] [--models-dir models] [--json FILE]

Two in-process engines on ``models/bench-<model>`` (the random-weight llama of the benchmark
suite, made on first use; float32, the CPU's default kernels): one plain, one with
``enable_lora`` and ``--adapters`` rank-``--rank`` PEFT adapters made here with random non-zero
A and B (``adapter_config.json`` + ``adapter_model.safetensors``, written with safetensors; no
peft needed) and loaded with ``add_lora``. Three variants run the same burst (all
``--requests`` requests added at once, greedy, ``--max-tokens`` each, EOS ignored):

* ``base``: the plain engine;
* ``base, LoRA on``: the LoRA engine, no request naming an adapter (what enabling LoRA costs);
* ``N adapters``: the LoRA engine, the requests spread round-robin over the adapters;
* with ``--with-reference``, ``N adapters, reference``: the same with the bundle's
  ``lora_delta`` swapped for the torch reference (:mod:`inflight.kernels.lora_reference`), so
  the CPU path's gain over it is measured in the same run.

Every round runs each variant in a rotated order on fresh prompts (so no prefix-cache hit
crosses rounds); the report gives the median (min-max) output tok/s over rounds and each
variant's ratio to ``base`` (the median of the per-round ratios), and how many adapter
requests' tokens differ from the base model's for the same prompt (a check that the adapters
took effect). The machine is shared and noisy: read the ratios. Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inflight.runtime.config import EngineConfig  # inflight.runtime sets passive OpenMP waits before torch loads
from inflight.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from inflight.runtime.core.engine import LLMEngine

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_shapes(model_config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection, from a llama ``config.json``."""
    hidden, inter = model_config["hidden_size"], model_config["intermediate_size"]
    head_dim = model_config.get("head_dim") or hidden // model_config["num_attention_heads"]
    q = model_config["num_attention_heads"] * head_dim
    kv = model_config["num_key_value_heads"] * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}  # fmt: skip


def write_adapter(out_dir: Path, model_dir: Path, rank: int, targets: tuple[str, ...], seed: int) -> Path:
    """A PEFT LoRA adapter for the model at ``model_dir`` with random non-zero A and B."""
    import torch
    from safetensors.torch import save_file

    model_config = json.loads((model_dir / "config.json").read_text())
    shapes = module_shapes(model_config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config["num_hidden_layers"]):
        for module in targets:
            in_features, out_features = shapes[module]
            part = "self_attn" if module in MODULES[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * in_features**-0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.05
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "lora_dropout": 0.0, "bias": "none", "target_modules": list(targets),
              "base_model_name_or_path": str(model_dir)}  # fmt: skip
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def run_burst(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, adapters: list[str], tag: str
) -> tuple[float, list[tuple[int, ...]]]:
    """(output tok/s, each request's tokens) of one burst; ``adapters`` empty: base model."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        req_id = f"{tag}-{i}"
        tokens[req_id] = []
        engine.add_request(req_id, list(prompt), params, lora_name=adapters[i % len(adapters)] if adapters else None)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.req_id].extend(out.new_token_ids)
    elapsed = time.perf_counter() - start
    total = sum(len(t) for t in tokens.values())
    if total != len(prompts) * max_tokens:
        raise RuntimeError(f"{tag}: {total} output tokens, expected {len(prompts) * max_tokens}")
    return total / elapsed, [tuple(tokens[f"{tag}-{i}"]) for i in range(len(prompts))]


def replay_kernels(engine: LLMEngine, prompts: list[list[int]], adapters: list[str], reps: int = 7) -> dict[str, float]:
    """ms per step of the LoRA deltas alone, the bundle's ``lora_delta`` against the torch
    reference: one prefill step's and one decode step's calls recorded from a short burst, then
    replayed in turn (best of ``reps``; the kernels alone move less with the machine's load)."""
    import torch

    from inflight.kernels import lora_reference

    native_ops = engine.runner.ops
    steps: list[list[tuple[torch.Tensor, ...]]] = [[]]

    def record(*args: torch.Tensor) -> None:
        if steps[-1] and args[0].shape[0] != steps[-1][0][0].shape[0]:
            steps.append([])  # a new step (the decode rows follow the prompts)
        steps[-1].append(args)
        native_ops.lora_delta(*args)

    engine.runner.ops = dataclasses.replace(native_ops, lora_delta=record)
    try:
        run_burst(engine, prompts, 2, adapters, "replay")
    finally:
        engine.runner.ops = native_ops
    figures: dict[str, float] = {}
    with torch.inference_mode():
        for label, calls in (("prefill", steps[0]), ("decode", steps[-1])):
            for name, fn in (("native", native_ops.lora_delta), ("reference", lora_reference.lora_delta)):
                best = float("inf")
                for _ in range(reps):
                    start = time.perf_counter()
                    for args in calls:
                        fn(*args)
                    best = min(best, time.perf_counter() - start)
                figures[f"{label}_{name}_ms"] = 1e3 * best
    return figures


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.lora_burst", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--target-modules", nargs="+", default=list(MODULES), choices=MODULES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--with-reference", action="store_true",
                        help="also run the adapters with the torch reference lora_delta")
    parser.add_argument("--model", default="small", choices=("small", "medium"))
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    for name in ("requests", "max_tokens", "prompt_len", "adapters", "rank", "max_loras", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.requests > 256 or args.max_tokens > 256 or args.prompt_len > 1024:
        parser.error("keep the burst bounded: --requests and --max-tokens at most 256, --prompt-len at most 1024")
    return args


def load_engines(args: argparse.Namespace, scratch: Path) -> tuple[dict[str, LLMEngine], list[str]]:
    """The plain engine and the LoRA engine (its adapters written under ``scratch`` and loaded), warmed up."""
    from inflight.bench.suite import SuiteOptions, bench_model
    from inflight.runtime.core.engine import LLMEngine

    model_dir = bench_model(SuiteOptions(models_dir=args.models_dir), args.model)
    max_len = args.prompt_len + args.max_tokens + 16
    common = {"max_num_sequences": args.requests, "max_model_len": max_len, "block_size": 16, "dtype": "float32",
              "num_kv_blocks": 2 * args.requests * -(-max_len // 16) + 8, "device": "cpu"}  # fmt: skip
    lora_config = {"enable_lora": True, "max_loras": args.max_loras, "max_lora_rank": args.rank,
                   "max_cpu_loras": max(args.max_loras, args.adapters)}  # fmt: skip
    names = [f"adapter{i}" for i in range(args.adapters)]
    paths = [write_adapter(scratch / n, model_dir, args.rank, tuple(args.target_modules), seed=i + 1)
             for i, n in enumerate(names)]  # fmt: skip
    engines = {"plain": LLMEngine.from_model_dir(model_dir, EngineConfig(**common)),
               "lora": LLMEngine.from_model_dir(model_dir, EngineConfig(**common, **lora_config))}  # fmt: skip
    for name, path in zip(names, paths, strict=True):
        engines["lora"].add_lora(name, str(path))
    for engine in engines.values():
        engine.warmup()
    return engines, names


def run_rounds(
    args: argparse.Namespace, engines: dict[str, LLMEngine], variants: dict[str, tuple[str, list[str]]],
) -> tuple[dict[str, list[float]], list[int]]:
    """Output tok/s of every variant in every round (rotated order, fresh prompts each round), and
    how many adapter requests' tokens differ from the base model's per round. A variant's engine
    name ``lora-reference`` is the LoRA engine with the reference ``lora_delta`` swapped in."""
    from inflight.kernels import lora_reference

    lora = engines["lora"]
    native_ops = lora.runner.ops
    reference_ops = dataclasses.replace(native_ops, lora_delta=lora_reference.lora_delta)
    vocab = engines["plain"].runner.spec.vocab_size
    warm = [[8 + i] * 8 for i in range(args.adapters)]
    runs: dict[str, list[float]] = {v: [] for v in variants}
    differing: list[int] = []
    adapters_label = f"{args.adapters} adapters"
    try:
        for engine_name, adapters in variants.values():  # untimed: first-call costs off the rounds
            lora.runner.ops = reference_ops if engine_name == "lora-reference" else native_ops
            run_burst(engines[engine_name], warm, 4, adapters, f"warm-{engine_name}-{len(adapters)}")
        for rnd in range(args.rounds):
            rng = random.Random(f"round-{rnd}")
            prompts = [[rng.randrange(8, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
            order = list(variants)
            order = order[rnd % len(order):] + order[: rnd % len(order)]
            outputs: dict[str, list[tuple[int, ...]]] = {}
            for variant in order:
                engine_name, adapters = variants[variant]
                lora.runner.ops = reference_ops if engine_name == "lora-reference" else native_ops
                tok_s, outputs[variant] = run_burst(engines[engine_name], prompts, args.max_tokens, adapters, f"r{rnd}")
                runs[variant].append(tok_s)
                print(f"round {rnd + 1} {variant}: {tok_s:.0f} output tok/s", flush=True)
            differing.append(sum(a != b for a, b in zip(outputs["base"], outputs[adapters_label], strict=True)))
            if outputs["base"] != outputs["base, LoRA on"]:
                print(f"round {rnd + 1}: WARNING the LoRA engine's base-model tokens differ from the plain engine's")
    finally:
        lora.runner.ops = native_ops
    return runs, differing


def print_report(args: argparse.Namespace, runs: dict[str, list[float]], differing: list[int],
                 replay: dict[str, float] | None) -> dict[str, Any]:  # fmt: skip
    report: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                              "tok_per_s": runs, "adapter_outputs_differing_from_base": differing}  # fmt: skip
    print(f"\noutput tok/s, median (min-max) of {args.rounds} rounds; ratio = this / base (median of per-round ratios)")
    for variant, values in runs.items():
        ratio = statistics.median(v / b for v, b in zip(values, runs["base"], strict=True))
        report.setdefault("ratio_to_base", {})[variant] = ratio
        print(f"{variant:<24} {statistics.median(values):>8.0f} ({min(values):.0f}-{max(values):.0f})   x{ratio:.2f}")
    adapters_label = f"{args.adapters} adapters"
    if replay is not None:
        pairs = zip(runs[adapters_label], runs[f"{adapters_label}, reference"], strict=True)
        report["native_over_reference"] = statistics.median(v / r for v, r in pairs)
        print(f"{adapters_label}: the CPU bundle's lora_delta over the torch reference "
              f"x{report['native_over_reference']:.2f} (median of per-round ratios)")  # fmt: skip
        report["kernel_replay"] = replay
        for label in ("prefill", "decode"):
            native, ref = replay[f"{label}_native_ms"], replay[f"{label}_reference_ms"]
            print(f"LoRA deltas of one {label} step alone: {native:.1f} ms (CPU bundle) vs {ref:.1f} ms (torch "
                  f"reference), x{ref / native:.2f}")
    print(f"adapter requests whose tokens differ from the base model's: {differing} of {args.requests} per round")
    return report


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import torch

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lora-burst-") as scratch:
        engines, names = load_engines(args, Path(scratch))
        adapters_label = f"{args.adapters} adapters"
        variants = {"base": ("plain", []), "base, LoRA on": ("lora", []), adapters_label: ("lora", names)}
        if args.with_reference:
            engines["lora-reference"] = engines["lora"]
            variants[f"{adapters_label}, reference"] = ("lora-reference", names)
        print(f"model bench-{args.model}, {args.requests} requests x {args.max_tokens} output tokens, prompts of "
              f"{args.prompt_len}; {args.adapters} adapters of rank {args.rank} on {', '.join(args.target_modules)}, "
              f"max_loras {args.max_loras}; threads {torch.get_num_threads()}; loaded in "
              f"{time.perf_counter() - start:.0f} s", flush=True)  # fmt: skip
        runs, differing = run_rounds(args, engines, variants)
        replay = None
        if args.with_reference:
            rng = random.Random("replay")
            vocab = engines["plain"].runner.spec.vocab_size
            prompts = [[rng.randrange(8, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
            replay = replay_kernels(engines["lora"], prompts, names)
        for engine in (engines["plain"], engines["lora"]):
            engine.close()
    report = print_report(args, runs, differing, replay)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
