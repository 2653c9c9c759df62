"""fp8 KV cache vs the float KV cache, side by side on seeded random-weight test models.

For each family (llama, qwen3, mistral, gemma3 demo models, fp32 serving) and each fp8 format
(e4m3, e5m2), over N prompts: the share of prompts whose greedy continuation equals the float
cache's token for token, the share of generated tokens before the first divergence, and the
largest |logprob delta| of the float run's tokens scored by both engines (teacher-forced through
prompt logprobs, so a divergence does not hide the deltas after it). Then the KV blocks that fit
in the same memory: bytes per block of the serving dtype (fp32 here, and bf16 for the record)
over fp8's, i.e. how many more sequences of a given length the pool holds. fp8 KV is not
token-exact; this states how far off it is.

    python -m bench.fp8_kv_agreement [--prompts 16] [--tokens 16] [--families llama,qwen3,mistral,gemma3]
"""

from __future__ import annotations

import argparse
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.demo.model import make_demo_model
from inflight.runtime.sampling_params import SamplingParams

FAMILIES = ("llama", "qwen3", "mistral", "gemma3")
# (kv_cache_dtype, calculate_kv_scales): the random models have no checkpoint scales. "bf16" is
# the yardstick: the whole model served in bfloat16 (KV included) against fp32, which says how
# sensitive these random models' near-flat logits are to any rounding at all.
FORMATS = (("fp8_e4m3", False), ("fp8_e4m3", True), ("fp8_e5m2", False), ("fp8_e5m2", True), ("bf16", False))


@dataclass(frozen=True, slots=True)
class Agreement:
    family: str
    kv_cache_dtype: str
    prompts_identical: float  # share of prompts with every greedy token equal
    tokens_before_divergence: float  # share of generated tokens before the first differing one
    max_logprob_delta: float  # over every teacher-forced token of every prompt
    mean_logprob_delta: float
    blocks_ratio: float  # KV blocks in the same memory: serving dtype's bytes per block / fp8's


def prompts(num: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randrange(6, 40))] for _ in range(num)]


def engine(model_dir: Path, kv_cache_dtype: str, **knobs: object) -> LLMEngine:
    config = dict(device="cpu", dtype="float32", block_size=8, max_num_sequences=8, max_model_len=256,
                  kv_cache_dtype=kv_cache_dtype, async_scheduling=False)
    return LLMEngine.from_model_dir(model_dir, EngineConfig(**{**config, **knobs}))


def greedy(eng: LLMEngine, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    for i, prompt in enumerate(batch):
        eng.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(batch))}
    while eng.has_unfinished_requests():
        for o in eng.step():
            out[o.req_id].extend(o.new_token_ids)
    return [out[str(i)] for i in range(len(batch))]


def scored(eng: LLMEngine, sequences: list[list[int]]) -> list[list[float]]:
    """Each sequence's prompt logprobs (tokens 1..), teacher-forced."""
    for i, seq in enumerate(sequences):
        eng.add_request(str(i), seq, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    out: dict[str, list[float]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.prompt_logprobs is not None:
                out[o.req_id] = [t.logprob for t in o.prompt_logprobs]
    return [out[str(i)] for i in range(len(sequences))]


def compare(family: str, model_dir: Path, fmt: tuple[str, bool], batch: list[list[int]], max_tokens: int,
            reference: tuple[list[list[int]], list[list[float]], int]) -> Agreement:  # fmt: skip
    ref_tokens, ref_scores, float_bytes = reference
    kv_dtype, calculate = fmt
    yardstick = kv_dtype == "bf16"
    knobs = {"dtype": "bfloat16"} if yardstick else {}
    eng = engine(model_dir, "auto" if yardstick else kv_dtype, calculate_kv_scales=calculate, **knobs)
    eng.warmup()  # as a served engine: calculated scales come from the warm-up prompt
    tokens = greedy(eng, batch, max_tokens)
    scores = scored(eng, [p + t for p, t in zip(batch, ref_tokens, strict=True)])
    fp8_bytes = eng.runner.bytes_per_block
    eng.close()
    same = sum(a == b for a, b in zip(tokens, ref_tokens, strict=True))
    before = 0
    for a, b in zip(tokens, ref_tokens, strict=True):
        before += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    deltas = [abs(x - y) for s, r in zip(scores, ref_scores, strict=True) for x, y in zip(s, r, strict=True)]
    label = "bf16 (all)" if kv_dtype == "bf16" else f"{kv_dtype}{' calc' if calculate else ' 1.0'}"
    return Agreement(family, label, same / len(batch), before / (len(batch) * max_tokens), max(deltas),
                     sum(deltas) / len(deltas),
                     float_bytes / fp8_bytes)  # fmt: skip


def run(families: tuple[str, ...], num_prompts: int, max_tokens: int, workdir: Path) -> list[Agreement]:
    results = []
    for family in families:
        model_dir = make_demo_model(workdir / family, family, "tiny", 0)
        eng = engine(model_dir, "auto")
        eng.warmup()
        batch = prompts(num_prompts, eng.runner.spec.vocab_size)
        ref_tokens = greedy(eng, batch, max_tokens)
        ref_scores = scored(eng, [p + t for p, t in zip(batch, ref_tokens, strict=True)])
        reference = (ref_tokens, ref_scores, eng.runner.bytes_per_block)
        eng.close()
        results += [compare(family, model_dir, f, batch, max_tokens, reference) for f in FORMATS]
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        results = run(tuple(args.families.split(",")), args.prompts, args.tokens, Path(tmp))
    print(f"fp8 KV vs fp32 KV, {args.prompts} prompts x {args.tokens} greedy tokens, random-weight demo models")
    print(f"{'family':8} {'kv dtype, scales':16} {'prompts same':>12} {'tokens before 1st diff':>22} "
          f"{'max |dlogprob|':>14} {'mean':>7} {'blocks vs fp32':>14} {'vs bf16':>8}")  # fmt: skip
    for r in results:
        print(f"{r.family:8} {r.kv_cache_dtype:16} {r.prompts_identical:12.2f} {r.tokens_before_divergence:22.2f} "
              f"{r.max_logprob_delta:14.4f} {r.mean_logprob_delta:7.4f} {r.blocks_ratio:13.1f}x {r.blocks_ratio / 2:7.1f}x")  # fmt: skip


if __name__ == "__main__":
    main()
