"""GLM-4.5/4.6 (``Glm4MoeForCausalLM``): greedy outputs token-identical to transformers ``generate``
(float32, CPU) on tiny random models from transformers' own ``Glm4MoeConfig``.

GLM-4.5's shape in small: qkv biases, q/k norms, rotary over half of each head, a dense first
layer (``first_k_dense_replace``), then expert layers: 8 experts in 4 groups, 3 a token from the
best 2 groups by sigmoid score plus the correction bias (spread so it matters), renormalised and
scaled by ``routed_scaling_factor``, and a shared expert. A second model without q/k norms, with
unnormalised weights and one group. Mixed steps, chunked context, preemption, prefix caching, an
extra multi-token-prediction layer skipped at load, and TP=2 (the shared expert's columns split
like the experts') equal to TP=1.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.model.loader import load_hf_config, load_model
from inflight.runtime.model.spec import spec_from_hf_config

from .family_checks import (
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
from .hf_reference import assert_engine_matches_hf

MODELS = {
    "glm45": {},
    "glm45_plain": {"use_qk_norm": False, "norm_topk_prob": False, "n_group": 1, "topk_group": 1,
                    "routed_scaling_factor": 1.0, "attention_bias": False},
}


@pytest.fixture(scope="module")
def glm_models(tmp_path_factory: pytest.TempPathFactory):
    return family_models(tmp_path_factory, "glm4_moe", MODELS)


def test_spec_reads_the_glm4_moe_config(glm_models) -> None:
    spec = spec_from_hf_config(load_hf_config(glm_models("glm45")))
    assert spec.arch == "glm4_moe" and spec.qkv_bias and not spec.o_bias and spec.qk_norm
    assert spec.rotary_dim == spec.head_dim // 2
    moe = spec.moe
    assert moe is not None and moe.sparse_layers == (1, 2) and moe.scoring == "sigmoid"
    assert (moe.num_experts, moe.top_k, moe.num_groups, moe.topk_groups) == (8, 3, 4, 2)
    assert moe.routed_scaling_factor == 2.5 and moe.renormalize and moe.shared_intermediate_size == 32


@pytest.mark.parametrize("name", list(MODELS))
def test_routing_matches_the_transformers_router(glm_models, name: str) -> None:
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    from inflight.runtime.model.moe import select_grouped_experts

    config = load_hf_config(glm_models(name))
    moe = spec_from_hf_config(config).moe
    assert moe is not None
    router = Glm4MoeTopkRouter(config)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, config.hidden_size, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(8, generator=gen))
        x = torch.randn(64, config.hidden_size, generator=gen)
        logits, want_weights, want_ids = router(x)
        weights, ids = select_grouped_experts(logits, router.e_score_correction_bias, moe)
    order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)  # both pick unsorted
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), want_weights.gather(1, want_order.indices))


def test_group_limit_excludes_the_other_groups() -> None:
    """With 4 groups of 2 and 1 group kept, every pick lies in one group even when a better
    expert sits in another group whose partner is poor."""
    from inflight.runtime.model.moe import select_grouped_experts
    from inflight.runtime.model.spec import MoeSpec

    moe = MoeSpec(8, 2, 4, True, (0,), scoring="sigmoid", num_groups=4, topk_groups=1)
    logits = torch.tensor([[5.0, -5.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0]])  # group 0: 5 + -5; group 1: 2 + 2
    _, ids = select_grouped_experts(logits, torch.zeros(8), moe)
    assert sorted(ids[0].tolist()) == [2, 3]


@pytest.mark.parametrize("name", list(MODELS))
def test_mixed_prefill_and_decode_steps(glm_models, name: str) -> None:
    model_dir = glm_models(name)
    config = cpu_config(num_kv_blocks=256, max_num_tokens=512)
    assert_engine_matches_hf(model_dir, config, prompts_for(model_dir, LENGTHS), MAX_TOKENS)


def test_chunked_context_small_budget(glm_models) -> None:
    model_dir = glm_models("glm45")
    config = cpu_config(num_kv_blocks=256, max_num_tokens=13, enable_chunked_context=True)
    assert_engine_matches_hf(model_dir, config, prompts_for(model_dir, LENGTHS), MAX_TOKENS)


def test_preemption_under_a_small_cache(glm_models) -> None:
    check_preemption(glm_models("glm45"))


def test_prefix_caching_shared_prefix(glm_models) -> None:
    check_prefix_caching(glm_models("glm45"))


def test_param2_moe_config_is_served_as_glm4_moe(glm_models, tmp_path: Path) -> None:
    """Param2-MoE (``model_type`` ``param2moe``, transformers 5.25+) is GLM-4.5's model under
    another config class whose defaults differ: rotary over the whole head and a rope theta of
    500k. Its checkpoints say ``Glm4MoeForCausalLM``; served as that, with transformers' tokens."""
    import json
    import shutil

    from transformers.models.auto import configuration_auto

    if "param2moe" not in configuration_auto.CONFIG_MAPPING_NAMES:
        pytest.skip("this transformers has no param2moe")
    for f in glm_models("glm45").iterdir():
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="param2moe", rope_parameters={"rope_type": "default"})  # its defaults decide
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = spec_from_hf_config(load_hf_config(tmp_path))
    assert spec.arch == "glm4_moe" and spec.rotary_dim is None  # the whole head, not GLM-4.5's half
    config = cpu_config(num_kv_blocks=256, max_num_tokens=512)
    assert_engine_matches_hf(tmp_path, config, prompts_for(tmp_path, LENGTHS), MAX_TOKENS)


def test_mtp_layer_is_skipped(glm_models, tmp_path: Path) -> None:
    """GLM-4.5 checkpoints carry a multi-token-prediction layer past the last decoder layer: it loads
    (ignored), and the model's weights are the same as without it."""
    import shutil

    model_dir = glm_models("glm45")
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(model_dir / "model.safetensors"))
    extra = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in tensors.items() if ".layers.2." in k}
    save_file({**tensors, **extra, "model.layers.3.eh_proj.weight": torch.zeros(64, 128)},
              str(tmp_path / "model.safetensors"))
    plain, _ = load_model(model_dir, torch.float32, torch.device("cpu"))
    with_mtp, _ = load_model(tmp_path, torch.float32, torch.device("cpu"))
    assert len(with_mtp.layers) == 3
    for (name, a), (_, b) in zip(plain.state_dict().items(), with_mtp.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_tensor_parallel_2_matches_1(glm_models) -> None:
    def shared_expert_split(engine: LLMEngine) -> None:
        shared = engine.runner.model.layers[1].mlp.shared_experts
        assert shared.down_proj.weight.shape == (64, 16)  # half of the 32 shared columns

    check_tp2_matches_tp1(glm_models("glm45"), "GLM-4.5", inspect=shared_expert_split)


def test_triton_kernels_in_the_interpreter(glm_models) -> None:
    """The Triton kernels (Triton's interpreter on the CPU) give transformers' tokens too."""
    check_triton_matches_hf(glm_models("glm45"))
