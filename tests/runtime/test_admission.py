"""Admission by capacity: ``max_queue_len`` bounds the requests that cannot run now, so a burst
of ``max_num_sequences + max_queue_len`` into an idle engine is accepted whole and one more is
refused (429 at the server); the same after a live retune; a group is admitted or refused as
a whole."""

from __future__ import annotations

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.core.engine_types import EngineRequest
from inflight.runtime.outputs import QueueFullError
from inflight.runtime.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=4, temperature=0)


@pytest.fixture
def engine(llama_dir) -> LLMEngine:
    return LLMEngine.from_model_dir(llama_dir, EngineConfig(device="cpu", num_kv_blocks=64, max_num_sequences=4,
                                                            max_queue_len=3, max_model_len=128))  # fmt: skip


def _add(engine: LLMEngine, n: int, tag: str) -> None:
    for i in range(n):
        engine.add_request(f"{tag}{i}", [5, 6, 7], PARAMS)


def test_a_burst_of_sequences_plus_queue_is_accepted_whole(engine: LLMEngine) -> None:
    _add(engine, 4 + 3, "r")  # nothing has run yet: all 7 wait, 4 of them board at the next step
    with pytest.raises(QueueFullError):
        _add(engine, 1, "extra")
    engine.step()  # boarding changes nothing: running + waiting is what counts
    assert engine.stats().num_running == 4
    with pytest.raises(QueueFullError):
        _add(engine, 1, "extra")
    engine.abort_request("r0")
    _add(engine, 1, "after-abort")


def test_the_rule_follows_a_live_retune(engine: LLMEngine) -> None:
    engine.update_config(max_num_sequences=2, max_queue_len=1)
    _add(engine, 3, "r")
    with pytest.raises(QueueFullError):
        _add(engine, 1, "extra")
    engine.update_config(max_num_sequences=6)
    _add(engine, 4, "more")  # 7 unfinished: 6 run, 1 waits
    with pytest.raises(QueueFullError):
        _add(engine, 1, "extra")


def test_a_group_is_admitted_or_refused_whole(engine: LLMEngine) -> None:
    group = [EngineRequest(f"g{i}", [5, 6], PARAMS) for i in range(5)]
    _add(engine, 3, "r")
    with pytest.raises(QueueFullError):
        engine.add_requests(group)  # 3 + 5 = 8 > 4 + 3
    assert engine.stats().num_waiting == 3  # none of the group was added
    engine.add_requests(group[:4])
    assert engine.stats().num_waiting == 7
