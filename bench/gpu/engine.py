"""Engine decode-step time against its memory roofline, for the kernel benchmark.

Owns the roofline arithmetic (weight bytes streamed per step from the checkpoint's tensor
shapes, K/V bytes read from the live context lengths) and the timing loop over
``LLMEngine.step``, eager and on decode graphs, with where a step's time goes. A generated
~1.5B Llama model (``make_demo_model(size="1.5b")``, Qwen2-1.5B's shape) stands in for a
real checkpoint. ``python -m bench.gpu.engine --json FILE`` runs it in a process of
its own (``make gpu-check`` does, so its GPU memory is gone before the served burst). Knows the engine only through its public API.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bench.gpu.timing import ENGINE_TARGETS, copy_bandwidth, wall_median_ms

if TYPE_CHECKING:
    from inflight.runtime.core.engine import LLMEngine

BATCHES = (1, 16, 64, 256)
QUICK_BATCHES = (1, 64, 256)  # batch 1 and 64 for the targets, 64 and 256 for the simulator's profile
PROMPT_LEN = 128
WARMUP_STEPS = 3
TIMED_STEPS = 20
MAX_PREFILL_STEPS = 1000


@dataclass(frozen=True, slots=True)
class ModelBytes:
    """What one decode step must stream, per the checkpoint."""

    weight_bytes: int  # every weight read once per step (the embedding only as the LM head)
    kv_bytes_per_token: int  # K + V of one cached token over all layers


def model_bytes(model_dir: Path, dtype: torch.dtype) -> ModelBytes:
    """Weights read per step and K/V bytes per cached token, in ``dtype``."""
    from safetensors import safe_open

    elem = torch.finfo(dtype).bits // 8
    shapes: dict[str, list[int]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = f.get_slice(name).get_shape()
    tied = not any(name.endswith("lm_head.weight") for name in shapes)
    weight_elems = sum(
        _numel(shape)
        for name, shape in shapes.items()
        if tied or not name.endswith("embed_tokens.weight")  # a lookup reads a few rows only
    )
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    kv_per_token = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * elem
    return ModelBytes(weight_bytes=weight_elems * elem, kv_bytes_per_token=kv_per_token)


def _kernel_name(engine: object) -> str:
    ops = getattr(getattr(engine, "runner", None), "ops", None)
    return getattr(ops, "name", "?")


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def time_decode_steps(
    engine: LLMEngine, batch: int, vocab_size: int, device: str = "cuda"
) -> tuple[float, float]:
    """(seconds per decode step, mean cached tokens per sequence) with ``batch`` sequences."""
    from inflight.runtime.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(
        max_tokens=WARMUP_STEPS + TIMED_STEPS + 64, ignore_eos=True, temperature=0
    )
    req_ids = [f"bench-{batch}-{i}" for i in range(batch)]
    for req_id in req_ids:
        prompt = torch.randint(10, vocab_size, (PROMPT_LEN,), generator=gen).tolist()
        engine.add_request(req_id, prompt, params)
    context: dict[str, int] = {}
    for _ in range(MAX_PREFILL_STEPS):  # prefill until every sequence has its first token
        for out in engine.step():
            context[out.req_id] = out.num_prompt_tokens + out.num_output_tokens
        if len(context) == batch:
            break
    if len(context) < batch:
        raise RuntimeError(f"{batch - len(context)} of {batch} requests never started decoding")
    for _ in range(WARMUP_STEPS):
        engine.step()
    start_context = sum(context.values()) / batch + WARMUP_STEPS
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(TIMED_STEPS):
        engine.step()
    _sync(device)
    seconds = (time.perf_counter() - t0) / TIMED_STEPS
    for req_id in req_ids:
        engine.abort_request(req_id)
    return seconds, start_context + TIMED_STEPS / 2


def step_breakdown(engine: LLMEngine, batch: int, vocab_size: int, device: str = "cuda") -> dict[str, float]:
    """Milliseconds per decode step in each stage (prepare, forward, sample, the rest), with a
    device sync after each stage so GPU time lands in the stage that queued it."""
    runner, sampler = engine.runner, engine.sampler
    spent: dict[str, float] = {"prepare": 0.0, "forward": 0.0, "sample": 0.0}
    originals = (runner.prepare, runner.execute, sampler.sample)

    def timed(name: str, fn):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            _sync(device)
            spent[name] += time.perf_counter() - t0
            return result

        return wrapper

    runner.prepare, runner.execute, sampler.sample = (
        timed("prepare", originals[0]), timed("forward", originals[1]), timed("sample", originals[2]))
    try:
        seconds, _ = time_decode_steps(engine, batch, vocab_size, device)
    finally:
        del runner.prepare, runner.execute, sampler.sample  # back to the class methods
    total_steps = TIMED_STEPS + WARMUP_STEPS  # the wrappers also saw the warm-up steps
    ms = {k: 1e3 * v / total_steps for k, v in spent.items()}
    ms["step"] = 1e3 * seconds
    ms["other"] = max(0.0, ms["step"] - ms["prepare"] - ms["forward"] - ms["sample"])
    return ms


def kernel_profile(engine: LLMEngine, batch: int, vocab_size: int, top: int = 12) -> list[dict[str, object]]:
    """The GPU kernels of an eager decode step at ``batch``: the ``top`` by device time per
    step (torch.profiler), to show where a step's GPU time goes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        time_decode_steps(engine, batch, vocab_size, "cuda")
    steps = TIMED_STEPS + WARMUP_STEPS + 1  # +1: the prefill step(s) are in it too, a small part
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return [{"kernel": e.key[:90], "us_per_step": e.self_device_time_total / steps, "calls_per_step": e.count / steps}
            for e in events[:top]]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def graph_modes() -> tuple[bool, ...]:
    """(eager, graphs) when the engine has CUDA graphs (``enforce_eager``), else eager only."""
    from inflight.runtime.config import EngineConfig

    return (False, True) if "enforce_eager" in EngineConfig.__dataclass_fields__ else (False,)


def step_modes() -> tuple[tuple[bool, bool], ...]:
    """(graphs, async scheduling) pairs to time: eager, graphs, and graphs with the host's work
    overlapped (``async_scheduling``) when the engine has it."""
    from inflight.runtime.config import EngineConfig

    modes = tuple((graphs, False) for graphs in graph_modes())
    if "async_scheduling" in EngineConfig.__dataclass_fields__:
        modes += ((modes[-1][0], True),)
    return modes


def engine_table(
    copy_bw: float, batches: tuple[int, ...], size: str = "1.5b", device: str = "cuda",
    work_dir: Path | None = None, profile_kernels: bool = True,
) -> tuple[list[dict[str, float]], list[dict[str, float]], list[dict[str, object]]]:
    """Print (and return) decode-step time vs (weight + K/V bytes) / copy bandwidth per batch,
    eager and (where the engine has them) with CUDA graphs; and where a step's time goes."""
    from inflight.runtime.config import EngineConfig
    from inflight.runtime.core.engine import LLMEngine
    from inflight.runtime.demo.model import make_demo_model
    from inflight.runtime.worker.graph_backend import RecordingGraphBackend

    rows: list[dict[str, float]] = []
    breakdowns: list[dict[str, float]] = []
    profiles: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        print(f"\nGenerating the ~{size} llama demo model ...", flush=True)
        model_dir = Path(make_demo_model(Path(tmp) / f"llama-{size}", arch="llama", size=size, eos=False))
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        sizes = model_bytes(model_dir, dtype)
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        for graphs, overlap in step_modes():
            knobs = {"enforce_eager": not graphs} if len(graph_modes()) > 1 else {}
            knobs |= {"async_scheduling": True} if overlap else {}
            config = EngineConfig(
                max_num_sequences=max(batches), max_num_tokens=8192, dtype=str(dtype)[6:],
                device=device, kernel_backend="triton" if device == "cuda" else "cpu",
                enable_prefix_caching=False, num_kv_blocks=None if device == "cuda" else 512, **knobs,
            )  # fmt: skip
            # The CPU dry run has no CUDA graphs: its stand-in backend exercises the same path.
            backend = RecordingGraphBackend() if graphs and device == "cpu" else None
            engine = LLMEngine.from_model_dir(model_dir, config, graph_backend=backend)
            graphs = engine.runner.graphs is not None
            print(
                f"Engine decode step, llama ~{size} {str(dtype)[6:]} ({sizes.weight_bytes / 1e6:.0f} MB "
                f"weights streamed per step), prompt {PROMPT_LEN}, kernels {_kernel_name(engine)}, "
                f"{'decode graphs (' + engine.runner.graphs.backend.name + ')' if graphs else 'eager'}"
                f"{', async scheduling' if overlap else ''}"
            )
            print(f"{'batch':>6} {'step ms':>9} {'KV MB':>8} {'roofline ms':>12} {'x roofline':>11}")
            for batch in batches:
                seconds, mean_context = time_decode_steps(engine, batch, vocab, device)
                kv = batch * mean_context * sizes.kv_bytes_per_token
                roofline = (sizes.weight_bytes + kv) / copy_bw
                rows.append({"batch": batch, "graphs": graphs, "async": overlap, "step_ms": seconds * 1e3,
                             "kv_mb": kv / 1e6, "context_tokens": batch * mean_context, "roofline_ms": roofline * 1e3,
                             "x_roofline": seconds / roofline})  # fmt: skip
                print(
                    f"{batch:>6} {seconds * 1e3:>9.2f} {kv / 1e6:>8.1f} {roofline * 1e3:>12.3f} "
                    f"{seconds / roofline:>10.2f}x"
                )
            b = 64 if 64 in batches else batches[-1]
            if overlap:  # the stage wrappers would sync the overlapped step; the timing is the point here
                engine.close()
                continue
            if device == "cuda" and profile_kernels:
                for pb in sorted({b, batches[-1]}) if not graphs else (b,):
                    kernels = kernel_profile(engine, pb, vocab)
                    profiles.append({"batch": pb, "graphs": graphs, "kernels": kernels})
                    print(f"{'graph' if graphs else 'eager'} GPU kernels at batch {pb} (us per step):")
                    for k in kernels:
                        print(f"  {k['us_per_step']:>9.1f} us {k['calls_per_step']:>6.1f} calls  {k['kernel']}")
            parts = step_breakdown(engine, b, vocab, device)
            breakdowns.append({"batch": b, "graphs": graphs, **parts})
            print(f"where a step goes at batch {b}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in parts.items()))
            engine.close()
            del engine
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows, breakdowns, profiles


def run_engine_bench(work_dir: Path, quick: bool = False, dry_run: bool = False) -> dict[str, object]:
    """The engine table as a report: the ~1.5B model on CUDA; a tiny model on the CPU in a dry run."""
    if dry_run:
        src = torch.empty(1 << 24, dtype=torch.uint8)
        dst = torch.empty_like(src)
        copy_bw = 2 * src.numel() / (wall_median_ms(lambda: dst.copy_(src)) * 1e-3)
        rows, breakdowns, profiles = engine_table(copy_bw, (1, 2), size="tiny", device="cpu", work_dir=work_dir)
    else:
        copy_bw = copy_bandwidth()
        rows, breakdowns, profiles = engine_table(copy_bw, QUICK_BATCHES if quick else BATCHES, work_dir=work_dir)
    best = {b: min((r["x_roofline"] for r in rows if r["batch"] == b and r["graphs"] == (len(graph_modes()) > 1)),
                   default=None) for b in ENGINE_TARGETS}
    parts = [f"batch {b}: {x:.2f}x roofline (target {ENGINE_TARGETS[b]}x)" for b, x in best.items() if x]
    return {"copy_gb_per_s": copy_bw / 1e9, "rows": rows, "breakdown": breakdowns, "profiles": profiles, "summary": "; ".join(parts),
            "targets": {str(b): {"x_roofline": x, "bound": ENGINE_TARGETS[b],
                                 "met": x is not None and x <= ENGINE_TARGETS[b]} for b, x in best.items()}}


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.gpu.engine")
    parser.add_argument("--json", type=Path, required=True, help="write the report here")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the model is generated")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU")
    args = parser.parse_args(argv)
    report = run_engine_bench(args.work_dir or Path(tempfile.gettempdir()), args.quick, args.dry_run)
    args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
