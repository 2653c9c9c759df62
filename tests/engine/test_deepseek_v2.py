"""DeepSeek-V2 (``DeepseekV2ForCausalLM``: latent attention, DeepSeek-V2's softmax routing): greedy
outputs token-identical to transformers ``generate`` (float32, CPU) on tiny random models from
transformers' own ``DeepseekV2Config``.

DeepSeek-V2's shape in small (tests/runtime/family_models.py): DeepSeek-V3's tiny MLA widths, a dense
first layer, 8 routed experts in 4 groups picked group_limited_greedy (3 a token from the 2 groups
with the best top score), routed_scaling_factor 2.5, two shared experts, yarn rope with mscale. A
V2-Lite-like second model: no q_lora_rank (one q_proj), greedy top-k over all experts, the default
rope, attention biases. Mixed steps, chunked context (prompt chunks taking both MLA prefill paths:
the absorbed kernel and the expanded one), preemption, prefix hits, TP=2 equal to TP=1, the Triton
kernels in the interpreter, and what is refused.
"""

from __future__ import annotations

import pytest
import torch

from inflight.runtime.config import EngineConfig
from inflight.runtime.model.loader import load_hf_config
from inflight.runtime.model.spec import spec_from_hf_config
from tests.devices import on_devices
from tests.runtime.family_checks import (
    LENGTHS,
    MAX_TOKENS,
    check_preemption,
    check_prefix_caching,
    check_tp2_matches_tp1,
    check_triton_matches_hf,
    cpu_config,
    family_models,
    prompts_for,
)
from tests.runtime.hf_reference import assert_engine_matches_hf

MODELS = {
    "v2": {},
    "v2_lite": {"q_lora_rank": None, "topk_method": "greedy", "n_group": None, "topk_group": None,
                "routed_scaling_factor": 1.0, "attention_bias": True,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    # v2 at half the hidden width for the interpreter (a Python loop per op): the expert GEMMs still
    # loop over K and tile N, the latent widths are v2's
    "v2_interpreter": {"hidden_size": 128},
}


@pytest.fixture(scope="module")
def ds_models(tmp_path_factory: pytest.TempPathFactory):
    return family_models(tmp_path_factory, "deepseek_v2", MODELS)


def test_spec_reads_the_deepseek_v2_config(ds_models) -> None:
    spec = spec_from_hf_config(load_hf_config(ds_models("v2")))
    mla, moe = spec.mla, spec.moe
    assert spec.arch == "deepseek_v2" and mla is not None and mla.rope_interleave and mla.q_lora_rank == 96
    assert spec.num_kv_heads == 1 and spec.head_dim == 16
    assert spec.attn_scale == pytest.approx(48**-0.5 * (0.1 * 0.707 * torch.log(torch.tensor(8.0)).item() + 1) ** 2)
    assert moe is not None and moe.scoring == "softmax_grouped" and moe.sparse_layers == (1, 2)
    assert (moe.num_experts, moe.top_k, moe.num_groups, moe.topk_groups, moe.shared_intermediate_size) == (8, 3, 4, 2, 128)
    assert moe.routed_scaling_factor == 2.5 and not moe.renormalize and not moe.score_correction_bias
    lite = spec_from_hf_config(load_hf_config(ds_models("v2_lite")))
    assert lite.mla is not None and lite.mla.q_lora_rank is None and lite.qkv_bias
    assert lite.moe is not None and (lite.moe.num_groups, lite.moe.topk_groups) == (1, 1)


def test_moe_layer_freq_and_refusals(ds_models) -> None:
    """Expert layers from first_k_dense_replace on, every moe_layer_freq-th (DeepSeek's own code);
    a routing DeepSeek-V2 does not have, or groups that cannot hold the top-k, are refused."""
    config = load_hf_config(ds_models("v2"))
    config.num_hidden_layers, config.moe_layer_freq = 7, 2
    assert spec_from_hf_config(config).moe.sparse_layers == (2, 4, 6)
    config = load_hf_config(ds_models("v2"))
    config.topk_method = "noaux_tc"
    with pytest.raises(ValueError, match="unsupported topk_method 'noaux_tc'"):
        spec_from_hf_config(config)
    config = load_hf_config(ds_models("v2"))
    config.topk_group = 1
    config.num_experts_per_tok = 3
    with pytest.raises(ValueError, match="exceeds the experts in topk_group 1 groups"):
        spec_from_hf_config(config)


@pytest.mark.parametrize("name", ["v2", "v2_lite"])
def test_routing_matches_the_transformers_router(ds_models, name: str) -> None:
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    from inflight.runtime.model.moe import select_softmax_grouped_experts

    config = load_hf_config(ds_models(name))
    moe = spec_from_hf_config(config).moe
    assert moe is not None
    router = DeepseekV2TopkRouter(config)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, config.hidden_size, generator=gen) * 0.05)  # logits ~ N(0, 0.8)
        logits, want_weights, want_ids = router(torch.randn(256, config.hidden_size, generator=gen))
        weights, ids = select_softmax_grouped_experts(logits, moe)
    order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), want_weights.gather(1, want_order.indices))


@pytest.mark.parametrize("device", on_devices("cpu", "cuda"))
@pytest.mark.parametrize("name", ["v2", "v2_lite"])
def test_mixed_prefill_and_decode_steps(ds_models, name: str, device: str) -> None:
    model_dir = ds_models(name)
    config = EngineConfig(device=device, dtype="float32", num_kv_blocks=256, max_num_tokens=512)
    assert_engine_matches_hf(model_dir, config, prompts_for(model_dir, LENGTHS), MAX_TOKENS)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_chunked_context_takes_both_prefill_paths(ds_models, monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """Under a 13-token budget a prompt's first chunk expands (queries = context) and its later
    chunks, behind a longer cached context, absorb (the MLA prefill kernel: native C, or the torch
    reference): both give transformers' tokens."""
    from inflight.runtime.model import mla

    picked: list[bool] = []
    choose = mla.absorbs_prefill

    def record(*args) -> bool:
        picked.append(choose(*args))
        return picked[-1]

    monkeypatch.setattr(mla, "absorbs_prefill", record)
    model_dir = ds_models("v2")
    config = cpu_config(num_kv_blocks=256, max_num_tokens=13, enable_chunked_context=True, kernel_backend=backend)
    engine = assert_engine_matches_hf(model_dir, config, prompts_for(model_dir, LENGTHS), MAX_TOKENS)
    assert engine.runner.ops.name == {"cpu": "cpu-native", "torch": "torch"}[backend]
    assert any(picked) and not all(picked)


def test_preemption_under_a_small_cache(ds_models) -> None:
    check_preemption(ds_models("v2"))


def test_prefix_caching_shared_prefix(ds_models) -> None:
    """A prefix hit's suffix chunk reads latents another request wrote (the absorbed path)."""
    check_prefix_caching(ds_models("v2_lite"))


@pytest.mark.parametrize("name", ["v2", "v2_lite"])
def test_tensor_parallel_2_matches_1(ds_models, name: str) -> None:
    """Heads split across 2 ranks, experts' columns too (two shared experts: 64 columns a rank)."""

    def inspect(engine) -> None:
        layer = engine.runner.model.layers[1]
        assert layer.self_attn.num_heads == 2 and layer.mlp.shared_experts.down_proj.weight.shape == (256, 64)

    check_tp2_matches_tp1(ds_models(name), f"DeepSeek-V2 {name}", inspect=inspect)


def test_triton_kernels_in_the_interpreter(ds_models) -> None:
    """The Triton bundle (its MLA decode and prefill kernels, fused MoE, in Triton's interpreter on the
    CPU) gives transformers' tokens too."""
    check_triton_matches_hf(ds_models("v2_interpreter"))


def test_fp8_kv_cache_and_lora_are_refused(ds_models) -> None:
    """At start-up, from the served directory's facts, before any weight loads."""
    from inflight.runtime.engine_core.served_facts import read_served_facts

    model_dir = ds_models("v2_lite")
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' is not supported with multi-head latent"):
        read_served_facts(model_dir, cpu_config(kv_cache_dtype="fp8"))
    with pytest.raises(ValueError, match="enable_lora is not supported for DeepSeek-V3 or V2"):
        read_served_facts(model_dir, cpu_config(enable_lora=True))
