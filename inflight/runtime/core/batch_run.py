"""The synchronous step's device half: a step's chunks through the drafter, the runner and the
sampler (or the verification of drafts), back as :class:`SampledTokens`.

:func:`run_batch` is what :meth:`LLMEngine.run_scheduled` retries request by request when it
raises, so it changes no request's progress: the chunks advance afterwards. What a drafter
learns that the core must know comes back as a result applied here, never as a write across the
boundary (the device side holds plain chunks, no ``Request``): the draft model's or EAGLE-3
head's KV lag (``Request.draft_kv_lag``, read by the prefix cache) after the target's forward,
and one more lagging position for a draft-model chunk whose drafts were all kept. Knows nothing
about scheduling policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from inflight.runtime.core.output_processor import SampledTokens
from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.spec_decode.verify import verify_chunks
from inflight.runtime.worker.logit_rows import split_logits

if TYPE_CHECKING:
    from inflight.runtime.core.engine import LLMEngine


def run_batch(engine: LLMEngine, chunks: tuple[ScheduledChunk, ...]) -> list[SampledTokens]:
    """Forward + sample ``chunks`` without advancing them (a retry writes the same KV slots).

    A retry after a failed batch may draw a sampled request's random numbers again, so
    only a failed step can change what a seeded request in it generates."""
    drafter, processor = engine.drafter, engine.output_processor
    proposal = drafter.propose(chunks, processor.sampling_row) if drafter else None
    ran = proposal.chunks if proposal else chunks
    slots = engine.lora_slots(chunks)  # None: no LoRA row (the draft model's pass above ran the base model)
    batch = engine.runner.prepare(ran) if slots is None else engine.runner.prepare(ran, slots)
    sampling_row = processor.sampling_row
    rows = [sampling_row(c.req_id) for c in batch.sampled_chunks]
    plain: Sequence[int] = range(len(rows))  # the rows without drafts: all of them unless speculating
    plain_rows = rows
    if engine.scheduler.spec is not None:
        plain = [i for i, c in enumerate(batch.sampled_chunks) if not c.draft_token_ids]
        plain_rows = [rows[i] for i in plain]
    masks = engine.sampler.prepare_masks(plain_rows, engine.runner.spec.vocab_size)  # filled during the forward
    split = split_logits(engine.runner.execute(batch), batch.sample_counts, batch.prompt_logprob_spans)
    requests = engine.scheduler.requests
    if drafter is not None:  # the drafter's KV lag after this step's passes (see module docstring)
        for req_id, lag in drafter.take_kv_lags().items():
            requests[req_id].draft_kv_lag = lag
    for chunk, first, span in split.prompt_spans:
        processor.collect_prompt_logprobs(chunk.req_id, first, span)
    logits = split.sampled
    if len(plain) == len(rows):  # no speculation this step: one row per chunk
        sampled = engine.sampler.sample(logits, rows, masks)
        return [SampledTokens(c, (t,), (lp,)) if i not in sampled.deferred else SampledTokens(c, (), ())
                for i, (c, t, lp) in enumerate(zip(batch.sampled_chunks, sampled.token_ids, sampled.logprobs,
                                                   strict=True))]  # fmt: skip
    starts = split.starts
    index = torch.tensor([starts[i] for i in plain], dtype=torch.long, device=logits.device)
    sampled = engine.sampler.sample(logits[index], plain_rows, masks)
    out: list[SampledTokens] = []
    accepted: dict[str, int] = {}  # req_id -> drafts kept, for a hybrid model's states
    plain_out = iter(enumerate(zip(sampled.token_ids, sampled.logprobs, strict=True)))
    spec = [i for i, c in enumerate(batch.sampled_chunks) if c.draft_token_ids]
    picked = [r for i in spec for r in range(starts[i], starts[i + 1])]
    spec_logits = logits[torch.tensor(picked, dtype=torch.long, device=logits.device)]
    verified = iter(verify_chunks(spec_logits, [batch.sampled_chunks[i] for i in spec], [rows[i] for i in spec],
                                  [proposal.probs_of(batch.sampled_chunks[i]) if proposal else None for i in spec]))  # fmt: skip
    for chunk in batch.sampled_chunks:
        if not chunk.draft_token_ids:
            j, (token_id, logprob) = next(plain_out)
            out.append(SampledTokens(chunk, (token_id,), (logprob,)) if j not in sampled.deferred
                       else SampledTokens(chunk, (), ()))
            continue
        tokens, logprobs = next(verified)
        engine.spec_stats.record(len(chunk.draft_token_ids), len(tokens) - 1)
        accepted[chunk.req_id] = len(tokens) - 1
        if chunk.num_model_drafts and len(tokens) > len(chunk.draft_token_ids):
            # every draft kept: the last one was never fed to the drafter (never below what it set)
            req = requests[chunk.req_id]
            req.draft_kv_lag = max(req.draft_kv_lag, 1)
        out.append(SampledTokens(chunk, tokens, logprobs))
    if engine.runner.spec.state_layers:  # the slots keep the state after the last accepted token
        engine.runner.keep_accepted_states(batch.sampled_chunks, accepted)  # type: ignore[union-attr]
    return out
