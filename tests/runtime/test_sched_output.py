"""The scheduler's chunks are plain data: copies of what the device side reads, never the live
``Request`` (core/sched_output.py, core/request.py's ``chunk_of``)."""

from __future__ import annotations

import pickle

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.block_pool import KVBlockPool
from inflight.runtime.core.kv_manager import KVCacheManager
from inflight.runtime.core.request import Request, chunk_of, decode_chunk
from inflight.runtime.core.scheduler import Scheduler
from inflight.runtime.sampling_params import SamplingParams


def _request(num_prompt: int = 10, num_output: int = 3) -> Request:
    req = Request("r", list(range(100, 100 + num_prompt)), SamplingParams(max_tokens=50, prompt_logprobs=2))
    req.token_ids += list(range(200, 200 + num_output))
    req.block_ids = [7, 3, 9, 4]
    return req


def test_a_chunk_is_a_copy_the_request_cannot_change() -> None:
    req = _request()
    req.num_computed_tokens = 4
    chunk = chunk_of(req, 5, False)
    assert (chunk.req_id, chunk.start, chunk.num_tokens, list(chunk.token_ids)) == ("r", 4, 5, list(range(104, 109)))
    assert chunk.block_table == (7, 3, 9, 4) and not chunk.sample and not chunk.speculative
    assert (chunk.facts.num_prompt_tokens, chunk.facts.prompt_logprobs, chunk.facts.lora_load_id) == (10, 2, None)
    req.token_ids[4:9] = [0] * 5  # (a request never rewrites its tokens; a copy would not see it if it did)
    req.block_ids.append(5)
    req.num_computed_tokens = 9
    assert list(chunk.token_ids) == list(range(104, 109)) and chunk.block_table == (7, 3, 9, 4) and chunk.start == 4


def test_decode_and_speculating_chunks_feed_the_last_token() -> None:
    req = _request()
    req.num_computed_tokens = req.num_tokens - 1
    assert decode_chunk(req) == chunk_of(req, 1, True)
    assert tuple(decode_chunk(req).token_ids) == (202,)
    spec = chunk_of(req, 3, True, (5, 6))
    assert tuple(spec.token_ids) == (202,) and spec.draft_token_ids == (5, 6) and spec.speculative
    model = chunk_of(req, 4, True, (), 3, draft_context=True)
    assert model.speculative and model.draft_context is not None and model.draft_context.next_token_id is None


def test_the_block_table_is_copied_only_when_it_changed() -> None:
    req = _request()
    first = chunk_of(req, 1, False).block_table
    assert chunk_of(req, 1, False).block_table is first  # unchanged: the same tuple, no copy per step
    req.block_ids.append(11)
    grown = chunk_of(req, 1, False).block_table
    assert grown == (7, 3, 9, 4, 11)
    req.block_ids = [1, 2, 8, 6, 5]  # freed and allocated again (a new list of the same length)
    assert chunk_of(req, 1, False).block_table == (1, 2, 8, 6, 5)


def test_the_draft_context_holds_the_lagging_tokens_and_the_next_one() -> None:
    req = _request()
    req.num_computed_tokens, req.draft_kv_lag = 6, 2
    chunk = chunk_of(req, 3, False, draft_context=True)
    assert chunk.draft_context is not None
    assert chunk.draft_context.lagging_ids == (104, 105) and chunk.draft_context.next_token_id == 109
    req.num_computed_tokens, req.draft_kv_lag = 1, 5  # never before position 0
    assert chunk_of(req, 2, False, draft_context=True).draft_context.lagging_ids == (100,)  # type: ignore[union-attr]
    assert chunk_of(req, 2, False).draft_context is None


def test_a_step_pickles_small_and_without_a_request() -> None:
    """What a step's chunks would weigh on the wire (tensor-parallel workers get the packed
    batch, not these): a few hundred bytes a decode row, no Request in it."""
    config = EngineConfig(max_num_sequences=64, max_num_tokens=4096, num_kv_blocks=512, max_model_len=256)
    scheduler = Scheduler(config, KVCacheManager(KVBlockPool(512, True), 16))
    for i in range(64):
        scheduler.add(Request(f"req-{i}", [i % 7 + 1] * 40, SamplingParams(max_tokens=8)))
    for chunk in scheduler.schedule().chunks:  # the prompts, then one decode step
        req = scheduler.requests[chunk.req_id]
        req.num_computed_tokens += chunk.num_tokens
        req.append_token(3)
    chunks = scheduler.schedule().chunks
    assert len(chunks) == 64 and all(c.num_tokens == 1 for c in chunks)
    wire = pickle.dumps(chunks)
    assert b"Request\n" not in wire and b"core.request" not in wire
    assert len(wire) / len(chunks) < 200, len(wire) / len(chunks)
    assert [c.req_id for c in pickle.loads(wire)] == [f"req-{i}" for i in range(64)]


def test_a_new_stay_gets_new_facts() -> None:
    """A preempted request boards again with new facts, so state a drafter keeps by them (weakly)
    is dropped with the stay it belongs to."""
    config = EngineConfig(max_num_sequences=4, max_num_tokens=64, num_kv_blocks=16, max_model_len=256)
    scheduler = Scheduler(config, KVCacheManager(KVBlockPool(16, False), 16))
    req = Request("r", [1] * 20, SamplingParams(max_tokens=8))
    scheduler.add(req)
    first = scheduler.schedule().chunks[0].facts
    scheduler._preempt(req)
    again = scheduler.schedule().chunks[0].facts
    assert again is not first and again.req_id == first.req_id == "r"
