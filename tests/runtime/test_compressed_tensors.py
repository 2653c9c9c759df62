"""compressed-tensors pack-quantized checkpoints, written by the package's own API from a tiny
random llama: loaded packed, read exactly as the package decompresses them, and served with
the same greedy tokens as an engine holding the dequantized weights in float."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from inflight.kernels.dispatch import packed_linear_backend
from inflight.kernels.intq_reference import IntQuantWeight, dequantize
from inflight.runtime import LLM, SamplingParams
from inflight.runtime.demo.model import make_demo_model
from inflight.runtime.model import compressed_tensors as ct
from inflight.runtime.model.quantized import summarize_packed

pytest.importorskip("compressed_tensors")
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_num_sequences=4)
SCHEMES = {  # name -> (weights args, scale dtype, max shard size)
    "int4-g32-sym": (dict(num_bits=4, symmetric=True, strategy="group", group_size=32), torch.float32, None),
    "int8-channel": (dict(num_bits=8, symmetric=True, strategy="channel"), torch.float16, "100KB"),  # sharded
    "int4-g32-asym": (dict(num_bits=4, symmetric=False, strategy="group", group_size=32), torch.bfloat16, None),
}


def write_pack_quantized(src: Path, dst: Path, weights: dict, scale_dtype: torch.dtype,
                         max_shard_size: str | None = None) -> Path:
    """``src`` quantized by compressed-tensors (min/max scales, lm_head ignored) into ``dst``."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(type="int", **weights)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head"])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        w = module.weight.detach()
        group = args.group_size or w.shape[1]
        grouped = w.unflatten(-1, (w.shape[1] // group, group))
        scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        module.weight_scale = torch.nn.Parameter(scale.to(scale_dtype), requires_grad=False)
        module.weight_zero_point.data.copy_(zero_point)
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(str(dst), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    compressor.update_config(str(dst))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ct")
    src = make_demo_model(root / "llama", arch="llama", size="tiny", seed=3)
    return {"float": src} | {name: write_pack_quantized(src, root / name, *spec) for name, spec in SCHEMES.items()}


def test_checkpoint_tensors_read_as_the_package_decompresses_them(checkpoints: dict[str, Path]) -> None:
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    for name in SCHEMES:
        config = json.loads((checkpoints[name] / "config.json").read_text())
        scheme = ct.detect(config)
        assert scheme is not None and scheme.ignore == ("lm_head",)
        group = config["quantization_config"]["config_groups"]["group_0"]
        package_scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
        reader = ct.CheckpointReader(ct._tensor_files(checkpoints[name]))
        for module in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"):
            args = scheme.args_for(module)
            assert args is not None
            ours = ct.read_packed_weight(reader, module, args, torch.device("cpu"))
            state = {s: reader.get(f"{module}.{s}") for s in ct.PACKED_SUFFIXES}
            state = {k: v for k, v in state.items() if v is not None}
            expected = PackedQuantizationCompressor.decompress(state, package_scheme)["weight"]
            assert torch.equal(dequantize(ours), expected), (name, module)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_quantized_engine_decodes_as_its_dequantized_twin(name: str, checkpoints: dict[str, Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFLIGHT_CPU_PREPACK", "0")  # the twin's weights are overwritten below: keep them float
    quant, twin = LLM(str(checkpoints[name]), **ENGINE), LLM(str(checkpoints["float"]), **ENGINE)
    runner = quant.engine.runner
    summary = summarize_packed(runner.model)
    assert runner.quantization.method == "compressed-tensors" and runner.ops.name.endswith("+packed")
    assert summary.num_quantized == 2 * 4 and summary.kept_float == ("lm_head",)
    weight = runner.model.layers[0].self_attn.qkv_proj.weight
    assert isinstance(weight, IntQuantWeight) and packed_linear_backend(runner.ops.name, weight, runner.device) == "cpu"
    assert summary.quantized_bytes < summary.float32_bytes / 3
    copied = 0
    with torch.no_grad():  # the twin: float weights equal to the dequantized packed ones
        for param_name, param in twin.engine.runner.model.named_parameters():
            packed = runner.model.get_submodule(param_name.rsplit(".", 1)[0]).__dict__.get("weight")
            if param_name.endswith(".weight") and isinstance(packed, IntQuantWeight):
                param.copy_(dequantize(packed))
                copied += 1
    assert copied == 2 * 4
    prompts = [list(range(3, 40)), [5, 9, 11], list(range(100, 112))]  # one prompt over 8 rows: the GEMM path
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ours = [o.token_ids for o in quant.generate(prompts, params)]
    assert ours == [o.token_ids for o in twin.generate(prompts, params)]


def _config(**changes: object) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
               "actorder": None}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": None}
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": group},
          "ignore": ["lm_head"]}
    for key, value in changes.items():
        target = weights if key in weights else group if key in group else qc
        target[key] = value
    return {"quantization_config": qc}


@pytest.mark.parametrize("changes", [
    dict(quant_method="gptq"), dict(quant_method="awq"), dict(quant_method="bitsandbytes"),
    dict(format="float-quantized"), dict(format="naive-quantized"),
    dict(input_activations={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}),
    dict(type="float", num_bits=8), dict(num_bits=2), dict(strategy="tensor"), dict(strategy="block"),
    dict(actorder="group"), dict(kv_cache_scheme={"num_bits": 8, "type": "int"}),
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items())[:40])
def test_unsupported_quantization_is_refused_naming_what_is(changes: dict) -> None:
    with pytest.raises(ValueError, match="pack-quantized format with int weights of 4 or 8 bits"):
        ct.detect(_config(**changes))


def test_supported_configs_parse() -> None:
    assert ct.detect({}) is None
    scheme = ct.detect(_config())
    assert scheme is not None and scheme.args_for("model.layers.0.mlp.up_proj") == ct.WeightArgs(4, 128, True, ("Linear",))
    assert scheme.args_for("lm_head") is None
    # an fp8 kv_cache_scheme: the checkpoint's k_scale/v_scale tensors serve --kv-cache-dtype fp8
    assert ct.detect(_config(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"})) is not None
    channel = ct.detect(_config(strategy="channel", group_size=None, num_bits=8, symmetric=False, actorder="weight"))
    assert channel is not None and channel.groups[0] == ct.WeightArgs(8, None, False, ("Linear",))


def test_tensor_parallel_and_expert_weights_are_refused() -> None:
    class Fake:
        tp = None
        spec = type("S", (), {"tie_word_embeddings": False})()

    with pytest.raises(ValueError, match="mixture-of-experts"):
        ct._check_model(Fake(), ["model.layers.0.mlp.experts.0.up_proj"])
    Fake.tp = object()
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        ct._check_model(Fake(), [])
