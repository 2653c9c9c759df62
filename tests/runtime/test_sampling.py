"""Sampling features: seeds, top-k/top-p/min-p, penalties, stops, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from inflight.runtime import LLM, SamplingParams
from inflight.runtime.worker.sampler import Sampler, SamplingRow

from .hf_reference import _hf_model, hf_greedy


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(llama_dir, num_kv_blocks=128, max_num_sequences=8, device="cpu")  # vs transformers on the CPU


def test_seeded_sampling_is_independent_of_the_batch(llm):
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    alone = llm.generate(["def main():"], p)[0].token_ids
    others = [SamplingParams(max_tokens=12, temperature=1.0) for _ in range(3)]
    batch = llm.generate(["x = [", "def main():", "import re", "class A:"], [others[0], p, others[1], others[2]])
    assert batch[1].token_ids == alone
    assert llm.generate(["def main():"], SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=99))[0].token_ids != alone


def test_top_k_one_equals_greedy(llm):
    greedy = llm.generate(["for i in range("], SamplingParams(max_tokens=12, temperature=0.0))[0]
    top1 = llm.generate(["for i in range("], SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=3))[0]
    assert greedy.token_ids == top1.token_ids


def test_repetition_penalty_matches_transformers(llm, llama_dir):
    prompt = llm.engine.encode_prompt("value = value + value")
    ours = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.3))[0]
    assert ours.token_ids == hf_greedy(llama_dir, prompt, 16, repetition_penalty=1.3)


def test_stop_string_is_cut_from_the_text(llm):
    full = llm.generate(["def fib(n):"], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    stop = full.text[5:8]
    assert stop and stop in full.text
    cut = llm.generate(["def fib(n):"], SamplingParams(max_tokens=24, temperature=0.0, stop=[stop], ignore_eos=True))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]


def test_stop_token_ids_and_length(llm):
    full = llm.generate(["import os"], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 10
    target = full.token_ids[3]
    first = full.token_ids.index(target)
    stopped = llm.generate(["import os"], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[target]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[: first + 1]


def test_logprobs_match_transformers_scores(llm, llama_dir):
    prompt = llm.engine.encode_prompt("while True:")
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=3))[0]
    model = _hf_model(str(llama_dir))
    gen = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                         output_scores=True, return_dict_in_generate=True)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for lp, token_id, scores in zip(out.logprobs, out.token_ids, gen.scores, strict=False):
        ref = torch.log_softmax(scores[0].float(), dim=-1)
        assert lp.token_id == token_id
        assert math.isclose(lp.logprob, float(ref[token_id]), abs_tol=1e-4)
        assert len(lp.top) == 3 and lp.top[0][0] == token_id  # greedy picks the best
        assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()


def test_min_tokens_masks_eos_until_reached():
    sampler = Sampler(torch.device("cpu"))
    logits = torch.zeros(1, 8)
    logits[0, 0] = 10.0  # EOS is by far the best
    row = SamplingRow(SamplingParams(min_tokens=5, max_tokens=8, temperature=0.0), [1], [2, 2], None, (0,))
    assert sampler.sample(logits.clone(), [row]).token_ids[0] != 0
    row = SamplingRow(SamplingParams(min_tokens=2, max_tokens=8, temperature=0.0), [1], [2, 2], None, (0,))
    assert sampler.sample(logits.clone(), [row]).token_ids[0] == 0


def test_presence_and_frequency_penalties():
    sampler = Sampler(torch.device("cpu"))
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.9, 0.0]])
    outputs = [1, 1, 2]
    row = SamplingRow(SamplingParams(temperature=0.0, frequency_penalty=1.0), [0], outputs, None, ())
    assert sampler.sample(logits.clone(), [row]).token_ids == [3]  # 5-2=3, 4-1=3, 3.9 -> ... 3.9 wins
    row = SamplingRow(SamplingParams(temperature=0.0, presence_penalty=2.0), [0], outputs, None, ())
    assert sampler.sample(logits.clone(), [row]).token_ids == [3]  # 3, 2, 3.9


@pytest.mark.parametrize("kw,allowed", [
    (dict(top_k=2), {1, 2}),
    (dict(top_p=0.35), {1}),
    (dict(top_p=0.6), {1, 2}),  # the smallest set whose mass reaches top_p
    (dict(min_p=0.5), {1, 2}),
])
def test_filters_only_draw_allowed_tokens(kw, allowed):
    sampler = Sampler(torch.device("cpu"))
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.3, 0.15, 0.1]]))
    gen = torch.Generator().manual_seed(1)
    seen = set()
    for _ in range(200):
        row = SamplingRow(SamplingParams(temperature=1.0, **kw), [0], [], gen, ())
        seen.update(sampler.sample(logits.clone(), [row]).token_ids)
    assert seen == allowed
