"""Qwen3-Next (``Qwen3NextForCausalLM``): greedy outputs token-identical to transformers ``generate``
(float32, CPU, its torch fallbacks for the delta rule and the conv) on a tiny random model made from
transformers' own ``Qwen3NextConfig`` (tests/engine/qwen3_next_models.py), and the per-sequence state
pool beside the block pool: chunked prefill carrying the state across chunks, preemption, the pool's
size capping the running sequences, slots freed at finish and abort (no leak), prefix caching
reported off, and what is refused with a reason (speculation: tests/engine/test_hybrid_speculative.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.core.state_pool import StatePool, hybrid_config, hybrid_refusal
from inflight.runtime.model.loader import load_hf_config
from inflight.runtime.model.spec import spec_from_hf_config
from inflight.runtime.sampling_params import SamplingParams
from tests.runtime.hf_reference import assert_engine_matches_hf, hf_greedy, prompts_of_lengths, run_staggered

from .qwen3_next_models import make_qwen3_next

EAGLE3 = '{"method": "eagle3", "model": "/heads/eagle3", "num_speculative_tokens": 2}'
LENGTHS = [1, 3, 7, 15, 16, 17, 31, 32, 33, 48, 5, 64, 2, 90, 24, 130]
MAX_TOKENS = [12, 20, 8, 16, 24, 10, 14, 18, 9, 22, 30, 11, 16, 13, 25, 17]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen3_next(tmp_path_factory.mktemp("qwen3-next"))


def _config(**knobs) -> EngineConfig:
    return EngineConfig(device="cpu", dtype="float32", **knobs)


def _prompts(model_dir: Path, lengths: list[int]) -> list[list[int]]:
    from transformers import AutoTokenizer

    return prompts_of_lengths(AutoTokenizer.from_pretrained(str(model_dir)), lengths)


def _states(engine: LLMEngine) -> StatePool:
    pool = engine.kv.state_pool
    assert pool is not None
    return pool


def test_spec_reads_the_qwen3_next_config(model_dir: Path) -> None:
    spec = spec_from_hf_config(load_hf_config(model_dir))
    linear = spec.linear_attention
    assert spec.arch == "qwen3_next" and linear is not None and linear.layers == (0, 2)
    assert (linear.num_k_heads, linear.num_v_heads, linear.k_head_dim, linear.conv_kernel) == (2, 4, 32, 4)
    assert spec.rotary_dim == 8 and spec.attn_output_gate and spec.qk_norm and spec.norm_plus_one
    moe = spec.moe
    assert moe is not None and moe.sparse_layers == (1, 2, 3) and moe.shared_expert_gate
    assert moe.shared_intermediate_size == 64 and moe.renormalize


@pytest.mark.parametrize("backend", ["auto", "torch"])  # native CPU (C decode step) and the torch references
def test_mixed_prefill_and_decode_steps(model_dir: Path, backend: str) -> None:
    config = _config(num_kv_blocks=256, max_num_tokens=512, kernel_backend=backend)
    engine = assert_engine_matches_hf(model_dir, config, _prompts(model_dir, LENGTHS), MAX_TOKENS)
    assert engine.runner.ops.name.startswith("cpu-native" if backend == "auto" else "torch")
    assert _states(engine).num_used == 0 and _states(engine).num_free == engine.config.max_num_sequences


@pytest.mark.parametrize("budget", [13, 40])
def test_chunked_prefill_carries_the_state(model_dir: Path, budget: int) -> None:
    """Prompts up to 130 tokens through a 13- or 40-token budget: chunk boundaries inside every
    longer prompt (and inside the reference's 64-token chunks), each chunk continuing the conv and
    recurrent state the one before left in the slot."""
    config = _config(num_kv_blocks=256, max_num_tokens=budget, enable_chunked_context=True)
    engine = assert_engine_matches_hf(model_dir, config, _prompts(model_dir, LENGTHS), MAX_TOKENS)
    assert _states(engine).num_used == 0


def test_preemption_under_a_small_cache(model_dir: Path) -> None:
    """A preempted request drops its state with its blocks and recomputes from its prompt."""
    config = _config(num_kv_blocks=12, block_size=16, max_num_tokens=256)
    engine = assert_engine_matches_hf(model_dir, config, _prompts(model_dir, LENGTHS), MAX_TOKENS)
    assert engine.stats().num_preemptions > 0
    assert _states(engine).num_used == 0


def test_the_state_pool_caps_the_running_sequences(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """3 slots (max_num_sequences 3), 10 requests: never more than 3 run, each boards as a slot
    frees, and every output still matches transformers."""
    with caplog.at_level(logging.INFO):
        engine = LLMEngine.from_model_dir(model_dir, _config(num_kv_blocks=256, max_num_sequences=3))
    assert "3 state slots" in caplog.text and "at most 3 sequences run at once" in caplog.text
    pool = _states(engine)
    assert pool.num_slots == 3
    prompts = _prompts(model_dir, LENGTHS[:10])
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in MAX_TOKENS[:10]]
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    got: dict[str, list[int]] = {str(i): [] for i in range(10)}
    most = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.req_id].extend(out.new_token_ids)
        most = max(most, engine.scheduler.num_running)
        assert pool.num_used == engine.scheduler.num_running <= 3
        assert sorted(engine.runner.state_slots[r.req_id] for r in engine.scheduler.running) == \
            sorted(set(engine.runner.state_slots[r.req_id] for r in engine.scheduler.running))  # fmt: skip
    assert most == 3
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == hf_greedy(model_dir, prompt, MAX_TOKENS[i]), f"prompt {i}"
    assert pool.num_used == 0 and pool.num_free == 3


def test_finish_and_abort_free_the_slot(model_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(model_dir, _config(num_kv_blocks=64, max_num_sequences=4))
    pool = _states(engine)
    prompts = _prompts(model_dir, [9, 20, 5])
    engine.add_request("long", prompts[0], SamplingParams(max_tokens=50, temperature=0.0))
    engine.add_request("short", prompts[1], SamplingParams(max_tokens=2, temperature=0.0))
    engine.add_request("aborted", prompts[2], SamplingParams(max_tokens=50, temperature=0.0))
    engine.step()
    assert pool.num_used == 3
    engine.abort_request("aborted")
    assert pool.num_used == 2 and not pool.holds("aborted")
    engine.step()  # "short" samples its second token and finishes
    assert not pool.holds("short") and pool.num_used == 1
    engine.abort_request("long")
    assert pool.num_used == 0 and pool.num_free == 4
    assert engine.stats().num_used_kv_blocks == 0


def test_a_waiting_request_holds_no_slot_and_an_aborted_one_frees_it(model_dir: Path) -> None:
    """Admission takes a slot with the first blocks; a request that cannot board holds none, and
    a failed block allocation gives the slot back (one free block, two requests)."""
    engine = LLMEngine.from_model_dir(model_dir, _config(num_kv_blocks=1, block_size=16, max_num_sequences=2,
                                                         max_model_len=16))  # fmt: skip
    pool = _states(engine)
    prompts = _prompts(model_dir, [6, 6])
    engine.add_request("a", prompts[0], SamplingParams(max_tokens=2, temperature=0.0))
    engine.add_request("b", prompts[1], SamplingParams(max_tokens=2, temperature=0.0))
    engine.step()
    assert pool.holds("a") and not pool.holds("b") and pool.num_used == 1
    engine.abort_request("b")
    while engine.has_unfinished_requests():
        engine.step()
    assert pool.num_used == 0


def test_prefix_caching_is_off_with_the_reason_logged(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    base = _prompts(model_dir, [50])[0]
    prompts = [base + t[1:] for t in _prompts(model_dir, [3, 9, 20])] + [base]
    with caplog.at_level(logging.INFO):
        engine = assert_engine_matches_hf(model_dir, _config(num_kv_blocks=128, enable_prefix_caching=True),
                                          prompts, [10, 14, 8, 12])  # fmt: skip
    assert "prefix caching is off for qwen3_next" in caplog.text
    assert not engine.config.enable_prefix_caching
    assert engine.stats().prefix_cache_hits == 0


def test_seeded_sampling_does_not_depend_on_the_batch(model_dir: Path) -> None:
    """A seeded request draws the same tokens alone and among others (other sequences' states
    never leak into its slot), chunked or not."""
    prompt = _prompts(model_dir, [40])[0]
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    alone = LLMEngine.from_model_dir(model_dir, _config(num_kv_blocks=64))
    want = run_staggered(alone, [prompt], [params])["0"]
    crowded = LLMEngine.from_model_dir(model_dir, _config(num_kv_blocks=256, max_num_tokens=24,
                                                          enable_chunked_context=True))  # fmt: skip
    others = _prompts(model_dir, [33, 7, 90, 12])
    got = run_staggered(crowded, [*others, prompt], [SamplingParams(max_tokens=20, temperature=0.0)] * 4 + [params])
    assert got["4"] == want and len(want) == 16


def test_what_cannot_apply_is_refused_with_a_reason(model_dir: Path) -> None:
    spec = spec_from_hf_config(load_hf_config(model_dir))
    base = _config()
    assert hybrid_refusal(spec, base) is None
    for knobs, words in (({"tensor_parallel_size": 2}, "tensor or pipeline parallelism"),
                         ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype fp8"),
                         ({"enable_lora": True}, "LoRA")):  # fmt: skip
        refusal = hybrid_refusal(spec, base.replace(**knobs))
        assert refusal is not None and words in refusal and "qwen3_next" in refusal
        with pytest.raises(ValueError, match="hybrid linear attention"):
            hybrid_config(spec, base.replace(**knobs))
    with pytest.raises(ValueError, match="fp8"):
        LLMEngine.from_model_dir(model_dir, _config(num_kv_blocks=32, kv_cache_dtype="fp8"))
    for method in ('{"method": "ngram"}', EAGLE3):  # speculation is served: tests/engine/test_hybrid_speculative.py
        assert hybrid_refusal(spec, base.replace(speculative_config=method)) is None


def test_a_non_hybrid_model_is_untouched() -> None:
    from inflight.runtime.model.spec_types import ModelSpec

    spec = ModelSpec("llama", 10, 8, 8, 1, 1, 1, 8, 1e-6, 64, False, False, False, False, False, None, "silu")
    config = _config(enable_prefix_caching=True, speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    assert hybrid_config(spec, config) is config and hybrid_refusal(spec, config) is None


# One layer of each kind for the interpreter (a Python loop per op): the linear layer with the
# dense MLP, the full-attention layer with the experts and the gated shared expert.
INTERPRETER_LAYERS = {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]}


@pytest.mark.slow
def test_triton_kernels_in_the_interpreter(tmp_path: Path) -> None:
    """The engine on the Triton kernels (the conv and the delta-rule scan included; Triton's
    interpreter on the CPU, 24-token budget, chunked prompts) gives transformers' tokens, on the
    fixture's shape cut to one layer of each kind (every kernel still runs)."""
    from tests.runtime.family_models import triton_tokens

    model_dir = make_qwen3_next(tmp_path / "qwen3-next-2", overrides=INTERPRETER_LAYERS)
    prompts, max_tokens = _prompts(model_dir, [1, 30, 70, 9]), [6, 8, 5, 7]
    got = triton_tokens(model_dir, prompts, max_tokens)
    assert got == [hf_greedy(model_dir, p, m) for p, m in zip(prompts, max_tokens, strict=True)]


def test_the_kernels_follow_the_bundle() -> None:
    """The Triton bundle runs the Triton conv and scan; the native CPU bundle the C decode step
    (prompt chunks and the conv on the torch reference); any other the torch references."""
    from types import SimpleNamespace

    from inflight.kernels import cpu_gated_delta, gated_delta
    from inflight.runtime.model.gated_delta_layer import kernels_for

    conv, rule = kernels_for(SimpleNamespace(name="triton"))
    assert (conv.__module__, rule.__module__) == ("inflight.kernels.triton_gated_delta",) * 2
    for name in ("cpu-native", "cpu-native+packed"):
        assert kernels_for(SimpleNamespace(name=name)) == (gated_delta.causal_conv1d, cpu_gated_delta.gated_delta_rule)
    assert kernels_for(SimpleNamespace(name="torch")) == (gated_delta.causal_conv1d, gated_delta.gated_delta_rule)


@pytest.mark.parametrize("knobs", [{"max_num_sequences": 4, "num_kv_blocks": 256}, {"num_kv_blocks": 12}],
                         ids=["few-slots", "preemption"])  # fmt: skip
def test_async_scheduling(model_dir: Path, knobs: dict) -> None:
    """Steps pipelined (the next one scheduled while one runs): a slot freed at a finish is handed
    out only at a later schedule, and a new sequence starts from zeros whatever its slot holds."""
    config = _config(max_num_tokens=40, enable_chunked_context=True, async_scheduling=True, block_size=16, **knobs)
    engine = assert_engine_matches_hf(model_dir, config, _prompts(model_dir, LENGTHS), MAX_TOKENS)
    assert engine.pipeline is not None and _states(engine).num_used == 0


def test_preflight_refuses_before_any_weight_loads(model_dir: Path) -> None:
    from inflight.runtime.engine_core.served_facts import read_served_facts

    with pytest.raises(ValueError, match="tensor or pipeline parallelism"):
        read_served_facts(model_dir, _config(tensor_parallel_size=2))
    facts, _ = read_served_facts(model_dir, _config())
    assert facts.max_position_embeddings == 1024
