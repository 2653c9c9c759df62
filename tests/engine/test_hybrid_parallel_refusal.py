"""The offline ``LLM`` refuses a hybrid model (Qwen3-Next) under tensor or pipeline parallelism
before any worker process starts, with the message ``inflight serve``'s preflight gives (not a
ValueError that arrives with each worker's traceback)."""

from __future__ import annotations

from pathlib import Path

import pytest

from inflight.runtime import LLM
from inflight.runtime.config import EngineConfig
from inflight.runtime.distributed.launcher import WorkerGroup
from inflight.runtime.engine_core.served_facts import read_served_facts

from .qwen3_next_models import make_qwen3_next


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen3_next(tmp_path_factory.mktemp("qwen3-next"))


@pytest.mark.parametrize("knobs", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp", "pp"])
def test_llm_refuses_before_starting_workers(model_dir: Path, knobs: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_workers(*args: object, **kwargs: object) -> None:
        raise AssertionError("worker processes were started before the refusal")

    monkeypatch.setattr(WorkerGroup, "start", no_workers)
    config = EngineConfig(device="cpu", dtype="float32", **knobs)
    with pytest.raises(ValueError) as serve:
        read_served_facts(model_dir, config)
    with pytest.raises(ValueError, match="tensor or pipeline parallelism") as offline:
        LLM(model_dir, device="cpu", dtype="float32", **knobs)
    assert str(offline.value) == str(serve.value)
