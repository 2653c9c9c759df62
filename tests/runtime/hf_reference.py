"""Helpers shared by the engine tests: Hugging Face greedy references and engine drivers."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import torch

from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.sampling_params import SamplingParams

CORPUS = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    "class Node:\n    def __init__(self, value, children=None):\n        self.value = value\n"
    "        self.children = children or []\n\n    def walk(self):\n        yield self.value\n"
    "        for child in self.children:\n            yield from child.walk()\n"
    "import os\nimport sys\nfrom pathlib import Path\n\nfor name in sorted(os.listdir('.')):\n"
    "    print(name, Path(name).stat().st_size, file=sys.stderr)\n"
)


def prompts_of_lengths(tokenizer, lengths: Sequence[int]) -> list[list[int]]:
    """Token-id prompts of the given lengths, cut from different offsets of a code corpus."""
    ids = tokenizer.encode(CORPUS * 4, add_special_tokens=False)
    out = []
    for i, n in enumerate(lengths):
        start = (i * 37) % (len(ids) - n)
        out.append([tokenizer.bos_token_id, *ids[start : start + n - 1]])
    return out


@functools.lru_cache(maxsize=8)
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """transformers ``generate`` greedy continuation (stops at EOS like our engine)."""
    return list(_hf_greedy(str(model_dir), tuple(prompt_ids), max_new_tokens, tuple(sorted(kwargs.items()))))


@functools.lru_cache(maxsize=1024)
def _hf_greedy(model_dir: str, prompt_ids: tuple[int, ...], max_new_tokens: int, kwargs: tuple) -> tuple[int, ...]:
    model = _hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, **dict(kwargs),
        )
    return tuple(out[0, len(prompt_ids) :].tolist())


def run_staggered(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    per_step: int = 3,
) -> dict[str, list[int]]:
    """Add ``per_step`` prompts before each step, so steps mix prefills and decodes."""
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    finished: set[str] = set()
    next_prompt = 0
    for _ in range(10_000):
        for _ in range(per_step):
            if next_prompt < len(prompts):
                engine.add_request(str(next_prompt), prompts[next_prompt], params[next_prompt])
                next_prompt += 1
        for out in engine.step():
            tokens[out.req_id].extend(out.new_token_ids)
            if out.finished:
                finished.add(out.req_id)
        if len(finished) == len(prompts):
            return tokens
    raise AssertionError("engine did not finish within 10000 steps")


def assert_engine_matches_hf(model_dir: Path, config, prompts: list[list[int]], max_tokens: list[int]) -> LLMEngine:
    """Run ``prompts`` staggered through a fresh engine; each greedy output must equal
    transformers' ``generate``, and the engine must end with nothing running and no KV block held."""
    engine = LLMEngine.from_model_dir(model_dir, config)
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens]
    got = run_staggered(engine, prompts, params)
    for i, prompt in enumerate(prompts):
        want = hf_greedy(model_dir, prompt, max_tokens[i])
        assert got[str(i)] == want, f"prompt {i} (len {len(prompt)}) diverged from transformers"
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_used_kv_blocks == 0, "KV blocks leaked"
    return engine
