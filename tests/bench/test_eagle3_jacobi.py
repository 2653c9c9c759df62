"""Prefill-made EAGLE-3 training data (``bench/eagle3_jacobi.py``) on a random demo model: its
labels are the served model's greedy next tokens, Jacobi iteration reaches the greedy answer the
engine decodes, and the training loss's chain mask (``bench.eagle3_fit.chain_ok``) keeps exactly
the chained passes whose fed tokens the target would have chosen."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.eagle3_fit import Example, chain_ok
from bench.eagle3_jacobi import jacobi_generate
from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.demo.model import make_demo_model
from inflight.runtime.sampling_params import SamplingParams

AUX = (0, 2, 3)
PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [7, 7, 250, 31, 12]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_demo_model(tmp_path_factory.mktemp("jacobi") / "tiny", "llama", "tiny", eos=False,
                           config_overrides={"num_hidden_layers": 4})  # fmt: skip


def _greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(num_kv_blocks=64))
    engine.add_request("g", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    out: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.extend(o.new_token_ids)
    engine.close()
    return out


def test_jacobi_iteration_reaches_the_engines_greedy_answer(model_dir: Path) -> None:
    n = 6
    drafts = [[1, 2, 3, 4, 5], [9, 9, 9, 9, 9]]  # far from any answer: only the iteration can fix them
    # a random model may fix one token per iteration: n of them reach the answer, one more sees it stay
    data = jacobi_generate(model_dir, PROMPTS, drafts, AUX, iters=n + 1, max_answer=n, log=lambda *_: None)
    assert len(data.examples) == 2 and data.on_path == 1.0 and data.changed[-1] == 0.0 < data.changed[0]
    for prompt, ex in zip(PROMPTS, data.examples, strict=True):
        answer = ex.tokens[len(prompt) :].tolist()
        assert answer == _greedy(model_dir, prompt, n)
        assert ex.aux.shape[0] == len(prompt) + n and ex.aux.shape[1] % 3 == 0
        # every answer token is the label (the model's greedy choice) of the position before it
        assert ex.labels[len(prompt) - 1 : -1].tolist() == answer
        assert ex.mask.tolist() == [i >= len(prompt) - 1 for i in range(len(prompt) + n)]


def test_one_prefill_labels_every_position_with_the_greedy_next_token(model_dir: Path) -> None:
    drafts = [[1, 2, 3, 4], [9, 9, 9]]
    data = jacobi_generate(model_dir, PROMPTS, drafts, AUX, iters=0, max_answer=8, log=lambda *_: None)
    for prompt, draft, ex in zip(PROMPTS, drafts, data.examples, strict=True):
        assert ex.tokens.tolist() == prompt + draft  # no iteration: the draft is the answer as given
        first = _greedy(model_dir, prompt, 1)
        assert int(ex.labels[len(prompt) - 1]) == first[0]
        assert int(ex.labels[-1]) == _greedy(model_dir, prompt + draft, 1)[0]


def test_chain_mask_keeps_only_chains_fed_the_targets_own_tokens() -> None:
    tokens = torch.tensor([10, 11, 12, 13, 14, 15, 16])
    labels = torch.tensor([11, 12, 99, 14, 15, 16, 17])  # token 3 (13) is not the choice after token 2 (99)
    ex = Example(torch.zeros(7, 6), tokens, labels, torch.ones(7, dtype=torch.bool))
    assert chain_ok(ex, 0).tolist() == [True] * 6  # pass 1 reads no draft
    # pass 2 at i is fed token i + 1 as a draft: wrong at i = 2 (token 3)
    assert chain_ok(ex, 1).tolist() == [False, True, False, True, True, True]
    # pass 3 at i is fed tokens i and i + 1: wrong at i = 2 and i = 3
    assert chain_ok(ex, 2).tolist() == [False, False, False, False, True, True]
