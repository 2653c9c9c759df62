"""Prompt logprobs: the log-probability of each prompt token given the tokens before it.

The runner computes logits for the prompt rows of requests that ask (``SamplingParams.
prompt_logprobs``); this module turns those rows into one :class:`TokenLogprob` per prompt
token (from the second on: the first has no context) with its rank in the vocabulary (vLLM's:
1 + the number of tokens scored strictly higher) and the top-k alternatives, from the raw
distribution (no penalties, temperature or masks). Knows nothing about scheduling; the
output processor keeps what each request has collected, so a recompute after preemption adds
nothing twice.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inflight.runtime.outputs import TokenLogprob


def span_logprobs(
    logits: torch.Tensor, prompt_token_ids: Sequence[int], first_position: int, k: int
) -> list[TokenLogprob]:
    """``logits``: ``[count, vocab]`` rows at positions ``first_position ..``; row i scores
    prompt token ``first_position + i + 1``."""
    count = logits.shape[0]
    scores = logits.float()  # [count, vocab]
    logp = torch.log_softmax(scores, dim=-1)
    targets = torch.tensor(prompt_token_ids[first_position + 1 : first_position + 1 + count],
                           dtype=torch.int64, device=logits.device)
    target_scores = scores.gather(1, targets[:, None])  # [count, 1]
    ranks = ((scores > target_scores).sum(dim=-1) + 1).tolist()
    chosen = logp.gather(1, targets[:, None]).squeeze(1).tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * count
    if k > 0:
        vals, idx = logp.topk(k, dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(idx.tolist(), vals.tolist(), strict=True)]
    return [TokenLogprob(int(t), lp, top, rank)
            for t, lp, top, rank in zip(targets.tolist(), chosen, tops, ranks, strict=True)]
