"""Verification of speculative drafts against the target model's logits at each draft position.

``logits`` holds ``1 + k`` rows for a sequence that ran its last token plus ``k`` drafts: row
``i`` is the target's distribution for the token after position ``i``. Greedy: drafts are
kept while each equals the row's argmax; the first disagreement is replaced by the argmax
(and if all agree, the last row's argmax is a free extra token). So greedy output is exactly
what decoding one token at a time gives. Sampling (temperature and the top-k / top-p / min-p
filters): a draft ``d`` is kept with probability ``p(d)``; the first one rejected is replaced
by a draw from ``p`` with ``d`` removed and renormalized, which makes every emitted token
distributed as the target model (the proposal is deterministic, so the usual
``min(1, p/q)`` test is ``p(d)``); if all are kept, one more token is drawn from the last
row. Draws use the request's own generator. Knows nothing about scheduling.
"""

from __future__ import annotations

import torch

from inflight.runtime.sampler import SamplingRow, filter_logits


def verify_greedy(logits: torch.Tensor, drafts: tuple[int, ...]) -> list[int]:
    """``logits`` ``[1 + k, vocab]``: the accepted drafts plus one token."""
    best = logits.argmax(dim=-1).tolist()
    out = []
    for i, draft in enumerate(drafts):
        if best[i] != draft:
            out.append(best[i])
            return out
        out.append(draft)
    out.append(best[len(drafts)])
    return out


def target_probs(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """``[1 + k, vocab]`` sampling distributions of the request (temperature, then filters)."""
    scaled = logits / (row.params.temperature or 1.0)
    return torch.softmax(filter_logits(scaled, [row] * logits.shape[0]), dim=-1)


def verify_sampled(logits: torch.Tensor, drafts: tuple[int, ...], row: SamplingRow) -> list[int]:
    """Rejection sampling of ``drafts`` (see module docstring): accepted drafts plus one token."""
    probs = target_probs(logits.float(), row)
    gen = row.generator
    accept = torch.rand(len(drafts), generator=gen, device=probs.device).tolist() if drafts else []
    out: list[int] = []
    for i, draft in enumerate(drafts):
        if accept[i] < float(probs[i, draft]):
            out.append(draft)
            continue
        residual = probs[i].clone()
        residual[draft] = 0.0
        total = float(residual.sum())
        if total <= 0.0:  # p put all its mass on the draft: it cannot be rejected
            out.append(draft)
            continue
        out.append(int(torch.multinomial(residual / total, 1, generator=gen)))
        return out
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=gen)))
    return out
