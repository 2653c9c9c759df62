"""gpt-oss (``GptOssForCausalLM``): greedy outputs token-identical to transformers ``generate``
(float32, CPU), and its MXFP4 checkpoints dequantized exactly at load.

A tiny random model from transformers' own ``GptOssConfig`` (``demo_model --arch gpt_oss``):
a sliding (8-token window) layer and a full layer, yarn rope, q/k/v/o biases, attention sinks,
8 biased experts (2 per token) behind a biased router, and a SwiGLU clamp low enough that the
random activations cross it. Prompts up to 90 tokens and generations past the window, added a
few per step so steps mix prefills and decodes; then chunked context under a small token
budget, preemption under a small cache, and prefix caching; every run ends with no KV block
held. Tensor parallelism (TP=2: heads, their sinks and every expert's columns split; the down
biases added once) gives the TP=1 tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inflight.runtime.demo.model import make_demo_model
from inflight.runtime.model.loader import load_hf_config, load_model
from inflight.runtime.model.spec import spec_from_hf_config

from .family_checks import check_preemption, check_prefix_caching, check_tp2_matches_tp1, cpu_config, prompts_for
from .hf_reference import assert_engine_matches_hf

WINDOW = 8
OVERRIDES = {"sliding_window": WINDOW, "swiglu_limit": 1.0}
LENGTHS = [1, 3, 7, 15, 16, 17, 31, 33, 48, 5, 64, 2, 90, 24]
MAX_TOKENS = [12, 20, 8, 16, 24, 10, 14, 9, 22, 30, 11, 16, 13, 25]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_demo_model(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", seed=3, config_overrides=OVERRIDES)


def test_spec_reads_the_gpt_oss_config(model_dir: Path) -> None:
    spec = spec_from_hf_config(load_hf_config(model_dir))
    assert spec.arch == "gpt_oss" and spec.attn_sinks and spec.qkv_bias and spec.o_bias
    assert spec.sliding_window == WINDOW and spec.sliding_layers == (0,)
    assert spec.head_dim * spec.num_heads != spec.hidden_size  # head_dim decoupled
    moe = spec.moe
    assert moe is not None and moe.sparse_layers == (0, 1) and moe.topk_first and moe.router_bias
    assert moe.expert_bias and moe.swiglu_limit == 1.0 and moe.swiglu_alpha == pytest.approx(1.702)


def test_routing_matches_the_transformers_router() -> None:
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    from inflight.runtime.model.moe import select_experts

    router = GptOssTopKRouter(transformers.GptOssConfig(hidden_size=32, num_local_experts=16, num_experts_per_tok=4))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=gen))
        router.bias.copy_(torch.randn(16, generator=gen))
        x = torch.randn(40, 32, generator=gen)
        _, want_weights, want_ids = router(x)
        weights, ids = select_experts(torch.nn.functional.linear(x, router.weight, router.bias), 4, True, True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-6)


def test_mixed_steps_past_the_window(model_dir: Path) -> None:
    config = cpu_config(num_kv_blocks=256, max_num_tokens=512)
    assert_engine_matches_hf(model_dir, config, prompts_for(model_dir, LENGTHS), MAX_TOKENS)


def test_chunked_context_small_budget(model_dir: Path) -> None:
    config = cpu_config(num_kv_blocks=256, max_num_tokens=13, enable_chunked_context=True)
    assert_engine_matches_hf(model_dir, config, prompts_for(model_dir, LENGTHS), MAX_TOKENS)


def test_preemption_under_a_small_cache(model_dir: Path) -> None:
    check_preemption(model_dir, LENGTHS, MAX_TOKENS)


def test_prefix_caching_shared_prefix(model_dir: Path) -> None:
    check_prefix_caching(model_dir)


def _pack_mxfp4(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random FP4 codes and E8M0 scales for a ``[..., rows, cols]`` tensor: ``(blocks, scales,
    the values they stand for)``, the values computed here by hand (code -> E2M1 value)."""
    *lead, cols = shape
    codes = torch.randint(0, 16, (*lead, cols // 32, 32), generator=gen)
    exponents = torch.randint(120, 132, (*lead, cols // 32), generator=gen)
    sign = torch.where(codes >= 8, -1.0, 1.0)
    magnitude = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])[codes % 8]
    values = (sign * magnitude * torch.pow(2.0, exponents - 127.0)[..., None]).reshape(shape)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # low nibble first
    return blocks, exponents.to(torch.uint8), values


def test_mxfp4_checkpoint_dequantizes_to_the_packed_values(model_dir: Path, tmp_path: Path) -> None:
    """A copy of the model whose experts are MXFP4 (``*_blocks``/``*_scales``, as gpt-oss ships:
    ``[E, rows, in / 32, 16]``) loads to exactly the values the codes and scales stand for."""
    import shutil

    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(11)
    expected: dict[str, torch.Tensor] = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        float_layout = tensors.pop(name)  # [E, in, out]: the MXFP4 rows are its columns
        blocks, scales, values = _pack_mxfp4((float_layout.shape[0], float_layout.shape[2], float_layout.shape[1]), gen)
        tensors[f"{name}_blocks"] = blocks.reshape(*scales.shape, 16)
        tensors[f"{name}_scales"] = scales
        expected[name] = values.transpose(1, 2)  # back to transformers' [E, in, out]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(config))

    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    name = "model.layers.0.mlp.experts.gate_up_proj"  # transformers' own dequantizer agrees
    hf = convert_moe_packed_tensors(tensors[f"{name}_blocks"], tensors[f"{name}_scales"], dtype=torch.float32)
    assert torch.equal(hf, expected[name])

    model, _ = load_model(tmp_path, torch.float32, torch.device("cpu"))
    for name, want in expected.items():  # ours: gate rows then up rows [E, 2I, hidden]; down [E, hidden, I]
        layer = int(name.split(".")[2])
        experts = model.layers[layer].mlp.experts
        if name.endswith("gate_up_proj"):
            got = torch.empty_like(want)
            width = want.shape[2] // 2
            got[..., 0::2], got[..., 1::2] = (experts.gate_up_proj[:, :width].transpose(1, 2),
                                              experts.gate_up_proj[:, width:].transpose(1, 2))  # fmt: skip
        else:
            got = experts.down_proj.transpose(1, 2)
        assert torch.equal(got, want), name


def test_mxfp4_without_a_partner_is_refused(model_dir: Path, tmp_path: Path) -> None:
    import shutil

    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["model.layers.0.mlp.experts.down_proj_blocks"] = torch.zeros(8, 64, 2, 16, dtype=torch.uint8)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="without their blocks/scales partner: .*down_proj_blocks"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def test_tensor_parallel_2_matches_1(model_dir: Path) -> None:
    def sinks_split(engine) -> None:
        model = engine.runner.model
        assert model.layers[0].self_attn.sinks.shape == (model.spec.num_heads // 2,)

    check_tp2_matches_tp1(model_dir, "gpt-oss", LENGTHS, MAX_TOKENS, inspect=sinks_split)
