"""Dropping an engine frees its runner (and with it the KV cache) at once: the decode graphs
hold the runner only weakly, so no reference cycle waits for a cyclic-GC pass. On a GPU the
cycle kept a benchmark engine's ~123 GB KV cache alive after ``del engine``."""

from __future__ import annotations

import gc
import weakref

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.worker.graph_backend import RecordingGraphBackend


def _run(engine: LLMEngine) -> LLMEngine:
    for i in range(3):
        engine.add_request(str(i), [5 + i, 9, 11], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def test_a_closed_engine_frees_its_runner_and_graphs(llama_dir) -> None:
    config = EngineConfig(device="cpu", dtype="float32", kernel_backend="cpu", num_kv_blocks=96,
                          max_num_sequences=8, max_num_tokens=64)  # fmt: skip
    _run(LLMEngine.from_model_dir(llama_dir, config)).close()  # eager first: the CPU kernels pack their weights
    backend = RecordingGraphBackend()
    engine = _run(LLMEngine.from_model_dir(llama_dir, config, graph_backend=backend))
    assert backend.num_replays > 0  # the decode graphs ran
    del backend  # its recorded steps hold the graphs (a CUDA backend holds only graph handles)
    runner = weakref.ref(engine.runner)
    graphs = weakref.ref(engine.runner.graphs)
    kv = weakref.ref(engine.runner.kv_caches[0][0])
    gc.disable()  # what reference counting frees alone, without a cyclic-GC pass
    try:
        engine.close()
        del engine
        assert runner() is None and kv() is None
    finally:
        gc.enable()
    gc.collect()
    assert runner() is None and graphs() is None and kv() is None


def test_capture_leaves_the_collector_as_it_found_it(llama_dir) -> None:
    config = EngineConfig(device="cpu", dtype="float32", kernel_backend="cpu", num_kv_blocks=96,
                          max_num_sequences=8, max_num_tokens=64)  # fmt: skip
    _run(LLMEngine.from_model_dir(llama_dir, config)).close()
    engine = LLMEngine.from_model_dir(llama_dir, config, graph_backend=RecordingGraphBackend())
    assert gc.isenabled() and gc.get_freeze_count() == 0
    engine.close()
    gc.freeze()  # a process settled for serving (engine_core/process_gc.py) before a capture
    try:
        engine = LLMEngine.from_model_dir(llama_dir, config, graph_backend=RecordingGraphBackend())
        assert gc.isenabled() and gc.get_freeze_count() > 0  # still frozen: the capture did not unfreeze it all
        engine.close()
    finally:
        gc.unfreeze()
