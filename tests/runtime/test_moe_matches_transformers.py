"""Mixture-of-experts models: greedy outputs token-identical to transformers ``generate`` (float32).

Tiny random Qwen3-MoE and Mixtral models made with transformers' own configs and
``save_pretrained`` (per-expert tensor names, as on the Hub): Qwen3-MoE with ``norm_topk_prob``
on (a dense first layer, then expert layers) and off (top-4 of 8, dense and expert layers
alternating by ``decoder_sparse_step``), and Mixtral (always renormalised). Sixteen prompts of
different lengths are added a few per step so steps mix prefills and decodes; then with chunked
context under a small token budget, a KV cache small enough to force preemption, and prefix
caching. The engine runs on the CPU and, on a GPU machine (``-m gpu``), on CUDA with the Triton
fused-MoE kernel; the reference is always transformers on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.demo.model import make_demo_model
from tests.devices import on_devices

from .hf_reference import assert_engine_matches_hf, prompts_of_lengths

LENGTHS = [1, 3, 7, 15, 16, 17, 31, 32, 33, 48, 5, 64, 2, 90, 24, 40]
MAX_TOKENS = [12, 20, 8, 16, 24, 10, 14, 18, 9, 22, 30, 11, 16, 13, 25, 17]
DEVICES = on_devices("cpu", "cuda")
# name: (demo arch, config overrides)
MODELS = {
    "qwen3_moe": ("qwen3_moe", {}),  # norm_topk_prob=True, layer 0 dense (mlp_only_layers), layer 1 experts
    "qwen3_moe_unnormalized": ("qwen3_moe", {
        "norm_topk_prob": False, "num_experts_per_tok": 4, "num_hidden_layers": 4,
        "decoder_sparse_step": 2, "mlp_only_layers": [],  # layers 1 and 3 experts, 0 and 2 dense
    }),
    "mixtral": ("mixtral", {}),
}


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory: pytest.TempPathFactory):
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            arch, overrides = MODELS[name]
            made[name] = make_demo_model(tmp_path_factory.mktemp(name), arch, seed=3, config_overrides=overrides)
        return made[name]

    return get


def _config(device: str, **knobs) -> EngineConfig:
    return EngineConfig(device=device, dtype="float32", **knobs)


def _prompts(model_dir: Path, lengths: list[int]) -> list[list[int]]:
    from transformers import AutoTokenizer

    return prompts_of_lengths(AutoTokenizer.from_pretrained(str(model_dir)), lengths)


@pytest.mark.parametrize(("family", "renormalize"), [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)])
def test_routing_matches_the_transformers_router(family: str, renormalize: bool) -> None:
    import torch
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from inflight.runtime.model.moe import select_experts

    if family == "mixtral":
        router = MixtralTopKRouter(transformers.MixtralConfig(hidden_size=32, num_local_experts=16, num_experts_per_tok=4))
    else:
        router = Qwen3MoeTopKRouter(transformers.Qwen3MoeConfig(
            hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=renormalize))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=gen))
        x = torch.randn(40, 32, generator=gen)
        _, want_weights, want_ids = router(x)
        weights, ids = select_experts(x @ router.weight.T, 4, renormalize)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights.float(), atol=1e-6, rtol=1e-6)
    assert torch.allclose(weights.sum(-1), torch.ones(40)) == renormalize


def test_layers_are_what_the_config_says(moe_models) -> None:
    from inflight.runtime.model.moe import SparseMoe

    engine = LLMEngine.from_model_dir(moe_models("qwen3_moe_unnormalized"), _config("cpu", num_kv_blocks=8))
    model = engine.runner.model
    assert [isinstance(layer.mlp, SparseMoe) for layer in model.layers] == [False, True, False, True]
    assert model.spec.moe is not None and not model.spec.moe.renormalize and model.spec.moe.top_k == 4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(MODELS))
def test_mixed_prefill_and_decode_steps(moe_models, name: str, device: str) -> None:
    model_dir = moe_models(name)
    config = _config(device, num_kv_blocks=256, max_num_tokens=512)
    assert_engine_matches_hf(model_dir, config, _prompts(model_dir, LENGTHS), MAX_TOKENS)


@pytest.mark.parametrize("name", list(MODELS))
def test_chunked_context_small_budget(moe_models, name: str) -> None:
    model_dir = moe_models(name)
    config = _config("cpu", num_kv_blocks=256, max_num_tokens=24, enable_chunked_context=True)
    assert_engine_matches_hf(model_dir, config, _prompts(model_dir, LENGTHS), MAX_TOKENS)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_preemption_under_a_small_cache(moe_models, name: str) -> None:
    model_dir = moe_models(name)
    config = _config("cpu", num_kv_blocks=12, block_size=16, max_num_tokens=256, enable_prefix_caching=False)
    engine = assert_engine_matches_hf(model_dir, config, _prompts(model_dir, LENGTHS), MAX_TOKENS)
    assert engine.stats().num_preemptions > 0


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_prefix_caching_shared_prefix(moe_models, name: str) -> None:
    model_dir = moe_models(name)
    config = _config("cpu", num_kv_blocks=128, max_num_tokens=256, enable_prefix_caching=True)
    base = _prompts(model_dir, [50])[0]
    prompts = [base + t[1:] for t in _prompts(model_dir, [3, 9, 20, 1, 14, 30, 6, 11])] + [base]
    engine = assert_engine_matches_hf(model_dir, config, prompts, [10, 14, 8, 12, 16, 9, 11, 13, 10])
    assert engine.stats().prefix_cache_hits > 0
