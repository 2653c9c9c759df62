"""DeepSeek-V3 (``DeepseekV3ForCausalLM``, multi-head latent attention): greedy outputs token-identical
to transformers ``generate`` (float32, CPU) on tiny random models from transformers' own
``DeepseekV3Config``.

DeepSeek-V3's shape in small (tests/runtime/family_models.py): hidden 256, 4 heads, q_lora_rank 96,
kv_lora_rank 64, qk_nope 32 + qk_rope 16, v_head_dim 32, yarn rope with mscale (factor 8), a dense
first layer, then 8 routed experts in 4 groups (3 a token from the best 2) and a shared expert. A
second model with no q_lora_rank (one q_proj), rotary features not interleaved, attention biases and
a yarn mscale that scales the rope table too. The paged cache holds the latent and the roped key
only; decode takes the absorbed path, prompt chunks the expanded one. Mixed steps, chunked context,
preemption, prefix hits, seeded sampling, the MTP layer skipped at load, TP=2 equal to TP=1, the
Triton kernels in the interpreter, and what is refused.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inflight.runtime.config import EngineConfig
from inflight.runtime.model.loader import load_hf_config, load_model
from inflight.runtime.model.spec import spec_from_hf_config
from tests.devices import on_devices
from tests.runtime.family_checks import LENGTHS, MAX_TOKENS, cpu_config, family_models, prompts_for
from tests.runtime.family_models import triton_tokens
from tests.runtime.hf_reference import assert_engine_matches_hf, hf_greedy, run_staggered

MODELS = {
    "v3": {},
    "v3_plain": {"q_lora_rank": None, "rope_interleave": False, "attention_bias": True,
                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 256}},
    "v3_dense": {"first_k_dense_replace": 3},  # no expert layer: the CPU's reference fused_moe reads the host
    # v3 at half the hidden width for the interpreter (a Python loop per op): the expert GEMMs still
    # loop over K and tile N, the latent widths are v3's
    "v3_interpreter": {"hidden_size": 128},
}


@pytest.fixture(scope="module")
def ds_models(tmp_path_factory: pytest.TempPathFactory):
    return family_models(tmp_path_factory, "deepseek_v3", MODELS)


_config = cpu_config
_prompts = prompts_for


def test_spec_reads_the_deepseek_v3_config(ds_models) -> None:
    spec = spec_from_hf_config(load_hf_config(ds_models("v3")))
    mla = spec.mla
    assert spec.arch == "deepseek_v3" and mla is not None and mla.rope_interleave
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (
        96, 64, 32, 16, 32)
    assert spec.num_kv_heads == 1 and spec.head_dim == 16  # one latent; the rope table's width
    assert spec.attn_scale == pytest.approx(48**-0.5 * (0.1 * 1.0 * torch.log(torch.tensor(8.0)).item() + 1) ** 2)
    moe = spec.moe
    assert moe is not None and moe.sparse_layers == (1, 2) and moe.scoring == "sigmoid"
    assert (moe.num_experts, moe.top_k, moe.num_groups, moe.topk_groups, moe.shared_intermediate_size) == (8, 3, 4, 2, 64)
    plain = spec_from_hf_config(load_hf_config(ds_models("v3_plain"))).mla
    assert plain is not None and plain.q_lora_rank is None and not plain.rope_interleave


def test_routing_matches_the_transformers_router(ds_models) -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from inflight.runtime.model.moe import select_grouped_experts

    config = load_hf_config(ds_models("v3"))
    moe = spec_from_hf_config(config).moe
    assert moe is not None
    router = DeepseekV3TopkRouter(config)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, config.hidden_size, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(8, generator=gen))
        logits, want_weights, want_ids = router(torch.randn(64, config.hidden_size, generator=gen))
        weights, ids = select_grouped_experts(logits, router.e_score_correction_bias, moe)
    order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), want_weights.gather(1, want_order.indices))


def test_latent_cache_is_the_paged_kv(ds_models, caplog: pytest.LogCaptureFixture) -> None:
    """Per layer and token the cache holds 64 latent + 16 rope values, 4x less than the 4 heads'
    K (32 + 16) and V (32) the same model would cache as plain attention; the block count is sized
    from those bytes and the start-up log says both."""
    from inflight.runtime.core.engine import LLMEngine

    with caplog.at_level(logging.INFO):
        engine = LLMEngine.from_model_dir(ds_models("v3"), _config(max_tokens_in_paged_kv_cache=16 * 40))
    runner = engine.runner
    latent, pe = runner.kv_caches[0]
    assert latent.shape[1:] == (16, 1, 64) and pe.shape[1:] == (16, 1, 16)
    assert runner.bytes_per_block == 3 * 16 * (64 + 16) * 4
    assert runner.num_kv_blocks == 40
    assert "MLA latent cache: 960 bytes a token" in caplog.text and "4.0x smaller" in caplog.text


@pytest.mark.parametrize("device", on_devices("cpu", "cuda"))
@pytest.mark.parametrize("name", ["v3", "v3_plain"])
def test_mixed_prefill_and_decode_steps(ds_models, name: str, device: str) -> None:
    """On CUDA: the Triton kernels (the MLA decode, fused MoE) and captured decode graphs."""
    model_dir = ds_models(name)
    config = EngineConfig(device=device, dtype="float32", num_kv_blocks=256, max_num_tokens=512)
    assert_engine_matches_hf(model_dir, config, _prompts(model_dir, LENGTHS), MAX_TOKENS)


def test_chunked_context_small_budget(ds_models) -> None:
    model_dir = ds_models("v3")
    config = _config(num_kv_blocks=256, max_num_tokens=13, enable_chunked_context=True)
    assert_engine_matches_hf(model_dir, config, _prompts(model_dir, LENGTHS), MAX_TOKENS)


def test_preemption_under_a_small_cache(ds_models) -> None:
    model_dir = ds_models("v3")
    config = _config(num_kv_blocks=12, block_size=16, max_num_tokens=256, enable_prefix_caching=False)
    engine = assert_engine_matches_hf(model_dir, config, _prompts(model_dir, LENGTHS), MAX_TOKENS)
    assert engine.stats().num_preemptions > 0


def test_prefix_caching_shared_prefix(ds_models) -> None:
    """Prefix hits reuse cached latents: a prompt's chunk expands K/V from blocks another wrote."""
    model_dir = ds_models("v3_plain")
    config = _config(num_kv_blocks=128, max_num_tokens=256, enable_prefix_caching=True)
    base = _prompts(model_dir, [50])[0]
    prompts = [base + t[1:] for t in _prompts(model_dir, [3, 9, 20, 1, 14, 30])] + [base]
    engine = assert_engine_matches_hf(model_dir, config, prompts, [10, 14, 8, 12, 16, 9, 11])
    assert engine.stats().prefix_cache_hits > 0


def test_seeded_sampling_is_independent_of_the_batch(ds_models) -> None:
    from inflight.runtime.llm import LLM
    from inflight.runtime.sampling_params import SamplingParams

    model_dir = ds_models("v3")
    prompts = _prompts(model_dir, [12, 30, 5, 21])
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    llm = LLM(model_dir, device="cpu", dtype="float32", num_kv_blocks=64, max_num_tokens=16,
              enable_chunked_context=True)  # fmt: skip
    try:
        alone = llm.generate([prompts[1]], seeded)[0].token_ids
        others = [SamplingParams(max_tokens=12, temperature=1.0) for _ in range(3)]
        batch = llm.generate(prompts, [others[0], seeded, others[1], others[2]])
        other_seed = llm.generate([prompts[1]], SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=7))
    finally:
        llm.close()
    assert batch[1].token_ids == alone and len(alone) == 16
    assert other_seed[0].token_ids != alone


def test_mtp_layer_is_skipped(ds_models, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """DeepSeek-V3 checkpoints carry num_nextn_predict_layers MTP layers past the last decoder
    layer: they load (skipped, said in the log), and the model's weights are the same as without."""
    model_dir = ds_models("v3")
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(model_dir / "model.safetensors"))
    extra = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in tensors.items() if ".layers.2." in k}
    save_file({**tensors, **extra, "model.layers.3.eh_proj.weight": torch.zeros(256, 512)},
              str(tmp_path / "model.safetensors"))
    plain, _ = load_model(model_dir, torch.float32, torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="inflight.model"):
        with_mtp, _ = load_model(tmp_path, torch.float32, torch.device("cpu"))
    assert len(with_mtp.layers) == 3
    assert f"skipped {len(extra) + 1} tensors" in caplog.text and "issue 53" in caplog.text
    for (name, a), (_, b) in zip(plain.state_dict().items(), with_mtp.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("name", ["v3", "v3_plain"])
def test_tensor_parallel_2_matches_1(ds_models, name: str) -> None:
    """Heads split across 2 ranks (q_b_proj / q_proj and kv_b_proj rows, o_proj columns); the latent
    cache is whole on each rank."""
    from inflight.runtime.core.engine import LLMEngine
    from inflight.runtime.llm import LLM
    from inflight.runtime.sampling_params import SamplingParams

    model_dir = ds_models(name)
    knobs = dict(num_kv_blocks=64, block_size=16, max_num_tokens=48, enable_chunked_context=True)
    prompts = _prompts(model_dir, LENGTHS[:10])
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in MAX_TOKENS[:10]]
    one = run_staggered(LLMEngine.from_model_dir(model_dir, EngineConfig(**knobs)), prompts, params)
    llm = LLM(model_dir, tensor_parallel_size=2, **knobs)
    try:
        two = run_staggered(llm.engine, prompts, params)
        assert llm.engine.stats().num_used_kv_blocks == 0, "KV blocks leaked"
        attn = llm.engine.runner.model.layers[0].self_attn
        assert attn.num_heads == 2 and attn.kv_b_proj.weight.shape == (2 * 64, 64)
        assert llm.engine.runner.kv_caches[0][0].shape[2:] == (1, 64)
    finally:
        llm.close()
    assert two == one, "DeepSeek-V3 TP=2 tokens differ from TP=1"


def test_decode_graphs_on_the_stand_in_equal_eager(ds_models) -> None:
    """Decode steps captured and replayed (the CPU stand-in for CUDA graphs, which fails on any host
    read; native CPU kernels: the C MLA decode) give the eager tokens. A model without expert layers:
    the CPU's fused_moe (the torch reference) reads expert counts on the host, so no MoE model
    captures here (Triton's does, on a GPU)."""
    from inflight.runtime.core.engine import LLMEngine
    from inflight.runtime.sampling_params import SamplingParams
    from inflight.runtime.worker.graph_backend import RecordingGraphBackend

    model_dir = ds_models("v3_dense")
    prompts = _prompts(model_dir, [3, 17, 9, 30, 1])

    def generate(backend: RecordingGraphBackend | None) -> dict[str, list[int]]:
        config = _config(kernel_backend="cpu", num_kv_blocks=64, max_num_sequences=8, max_num_tokens=64)
        engine = LLMEngine.from_model_dir(model_dir, config, graph_backend=backend)
        params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
        return run_staggered(engine, prompts, params)

    eager = generate(None)  # first: the kernels' one-time probes run outside any capture
    backend = RecordingGraphBackend()
    assert generate(backend) == eager
    assert backend.captured and backend.num_replays > 5


def test_host_tier_copies_the_latent_cache(ds_models) -> None:
    """The host KV tier stores and loads (latent, roped key) blocks as it does K/V: multi-turn chats
    on a small pool give the tokens they give without the tier, with prefix hits served from the host."""
    from tests.engine.test_host_tier_engine import _chats, _check_clean, _engine

    model_dir = ds_models("v3")
    plain = _engine(model_dir, None)
    try:
        want = _chats(plain)
    finally:
        plain.close()
    engine = _engine(model_dir, 0.001)
    try:
        got = _chats(engine)
        stats = engine.stats()
        _check_clean(engine)
    finally:
        engine.close()
    assert got == want
    assert stats.external_prefix_cache_hits > 0 and stats.kv_offload_loaded_blocks > 0


def test_triton_kernels_in_the_interpreter(ds_models) -> None:
    """The Triton bundle (its MLA decode kernel, in Triton's interpreter on the CPU) gives
    transformers' tokens too."""
    model_dir = ds_models("v3_interpreter")
    prompts, max_tokens = _prompts(model_dir, [17, 9, 5]), [8, 12, 14]  # as check_triton_matches_hf's
    got = triton_tokens(model_dir, prompts, max_tokens)
    for i, prompt in enumerate(prompts):
        assert got[i] == hf_greedy(model_dir, prompt, max_tokens[i]), f"prompt {i} diverged"


def test_fp8_kv_cache_and_lora_are_refused(ds_models) -> None:
    """At start-up, before any weight loads (the served directory's facts), and by the runner."""
    from inflight.runtime.core.engine import LLMEngine
    from inflight.runtime.engine_core.served_facts import read_served_facts

    model_dir = ds_models("v3")
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e5m2' is not supported with multi-head latent"):
        read_served_facts(model_dir, _config(kv_cache_dtype="fp8_e5m2"))
    with pytest.raises(ValueError, match="multi-head latent attention"):
        LLMEngine.from_model_dir(model_dir, _config(num_kv_blocks=16, kv_cache_dtype="fp8"))
    with pytest.raises(ValueError, match="enable_lora is not supported for DeepSeek-V3"):
        LLMEngine.from_model_dir(model_dir, _config(num_kv_blocks=16, enable_lora=True))


def test_fp8_block_quantized_checkpoint_is_refused(ds_models, tmp_path: Path) -> None:
    model_dir = ds_models("v3")
    raw = json.loads((model_dir / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="fp8 block-quantized"):
        spec_from_hf_config(load_hf_config(tmp_path))
