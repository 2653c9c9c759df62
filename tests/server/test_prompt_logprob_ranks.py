"""``prompt_logprobs`` give every prompt token its rank in the whole vocabulary (vLLM's: 1 + the
number of tokens scored strictly higher), also when it is not among the top-k alternatives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inflight.runtime.core.prompt_logprobs import span_logprobs
from tests.server.server_helpers import MODEL_NAME, LiveServer, http

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
TOLERANCE = 1e-4  # our kernels against transformers' float32 forward


def test_rank_counts_strictly_higher_scores() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0, 5.0]] * 4)  # [4, vocab]
    prompt = [0, 2, 3, 4, 5]  # row i scores prompt token i + 1
    entries = span_logprobs(logits, prompt, 0, k=1)
    assert [e.rank for e in entries] == [3, 3, 6, 1]  # a tie shares its rank
    assert [e.top[0][0] for e in entries] == [5] * 4


def _reference_rank_bounds(model_dir: Path, ids: list[int]) -> list[tuple[int, int]]:
    """Per prompt token after the first: the (best, worst) rank transformers' logits allow
    within TOLERANCE (near-ties may fall either way between two implementations)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()  # [len(ids), vocab]
    bounds = []
    for i in range(1, len(ids)):
        row, target = logits[i - 1], logits[i - 1, ids[i]]
        bounds.append((1 + int((row > target + TOLERANCE).sum()), 1 + int((row > target - TOLERANCE).sum())))
    return bounds


def test_prompt_tokens_outside_the_top_k_get_their_rank(server: LiveServer, demo_model_dir: Path) -> None:
    import transformers

    reply = http("POST", f"{server.url}/v1/completions", {
        "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1})
    assert reply.status == 200, reply.text
    plp = reply.json()["choices"][0]["prompt_logprobs"]
    ids = transformers.AutoTokenizer.from_pretrained(str(demo_model_dir)).encode(PROMPT)
    assert plp[0] is None and len(plp) == len(ids)
    ranks = [entry[str(token)]["rank"] for entry, token in zip(plp[1:], ids[1:], strict=True)]
    for rank, (best, worst) in zip(ranks, _reference_rank_bounds(demo_model_dir, ids), strict=True):
        assert isinstance(rank, int) and best <= rank <= worst
    assert any(rank > 1 for rank in ranks)  # tokens outside the top 1: null before
    for entry in plp[1:]:
        assert sorted(e["rank"] for e in entry.values())[0] == 1


def test_chat_prompt_logprobs_carry_ranks(server: LiveServer) -> None:
    reply = http("POST", f"{server.url}/v1/chat/completions", {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 1,
        "prompt_logprobs": 0})
    plp = reply.json()["prompt_logprobs"]
    assert plp[0] is None and all(isinstance(e["rank"], int) and e["rank"] >= 1
                                  for entry in plp[1:] for e in entry.values())


@pytest.mark.parametrize("k", [0, 3])
def test_top_k_ranks_are_positions(k: int) -> None:
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(k))
    prompt = [int(t) for t in torch.randint(0, 40, (6,), generator=torch.Generator().manual_seed(1))]
    for row, entry in enumerate(span_logprobs(logits, prompt, 0, k)):
        order = logits[row].argsort(descending=True).tolist()
        assert entry.rank == order.index(entry.token_id) + 1
        assert [t for t, _ in entry.top] == order[:k]
