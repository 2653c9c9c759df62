"""``python -m bench.kv_groups``: KV blocks a 512-token generation holds with one block table for every
layer (``INFLIGHT_KV_GROUPS=0``) and with per-group tables (the default), side by side in one run.

Two tiny random models from transformers' own config classes (``make_demo_model``): Gemma 3 with
five sliding-window layers per global one, and gpt-oss with sliding and full layers in turn, both
with a 128-token window. One greedy request (a 16-token prompt, 512 tokens, ``ignore_eos``) runs
each way on the same KV memory (``--num-kv-blocks`` blocks of the whole model); the table gives
the pool blocks it holds at its last step and at its peak, those as bytes and as a share of the
pool, and how many such sequences the pool holds at that peak. The tokens must be the same both
ways. Counts blocks; times nothing. Writes ``bench/results/kv_groups.md``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "kv_groups.md"


@dataclass(frozen=True, slots=True)
class Held:
    tokens: tuple[int, ...]
    pool_blocks: int
    block_bytes: int  # one pool block
    end_blocks: int  # held at the request's last step
    peak_blocks: int
    groups: str  # how the layers were grouped


def _families(window: int) -> dict[str, tuple[str, dict]]:
    gemma = ["sliding_attention"] * 5 + ["full_attention"]
    oss = ["sliding_attention", "full_attention"] * 2
    return {
        f"Gemma 3 (5 sliding:1 global, W={window})": ("gemma3", {"num_hidden_layers": 6, "layer_types": gemma,
                                                                 "sliding_window": window}),
        f"gpt-oss (2 sliding, 2 full, W={window})": ("gpt_oss", {"num_hidden_layers": 4, "layer_types": oss,
                                                                 "sliding_window": window}),
    }  # fmt: skip


def _run(model_dir: Path, grouped: bool, num_kv_blocks: int, prompt_len: int, max_tokens: int) -> Held:
    from inflight.runtime.config import EngineConfig
    from inflight.runtime.core.engine import LLMEngine
    from inflight.runtime.sampling_params import SamplingParams

    os.environ["INFLIGHT_KV_GROUPS"] = "1" if grouped else "0"
    config = EngineConfig(device="cpu", dtype="float32", block_size=16, num_kv_blocks=num_kv_blocks,
                          enable_prefix_caching=False, max_num_tokens=256)  # fmt: skip
    engine = LLMEngine.from_model_dir(model_dir, config)
    layout = getattr(engine.runner, "kv_groups", None)
    assert (layout is not None) == grouped, "the switch did not take"
    prompt = [(7 * i) % 200 + 3 for i in range(prompt_len)]
    engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    end = peak = 0
    while engine.has_unfinished_requests():
        used = engine.pool.num_used_blocks  # before the step: what the request holds going into it
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        if engine.has_unfinished_requests():
            end = engine.pool.num_used_blocks
        else:
            end = max(end, used)
        peak = max(peak, end)
    groups = (f"{layout.num_groups} groups x {layout.num_slots} layers (windows {list(layout.windows)})"
              if layout is not None else "one table")  # fmt: skip
    block_bytes = engine.runner.kv_cache_bytes // engine.pool.num_blocks
    return Held(tuple(tokens), engine.pool.num_blocks, block_bytes, end, peak, groups)


def _fit(held: Held) -> int:
    """Sequences like this one the pool holds at its peak."""
    return held.pool_blocks // held.peak_blocks


def _row(name: str, held: Held) -> str:
    fit = _fit(held)
    return (f"| {name} | {held.groups} | {held.pool_blocks} x {held.block_bytes / 1024:.0f} KiB | {held.end_blocks} | "
            f"{held.peak_blocks} | {held.end_blocks * held.block_bytes / 1024:.0f} KiB "
            f"({100 * held.end_blocks / held.pool_blocks:.1f}%) | {fit} |")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    from inflight.runtime.demo.model import make_demo_model

    parser = argparse.ArgumentParser(prog="python -m bench.kv_groups")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=256, help="whole-model blocks of KV memory, both ways")
    args = parser.parse_args(argv)
    seq_tokens = args.prompt_len + args.max_tokens
    lines = [f"One request: a {args.prompt_len}-token prompt, {args.max_tokens} generated tokens (ignore_eos), "
             f"16-token blocks, the same KV memory both ways ({args.num_kv_blocks} whole-model blocks). "
             f"`fit`: sequences of {seq_tokens} tokens the pool holds at the measured peak.", "",
             "| model | KV tables | pool (blocks x bytes) | blocks held at the end | peak | KV held at the end | fit |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    ratios: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (arch, overrides) in _families(args.window).items():
            model_dir = make_demo_model(Path(tmp) / arch, arch, seed=3, eos=False, config_overrides=overrides)
            off = _run(model_dir, False, args.num_kv_blocks, args.prompt_len, args.max_tokens)
            on = _run(model_dir, True, args.num_kv_blocks, args.prompt_len, args.max_tokens)
            if on.tokens != off.tokens:
                raise SystemExit(f"{name}: per-group tables changed the tokens")
            lines += [_row(name, off), _row(name, on)]
            ratios.append(f"* {name}: one table holds {(off.end_blocks * off.block_bytes) / (on.end_blocks * on.block_bytes):.2f}x "
                          f"the KV bytes of per-group tables at the end; {_fit(on) / _fit(off):.2f}x the sequences fit "
                          "with per-group tables.")  # fmt: skip
    text = "\n".join([*lines, "", *ratios]) + "\n"
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("# Per-group KV tables: blocks held (bench/kv_groups.py)\n\n" + text)


if __name__ == "__main__":
    main()
