"""Batched sampling on the logits' device: one pass over the whole step, at most one host sync.

Owns the per-step work of :class:`inflight.runtime.worker.sampler.Sampler` once the grammar
masks are applied, written the way vLLM v1's sampler does it:

* per-row parameters (temperature, top-k, top-p, min-p, penalties) become device tensors once
  per step, built in numpy on the host and uploaded without waiting (pinned, non-blocking on
  CUDA); which features the step needs is read from the rows' parameters on the host, never from
  a tensor;
* ``logit_bias`` and the ``min_tokens`` ban are one indexed add / fill over the flat
  ``(row, token)`` pairs of the batch; penalties are one gather and one indexed write at each
  penalized row's distinct tokens, so their work follows the rows' tokens, never
  ``rows x vocab``. The sampler's rows take those tokens from their request's state on the
  device (:mod:`~inflight.runtime.worker.penalty_state`, no host re-read of a prompt a step);
  a row without state (spec-decode verification, drafters, tests) has them counted from its
  token lists with ``np.unique`` here, the same values to the bit;
* top-k and top-p cut one sort of the batch, min-p compares with each row's max probability;
* the draw is an exponential race (``argmax(p / E)``, ``E ~ Exp(1)``): the unseeded rows'
  noise in one launch from the default generator, a seeded row's from its own generator (the
  only per-row launch, and only for seeded rows: a seeded request gets the same tokens whatever
  shares its batch);
* the chosen tokens' log-probabilities and the top-n alternatives are one gather and one
  ``topk`` over the rows that ask for them, packed with the sampled ids into ONE device-to-host
  transfer, which :func:`start_sample` only starts (:class:`HostTokens`: pinned memory and an
  event on CUDA) and ``HostTokens.result`` waits for.

Log-probabilities come from the shaped, masked logits before temperature. Knows nothing about
grammars, scheduling or the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from inflight.runtime.outputs import TokenLogprob

if TYPE_CHECKING:
    from inflight.runtime.worker.penalty_state import PenaltyPool, PenaltyRows
    from inflight.runtime.worker.sampler import SamplingRow


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` as a tensor on ``device`` without a host sync: pinned and copied non-blocking
    on CUDA (a pageable copy would wait for every kernel queued before it)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def row_index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """Row indices as an int64 index tensor on ``device`` (uploaded without a sync)."""
    return upload(np.asarray(rows, dtype=np.int64), device)


# -- shaping: logit_bias, penalties, min_tokens ---------------------------------------------
def shape_batch(
    logits: torch.Tensor, rows: Sequence[SamplingRow], pool: PenaltyPool | None = None
) -> PenaltyRows | None:
    """Apply each row's ``logit_bias``, penalties and ``min_tokens`` ban to ``logits``
    ``[len(rows), vocab]`` in place (the distribution logprobs are taken from). With ``pool``,
    the rows whose request keeps penalty state (``row.penalties``) are penalized from it and
    returned (for :meth:`PenaltyPool.record` once drawn); the others from their token lists."""
    dev = logits.device
    bias = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias]
    if bias:
        ri, ti, vals = zip(*bias, strict=True)
        index = (row_index(ri, dev), row_index(ti, dev))
        logits.index_put_(index, upload(np.asarray(vals, dtype=np.float32), dev).to(logits.dtype), accumulate=True)
    penalized = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    kept = None
    if penalized and pool is not None and any(rows[i].penalties is not None for i in penalized):
        kept = pool.prepare(rows, penalized)
        if kept.rows:
            pool.apply(logits, kept, rows)
            done = set(kept.rows)
            penalized = [i for i in penalized if i not in done]
    if penalized:
        _apply_penalties(logits, penalized, [rows[i] for i in penalized])
    banned = [(i, t) for i, r in enumerate(rows) for t in _min_tokens_ban(r)]
    if banned:
        ri, ti = zip(*banned, strict=True)
        logits.index_put_((row_index(ri, dev), row_index(ti, dev)),
                          torch.full((), float("-inf"), dtype=logits.dtype, device=dev))  # fmt: skip
    return kept


def _min_tokens_ban(row: SamplingRow) -> tuple[int, ...]:
    p = row.params
    if not p.min_tokens or len(row.output_token_ids) >= p.min_tokens:
        return ()
    return p.stop_token_ids if p.ignore_eos else p.stop_token_ids + tuple(row.eos_token_ids)


def _padded(arrays: list[np.ndarray]) -> np.ndarray:
    """``[len(arrays), longest]``: each row its values, then its first value again (a repeated
    position computes and writes the same value as the first, so the pad changes nothing)."""
    out = np.empty((len(arrays), max(len(a) for a in arrays)), dtype=arrays[0].dtype)
    for j, a in enumerate(arrays):
        out[j, : len(a)] = a
        out[j, len(a) :] = a[0]
    return out


def id_array(seq: Sequence[int]) -> np.ndarray:
    """A list or a request's TokenRange as int64 (a range slices to a list without a copy loop)."""
    return np.asarray(seq if isinstance(seq, list) else seq[:], dtype=np.int64)


def _apply_penalties(logits: torch.Tensor, index: list[int], rows: list[SamplingRow]) -> None:
    """Repetition (prompt and output tokens), then frequency and presence (output tokens)
    penalties of the rows ``index``: each one gather and one indexed write at the rows' own
    distinct token ids (padded per row), so the work follows the tokens, not the vocabulary."""
    dev = logits.device
    rep_rows = [(i, r) for i, r in zip(index, rows, strict=True) if r.params.repetition_penalty != 1.0]
    if rep_rows:
        seen = [np.unique(np.concatenate([id_array(r.prompt_token_ids), id_array(r.output_token_ids)]))
                for _, r in rep_rows]  # fmt: skip
        keep = [(i, r, ids) for (i, r), ids in zip(rep_rows, seen, strict=True) if len(ids)]
        if keep:
            at = (row_index([i for i, _, _ in keep], dev)[:, None], upload(_padded([ids for _, _, ids in keep]), dev))
            rep = upload(np.asarray([r.params.repetition_penalty for _, r, _ in keep], dtype=np.float32), dev)
            r = rep.to(logits.dtype)[:, None]
            vals = logits[at]  # [k, width]
            logits[at] = torch.where(vals > 0, vals / r, vals * r)
    freq_rows = [(i, r) for i, r in zip(index, rows, strict=True)
                 if (r.params.frequency_penalty or r.params.presence_penalty) and len(r.output_token_ids)]  # fmt: skip
    if freq_rows:
        counted = [np.unique(id_array(r.output_token_ids), return_counts=True) for _, r in freq_rows]
        at = (row_index([i for i, _ in freq_rows], dev)[:, None], upload(_padded([u for u, _ in counted]), dev))
        counts = upload(_padded([c.astype(np.float32) for _, c in counted]), dev).to(logits.dtype)  # [k, width]
        fp = upload(np.asarray([(r.params.frequency_penalty, r.params.presence_penalty) for _, r in freq_rows],
                               dtype=np.float32), dev).to(logits.dtype)  # fmt: skip
        logits[at] = logits[at] - (fp[:, :1] * counts + fp[:, 1:])  # every listed token occurs: presence applies


# -- the draw ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FilterTensors:
    """Per-row truncation parameters on the device, for the rows that use each (a row's
    distribution never depends on what else shares its batch); None where no row does."""

    sort_rows: torch.Tensor | None  # [s] rows with top-k or top-p (None: every row)
    top_k: torch.Tensor | None  # [s] int64 (vocab: none)
    top_p: torch.Tensor | None  # [s] float32 (1.0: none)
    min_p_rows: torch.Tensor | None  # [m] rows with min-p (None: every row)
    min_p: torch.Tensor | None  # [m] float32


def _subset(rows: list[int], n: int, device: torch.device) -> torch.Tensor | None:
    return None if len(rows) == n else row_index(rows, device)


def filter_tensors(rows: Sequence[SamplingRow], vocab: int, device: torch.device) -> FilterTensors:
    """The step's truncation tensors, which rows use what decided from the parameters on the host."""
    n = len(rows)
    sort_rows = [i for i, r in enumerate(rows) if r.params.top_k > 0 or r.params.top_p < 1.0]
    min_rows = [i for i, r in enumerate(rows) if r.params.min_p > 0]
    sort_idx = top_k = top_p = min_idx = min_p = None
    if sort_rows:
        sort_idx = _subset(sort_rows, n, device)
        top_k = upload(np.asarray([rows[i].params.top_k if rows[i].params.top_k > 0 else vocab for i in sort_rows],
                                  dtype=np.int64), device)  # fmt: skip
        top_p = upload(np.asarray([rows[i].params.top_p for i in sort_rows], dtype=np.float32), device)
    if min_rows:
        min_idx = _subset(min_rows, n, device)
        min_p = upload(np.asarray([rows[i].params.min_p for i in min_rows], dtype=np.float32), device)
    return FilterTensors(sort_idx, top_k, top_p, min_idx, min_p)


def apply_filters(logits: torch.Tensor, f: FilterTensors) -> torch.Tensor:
    """Mask tokens outside each row's top-k / top-p (one sort of the rows that use them) and
    min-p (against its max probability); a new tensor."""
    if f.top_k is not None and f.top_p is not None:
        part = logits if f.sort_rows is None else logits.index_select(0, f.sort_rows)
        part = _top_k_top_p(part, f.top_k, f.top_p)
        logits = part if f.sort_rows is None else logits.index_copy(0, f.sort_rows, part)
    if f.min_p is not None:
        part = logits if f.min_p_rows is None else logits.index_select(0, f.min_p_rows)
        probs = torch.softmax(part, dim=-1)
        threshold = f.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        part = part.masked_fill(probs < threshold, float("-inf"))
        logits = part if f.min_p_rows is None else logits.index_copy(0, f.min_p_rows, part)
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[s, vocab]`` with the tokens past each row's top-k, or past the smallest
    set whose mass reaches its top-p, at -inf (one sort; the best token always stays)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = torch.arange(vocab, device=logits.device)[None, :] >= top_k[:, None]
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before > top_p[:, None]
    drop[:, 0] = False
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def draw(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Token ids ``[n]`` int64 on the device: argmax for greedy rows, else temperature,
    filters and an exponential race; no host sync."""
    dev = logits.device
    greedy = [r.params.greedy for r in rows]
    if all(greedy):
        return logits.argmax(dim=-1)
    temps = upload(np.asarray([r.params.temperature or 1.0 for r in rows], dtype=np.float32), dev)
    scaled = apply_filters(logits / temps[:, None].to(logits.dtype), filter_tensors(rows, logits.shape[-1], dev))
    probs = torch.softmax(scaled, dim=-1)
    noise = torch.empty_like(probs)
    if any(r.generator is None for r, g in zip(rows, greedy, strict=True) if not g):
        noise.exponential_()  # every unseeded row in one launch, from the default generator
    for i, (row, g) in enumerate(zip(rows, greedy, strict=True)):
        if row.generator is not None and not g:
            noise[i].exponential_(generator=row.generator)  # a seeded row: its own stream
    sampled = (probs / noise).argmax(dim=-1)
    if not any(greedy):
        return sampled
    return torch.where(upload(np.asarray(greedy, dtype=np.bool_), dev), logits.argmax(dim=-1), sampled)


# -- one transfer back -----------------------------------------------------------------------
class HostTokens:
    """A step's sampled ids (and logprob entries) on their way to the host. On CUDA the copy
    into pinned memory is started without waiting and :meth:`result` waits for it alone (an
    event), so the thread that launched the sampling may launch the next step first; elsewhere
    :meth:`result` reads the values (one ``.tolist()``)."""

    __slots__ = ("_rows", "_wanted", "_k", "_host", "_event", "_ready")

    def __init__(self, rows: Sequence[SamplingRow], wanted: list[int], k: int,
                 packed: torch.Tensor | None, ready: list[int] | None = None) -> None:  # fmt: skip
        self._rows, self._wanted, self._k, self._ready = rows, wanted, k, ready
        self._host, self._event = packed, None
        if packed is not None and packed.device.type == "cuda":
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> tuple[list[int], list[TokenLogprob | None]]:
        """The ids as ints and the rows' logprob entries (waits for the copy)."""
        n = len(self._rows)
        if self._ready is not None:
            return self._ready, [None] * n
        assert self._host is not None
        if self._event is not None:
            self._event.synchronize()
        flat = self._host.tolist()  # the one host read (token ids are exact in float64)
        if not self._wanted:
            return flat, [None] * n
        out_ids = [int(t) for t in flat[:n]]
        w, k = len(self._wanted), self._k
        chosen, tops = flat[n : n + w], flat[n + w :]
        logprobs: list[TokenLogprob | None] = [None] * n
        for j, i in enumerate(self._wanted):
            want = self._rows[i].params.logprobs or 0
            top: tuple[tuple[int, float], ...] = ()
            if want:
                ti = tops[j * k : j * k + want]
                tv = tops[w * k + j * k : w * k + j * k + want]
                top = tuple((int(t), v) for t, v in zip(ti, tv, strict=True))
            logprobs[i] = TokenLogprob(out_ids[i], chosen[j], top)
        return out_ids, logprobs


def start_fetch(logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: torch.Tensor) -> HostTokens:
    """Start bringing ``token_ids`` ``[n]`` and the logprob entries of the rows that ask for
    them (chosen plus top alternatives under ``logits``) to the host, in one transfer."""
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not wanted:
        return HostTokens(rows, wanted, 0, token_ids)
    k = max(rows[i].params.logprobs or 0 for i in wanted)
    idx = None if len(wanted) == len(rows) else row_index(wanted, logits.device)
    part = logits if idx is None else logits.index_select(0, idx)
    logp = torch.log_softmax(part, dim=-1)  # [w, vocab]
    ids = token_ids if idx is None else token_ids.index_select(0, idx)
    pieces = [token_ids.to(torch.float64), logp.gather(1, ids[:, None]).flatten().to(torch.float64)]
    if k:
        top_vals, top_idx = logp.topk(k, dim=-1)  # [w, k]
        pieces += [top_idx.flatten().to(torch.float64), top_vals.flatten().to(torch.float64)]
    return HostTokens(rows, wanted, k, torch.cat(pieces))


def fetch(logits: torch.Tensor, rows: Sequence[SamplingRow],
          token_ids: torch.Tensor) -> tuple[list[int], list[TokenLogprob | None]]:  # fmt: skip
    """:func:`start_fetch` and wait for it."""
    return start_fetch(logits, rows, token_ids).result()


def start_sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> tuple[torch.Tensor, HostTokens]:
    """Draw one token per row of the shaped, masked ``logits`` ``[n, vocab]``: the ids on the
    device (int64 ``[n]``) and their transfer to the host, started (no host sync yet)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and all(r.params.greedy for r in rows):
        # numpy's vectorized argmax is ~10-20x faster than torch's on the CPU, ties alike
        ids = logits.numpy().argmax(axis=-1)
        if all(r.params.logprobs is None for r in rows):
            return torch.from_numpy(ids), HostTokens(rows, [], 0, None, ids.tolist())
        token_ids = torch.from_numpy(ids)
    else:
        token_ids = draw(logits, rows)
    return token_ids, start_fetch(logits, rows, token_ids)

