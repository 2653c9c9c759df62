"""Draft-model speculation: a small model sharing the served model's vocabulary proposes drafts.

The draft model has a paged KV cache of its own, indexed by the served (target) model's block
tables and slot mapping (the same block ids, the same block count), so it needs no block
manager: it runs over every token the target runs (prompt chunks, decodes and verified drafts
alike), so its KV is valid wherever the target's is, prefix-cache hits included (a cached
block was written by both). The KV pool is sized for both caches' bytes per block
(:func:`load_runners`). Each step, before the target's forward, :meth:`DraftProposer.propose`

1. runs the draft over the step's known tokens: each chunk's tokens, and for a chunk that
   speculates (the scheduler left room for ``k`` drafts) its last token, whose logits give
   the first draft;
2. runs ``k - 1`` more one-token passes over the speculating rows, each feeding the draft
   just chosen into the KV slot the scheduler allocated for it (a rejected draft's slot is
   overwritten by a later step).

The draft model's logits are shaped as the target's verification rows are (``logit_bias``, and
penalties counted over the output plus the drafts so far), so a draft that shares the target's
opinions keeps agreeing with a penalized request. A greedy request's drafts are the shaped
argmax; a sampled request's are draws from ``q``, the draft model's shaped distribution under
the request's temperature and top-k / top-p / min-p, with the request's own generator, and ``q`` goes to the verification
(:func:`inflight.runtime.spec_decode.verify.verify_sampled`) so the emitted tokens follow the target's
distribution. The last draft is never fed to the draft model: when the target keeps every
draft, the next step's first pass writes that position (``Request.draft_kv_lag``: the engine
sets it from the verification, and resets it from :meth:`DraftProposer.take_kv_lags`; a chunk's
:class:`~inflight.runtime.core.sched_output.DraftContext` carries the lagging tokens), and the
prefix cache registers a block only once both models' KV fill it. Reads plain chunks and writes
no request. Knows nothing about scheduling policy; the start-up checks are
:mod:`inflight.runtime.spec_decode.draft_checks`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.model.loader import Progress
from inflight.runtime.model.spec import ModelSpec
from inflight.runtime.spec_decode.draft_checks import check_draft_model, draft_model_dir
from inflight.runtime.spec_decode.proposal import Proposal, choose_drafts, known_tokens
from inflight.runtime.spec_decode.speculative import draft_states, parse_speculative_config
from inflight.runtime.spec_decode.verify import row_after
from inflight.runtime.worker.batch_inputs import BatchInputs, Segment, pack_segments, upload
from inflight.runtime.worker.graph_backend import GraphBackend
from inflight.runtime.worker.model_runner import ModelRunner
from inflight.runtime.worker.sampler import SamplingRow, shape_logits

if TYPE_CHECKING:
    from inflight.runtime.distributed.comm import TensorParallel
    from inflight.runtime.distributed.launcher import WorkerGroup


class DraftProposer:
    """Proposes the drafts of the chunks the scheduler left room for (see module docstring)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._kv_lags: dict[str, int] = {}  # req_id -> its lag after the last proposal's passes (0: none)

    @property
    def spec(self) -> ModelSpec:
        return self.runner.spec

    def close(self) -> None:
        self.runner.close()

    def take_kv_lags(self) -> dict[str, int]:
        """The draft KV lag of each request of the last proposal (0: its passes wrote every
        computed position), for the engine to record; forgotten here."""
        lags, self._kv_lags = self._kv_lags, {}
        return lags

    @torch.inference_mode()
    def propose(
        self, chunks: Sequence[ScheduledChunk], sampling_row: Callable[[str], SamplingRow]
    ) -> Proposal:
        """Run the draft model over the step's tokens and choose each speculating chunk's drafts
        (``sampling_row(req_id)``: a request's sampling row)."""
        speculating, logits = self._mirror(chunks)
        if not speculating:
            return Proposal(tuple(chunks), {})
        rows = [sampling_row(c.req_id) for c in speculating]
        drafts: list[list[int]] = [[] for _ in speculating]
        probs: list[list[torch.Tensor]] = [[] for _ in speculating]
        active = list(range(len(speculating)))
        while True:
            active_rows = [row_after(rows[i], drafts[i]) for i in active]
            shape_logits(logits, active_rows)  # bias and penalties as the target's rows get them
            tokens, dists = choose_drafts(logits, active_rows)
            for i, token, dist in zip(active, tokens, dists, strict=True):
                drafts[i].append(token)
                if dist is not None:
                    probs[i].append(dist)
            active = [i for i in active if len(drafts[i]) < speculating[i].num_model_drafts]
            if not active:
                break
            logits = self._feed([speculating[i] for i in active], [drafts[i] for i in active])
        filled = {id(c): c._replace(draft_token_ids=tuple(d))
                  for c, d in zip(speculating, drafts, strict=True)}  # fmt: skip
        return Proposal(
            tuple(filled.get(id(c), c) for c in chunks),
            {c.req_id: torch.stack(p) for c, p in zip(speculating, probs, strict=True) if p},
        )

    def _mirror(self, chunks: Sequence[ScheduledChunk]) -> tuple[list[ScheduledChunk], torch.Tensor]:
        """Run the draft over every chunk's known tokens (after any position it lags behind);
        the chunks that speculate, and the logits at their last tokens, in that order."""
        parts = []
        for chunk in chunks:
            first, known = known_tokens(chunk)
            end = chunk.start + (1 if chunk.num_model_drafts else chunk.num_tokens)
            ids = known[: end - first]  # from the first lagging position to the chunk's last known token
            parts.append((chunk, Segment(ids, first, chunk.block_table, len(ids) == 1,
                                         int(chunk.num_model_drafts > 0))))  # fmt: skip
        parts.sort(key=lambda part: not part[1].decode_rows)  # decode rows first (a stable sort)
        logits = self._run([segment for _, segment in parts])
        self._kv_lags = {chunk.req_id: 0 for chunk in chunks}  # every computed position written now
        return [chunk for chunk, _ in parts if chunk.num_model_drafts], logits

    def _feed(self, chunks: list[ScheduledChunk], drafts: list[list[int]]) -> torch.Tensor:
        """One decode row per chunk: its latest draft, at its position (the request's last
        token sits at the chunk's ``start``, draft ``j`` (from 1) at ``j`` after it)."""
        return self._run([Segment((d[-1],), chunk.start + len(d), chunk.block_table, True, 1)
                          for chunk, d in zip(chunks, drafts, strict=True)])  # fmt: skip

    def _run(self, segments: list[Segment]) -> torch.Tensor:
        """The draft model's float32 logits ``[num_logit_rows, vocab]`` for ``segments``."""
        runner = self.runner
        packed = pack_segments(segments, runner.block_size, runner.device)
        batch = BatchInputs(packed.input_ids, packed.positions, packed.meta,
                            upload(list(packed.logit_rows), torch.int64, runner.device), ())  # fmt: skip
        return runner.execute(batch)


def load_runners(
    model_dir: str | Path, config: EngineConfig, progress: Progress | None = None,
    tp: TensorParallel | None = None, workers: WorkerGroup | None = None, graph_backend: GraphBackend | None = None,
) -> tuple[ModelRunner, DraftProposer | None]:
    """The served model's runner and, with draft-model speculation, the draft's proposer (with
    EAGLE-3, the head's: :func:`inflight.runtime.spec_decode.eagle3.load_eagle3_runners`).

    The draft's weights load first, so the KV pool is sized (free memory on CUDA, the cap on
    the CPU) for both caches' bytes per block; the draft's cache then gets the same block count.
    """
    spec = parse_speculative_config(config.speculative_config)
    if spec is not None and spec.method == "eagle3":
        from inflight.runtime.spec_decode.eagle3 import load_eagle3_runners

        return load_eagle3_runners(model_dir, config, progress, tp, workers, graph_backend)  # type: ignore[return-value]
    if spec is not None and spec.method == "mtp":  # the served model's own MTP layer (spec_decode/mtp.py)
        from inflight.runtime.spec_decode.mtp import load_mtp_runners

        return load_mtp_runners(model_dir, config, progress, tp, workers, graph_backend)  # type: ignore[return-value]
    draft_dir = draft_model_dir(config)
    states = draft_states(spec, config.max_num_sequences)  # a hybrid target's scratch states (worker/hybrid_cache.py)
    if draft_dir is None:
        return ModelRunner(model_dir, config, progress, tp=tp, workers=workers, graph_backend=graph_backend,
                           draft_states=states), None  # fmt: skip
    max_model_len = check_draft_model(model_dir, config)
    draft_config = config.replace(max_model_len=max_model_len, num_kv_blocks=None, max_tokens_in_paged_kv_cache=None,
                                  quantization="auto", speculative_config=None, enable_lora=False)  # fmt: skip
    draft_progress = (lambda message: progress(f"draft model: {message}")) if progress else None
    if progress:
        progress(f"loading the draft model from {draft_dir}")
    draft = ModelRunner(draft_dir, draft_config, draft_progress, allocate_kv=False)
    runner: ModelRunner | None = None
    try:
        runner = ModelRunner(model_dir, config, progress, tp=tp, workers=workers, graph_backend=graph_backend,
                             kv_bytes_beside=draft.bytes_per_block, draft_states=states)  # fmt: skip
        draft.allocate_kv_cache(runner.num_kv_blocks, draft_config, graph_backend, draft_progress)
    except BaseException:
        draft.close()
        if runner is not None:
            runner.close()
        raise
    return runner, DraftProposer(draft)
