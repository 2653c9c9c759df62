"""Engine decode-step time against its memory roofline, for the kernel benchmark.

Owns the roofline arithmetic (weight bytes streamed per step from the checkpoint's tensor
shapes, K/V bytes read from the live context lengths) and the timing loop over
``LLMEngine.step``. A generated ~0.5B Llama model (``make_demo_model(size="0.5b")``) stands
in for a real checkpoint. Knows the engine only through its public API.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from inflight.runtime.engine import LLMEngine

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


def time_decode_steps(engine: LLMEngine, batch: int, vocab_size: int) -> tuple[float, float]:
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
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(TIMED_STEPS):
        engine.step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / TIMED_STEPS
    for req_id in req_ids:
        engine.abort_request(req_id)
    return seconds, start_context + TIMED_STEPS / 2


def engine_table(copy_bw: float, batches: tuple[int, ...]) -> list[dict[str, float]]:
    """Print (and return) decode-step time vs (weight + K/V bytes) / copy bandwidth per batch."""
    rows: list[dict[str, float]] = []
    try:
        from inflight.runtime.config import EngineConfig
        from inflight.runtime.demo_model import make_demo_model
        from inflight.runtime.engine import LLMEngine
    except ImportError as e:
        print(f"\nEngine roofline skipped: the engine API is not importable ({e}).")
        return rows
    with tempfile.TemporaryDirectory() as tmp:
        print("\nGenerating the ~0.5B llama demo model ...", flush=True)
        model_dir = Path(make_demo_model(Path(tmp) / "llama-0.5b", arch="llama", size="0.5b"))
        sizes = model_bytes(model_dir, torch.bfloat16)
        config = EngineConfig(
            max_num_sequences=max(batches), max_num_tokens=8192, dtype="bfloat16",
            device="cuda", kernel_backend="triton", enable_prefix_caching=False,
        )  # fmt: skip
        engine = LLMEngine.from_model_dir(model_dir, config)
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        print(
            f"Engine decode step, llama ~0.5B bf16 ({sizes.weight_bytes / 1e6:.0f} MB weights "
            f"streamed per step), prompt {PROMPT_LEN}, kernels {_kernel_name(engine)}"
        )
        print(f"{'batch':>6} {'step ms':>9} {'KV MB':>8} {'roofline ms':>12} {'x roofline':>11}")
        for batch in batches:
            seconds, mean_context = time_decode_steps(engine, batch, vocab)
            kv = batch * mean_context * sizes.kv_bytes_per_token
            roofline = (sizes.weight_bytes + kv) / copy_bw
            rows.append({"batch": batch, "step_ms": seconds * 1e3, "kv_mb": kv / 1e6,
                         "roofline_ms": roofline * 1e3, "x_roofline": seconds / roofline})  # fmt: skip
            print(
                f"{batch:>6} {seconds * 1e3:>9.2f} {kv / 1e6:>8.1f} {roofline * 1e3:>12.3f} "
                f"{seconds / roofline:>10.2f}x"
            )
    return rows
