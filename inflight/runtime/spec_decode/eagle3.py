"""EAGLE-3 speculation (``"method": "eagle3"``): the head of :mod:`.eagle3_head` proposes drafts
from the served (target) model's own hidden states. The same proposer drives the served model's own
MTP layer (:mod:`.mtp`: a head with another forward, KV format and target state).

The head has a one-layer paged KV cache of its own, indexed by the target's block tables and
slot mapping (as a draft model's is, :mod:`.draft_proposer`), so it needs no block manager. Its
entry at position ``p`` is computed from token ``p + 1`` and the target's fused hidden states
at ``p``, so it runs one step behind the target:

1. while the target runs a step, its forward collects the hidden states entering the head's
   aux layers (``AuxHidden``; such steps run eagerly and whole: no decode graph, no CPU lanes),
   fused through ``fc``; right after it the head runs over the prompt positions whose next token
   is known (so a prompt's blocks reach the prefix cache as soon as without the head), and the
   other rows (each chunk's last, a speculating chunk's all) are kept with their request's
   stay (weakly, by its :class:`~inflight.runtime.core.sched_output.RequestFacts`, which a
   preemption renews), and :meth:`Eagle3Proposer.take_kv_lags` tells the engine how many
   positions still lack the head's KV (``Request.draft_kv_lag``, so the prefix cache registers no
   block the head has not filled; the next chunk's ``DraftContext`` carries their tokens);
2. at the next step, before the target's forward, :meth:`Eagle3Proposer.propose` runs the head
   over each scheduled request's kept positions that the target kept (rejected drafts' rows
   are dropped), reading each next token; for a chunk that speculates the last of them is the
   last computed position, whose logits give the first draft;
3. ``k - 1`` more one-token passes chain the drafts: draft ``j`` at position ``p + j`` with the
   head's own pre-norm state of the pass before in place of the target's (a tree of drafts is a
   later step).

Drafts are chosen as a draft model's are (the same shaping, argmax or a draw from ``q`` with the
request's generator; ``q`` goes to the rejection sampler), over the draft vocabulary mapped into
the target's through ``d2t``. A chunk that speculates without kept states (a rare case: none are
kept after a preemption until its recompute has run) proposes its last token ``k`` times, a
deterministic proposal verified as an n-gram's is. A prefix-cache hit reuses the head's KV with
the blocks; the head's entry at a block's last position was computed from the token after the
block, so a request that continues the prefix differently reads one slightly different entry
(acceptance may drop there; output never changes). Reads plain chunks and writes no request.
Knows nothing about scheduling policy.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary

import torch

from inflight.kernels.cpu_huge_pages import cache_zeros
from inflight.runtime.config import EngineConfig
from inflight.runtime.core.sched_output import RequestFacts, ScheduledChunk
from inflight.runtime.model.aux_hidden import AuxHidden
from inflight.runtime.model.loader import Progress, load_hf_config
from inflight.runtime.model.rope import build_rope_tables
from inflight.runtime.model.spec import ModelSpec, spec_from_hf_config
from inflight.runtime.spec_decode.eagle3_head import Eagle3Head, eagle3_head_dir, load_head, read_head_config
from inflight.runtime.spec_decode.proposal import Proposal, choose_drafts, known_tokens
from inflight.runtime.spec_decode.speculative import draft_states, parse_speculative_config
from inflight.runtime.spec_decode.verify import row_after
from inflight.runtime.worker.batch_inputs import BatchInputs, Segment, pack_segments, packed_order
from inflight.runtime.worker.batched_sampling import row_index
from inflight.runtime.worker.graph_backend import GraphBackend
from inflight.runtime.worker.model_runner import ModelRunner
from inflight.runtime.worker.sampler import SamplingRow, shape_logits

if TYPE_CHECKING:
    from inflight.runtime.distributed.comm import TensorParallel
    from inflight.runtime.distributed.launcher import WorkerGroup

@dataclass(frozen=True, slots=True)
class _Kept:
    """A request's fused target states of positions ``start ..`` from the step that computed them."""

    start: int
    hidden: torch.Tensor  # [num_positions, hidden]


@dataclass(slots=True)
class _Pass:
    """One head pass's inputs: segments (decode rows first) and their states, row for row."""

    segments: list[Segment]
    hidden: list[torch.Tensor]


class Eagle3Proposer:
    """Proposes the drafts of the chunks the scheduler left room for (see module docstring)."""

    def __init__(self, head: Eagle3Head, head_config: object, target: ModelRunner,
                 embeddings: torch.Tensor | None = None) -> None:  # fmt: skip
        self.head = head
        self.target = target
        # under tensor parallelism rank 0 holds a slice of the target's table: a whole copy, for the head
        self.embeddings = embeddings  # [vocab, hidden]; None: the head's own table, or the target's
        self.block_size = target.block_size
        self.cos_sin = build_rope_tables(head_config, head.spec, target.max_model_len).to(target.device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._kept: WeakKeyDictionary[RequestFacts, _Kept] = WeakKeyDictionary()  # by a request's stay
        self._kv_lags: dict[str, int] = {}  # req_id -> positions the head's KV lacks after the last step
        self._step: tuple[ScheduledChunk, ...] = ()  # the chunks the target runs next, as proposed
        self.num_fallback_proposals = 0  # speculating chunks that had no kept states (see module docstring)
        ref = weakref.ref(self)  # the runner holds its hook; a strong one would make a cycle through the KV

        def hook(batch: BatchInputs) -> torch.Tensor:
            live = ref()
            if live is None:
                raise RuntimeError("the EAGLE-3 proposer of this runner is gone")
            return live.execute_target(batch)

        target.execute_hook = hook

    @property
    def spec(self) -> ModelSpec:
        return self.head.spec

    @property
    def runner(self) -> Eagle3Proposer:
        """What the host tier copies beside the target's cache (``kv_caches``, ``bytes_per_block``)."""
        return self

    @property
    def bytes_per_block(self) -> int:
        spec, elem = self.head.spec, torch.finfo(self.target.dtype).bits // 8
        return 2 * self.block_size * spec.num_kv_heads * spec.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int) -> None:
        spec = self.head.spec
        shape = (num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
        dtype, device = self.target.dtype, self.target.device
        self.kv_caches = [(cache_zeros(shape, dtype, device), cache_zeros(shape, dtype, device))]

    def close(self) -> None:
        self.target.execute_hook = None

    def take_kv_lags(self) -> dict[str, int]:
        """The head's KV lag of each request of the target's last step, for the engine to
        record (see module docstring); forgotten here."""
        lags, self._kv_lags = self._kv_lags, {}
        return lags

    # -- the target's step ---------------------------------------------------------------
    @torch.inference_mode()
    def execute_target(self, batch: BatchInputs) -> torch.Tensor:
        """The target's logits for ``batch`` (the runner's ``execute``), keeping each chunk's
        fused aux states for the next step's head pass."""
        runner = self.target
        aux = AuxHidden(self.head.config.aux_layer_ids)

        def forward() -> torch.Tensor | None:  # rank 0's; its hidden states are whole after each all-reduce
            hidden = runner.model(batch.input_ids, batch.positions, runner.cos_sin, runner.kv_caches, batch.meta,
                                  runner.ops, aux=aux)  # fmt: skip
            return runner.model.compute_logits(hidden[batch.sample_indices], runner.ops)

        if runner.workers is None:
            logits = forward()
        else:  # the other ranks run the broadcast step as always (their states are not needed)
            logits = runner.workers.run_step(forward, (batch.input_ids, batch.positions, batch.meta,
                                                       batch.sample_indices))  # fmt: skip
        assert logits is not None  # rank 0 gets the gathered logits
        fused = self.head.fuse(torch.cat(aux.hidden, dim=-1), runner.ops)  # [num_tokens, hidden]
        now = _Pass([], [])  # prompt positions whose next token is known: the head runs them at once
        row = 0
        lags: dict[str, int] = {}
        for chunk in packed_order(self._step):
            start = chunk.start
            n = 1 + len(chunk.draft_token_ids) if chunk.draft_token_ids else chunk.num_tokens
            m = 0
            if not chunk.draft_token_ids:  # the positions whose next token is known (the chunk's, and after it)
                first, known = known_tokens(chunk)
                m = min(n, first + len(known) - 1 - start)
                if m > 0:
                    ids = known[start + 1 - first : start + m + 1 - first]
                    now.segments.append(Segment(ids, start, chunk.block_table, m == 1))
                    now.hidden.append(fused[row : row + m])
            self._kept[chunk.facts] = _Kept(start + m, fused[row + m : row + n].clone())
            lags[chunk.req_id] = n - m  # the head's KV lacks these positions until its next pass
            row += n
        self._kv_lags = lags
        if row != fused.shape[0]:
            raise RuntimeError(f"the EAGLE-3 head was given {row} rows of a {fused.shape[0]}-token step")
        if now.segments:
            order = sorted(range(len(now.segments)), key=lambda i: not now.segments[i].decode_rows)
            self._run(_Pass([now.segments[i] for i in order], [now.hidden[i] for i in order]))
        return logits

    # -- proposing -------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(
        self, chunks: Sequence[ScheduledChunk], sampling_row: Callable[[str], SamplingRow]
    ) -> Proposal:
        """Run the head over the kept positions of the step's requests and choose each
        speculating chunk's drafts (``sampling_row(req_id)``: a request's sampling row)."""
        speculating, normed, prenorm = self._catch_up(chunks)
        drafts: dict[int, list[int]] = {}
        probs: dict[str, torch.Tensor] = {}
        if speculating:
            rows = [sampling_row(c.req_id) for c in speculating]
            chosen: list[list[int]] = [[] for _ in speculating]
            dists: list[list[torch.Tensor]] = [[] for _ in speculating]
            active = list(range(len(speculating)))
            logits = self.head.logits(normed, self.target.ops)
            while True:
                active_rows = [row_after(rows[i], chosen[i]) for i in active]
                shape_logits(logits, active_rows)
                tokens, dist = choose_drafts(logits, active_rows)
                for j, i in enumerate(active):
                    chosen[i].append(tokens[j])
                    if dist[j] is not None:
                        dists[i].append(dist[j])
                keep = [j for j, i in enumerate(active) if len(chosen[i]) < speculating[i].num_model_drafts]
                if not keep:
                    break
                active = [active[j] for j in keep]
                normed, prenorm = self._chain([speculating[i] for i in active], [chosen[i] for i in active],
                                              prenorm[keep])  # fmt: skip
                logits = self.head.logits(normed, self.target.ops)
            for chunk, d, q in zip(speculating, chosen, dists, strict=True):
                drafts[id(chunk)] = d
                if q:
                    probs[chunk.req_id] = torch.stack(q)
        filled = []
        for chunk in chunks:
            if chunk.num_model_drafts and id(chunk) not in drafts:  # no kept states: a deterministic proposal
                self.num_fallback_proposals += 1
                drafts[id(chunk)] = [chunk.token_ids[-1]] * chunk.num_model_drafts  # its last known token
            d = drafts.get(id(chunk))
            filled.append(chunk if d is None else chunk._replace(draft_token_ids=tuple(d)))
        self._step = tuple(filled)
        return Proposal(self._step, probs)

    def _catch_up(self, chunks: Sequence[ScheduledChunk]) -> tuple[list[ScheduledChunk], torch.Tensor, torch.Tensor]:
        """The head over each request's kept positions the target kept: the chunks whose last
        computed position it reached and that speculate, and their rows' (normed, pre-norm) states."""
        parts: list[tuple[ScheduledChunk, Segment, torch.Tensor]] = []
        for chunk in chunks:
            kept = self._kept.get(chunk.facts)  # none after a preemption: its stay has new facts
            if kept is None:
                continue
            end = min(kept.start + kept.hidden.shape[0], chunk.start)
            if end <= kept.start:
                continue
            first, known = known_tokens(chunk)
            if kept.start + 1 < first:  # the engine never recorded the lag of the step that kept them (it failed)
                continue
            ids = known[kept.start + 1 - first : end + 1 - first]  # each position's next token
            speculates = chunk.num_model_drafts > 0 and end == chunk.start
            parts.append((chunk, Segment(ids, kept.start, chunk.block_table, len(ids) == 1, int(speculates)),
                          kept.hidden[: end - kept.start]))  # fmt: skip
        parts.sort(key=lambda part: not part[1].decode_rows)  # decode rows first (a stable sort)
        hidden_size = self.head.spec.hidden_size
        if not parts:
            empty = torch.empty(0, hidden_size, device=self.target.device)
            return [], empty, empty
        normed, prenorm = self._run(_Pass([p[1] for p in parts], [p[2] for p in parts]))
        return [p[0] for p in parts if p[1].num_logit_rows], normed, prenorm

    def _chain(self, chunks: list[ScheduledChunk], drafts: list[list[int]],
               prenorm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """One decode row per chunk: its latest draft at the position after the last pass's."""
        segments = [Segment((d[-1],), chunk.start + len(d) - 1, chunk.block_table, True, 1)
                    for chunk, d in zip(chunks, drafts, strict=True)]  # fmt: skip
        return self._run(_Pass(segments, [prenorm]))

    def _run(self, step: _Pass) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over ``step``: the (normed, pre-norm) states of its logit rows."""
        target = self.target
        packed = pack_segments(step.segments, self.block_size, target.device)
        if self.head.embed_tokens is not None:
            embeds = self.head.embed_tokens(packed.input_ids)
        elif self.embeddings is not None:
            embeds = self.embeddings[packed.input_ids]
        else:
            embeds = target.model.embed(packed.input_ids)
        hidden = torch.cat(step.hidden).to(embeds.dtype)
        normed, prenorm = self.head(embeds, hidden, packed.positions, self.cos_sin, self.kv_caches[0], packed.meta,
                                    target.ops)  # fmt: skip
        rows = row_index(packed.logit_rows, normed.device)  # pinned, non-blocking: no wait on the head's kernels
        return normed[rows], prenorm[rows]


def load_eagle3_runners(
    model_dir: str | Path, config: EngineConfig, progress: Progress | None = None,
    tp: TensorParallel | None = None, workers: WorkerGroup | None = None, graph_backend: GraphBackend | None = None,
) -> tuple[ModelRunner, Eagle3Proposer]:
    """The served model's runner and the EAGLE-3 proposer: the head's config is checked and its
    weights load first (a bad head fails before the target loads), then the target, whose KV
    pool is sized for both caches' bytes per block, then the head's cache of the same block count."""
    head_dir = eagle3_head_dir(config)
    assert head_dir is not None
    hf_config, head_spec, eagle = read_head_config(head_dir, spec_from_hf_config(load_hf_config(model_dir)))
    if progress:
        progress(f"loading the EAGLE-3 head from {head_dir} (aux layers {list(eagle.aux_layer_ids)}, "
                 f"draft vocabulary {eagle.draft_vocab_size})")
    head = load_head(head_dir, head_spec, eagle, *head_device_dtype(model_dir, config, tp))
    elem = torch.finfo(head.fc.weight.dtype).bits // 8
    head_bytes = 2 * config.block_size * head_spec.num_kv_heads * head_spec.head_dim * elem
    runner = ModelRunner(model_dir, config, progress, tp=tp, workers=workers, graph_backend=graph_backend,
                         kv_bytes_beside=head_bytes,  # a hybrid target's scratch states (worker/hybrid_cache.py):
                         draft_states=draft_states(parse_speculative_config(config.speculative_config),
                                                   config.max_num_sequences))  # fmt: skip
    try:
        if head.fc.weight.dtype != runner.dtype:
            head = head.to(runner.dtype)
        embeddings = None
        if tp is not None and head.embed_tokens is None:  # rank 0's table is a slice: read the whole one
            embeddings = target_embeddings(model_dir).to(device=runner.device, dtype=runner.dtype)
        proposer = Eagle3Proposer(head, hf_config, runner, embeddings)
        proposer.allocate_kv_cache(runner.num_kv_blocks)
    except BaseException:
        runner.close()
        raise
    return runner, proposer


def head_device_dtype(model_dir: str | Path, config: EngineConfig,
                      tp: TensorParallel | None) -> tuple[torch.device, torch.dtype]:  # fmt: skip
    """Where a head beside the served model loads (rank 0's device) and its dtype (the served model's)."""
    from inflight.runtime.worker.cpu.device_setup import resolve_device, resolve_dtype

    device = resolve_device(config.device, 0, tp.world_size if tp is not None else 1)
    target_config = load_hf_config(model_dir)
    checkpoint_dtype = getattr(target_config, "dtype", None) or getattr(target_config, "torch_dtype", None)
    return device, resolve_dtype(config.dtype, device, checkpoint_dtype)


def target_embeddings(model_dir: str | Path) -> torch.Tensor:  # [vocab, hidden]
    """The served model's whole embedding table, read from its checkpoint."""
    from inflight.runtime.model.loader import checkpoint_tensors

    for name, part in checkpoint_tensors(model_dir):
        if name in ("model.embed_tokens.weight", "embed_tokens.weight"):
            return part[:]
    raise ValueError(f"{model_dir} has no model.embed_tokens.weight for the EAGLE-3 head to read")
