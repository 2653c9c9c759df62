"""The engine core's per-step host path (issue 47): the vectorised batch packing equals a plain
row-by-row packing, the simulated sampler's cached prompt seeds change no token, and async
scheduling resolves to on for the simulated device unless the user says otherwise. No test
here knows how fast anything is."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from inflight.operator.engine_args import parse_engine, static_flags
from inflight.runtime.cli.command import build_parser, engine_config_from_args
from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.core.request import Request, chunk_of
from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.worker.batch_inputs import (
    Segment,
    cut_buffer,
    flatten_arrays,
    pack_segments,
    prepare_batch,
    upload_arrays,
)
from inflight.runtime.worker.sampler import SamplingRow
from inflight.runtime.worker.sim_device import SimSampler

CPU = torch.device("cpu")


def _random_chunks(rng: random.Random, block_size: int) -> list[ScheduledChunk]:
    """Decode, prompt-chunk and speculating chunks, some with prompt logprobs, in random order
    (plain chunks: the requests they were copied from are gone)."""
    chunks = []
    for i in range(rng.randint(0, 10)):
        params = SamplingParams(max_tokens=50, prompt_logprobs=rng.choice([None, None, 2]))
        req = Request(f"r{i}", [rng.randint(0, 99) for _ in range(rng.randint(2, 40))], params)
        req.token_ids += [rng.randint(0, 99) for _ in range(rng.randint(0, 10))]
        kind = rng.choice(["decode", "prompt", "speculate"])
        drafts: tuple[int, ...] = ()
        if kind == "prompt":
            req.num_computed_tokens = rng.randint(0, req.num_tokens - 2)
            num_tokens = rng.randint(2, req.num_tokens - req.num_computed_tokens)
        else:
            req.num_computed_tokens = req.num_tokens - 1
            if kind == "speculate":
                drafts = tuple(rng.randint(0, 99) for _ in range(rng.randint(1, 4)))
            num_tokens = 1 + len(drafts)
        num_blocks = -(-(req.num_computed_tokens + num_tokens) // block_size) + rng.randint(0, 2)
        req.block_ids = [rng.randint(0, 500) for _ in range(num_blocks)]
        sample = req.num_computed_tokens + num_tokens >= req.num_tokens
        chunks.append(chunk_of(req, num_tokens, sample, drafts))
    rng.shuffle(chunks)
    return chunks


def _plain_packing(chunks: list[ScheduledChunk], bs: int) -> dict[str, list]:
    """The batch packed row by row, as the layout (batch_inputs' docstring) describes it."""
    ordered = [c for c in chunks if c.num_tokens == 1 or c.draft_token_ids]
    num_decode_chunks = len(ordered)
    ordered += [c for c in chunks if c.num_tokens > 1 and not c.draft_token_ids]
    out: dict[str, list] = {k: [] for k in ("ids", "pos", "slots", "dlens", "dtables", "ptables", "plens",
                                            "q", "logit_rows")}  # fmt: skip
    out["q"].append(0)
    for j, c in enumerate(ordered):
        start, table = c.start, list(c.block_table)
        ids = [c.token_ids[0], *c.draft_token_ids] if c.draft_token_ids else list(c.token_ids)
        assert len(ids) == c.num_tokens
        for k, token in enumerate(ids):
            p = start + k
            out["ids"].append(token)
            out["pos"].append(p)
            out["slots"].append(table[p // bs] * bs + p % bs)
            if j < num_decode_chunks:
                out["dlens"].append(p + 1)
                out["dtables"].append(table)
        if j >= num_decode_chunks:
            out["ptables"].append(table)
            out["plens"].append(start + len(ids))
            out["q"].append(out["q"][-1] + len(ids))
        if c.sample:
            n = len(ids) if c.draft_token_ids else 1
            out["logit_rows"] += range(len(out["ids"]) - n, len(out["ids"]))
    return out


def _padded(tables: list[list[int]]) -> list[list[int]]:
    width = max((len(t) for t in tables), default=1)
    return [t + [0] * (width - len(t)) for t in tables]


@pytest.mark.parametrize("block_size", [4, 16])
def test_vectorised_packing_equals_the_plain_one(block_size: int) -> None:
    rng = random.Random(block_size)
    for _ in range(150):
        chunks = _random_chunks(rng, block_size)
        batch = prepare_batch(chunks, block_size, CPU)
        want = _plain_packing(chunks, block_size)
        meta = batch.meta
        assert batch.input_ids.tolist() == want["ids"] and batch.input_ids.dtype == torch.int64
        assert batch.positions.tolist() == want["pos"]
        assert meta.slot_mapping.tolist() == want["slots"] and meta.slot_mapping.dtype == torch.int64
        assert meta.num_decode_tokens == len(want["dlens"])
        assert meta.decode_context_lens.tolist() == want["dlens"] and meta.decode_context_lens.dtype == torch.int32
        assert meta.decode_block_tables.dtype == meta.prefill_block_tables.dtype == torch.int32
        assert meta.decode_block_tables.tolist() == _padded(want["dtables"])
        assert meta.decode_block_tables.shape[1] == max((len(t) for t in want["dtables"]), default=1)
        assert meta.prefill_block_tables.tolist() == _padded(want["ptables"])
        assert meta.prefill_block_tables.shape[0] == meta.num_prefills == len(want["plens"])
        assert meta.prefill_context_lens.tolist() == want["plens"]
        assert meta.prefill_query_start_loc.tolist() == want["q"]
        rows = batch.sample_indices.tolist()
        assert rows[: len(want["logit_rows"])] == want["logit_rows"]
        assert len(rows) == len(want["logit_rows"]) + sum(count for _, _, count in batch.prompt_logprob_spans)


def test_pack_segments_keeps_decode_rows_first() -> None:
    prefill = Segment([1, 2, 3], 0, [4], decode_rows=False, num_logit_rows=1)
    decode = Segment([5], 7, [2, 3], decode_rows=True, num_logit_rows=1)
    packed = pack_segments([decode, prefill], 4, CPU)
    assert packed.input_ids.tolist() == [5, 1, 2, 3]
    assert packed.meta.slot_mapping.tolist() == [3 * 4 + 3, 16, 17, 18]
    assert packed.row_starts == (0, 1) and packed.logit_rows == (0, 3)
    with pytest.raises(RuntimeError, match="decode-row segments must come before"):
        pack_segments([prefill, decode], 4, CPU)
    empty = pack_segments([], 4, CPU)
    assert empty.input_ids.shape == (0,) and empty.meta.decode_block_tables.shape == (0, 1)


def test_the_one_buffer_upload_cuts_back_into_every_field() -> None:
    """What CUDA gets (one int64 buffer cut on the device) equals what the CPU gets, field by field."""
    batch = prepare_batch(_random_chunks(random.Random(3), 4) or _random_chunks(random.Random(4), 4), 4, CPU)
    meta = batch.meta
    fields = [batch.input_ids, batch.positions, meta.slot_mapping, meta.decode_block_tables,
              meta.decode_context_lens, meta.prefill_block_tables, meta.prefill_query_start_loc,
              meta.prefill_context_lens, batch.sample_indices]  # fmt: skip
    arrays = [t.numpy() for t in fields]
    for got, want in zip(cut_buffer(torch.from_numpy(flatten_arrays(arrays)), arrays), fields, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(upload_arrays(arrays, CPU), fields, strict=True))


def test_cached_prompt_seeds_change_no_token() -> None:
    sampler = SimSampler(CPU, 1000)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompts = [[1, 2, 3], [1, 2, 3], list(range(200))]
    rows = [SamplingRow(params, p, [7] * k, None, (0,)) for k, p in enumerate(prompts)]
    logits = torch.zeros(3, 1000)
    first = sampler.sample(logits, rows).token_ids
    assert sampler.sample(logits, rows).token_ids == first  # from the cache
    fresh = SimSampler(CPU, 1000)
    fresh._prompt_seeds.clear()
    assert fresh.sample(logits, [SamplingRow(params, list(p), list(r.output_token_ids), None, (0,))
                                 for p, r in zip(prompts, rows, strict=True)]).token_ids == first  # fmt: skip
    banned = SamplingRow(SamplingParams(max_tokens=8, min_tokens=5, temperature=0.0, stop_token_ids=[first[0]]),
                         prompts[0], [], None, (0,))  # fmt: skip
    assert sampler.sample(torch.zeros(1, 1000), [banned]).token_ids[0] != first[0]  # min_tokens bans it


# -- async scheduling: auto ------------------------------------------------------------
def test_async_scheduling_resolves_to_on_for_the_simulated_device_only() -> None:
    assert EngineConfig().async_scheduling is None and not EngineConfig().async_scheduling_on
    assert not EngineConfig(device="cuda").async_scheduling_on  # until a GPU run shows it wins
    assert EngineConfig(device="sim").async_scheduling_on
    assert not EngineConfig(device="sim", async_scheduling=False).async_scheduling_on
    assert EngineConfig(device="cpu", async_scheduling=True).async_scheduling_on
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 2})
    assert not EngineConfig(speculative_config=spec).async_scheduling_on  # auto: off, not refused
    assert not EngineConfig(tensor_parallel_size=2).async_scheduling_on
    for combined in ({"speculative_config": spec}, {"tensor_parallel_size": 2}):  # set: it combines
        assert EngineConfig(async_scheduling=True, **combined).async_scheduling_on  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="async_scheduling must be true, false or unset"):
        EngineConfig(async_scheduling="yes")  # type: ignore[arg-type]


def test_the_flag_and_the_operator_leave_it_unset_or_set_it() -> None:
    def parse(*argv: str) -> EngineConfig:
        return engine_config_from_args(build_parser().parse_args(["serve", "--model", "m", *argv]))

    assert parse().async_scheduling is None
    assert parse("--async-scheduling").async_scheduling is True
    assert parse("--no-async-scheduling").async_scheduling is False
    assert static_flags(parse_engine({})) == []
    assert static_flags(parse_engine({"asyncScheduling": False})) == ["--no-async-scheduling"]
    assert static_flags(parse_engine({"asyncScheduling": True})) == ["--async-scheduling"]


def test_a_sim_engine_pipelines_by_default_with_the_same_tokens(llama_dir: Path, tmp_path: Path) -> None:
    profile = tmp_path / "zero.json"
    profile.write_text(json.dumps({"base_ms": 0, "decode_row_ms": 0, "prefill_token_ms": 0,
                                   "attention_ms_per_1k_context": 0}))
    tokens = {}
    for flag in (None, False):
        config = EngineConfig(device="sim", sim_profile=str(profile), num_kv_blocks=64, max_model_len=256,
                              max_num_sequences=4, async_scheduling=flag)  # fmt: skip
        engine = LLMEngine.from_model_dir(llama_dir, config)
        try:
            assert (engine.pipeline is not None) is (flag is None)
            for i in range(6):
                engine.add_request(f"r{i}", engine.encode_prompt(f"prompt {i}"),
                                   SamplingParams(max_tokens=5 + i, temperature=0.0, ignore_eos=True))
            out: dict[str, list[int]] = {}
            while engine.has_unfinished_requests():
                for o in engine.step():
                    out.setdefault(o.req_id, []).extend(o.new_token_ids)
            tokens[flag] = out
            assert engine.pool.num_used_blocks == 0
        finally:
            engine.close()
    assert tokens[None] == tokens[False]
    assert [len(tokens[None][f"r{i}"]) for i in range(6)] == [5 + i for i in range(6)]
