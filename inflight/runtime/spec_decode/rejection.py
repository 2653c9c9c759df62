"""Rejection sampling of a step's sampled drafts on the device, with one host read for them all.

The rule is :mod:`inflight.runtime.spec_decode.verify`'s: with ``p`` the target's distribution
and ``q`` the draft's (a point mass for an n-gram proposal), draft ``i`` is kept while
``u_i q(d_i) < p(d_i)`` (or while ``max(0, p - q)`` is all zero, where it cannot be rejected); the
first draft rejected is replaced by a draw from that residual renormalized, and if every
draft is kept one more token is drawn from the last row. A chunk's random draws come from its
request's generator in the order a one-chunk-at-a-time loop takes them (``k`` uniforms, then one
multinomial draw), so the tokens are the same as drawing draft by draft on the host; only
here every comparison, the count of kept drafts and the row the last token is drawn from
stay on the device (a GPU ran ~2k + 3 syncs a chunk that way), and :func:`draw_chunks` reads
every chunk's ``(kept, token)`` in one ``.tolist()``. On the CPU, where a read costs nothing,
the draft-by-draft loop (:func:`draw_chunk_host`), which touches only the rejected row, stays
cheaper (8 chunks of 3 drafts, vocabulary 49k, one thread: 7.0 ms against 10.5-10.9 ms), so it
runs there; the two give the same tokens from the same draws (tests/runtime/test_spec_rejection.py).
Knows nothing about scheduling.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from inflight.runtime.worker.batched_sampling import upload


def draw_chunk(probs: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
               generator: torch.Generator | None) -> torch.Tensor:
    """``[2]`` int64 on the device: how many of ``drafts`` (``[k]`` int64 on ``probs``'s device)
    are kept, and the token drawn after them. ``probs`` ``[k + 1, vocab]`` float32: the target's
    sampling distribution at each position; ``draft_probs`` ``[k, vocab]``: each draft's own
    (None: deterministic proposals)."""
    k = drafts.shape[0]
    device = probs.device
    if k == 0:
        token = exponential_race(probs[0], generator)
        return torch.cat([token.new_zeros(1), token])
    u = torch.rand(k, generator=generator, device=device)
    rows = torch.arange(k, device=device)
    p_kept = probs[rows, drafts]
    q = None if draft_probs is None else draft_probs.to(device, torch.float32)
    q_kept = torch.ones_like(p_kept) if q is None else q[rows, drafts]
    # max(0, p - q) is all zero exactly where no token has p > q (for an n-gram, none but the draft has p > 0)
    if q is None:
        empty = ~(probs[:k] > 0).scatter(1, drafts[:, None], False).any(dim=-1)
    else:
        empty = ~(probs[:k] > q).any(dim=-1)
    # float64: the product of two float32 values is exact there, as the host's Python floats had it
    keep = (u.double() * q_kept.double() < p_kept.double()) | empty
    kept = torch.cumprod(keep.to(torch.int64), 0).sum().view(1)  # the drafts before the first rejection
    # the row the last token is drawn from: the first rejected draft's residual, or the last row
    rejected = kept < k
    row = probs.index_select(0, kept)[0]
    if q is None:
        draft = torch.cat([drafts, drafts.new_zeros(1)]).index_select(0, kept)
        residual = row.masked_fill((torch.arange(row.shape[0], device=device) == draft) & rejected, 0.0)
    else:
        q_row = q.index_select(0, kept.clamp(max=k - 1))[0]
        residual = torch.where(rejected, (row - q_row).clamp_(min=0.0), row)
    norm = torch.where(rejected, residual.sum(), residual.new_ones(()))
    token = exponential_race(residual / norm, generator)
    return torch.cat([kept, token])


def exponential_race(dist: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``[1]`` int64: ``torch.multinomial(dist, 1, generator=generator)``'s draw, computed as it
    computes it (``argmax(dist / E)``, ``E ~ Exp(1)`` from the generator), without its check of
    ``dist``, which reads the device's min and max on the host."""
    noise = torch.empty_like(dist).exponential_(1, generator=generator)
    return (dist / noise).argmax(dim=-1, keepdim=True)


def draw_chunk_host(probs: torch.Tensor, drafts: tuple[int, ...], draft_probs: torch.Tensor | None,
                    generator: torch.Generator | None) -> list[int]:
    """:func:`draw_chunk` draft by draft, a host read per comparison: the kept drafts and the
    drawn token."""
    accept = torch.rand(len(drafts), generator=generator, device=probs.device).tolist() if drafts else []
    out: list[int] = []
    for i, draft in enumerate(drafts):
        q_draft = 1.0 if draft_probs is None else float(draft_probs[i, draft])
        if accept[i] * q_draft < float(probs[i, draft]):  # u < p(d) / q(d), without dividing by q
            out.append(draft)
            continue
        if draft_probs is None:
            residual = probs[i].clone()
            residual[draft] = 0.0
        else:
            residual = (probs[i] - draft_probs[i].to(probs.device, torch.float32)).clamp_(min=0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p <= q everywhere, so p == q: the draft cannot be rejected
            out.append(draft)
            continue
        out.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator)))
    return out


def draw_chunks(probs: Sequence[torch.Tensor], drafts: Sequence[tuple[int, ...]],
                draft_probs: Sequence[torch.Tensor | None], generators: Sequence[torch.Generator | None],
                *, on_device: bool | None = None) -> list[list[int]]:
    """Each chunk's emitted tokens (its kept drafts, then the drawn token), one chunk after
    another: by :func:`draw_chunk`, the drafts uploaded in one copy and the results read in one;
    or on the CPU (``on_device`` None) by :func:`draw_chunk_host`."""
    if not probs:
        return []
    if not draws_on_device(probs[0].device, on_device):
        return [draw_chunk_host(p, d, q, gen) for p, d, q, gen in zip(probs, drafts, draft_probs, generators,
                                                                        strict=True)]  # fmt: skip
    return emitted(drafts, draw_stacked(probs, drafts, draft_probs, generators).tolist())


def draws_on_device(device: torch.device, on_device: bool | None = None) -> bool:
    """Whether a step's drafts on ``device`` are drawn by :func:`draw_stacked` (``on_device`` None:
    everywhere but the CPU) rather than draft by draft on the host."""
    return device.type != "cpu" if on_device is None else on_device


def draw_stacked(probs: Sequence[torch.Tensor], drafts: Sequence[tuple[int, ...]],
                 draft_probs: Sequence[torch.Tensor | None],
                 generators: Sequence[torch.Generator | None]) -> torch.Tensor:  # fmt: skip
    """``[n, 2]`` int64 on the device, not read: each chunk's :func:`draw_chunk` (its kept count and
    drawn token), one chunk after another, the drafts uploaded in one copy."""
    device = probs[0].device
    flat = upload(np.asarray([d for chunk in drafts for d in chunk], dtype=np.int64), device)
    starts = np.cumsum([0, *(len(chunk) for chunk in drafts)])
    return torch.stack([draw_chunk(p, flat[int(starts[i]) : int(starts[i + 1])], q, gen)
                        for i, (p, q, gen) in enumerate(zip(probs, draft_probs, generators, strict=True))])  # fmt: skip


def emitted(drafts: Sequence[tuple[int, ...]], drawn: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each chunk's emitted tokens from its ``(kept, token)`` pair (a row of :func:`draw_stacked`)."""
    return [[*chunk[:kept], token] for chunk, (kept, token) in zip(drafts, drawn, strict=True)]
