"""Bad input raises an error whose message says what to change; nothing leaks."""

from __future__ import annotations

import json
import shutil

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.outputs import QueueFullError, RequestRejectedError
from inflight.runtime.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(max_num_sequences=0), "max_num_sequences must be an integer >= 1"),
    (dict(max_num_tokens=-5), "max_num_tokens must be an integer >= 1"),
    (dict(block_size=12), "block_size must be a power of two"),
    (dict(kv_cache_free_gpu_mem_fraction=0.0), "kv_cache_free_gpu_mem_fraction must be in (0, 1]"),
    (dict(kv_cache_free_gpu_mem_fraction=1.5), "kv_cache_free_gpu_mem_fraction must be in (0, 1]"),
    (dict(scheduler_policy="lifo"), "scheduler_policy must be one of fcfs, priority, fair, static"),
    (dict(dtype="int8"), "dtype must be one of"),
    (dict(device="tpu"), "device must be one of"),
    (dict(num_kv_blocks=0), "num_kv_blocks must be an integer >= 1"),
    (dict(max_queue_len=-1), "max_queue_len must be an integer >= 0"),
    (dict(enable_chunked_context="yes"), "enable_chunked_context must be true or false"),
    (dict(kernel_backend="cuda"), "kernel_backend must be one of"),
])
def test_engine_config_errors(kwargs, fragment):
    with pytest.raises(ValueError) as exc:
        EngineConfig(**kwargs)
    assert fragment in str(exc.value)


def test_unknown_config_field_on_replace():
    with pytest.raises(ValueError, match="unknown engine config field"):
        EngineConfig().replace(max_batch=3)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(top_p=1.2), "top_p must be in (0, 1]"),
    (dict(temperature=-1), "temperature must be in [0, 2]"),
    (dict(top_k=-3), "top_k must be an integer in [-1,"),
    (dict(min_p=2), "min_p must be in [0, 1]"),
    (dict(repetition_penalty=0), "repetition_penalty must be in (0, 10]"),
    (dict(presence_penalty=3), "presence_penalty must be in [-2, 2]"),
    (dict(logprobs=-1), "logprobs must be an integer >= 0"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens (5) must not exceed max_tokens (2)"),
    (dict(stop=[""]), "stop must be non-empty strings"),
])
def test_sampling_params_errors(kwargs, fragment):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    assert fragment in str(exc.value)


@pytest.fixture(scope="module")
def engine(llama_dir) -> LLMEngine:
    return LLMEngine.from_model_dir(llama_dir, EngineConfig(num_kv_blocks=8, max_model_len=256, max_queue_len=2,
                                                            max_num_sequences=1))


def test_empty_prompt(engine):
    with pytest.raises(RequestRejectedError, match="prompt must not be empty") as exc:
        engine.add_request("e", engine.encode_prompt(""), SamplingParams())
    assert exc.value.reason == "invalid_request"
    with pytest.raises(RequestRejectedError, match="prompt must not be empty"):
        engine.add_request("e", [], SamplingParams())


def test_prompt_over_max_model_len(engine):
    with pytest.raises(RequestRejectedError, match="exceeds the model's context length") as exc:
        engine.add_request("long", [5] * 250, SamplingParams(max_tokens=10))
    assert exc.value.reason == "prompt_too_long"


def test_request_larger_than_the_whole_cache(engine):
    with pytest.raises(RequestRejectedError, match="larger than the whole KV cache") as exc:
        engine.add_request("big", [5] * 100, SamplingParams(max_tokens=100))
    assert exc.value.reason == "too_large_for_cache"


def test_token_ids_outside_the_vocabulary(engine):
    with pytest.raises(RequestRejectedError, match="prompt token ids must be integers"):
        engine.add_request("v", [1, 10**9], SamplingParams())


def test_queue_full_and_nothing_leaks(engine):
    for i in range(3):  # one runs, two wait
        engine.add_request(f"q{i + 1}", [5, 6 + i], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError) as exc:
        engine.add_request("q4", [5, 9], SamplingParams(max_tokens=2))
    assert exc.value.reason == "queue_full"
    assert engine.abort_request("q1").finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_used_kv_blocks == 0


def test_only_live_fields_can_be_retuned(engine):
    assert engine.update_config(max_num_sequences=3).max_num_sequences == 3
    assert engine.scheduler.config.max_num_sequences == 3
    with pytest.raises(ValueError, match="cannot change block_size on a running engine"):
        engine.update_config(block_size=32)
    with pytest.raises(ValueError, match="max_num_tokens must be an integer >= 1"):
        engine.update_config(max_num_tokens=0)


def test_unsupported_architecture(llama_dir, tmp_path):
    bad = tmp_path / "gpt2"
    shutil.copytree(llama_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config["model_type"] = "gpt2"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture .*GPT2LMHeadModel.*inflight serves"):
        LLMEngine.from_model_dir(bad, EngineConfig(num_kv_blocks=8))


def test_not_a_model_directory(tmp_path):
    with pytest.raises(ValueError, match="is not a model directory"):
        LLMEngine.from_model_dir(tmp_path, EngineConfig(num_kv_blocks=8))
