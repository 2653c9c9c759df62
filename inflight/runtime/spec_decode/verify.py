"""Verification of speculative drafts against the target model's logits at each draft position.

``logits`` holds ``1 + k`` rows for a sequence that ran its last token plus ``k`` drafts: row
``i`` is the target's distribution for the token after position ``i``. Greedy: drafts are
kept while each equals the row's argmax; the first disagreement is replaced by the argmax
(and if all agree, the last row's argmax is a free extra token). So greedy output is exactly
what decoding one token at a time gives. Sampling (temperature and the top-k / top-p / min-p
filters, :func:`sampling_probs`): with ``p`` the target's distribution and ``q`` the one the
draft was drawn from, a draft ``d`` is kept with probability ``min(1, p(d) / q(d))``; the
first one rejected is replaced by a draw from ``max(0, p - q)`` renormalized, which makes
every emitted token distributed as the target model (Leviathan et al., Chen et al. 2023); if
all are kept, one more token is drawn from the last row. An n-gram proposal is deterministic,
so its ``q`` is a point mass on ``d``: the test is ``p(d)`` and the residual is ``p`` without
``d``. A draft model's ``q`` is its own distribution under the same temperature and filters
(:mod:`inflight.runtime.spec_decode.draft_proposer`). Draws use the request's own generator.

Each row is first shaped as the sampler shapes a one-token step's row (:func:`shape_logits`):
``logit_bias``, and the penalties as of that row's own position, i.e. counted over the output
so far plus the drafts before the row (which were kept if the row's token is emitted). So a
request with penalties or a bias verifies against the distribution it would sample from
without speculation, and each emitted token gets the logprob entries (chosen token and top
alternatives, before temperature) that decoding it alone would give. A grammar-bound
request's rows then get the grammar's mask of their own position
(:mod:`inflight.runtime.spec_decode.grammar`), as the sampler masks a one-token row. Knows nothing
about scheduling.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from inflight.runtime.outputs import TokenLogprob
from inflight.runtime.spec_decode.grammar import draft_masks
from inflight.runtime.spec_decode.rejection import draw_chunks, draw_stacked, draws_on_device, emitted
from inflight.runtime.structured.bitmask import apply_bitmask
from inflight.runtime.worker.batched_sampling import row_index, upload
from inflight.runtime.worker.sampler import SamplingRow, filter_logits, shape_logits, token_logprobs

if TYPE_CHECKING:
    from inflight.runtime.core.sched_output import ScheduledChunk


def verify_greedy(logits: torch.Tensor, drafts: tuple[int, ...]) -> list[int]:
    """``logits`` ``[1 + k, vocab]``: the accepted drafts plus one token."""
    return accept_greedy(logits.argmax(dim=-1).tolist(), drafts)


def accept_greedy(best: Sequence[int], drafts: tuple[int, ...]) -> list[int]:
    """The accepted drafts plus one token, from each row's argmax ``best`` (``1 + k`` of them)."""
    out = []
    for i, draft in enumerate(drafts):
        if best[i] != draft:
            out.append(best[i])
            return out
        out.append(draft)
    out.append(best[len(drafts)])
    return out


def sampling_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """``[n, vocab]`` float32: row ``i``'s sampling distribution under ``rows[i]``'s temperature
    and top-k / top-p / min-p filters."""
    temperature = upload(np.asarray([r.params.temperature or 1.0 for r in rows], dtype=np.float32), logits.device)
    return torch.softmax(filter_logits(logits.float() / temperature[:, None], rows), dim=-1)


def target_probs(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """``[1 + k, vocab]`` sampling distributions of the request (temperature, then filters)."""
    return sampling_probs(logits, [row] * logits.shape[0])


def verify_sampled(
    logits: torch.Tensor, drafts: tuple[int, ...], row: SamplingRow, draft_probs: torch.Tensor | None = None
) -> list[int]:
    """Rejection sampling of ``drafts`` (see module docstring): accepted drafts plus one token
    (:mod:`inflight.runtime.spec_decode.rejection`: on a GPU on the device with one host read,
    on the CPU draft by draft).

    ``draft_probs`` ``[k, vocab]``: the distribution each draft was drawn from; None for
    deterministic proposals (n-gram)."""
    return draw_chunks([target_probs(logits, row)], [drafts], [draft_probs], [row.generator])[0]


def position_rows(row: SamplingRow, drafts: tuple[int, ...]) -> list[SamplingRow]:
    """The ``1 + k`` verification rows' sampling rows: row ``i`` sees the output so far plus
    ``drafts[:i]`` (what its penalties and min_tokens count)."""
    return [row_after(row, drafts[:i]) for i in range(len(drafts) + 1)]


def row_after(row: SamplingRow, drafts: Sequence[int]) -> SamplingRow:
    """``row`` for the position after ``drafts``: its output counted with them."""
    if not drafts or (not row.params.needs_penalties and not row.params.min_tokens):
        return row
    return dataclasses.replace(row, output_token_ids=[*row.output_token_ids, *drafts])


Verified = tuple[tuple[int, ...], tuple[TokenLogprob | None, ...]]


@torch.inference_mode()
def verify_chunks(
    logits: torch.Tensor,
    chunks: Sequence[ScheduledChunk],
    rows: Sequence[SamplingRow],
    draft_probs: Sequence[torch.Tensor | None],
    *,
    on_device: bool | None = None,
) -> list[Verified]:
    """:func:`verify_chunk` for a step's speculating chunks at once. ``logits`` ``[sum(1 + k_i),
    vocab]`` float32 holds each chunk's rows in turn and is shaped in place. Every row is shaped
    in one batched pass and the logprob entries of every chunk that asks for them are fetched in one
    call. A sampled chunk draws with its own generator, one chunk after another (its draws are the
    same as alone): on a GPU on the device (:mod:`.rejection`; ``on_device`` True forces that path
    on the CPU), where the greedy chunks' argmaxes and every sampled chunk's result come to the host
    in one read together (one device sync a step, where a chunk at a time cost one each); on the
    CPU draft by draft, after one read of the argmaxes. The same tokens and entries as
    :func:`verify_chunk` chunk by chunk."""
    all_rows: list[SamplingRow] = []
    spans: list[tuple[int, int]] = []
    for chunk, row in zip(chunks, rows, strict=True):
        spans.append((len(all_rows), len(chunk.draft_token_ids) + 1))
        all_rows += position_rows(row, chunk.draft_token_ids)
    if logits.shape[0] != len(all_rows):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(all_rows)} verification rows")
    shape_logits(logits, all_rows)
    for chunk, row, (first, _) in zip(chunks, rows, spans, strict=True):
        if row.matcher is not None:  # a grammar: each row's mask is the one of its own position (the rows
            masks = draft_masks(row.matcher, chunk.draft_token_ids, logits.shape[-1])  # up to a draft it refuses)
            apply_bitmask(logits, range(first, first + masks.shape[0]), masks)
    tokens = _accepted(logits, chunks, rows, draft_probs, spans, on_device)
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    entries: dict[int, list[TokenLogprob | None]] = {}
    if wanted:
        picked = [spans[i][0] + j for i in wanted for j in range(len(tokens[i]))]
        index = row_index(picked, logits.device)
        got = iter(token_logprobs(logits[index], [all_rows[r] for r in picked], [t for i in wanted for t in tokens[i]]))
        entries = {i: [next(got) for _ in tokens[i]] for i in wanted}
    return [(tuple(t), tuple(entries[i]) if i in entries else (None,) * len(t)) for i, t in enumerate(tokens)]


def _accepted(
    logits: torch.Tensor, chunks: Sequence[ScheduledChunk], rows: Sequence[SamplingRow],
    draft_probs: Sequence[torch.Tensor | None], spans: Sequence[tuple[int, int]], on_device: bool | None,
) -> list[list[int]]:  # fmt: skip
    """Each chunk's emitted tokens (see :func:`verify_chunks`): the argmax of the greedy chunks'
    rows only, read with the sampled chunks' draws where those stay on the device."""
    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    picked = [spans[i][0] + j for i in greedy for j in range(spans[i][1])]
    best = None
    if greedy:
        best = (logits if len(picked) == logits.shape[0] else logits[row_index(picked, logits.device)]).argmax(dim=-1)
    drafts = [chunks[i].draft_token_ids for i in sampled]
    probs = [target_probs(logits[spans[i][0] : spans[i][0] + spans[i][1]], rows[i]) for i in sampled]
    dists, gens = [draft_probs[i] for i in sampled], [rows[i].generator for i in sampled]
    if sampled and draws_on_device(logits.device, on_device):
        stacked = draw_stacked(probs, drafts, dists, gens).flatten()
        read = (stacked if best is None else torch.cat([best, stacked])).tolist()  # the step's one host read
        best_ids, pairs = read[: len(picked)], read[len(picked) :]
        draws = emitted(drafts, list(zip(pairs[::2], pairs[1::2], strict=True)))
    else:
        best_ids = [] if best is None else best.tolist()
        draws = draw_chunks(probs, drafts, dists, gens, on_device=False)
    drawn = dict(zip(sampled, draws, strict=True))
    tokens: list[list[int]] = []
    offset = 0
    for i, (chunk, (_, n)) in enumerate(zip(chunks, spans, strict=True)):
        if i in drawn:
            tokens.append(drawn[i])
            continue
        tokens.append(accept_greedy(best_ids[offset : offset + n], chunk.draft_token_ids))
        offset += n
    return tokens


@torch.inference_mode()
def verify_chunk(
    logits: torch.Tensor, chunk: ScheduledChunk, row: SamplingRow, draft_probs: torch.Tensor | None = None
) -> Verified:
    """The tokens a speculating ``chunk`` emits (its accepted drafts plus one) and their
    logprob entries (None each unless the request asks for logprobs). ``logits`` ``[1 + k,
    vocab]`` float32 is shaped in place.

    A draft model's chunk whose drafts are all kept (``len(tokens) > k``) leaves the draft
    model's KV one position behind the target's (its last draft was never fed to it): the
    engine records that lag on the request (core/batch_run.py); nothing here writes a request."""
    return verify_chunks(logits, [chunk], [row], [draft_probs])[0]
