"""The pooling engine: prompts through the same scheduler, one vector each, equal to transformers'.

Each test serves a tiny random checkpoint made here (tests/runtime/pooling_models.py) and compares
the engine's pooled vector (``RequestOutput.pooled``) with transformers on the same weights:
LAST, MEAN and CLS pooling, prompts chunked over several steps (``max_num_tokens`` below the
prompt), preempted and recomputed (a KV cache too small for the burst), a sequence classifier's
logits; and the KV blocks all free once a burst is done.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.engine_core.protocol import step_done
from inflight.runtime.model.pooling import PoolerConfig, parse_pooler_config, resolve_pooler, resolve_runner
from inflight.runtime.outputs import EngineStats, RequestOutput
from inflight.runtime.sampling_params import SamplingParams
from tests.runtime.pooling_models import (
    bert_reference,
    make_bert,
    make_embedding_model,
    make_reranker,
    reference_embedding,
    reference_logits,
)

PARAMS = SamplingParams(max_tokens=1, temperature=0.0)
STATS = EngineStats(0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1)
TEXTS = ["a short one", "def main(argv):\n    return parse(argv) or 0\n" * 3, "x",
         "import os\nimport sys\nfrom pathlib import Path\n" * 4]


@pytest.fixture(scope="module")
def qwen3_embed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_embedding_model(tmp_path_factory.mktemp("qwen3-embed"), "qwen3")


@pytest.fixture(scope="module")
def llama_st_cls(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_embedding_model(tmp_path_factory.mktemp("llama-cls"), "llama", st_pooling="CLS")


@pytest.fixture(scope="module")
def qwen3_rerank(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_reranker(tmp_path_factory.mktemp("qwen3-rerank"), "qwen3")


def _run(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, RequestOutput]:
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, PARAMS)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert not out.new_token_ids  # a pooled request never samples
            if out.finished:
                done[out.req_id] = out
    return done


def _vector(out: RequestOutput) -> np.ndarray:
    assert out.finish_reason == "stop" and out.pooled is not None
    return np.frombuffer(out.pooled, dtype="<f4")


def _prompts(engine: LLMEngine) -> list[list[int]]:
    return [engine.encode_prompt(t) for t in TEXTS]


def test_last_token_pooling_equals_transformers_when_chunked(qwen3_embed: Path) -> None:
    engine = LLMEngine.from_model_dir(qwen3_embed, EngineConfig(max_num_tokens=16, num_kv_blocks=64,
                                                                max_model_len=256))  # fmt: skip
    assert engine.config.runner == "pooling"
    pooler = PoolerConfig.from_json(engine.config.pooler_config or "")
    assert (pooler.kind, pooler.pooling_type, pooler.normalize) == ("embed", "LAST", True)
    assert engine.config.enable_prefix_caching  # LAST pooling keeps it
    prompts = _prompts(engine)
    assert max(map(len, prompts)) > 16  # some prompts take several steps
    for _ in range(2):  # the second time round, prefixes come from the cache
        done = _run(engine, prompts)
        for i, ids in enumerate(prompts):
            ref = reference_embedding(qwen3_embed, ids, "LAST", normalize=False)
            np.testing.assert_allclose(_vector(done[f"r{i}"]), ref, rtol=1e-4, atol=1e-4)
        assert engine.pool.num_used_blocks == 0  # every block given back at finish
    assert engine.stats().prefix_cache_hits > 0
    assert engine.stats().num_running == engine.stats().num_waiting == 0


def test_mean_pooling_from_the_flag_survives_chunking_and_preemption(qwen3_embed: Path) -> None:
    # each step gives each prompt 16 tokens, so four long prompts outgrow the 8 blocks together
    config = EngineConfig(max_num_tokens=64, long_prefill_token_threshold=16, num_kv_blocks=8, block_size=16,
                          max_model_len=128, pooler_config='{"pooling_type": "MEAN", "normalize": false}')
    engine = LLMEngine.from_model_dir(qwen3_embed, config)
    assert not engine.config.enable_prefix_caching  # MEAN reads every position: caching off
    longs = [TEXTS[1] * 3, TEXTS[3] * 3, TEXTS[1] + TEXTS[3], TEXTS[3] + TEXTS[1]]
    prompts = [engine.encode_prompt(t)[:100] for t in longs] + _prompts(engine)[:1]
    assert min(map(len, prompts[:4])) > 64
    done = _run(engine, prompts)
    for i, ids in enumerate(prompts):
        ref = reference_embedding(qwen3_embed, ids, "MEAN", normalize=False)
        np.testing.assert_allclose(_vector(done[f"r{i}"]), ref, rtol=1e-4, atol=1e-4)
    assert engine.stats().num_preemptions > 0
    assert engine.pool.num_used_blocks == 0


def test_sentence_transformers_pooling_is_read_from_the_model_dir(llama_st_cls: Path) -> None:
    engine = LLMEngine.from_model_dir(llama_st_cls, EngineConfig(max_num_tokens=8, num_kv_blocks=64,
                                                                 max_model_len=256))  # fmt: skip
    pooler = PoolerConfig.from_json(engine.config.pooler_config or "")
    assert (pooler.pooling_type, pooler.normalize) == ("CLS", True)
    prompts = _prompts(engine)
    done = _run(engine, prompts)
    for i, ids in enumerate(prompts):  # the engine's vector is not normalized yet (the front end does)
        ref = reference_embedding(llama_st_cls, ids, "CLS", normalize=False)
        np.testing.assert_allclose(_vector(done[f"r{i}"]), ref, rtol=1e-4, atol=1e-4)


def test_sequence_classifier_logits_equal_transformers(qwen3_rerank: Path) -> None:
    engine = LLMEngine.from_model_dir(qwen3_rerank, EngineConfig(max_num_tokens=16, num_kv_blocks=64,
                                                                 max_model_len=256))  # fmt: skip
    pooler = PoolerConfig.from_json(engine.config.pooler_config or "")
    assert (pooler.kind, pooler.pooling_type, pooler.normalize) == ("score", "LAST", False)
    prompts = _prompts(engine)
    done = _run(engine, prompts)
    for i, ids in enumerate(prompts):
        logits = _vector(done[f"r{i}"])
        assert logits.shape == (1,)
        np.testing.assert_allclose(logits, reference_logits(qwen3_rerank, ids), rtol=1e-4, atol=1e-4)


def test_a_causal_lm_served_by_the_pooling_runner(model_factory) -> None:
    llama = model_factory("llama")
    with pytest.raises(ValueError, match="add --runner pooling"):
        LLMEngine.from_model_dir(llama, EngineConfig(num_kv_blocks=16, max_model_len=64, pooler_config="{}"))
    engine = LLMEngine.from_model_dir(llama, EngineConfig(runner="pooling", num_kv_blocks=16, max_model_len=64))
    done = _run(engine, _prompts(engine)[:1])
    assert _vector(done["r0"]).shape == (engine.runner.spec.hidden_size,)


def test_pooled_vectors_cross_the_engine_core_protocol() -> None:
    out = RequestOutput("a", (), "", True, "stop", 3, 0, 0, pooled=np.arange(4, dtype="<f4").tobytes())
    running = RequestOutput("b", (7,), "", False, None, 3, 1, 0)
    message = pickle.loads(pickle.dumps(step_done([running, out], STATS)))
    assert message.outputs() == (running, out)


def test_runner_choice_and_its_refusals(qwen3_rerank: Path) -> None:
    assert resolve_runner("auto", "lm") == "generate"
    assert resolve_runner("auto", "score") == "pooling"
    assert resolve_runner("pooling", "lm") == "pooling"  # a *ForCausalLM checkpoint as an embedding model
    with pytest.raises(ValueError, match="no LM head"):
        resolve_runner("generate", "none")
    with pytest.raises(ValueError, match="no LM head"):
        LLMEngine.from_model_dir(qwen3_rerank, EngineConfig(runner="generate", num_kv_blocks=16, max_model_len=64))
    with pytest.raises(ValueError, match="pooling_type LAST only"):
        LLMEngine.from_model_dir(qwen3_rerank, EngineConfig(num_kv_blocks=16, max_model_len=64,
                                                            pooler_config='{"pooling_type": "MEAN"}'))


@pytest.mark.parametrize(("text", "message"), [
    ("[1]", "JSON object"),
    ('{"pooling_type": "MAX"}', "LAST, MEAN, CLS"),
    ('{"normalize": "yes"}', "true or false"),
    ('{"softmax": true}', "not supported here"),
    ('{"pooling_typ": "LAST"}', "unknown pooler_config key"),
    ('{"matryoshka_dimensions": [0]}', "positive integers"),
])
def test_pooler_config_is_checked_key_by_key(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_pooler_config(text)
    with pytest.raises(ValueError, match=message):
        EngineConfig(pooler_config=text)


def test_pooling_runner_refuses_what_it_cannot_run() -> None:
    assert parse_pooler_config('{"pooling_type": "mean"}')["pooling_type"] == "MEAN"
    for clash in ({"tensor_parallel_size": 2}, {"device": "sim"}, {"async_scheduling": True},
                  {"speculative_config": json.dumps({"method": "ngram"})}):
        with pytest.raises(ValueError, match="pooling runner"):
            EngineConfig(runner="pooling", **clash)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="runner pooling"):
        EngineConfig(runner="generate", pooler_config="{}")


def test_sentence_transformers_pooling_inflight_lacks_is_refused(tmp_path: Path) -> None:
    (tmp_path / "modules.json").write_text(json.dumps([
        {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling modes"):
        resolve_pooler(tmp_path, SimpleNamespace(), "none", None)
    pooler = resolve_pooler(tmp_path, SimpleNamespace(), "none", '{"pooling_type": "MEAN", "normalize": false, '
                            '"matryoshka_dimensions": [8, 16]}')  # the flag wins over the directory
    assert pooler == PoolerConfig("embed", "MEAN", False, True, (8, 16))
    assert PoolerConfig.from_json(pooler.to_json()) == pooler
    assert resolve_pooler(tmp_path / "none", SimpleNamespace(is_matryoshka=True), "none", None) == PoolerConfig(
        "embed", "LAST", True, True, None)


def test_bert_encoder_embeddings_and_classifier_equal_transformers(tmp_path: Path) -> None:
    cls_dir = make_bert(tmp_path / "cls")
    engine = LLMEngine.from_model_dir(cls_dir, EngineConfig(num_kv_blocks=64, max_model_len=256))
    pooler = PoolerConfig.from_json(engine.config.pooler_config or "")
    assert (pooler.pooling_type, pooler.normalize) == ("CLS", True)  # an encoder's default
    assert not engine.config.enable_chunked_context and not engine.config.enable_prefix_caching
    refs = [bert_reference(cls_dir, t) for t in TEXTS]
    done = _run(engine, [ids for ids, _ in refs])
    for i, (_, hidden) in enumerate(refs):
        np.testing.assert_allclose(_vector(done[f"r{i}"]), hidden[0], rtol=1e-4, atol=1e-4)
    mean_dir = make_bert(tmp_path / "mean", st_pooling="MEAN")
    engine = LLMEngine.from_model_dir(mean_dir, EngineConfig(num_kv_blocks=64, max_model_len=256))
    done = _run(engine, [ids for ids, _ in refs])
    for i, text in enumerate(TEXTS):
        np.testing.assert_allclose(_vector(done[f"r{i}"]), bert_reference(mean_dir, text)[1].mean(0),
                                   rtol=1e-4, atol=1e-4)
    score_dir = make_bert(tmp_path / "score", head="score")
    engine = LLMEngine.from_model_dir(score_dir, EngineConfig(num_kv_blocks=64, max_model_len=256))
    pairs = [bert_reference(score_dir, "a query", t) for t in TEXTS]
    done = _run(engine, [ids for ids, _ in pairs])
    for i, (_, logits) in enumerate(pairs):
        np.testing.assert_allclose(_vector(done[f"r{i}"]), logits, rtol=1e-4, atol=1e-5)
    assert engine.pool.num_used_blocks == 0


def test_xlm_roberta_encoder_and_reranker_equal_transformers(tmp_path: Path) -> None:
    embed_dir = make_bert(tmp_path / "embed", family="xlm-roberta")
    engine = LLMEngine.from_model_dir(embed_dir, EngineConfig(num_kv_blocks=64))
    assert engine.max_model_len == 256  # the position table less RoBERTa's padding offset
    refs = [bert_reference(embed_dir, t) for t in TEXTS]
    done = _run(engine, [ids for ids, _ in refs])
    for i, (_, hidden) in enumerate(refs):
        np.testing.assert_allclose(_vector(done[f"r{i}"]), hidden[0], rtol=1e-4, atol=1e-4)
    score_dir = make_bert(tmp_path / "score", head="score", family="xlm-roberta")
    engine = LLMEngine.from_model_dir(score_dir, EngineConfig(num_kv_blocks=64))
    pairs = [bert_reference(score_dir, "a query", t) for t in TEXTS]
    done = _run(engine, [ids for ids, _ in pairs])
    for i, (_, logits) in enumerate(pairs):
        np.testing.assert_allclose(_vector(done[f"r{i}"]), logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("argv", "runner"), [
    (["--task", "embed"], "pooling"), (["--task", "score"], "pooling"), (["--runner", "pooling"], "pooling"),
    (["--task", "generate"], "generate"), ([], "auto"),
])
def test_vllm_runner_and_task_flags(argv: list[str], runner: str) -> None:
    from inflight.runtime.cli.command import build_parser, engine_config_from_args

    args = build_parser().parse_args(["serve", "m", *argv, "--pooler-config", '{"pooling_type": "CLS"}'])
    config = engine_config_from_args(args) if runner != "generate" else None
    if config is not None:
        assert (config.runner, config.pooler_config) == (runner, '{"pooling_type": "CLS"}')
    else:
        with pytest.raises(ValueError, match="runner pooling"):
            engine_config_from_args(args)
