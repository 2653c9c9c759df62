"""Prompt logprobs match transformers' own log-softmax over the prompt, with the prompt split
into chunks, with the prefix cache warm, and after preemption (nothing collected twice)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.sampling_params import SamplingParams

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from inflight.runtime.demo.model import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("prompt-logprobs") / "llama", arch="llama", size="tiny")


def _reference(model_dir: Path, ids: list[int], k: int) -> tuple[list[float], list[list[int]]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    chosen = [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]
    tops = [logp[i - 1].topk(k).indices.tolist() for i in range(1, len(ids))]
    return chosen, tops


def _prompt_logprobs(engine: LLMEngine, ids: list[int], req_id: str, k: int = 3) -> list:
    engine.add_request(req_id, ids, SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=k))
    got = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.req_id == req_id and out.prompt_logprobs is not None:
                got.append(out.prompt_logprobs)
    assert len(got) == 1, "prompt logprobs must come exactly once"
    return list(got[0])


@pytest.mark.parametrize("max_num_tokens", [512, 16], ids=["whole", "chunked"])
def test_prompt_logprobs_match_transformers(model_dir: Path, max_num_tokens: int) -> None:
    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(
        device="cpu", max_num_sequences=4, num_kv_blocks=64, max_model_len=512, max_num_tokens=max_num_tokens, block_size=16))
    ids = engine.encode_prompt(PROMPT)
    want, want_top = _reference(model_dir, ids, 3)
    for attempt in range(2):  # the second run would hit the prefix cache if it were used
        got = _prompt_logprobs(engine, ids, f"r{attempt}")
        assert [e.token_id for e in got] == ids[1:]
        assert max(abs(e.logprob - w) for e, w in zip(got, want, strict=True)) < 1e-4
        assert [[t for t, _ in e.top] for e in got] == want_top


def test_prompt_logprobs_survive_preemption(model_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(
        device="cpu", max_num_sequences=4, num_kv_blocks=12, max_model_len=128, block_size=4, max_num_tokens=8))
    ids = engine.encode_prompt(PROMPT)[:30]
    want, _ = _reference(model_dir, ids, 1)
    for i in range(3):
        engine.add_request(f"filler{i}", ids[: 8 + i], SamplingParams(max_tokens=12, temperature=0.0))
    got = _prompt_logprobs(engine, ids, "target", k=1)
    assert engine.stats().num_preemptions > 0
    assert len(got) == len(ids) - 1
    assert max(abs(e.logprob - w) for e, w in zip(got, want, strict=True)) < 1e-4
