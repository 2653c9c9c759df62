"""CPU decode lanes: a pure-decode step split by rows over threads gives the rows back in
order, only takes steps it should, and the engine's greedy tokens with lanes forced on stay
identical to transformers for the four architectures, as they do without lanes where MKL's
packed weights come in column blocks (the default there)."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import cpu_packed
from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.model.batch import AttentionMetadata
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.worker.cpu import device_setup
from inflight.runtime.worker.cpu import lanes as cpu_lanes
from inflight.runtime.worker.cpu.lanes import DecodeLanes

from .hf_reference import hf_greedy, prompts_of_lengths, run_staggered

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


def _meta(n: int, num_prefills: int = 0) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.arange(n), num_decode_tokens=n,
        decode_block_tables=torch.arange(n, dtype=torch.int32)[:, None], decode_context_lens=torch.ones(n, dtype=torch.int32),
        prefill_block_tables=torch.zeros(num_prefills, 1, dtype=torch.int32),
        prefill_query_start_loc=torch.zeros(num_prefills + 1, dtype=torch.int32),
        prefill_context_lens=torch.zeros(num_prefills, dtype=torch.int32), num_prefills=num_prefills,
    )  # fmt: skip


def test_rows_come_back_in_order_from_every_lane() -> None:
    lanes = DecodeLanes(3)
    seen: list[tuple[int, int]] = []

    def logits_fn(ids, positions, meta):
        seen.append((int(ids[0]), meta.num_decode_tokens))
        assert torch.equal(meta.slot_mapping, ids) and torch.get_num_threads() == 1
        return torch.stack([ids.float(), positions.float()], dim=1)

    n = 14
    ids = torch.arange(n)
    out = lanes.forward(ids, ids + 100, _meta(n), torch.tensor([13, 0, 5]), logits_fn)
    lanes.close()
    assert sorted(seen) == [(0, 5), (5, 4), (9, 5)]  # three lanes cover the rows once
    assert out[:, 0].tolist() == [13.0, 0.0, 5.0] and out[:, 1].tolist() == [113.0, 100.0, 105.0]


@pytest.mark.parametrize(("lanes", "row_cost", "contexts", "sizes"), [
    (2, 0.0, [100] * 8, [4, 4]),  # even work: even counts
    (2, 0.0, [50] * 6 + [600] * 6, [9, 3]),  # the long contexts' lane takes fewer rows
    (2, 550.0, [50] * 6 + [600] * 6, [7, 5]),  # the rows' own cost evens it out a little
    (2, 1e9, [50] * 6 + [600] * 6, [6, 6]),  # rows dominate: even counts
    (2, 0.0, [10_000, 1, 1, 1], [1, 3]),  # never an empty lane
    (3, 0.0, [1, 1, 1], [1, 1, 1]),
    (3, 0.0, [5, 5, 5, 5, 5, 100], [4, 1, 1]),
])  # fmt: skip
def test_rows_are_split_by_their_estimated_work(lanes: int, row_cost: float, contexts: list[int],
                                                sizes: list[int]) -> None:
    """Contiguous lanes, in order, covering every row once, each as close to an even share of
    the step's work (row cost + context, a row) as a contiguous split gets."""
    decode = DecodeLanes(lanes, row_cost=row_cost)
    slices = decode.lane_rows(contexts)
    decode.close()
    assert [s.start for s in slices] == [0] + [s.stop for s in slices[:-1]] and slices[-1].stop == len(contexts)
    assert [s.stop - s.start for s in slices] == sizes


def test_a_rows_cost_is_its_products_in_tokens_of_attention() -> None:
    """bench-medium's shape (61M parameters, 36 KiB of KV a token): a row costs ~550 tokens."""
    assert cpu_lanes.row_cost_tokens(60_800_000, 36_864) == pytest.approx(550, rel=0.01)


@pytest.mark.parametrize(("rows", "prefills", "params", "taken"), [
    (8, 0, 10**8, True), (7, 0, 10**8, False), (64, 1, 10**8, False), (64, 0, 1000, False),
])  # fmt: skip
def test_which_steps_the_lanes_take(rows: int, prefills: int, params: int, taken: bool) -> None:
    lanes = DecodeLanes(2)
    assert lanes.takes(_meta(rows, prefills), params) is taken
    lanes.close()


@pytest.mark.parametrize("float_copy", ["0", "1"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_with_lanes_forced_match_transformers(model_factory, arch, float_copy, monkeypatch) -> None:
    monkeypatch.setenv("INFLIGHT_CPU_FLOAT_COPY", float_copy)
    monkeypatch.setattr(device_setup, "ROW_FLOPS_FOR_EVERY_CORE", 0)  # the test models' rows are tiny
    model_dir = model_factory(arch)
    engine, calls, floor = _forced_lanes_engine(model_dir, monkeypatch)
    assert floor == (17 if float_copy == "1" else 2)
    _assert_staggered_greedy_matches_transformers(engine, model_dir)
    assert len(calls) > 5  # most steps went through the lanes
    engine.close()


def test_a_higher_floor_keeps_few_row_steps_whole() -> None:
    """A model whose packed weights kept float copies runs steps of up to 16 rows whole (the few-row
    kernel already uses every thread); the floor never drops below MIN_ROWS_PER_LANE a lane."""
    lanes = DecodeLanes(2, 17)
    assert not lanes.takes(_meta(16, 0), 10**8) and lanes.takes(_meta(17, 0), 10**8)
    lanes.close()
    lanes = DecodeLanes(2, 1)
    assert lanes.min_rows == 8 and not lanes.takes(_meta(7, 0), 10**8)
    lanes.close()


def test_the_runner_raises_the_floor_only_for_float_copies(model_factory, monkeypatch) -> None:
    from inflight.runtime.config import EngineConfig
    from inflight.runtime.core.engine import LLMEngine

    monkeypatch.setenv("INFLIGHT_CPU_LANES", "2")
    floors = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("INFLIGHT_CPU_FLOAT_COPY", setting)
        runner = LLMEngine.from_model_dir(model_factory("llama"), EngineConfig(device="cpu", dtype="float32",
                                                                                num_kv_blocks=32)).runner
        floors[setting] = runner._lanes.min_rows
        runner.close()
    assert floors == {"1": 17, "0": 8}


@pytest.mark.skipif(not cpu_packed.mkl_packing_available(), reason="torch built without MKL")
@pytest.mark.parametrize("arch", ARCHS)
def test_products_in_column_blocks_run_without_lanes_and_match_transformers(model_factory, arch,
                                                                            monkeypatch) -> None:
    """MKL's packed weights in one column block per thread (whatever this CPU's default format):
    every step's products spread the blocks over the threads, no lanes, the same greedy tokens."""
    monkeypatch.delenv("INFLIGHT_CPU_LANES", raising=False)
    monkeypatch.setenv("INFLIGHT_CPU_PACK_FORMAT", "mkl")
    monkeypatch.setenv("INFLIGHT_CPU_FLOAT_COPY", "0")
    monkeypatch.setenv("INFLIGHT_CPU_THREADS", "2")
    model_dir = model_factory(arch)
    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(device="cpu", dtype="float32", num_kv_blocks=256,
                                                              max_num_tokens=512))  # fmt: skip
    gate_up = engine.runner.model.layers[0].mlp.gate_up_proj.weight
    assert len(gate_up.packed) == 2 and cpu_packed.has_column_blocks(engine.runner.model)
    assert engine.runner._lanes is None
    _assert_staggered_greedy_matches_transformers(engine, model_dir)
    engine.close()


def test_a_tiny_models_decodes_skip_the_lanes_and_leave_a_core_to_the_host(model_factory, monkeypatch) -> None:
    """Lanes on and every step big enough for them, but the test model's rows are far below
    ``ROW_FLOPS_FOR_EVERY_CORE``: its decodes run whole, on the small step's thread count."""
    model_dir = model_factory("llama")
    engine, calls, _ = _forced_lanes_engine(model_dir, monkeypatch)
    threads: list[int] = []
    set_threads = engine.runner._set_cpu_threads

    def record(*args, **kwargs):
        set_threads(*args, **kwargs)
        threads.append(torch.get_num_threads())

    monkeypatch.setattr(engine.runner, "_set_cpu_threads", record)
    monkeypatch.setattr(device_setup, "BIG_STEP_PARAM_TOKENS", 0)  # only the rows' work decides
    _assert_staggered_greedy_matches_transformers(engine, model_dir)
    assert calls == [] and len(threads) > 5
    assert set(threads) == {engine.runner._cpu_threads[0]}
    engine.close()


def _forced_lanes_engine(model_dir, monkeypatch) -> tuple[LLMEngine, list[int], int]:
    """An engine whose runner keeps two decode lanes and would split any step of two rows or more
    (whatever its size); the lanes' calls are counted in the list. Also the lanes' own row floor."""
    monkeypatch.setenv("INFLIGHT_CPU_LANES", "2")
    monkeypatch.setattr(cpu_lanes, "MIN_PARAM_TOKENS", 0)
    monkeypatch.setattr(cpu_lanes, "MIN_ROWS_PER_LANE", 1)
    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(device="cpu", dtype="float32", num_kv_blocks=256,
                                                              max_num_tokens=512))  # fmt: skip
    lanes = engine.runner._lanes
    assert lanes is not None
    floor, lanes.min_rows = lanes.min_rows, 2  # few-row steps too, even on float copies
    calls: list[int] = []
    original = lanes.forward
    monkeypatch.setattr(lanes, "forward", lambda *a, **k: calls.append(1) or original(*a, **k))
    return engine, calls, floor


def _assert_staggered_greedy_matches_transformers(engine: LLMEngine, model_dir) -> None:
    """Twelve prompts of 1-64 tokens, added a few a step: every greedy output equals transformers'."""
    lengths = [1, 3, 7, 15, 16, 17, 31, 32, 33, 48, 5, 64]
    max_tokens = [12, 20, 8, 16, 24, 10, 14, 18, 9, 22, 30, 11]
    prompts = prompts_of_lengths(engine.tokenizer, lengths)
    got = run_staggered(engine, prompts, [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens])
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == hf_greedy(model_dir, prompt, max_tokens[i]), f"prompt {i} diverged"
