"""Granite 4 hybrid (``GraniteMoeHybridForCausalLM``): greedy outputs token-identical to transformers
``generate`` (float32, CPU, its torch fallbacks for the Mamba-2 scan and conv) on tiny random models
made from transformers' own ``GraniteMoeHybridConfig`` (tests/runtime/granite_hybrid_models.py): NoPE
attention with experts, and rotary attention with a dense MLP and tied embeddings. The per-sequence
state pool beside the block pool: chunked prefill carrying the conv and SSM state across chunks,
preemption, async scheduling, the pool's size capping the running sequences, no slot leaked,
prefix caching reported off, and what is refused with a reason."""

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

from .granite_hybrid_models import make_granite_hybrid

LENGTHS = [1, 3, 7, 15, 16, 17, 31, 33, 48, 5, 70, 2, 130, 24]
MAX_TOKENS = [12, 20, 8, 16, 10, 14, 18, 9, 22, 30, 11, 16, 13, 17]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_granite_hybrid(tmp_path_factory.mktemp("granite-hybrid"))


def _config(**knobs) -> EngineConfig:
    return EngineConfig(device="cpu", dtype="float32", **knobs)


def _prompts(model_dir: Path, lengths: list[int]) -> list[list[int]]:
    from transformers import AutoTokenizer

    return prompts_of_lengths(AutoTokenizer.from_pretrained(str(model_dir)), lengths)


def _states(engine: LLMEngine) -> StatePool:
    pool = engine.kv.state_pool
    assert pool is not None
    return pool


def test_spec_reads_the_granite_config(model_dir: Path) -> None:
    spec = spec_from_hf_config(load_hf_config(model_dir))
    mamba = spec.mamba
    assert spec.arch == "granitemoehybrid" and mamba is not None and mamba.layers == (0, 2, 3)
    assert spec.state_layers == (0, 2, 3) and spec.linear_attention is None
    assert (mamba.num_heads, mamba.head_dim, mamba.num_groups, mamba.state_size, mamba.conv_kernel) == (4, 32, 2, 16, 4)
    assert mamba.conv_dim == 128 + 2 * 2 * 16 and mamba.conv_bias and not mamba.proj_bias
    assert spec.nope_layers == (0, 1, 2, 3) and spec.attn_scale == 0.125 and spec.embed_scale == 3.0
    assert spec.residual_multiplier == 0.5 and spec.logits_scaling == 2.5
    moe = spec.moe
    assert moe is not None and moe.topk_first and moe.intermediate_size == 32 and moe.shared_intermediate_size == 48


@pytest.mark.parametrize("backend", ["auto", "torch"])  # native CPU (C decode step) and the torch references
def test_mixed_prefill_and_decode_steps(model_dir: Path, backend: str) -> None:
    config = _config(num_kv_blocks=256, max_num_tokens=512, kernel_backend=backend)
    engine = assert_engine_matches_hf(model_dir, config, _prompts(model_dir, LENGTHS), MAX_TOKENS)
    assert engine.runner.ops.name.startswith("cpu-native" if backend == "auto" else "torch")
    assert _states(engine).num_used == 0 and _states(engine).num_free == engine.config.max_num_sequences


@pytest.mark.parametrize("budget", [13, 40])
def test_chunked_prefill_carries_the_state(model_dir: Path, budget: int) -> None:
    """Prompts up to 130 tokens through a 13- or 40-token budget: chunk boundaries inside every
    longer prompt (and inside our 64-token and transformers' 16-token scan chunks), each chunk
    continuing the conv and SSM state the one before left in the slot."""
    config = _config(num_kv_blocks=256, max_num_tokens=budget, enable_chunked_context=True)
    engine = assert_engine_matches_hf(model_dir, config, _prompts(model_dir, LENGTHS), MAX_TOKENS)
    assert _states(engine).num_used == 0


def test_preemption_under_a_small_cache(model_dir: Path) -> None:
    """A preempted request drops its state with its blocks and recomputes from its prompt."""
    config = _config(num_kv_blocks=12, block_size=16, max_num_tokens=256)
    engine = assert_engine_matches_hf(model_dir, config, _prompts(model_dir, LENGTHS), MAX_TOKENS)
    assert engine.stats().num_preemptions > 0
    assert _states(engine).num_used == 0


@pytest.mark.parametrize("knobs", [{"max_num_sequences": 4, "num_kv_blocks": 256}, {"num_kv_blocks": 12}],
                         ids=["few-slots", "preemption"])  # fmt: skip
def test_async_scheduling(model_dir: Path, knobs: dict) -> None:
    """Steps pipelined: a slot freed at a finish is handed out only at a later schedule, and a new
    sequence starts from zeros whatever its slot holds."""
    config = _config(max_num_tokens=40, enable_chunked_context=True, async_scheduling=True, block_size=16, **knobs)
    engine = assert_engine_matches_hf(model_dir, config, _prompts(model_dir, LENGTHS), MAX_TOKENS)
    assert engine.pipeline is not None and _states(engine).num_used == 0


def test_the_state_pool_caps_the_running_sequences(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """3 slots, 8 requests: never more than 3 run, each boards as a slot frees, outputs still match,
    and finish and abort give every slot back."""
    with caplog.at_level(logging.INFO):
        engine = LLMEngine.from_model_dir(model_dir, _config(num_kv_blocks=256, max_num_sequences=3))
    assert "3 state slots for its 3 Mamba-2 layers" in caplog.text
    pool = _states(engine)
    prompts = _prompts(model_dir, LENGTHS[:8])
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0))
    engine.add_request("aborted", prompts[0], SamplingParams(max_tokens=50, temperature=0.0))
    got: dict[str, list[int]] = {str(i): [] for i in range(8)}
    most = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.req_id != "aborted":
                got[out.req_id].extend(out.new_token_ids)
        if engine.scheduler.num_running and any(r.req_id == "aborted" for r in engine.scheduler.running):
            engine.abort_request("aborted")
        most = max(most, engine.scheduler.num_running)
        assert pool.num_used == engine.scheduler.num_running <= 3
    assert most == 3
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == hf_greedy(model_dir, prompt, MAX_TOKENS[i]), f"prompt {i}"
    assert pool.num_used == 0 and pool.num_free == 3 and engine.stats().num_used_kv_blocks == 0


def test_prefix_caching_is_off_with_the_reason_logged(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    base = _prompts(model_dir, [50])[0]
    prompts = [base + t[1:] for t in _prompts(model_dir, [3, 9, 20])] + [base]
    with caplog.at_level(logging.INFO):
        engine = assert_engine_matches_hf(model_dir, _config(num_kv_blocks=128, enable_prefix_caching=True),
                                          prompts, [10, 14, 8, 12])  # fmt: skip
    assert "prefix caching is off for granitemoehybrid: its Mamba-2 layers" in caplog.text
    assert not engine.config.enable_prefix_caching and engine.stats().prefix_cache_hits == 0


def test_seeded_sampling_does_not_depend_on_the_batch(model_dir: Path) -> None:
    """A seeded request draws the same tokens alone and among others (no state leaks between slots)."""
    prompt = _prompts(model_dir, [40])[0]
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    want = run_staggered(LLMEngine.from_model_dir(model_dir, _config(num_kv_blocks=64)), [prompt], [params])["0"]
    crowded = LLMEngine.from_model_dir(model_dir, _config(num_kv_blocks=256, max_num_tokens=24,
                                                          enable_chunked_context=True))  # fmt: skip
    others = _prompts(model_dir, [33, 7, 90, 12])
    got = run_staggered(crowded, [*others, prompt], [SamplingParams(max_tokens=20, temperature=0.0)] * 4 + [params])
    assert got["4"] == want and len(want) == 16


def test_what_cannot_apply_is_refused_with_a_reason(model_dir: Path) -> None:
    spec = spec_from_hf_config(load_hf_config(model_dir))
    base = _config()
    assert hybrid_refusal(spec, base) is None
    for knobs, words in (({"tensor_parallel_size": 2}, "tensor or pipeline parallelism (the Mamba-2 layers"),
                         ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype fp8"),
                         ({"enable_lora": True}, "LoRA"),
                         ({"kv_offloading_size": 1.0}, "host KV tier")):  # fmt: skip
        refusal = hybrid_refusal(spec, base.replace(**knobs))
        assert refusal is not None and words in refusal and "granitemoehybrid" in refusal
        with pytest.raises(ValueError, match="hybrid Mamba-2"):
            hybrid_config(spec, base.replace(**knobs))
    assert hybrid_refusal(spec, base.replace(speculative_config='{"method": "ngram"}')) is None  # served
    from inflight.runtime.engine_core.served_facts import read_served_facts

    with pytest.raises(ValueError, match="tensor or pipeline parallelism"):
        read_served_facts(model_dir, _config(tensor_parallel_size=2))


def test_rotary_attention_dense_mlp_and_tied_embeddings(tmp_path: Path) -> None:
    """The other Granite 4 shapes: rotary attention, no experts (the shared MLP alone), tied
    embeddings, attention first; chunked, with preemption."""
    model_dir = make_granite_hybrid(tmp_path / "dense", seed=5, overrides={
        "position_embedding_type": "rope", "num_local_experts": 0, "tie_word_embeddings": True,
        "layer_types": ["attention", "mamba", "mamba", "attention"], "mamba_n_groups": 1})  # fmt: skip
    spec = spec_from_hf_config(load_hf_config(model_dir))
    assert spec.moe is None and spec.nope_layers == () and spec.tie_word_embeddings
    config = _config(num_kv_blocks=14, block_size=16, max_num_tokens=24, enable_chunked_context=True)
    assert_engine_matches_hf(model_dir, config, _prompts(model_dir, LENGTHS), MAX_TOKENS)


def test_attention_only_granite_4(tmp_path: Path) -> None:
    """Granite 4.0 Micro's shape (the same architecture with no Mamba-2 layer): no state pool,
    prefix caching left on, and transformers' tokens."""
    model_dir = make_granite_hybrid(tmp_path / "micro", seed=6, overrides={
        "num_hidden_layers": 2, "layer_types": ["attention", "attention"], "position_embedding_type": "rope"})
    spec = spec_from_hf_config(load_hf_config(model_dir))
    assert spec.mamba is None and spec.state_layers == ()
    config = _config(num_kv_blocks=64, max_num_tokens=24, enable_chunked_context=True, enable_prefix_caching=True)
    engine = assert_engine_matches_hf(model_dir, config, _prompts(model_dir, LENGTHS[:6]), MAX_TOKENS[:6])
    assert engine.kv.state_pool is None and engine.config.enable_prefix_caching


def test_the_kernels_follow_the_bundle() -> None:
    from types import SimpleNamespace

    from inflight.kernels import cpu_mamba2, mamba2_reference, triton_causal_conv, triton_mamba2
    from inflight.runtime.model.mamba2_layer import kernels_for

    assert kernels_for(SimpleNamespace(name="triton")) == (triton_causal_conv.causal_conv1d, triton_mamba2.ssd_scan)
    assert kernels_for(SimpleNamespace(name="cpu-native")) == (mamba2_reference.causal_conv1d, cpu_mamba2.ssd_scan)
    assert kernels_for(SimpleNamespace(name="torch")) == (mamba2_reference.causal_conv1d, mamba2_reference.ssd_scan)


# One layer of each kind for the interpreter (a Python loop per op): a Mamba-2 layer and a NoPE
# attention layer, both with the experts beside the shared MLP.
INTERPRETER_LAYERS = {"num_hidden_layers": 2, "layer_types": ["mamba", "attention"]}


@pytest.mark.slow
def test_triton_kernels_in_the_interpreter(tmp_path: Path) -> None:
    """The engine on the Triton kernels (conv and scan included; Triton's interpreter on the CPU,
    24-token budget, chunked prompts) gives transformers' tokens, on the fixture's shape cut to
    one layer of each kind (every kernel still runs)."""
    from tests.runtime.family_models import triton_tokens

    model_dir = make_granite_hybrid(tmp_path / "granite-hybrid-2", overrides=INTERPRETER_LAYERS)
    prompts, max_tokens = _prompts(model_dir, [1, 30, 70, 9]), [6, 8, 5, 7]
    got = triton_tokens(model_dir, prompts, max_tokens)
    assert got == [hf_greedy(model_dir, p, m) for p, m in zip(prompts, max_tokens, strict=True)]
