"""Swapping packed GGUF blocks into a loaded model: the engine with quantized weights decodes
exactly as the engine whose float weights are those blocks dequantized (tiny llama, no GGUF file)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from inflight.kernels.dispatch import with_quantized_linear
from inflight.kernels.quant_reference import QuantizedWeight, dequantize
from inflight.runtime import LLM, SamplingParams
from inflight.runtime.demo.model import make_demo_model
from inflight.runtime.model.quantized import (
    QuantizedEmbedding,
    quantize_model,
    resident_weight_bytes,
)

gguf = pytest.importorskip("gguf")
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_num_sequences=4)


def _pack(weight: torch.Tensor, qtype: str) -> QuantizedWeight:
    from gguf.quants import quantize

    blocks = quantize(weight.detach().numpy().astype(np.float32), gguf.GGMLQuantizationType[qtype])
    return QuantizedWeight(qtype, torch.from_numpy(np.ascontiguousarray(blocks)), weight.shape[1])


def _weights(model) -> dict[str, QuantizedWeight]:
    """transformers-named packed weights made from the model's own (fused) float weights."""
    spec = model.spec
    q, kv, inter = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    out = {"model.embed_tokens.weight": _pack(model.embed_tokens.weight, "Q8_0")}
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}"
        qkv, gate_up = layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight
        for name, rows, qtype in (("q", qkv[:q], "Q4_1"), ("k", qkv[q:q + kv], "Q4_1"),
                                  ("v", qkv[q + kv:], "Q4_1"), ("gate", gate_up[:inter], "Q4_0"),
                                  ("up", gate_up[inter:], "Q4_0")):
            group = "self_attn" if len(name) == 1 else "mlp"
            out[f"{pre}.{group}.{name}_proj.weight"] = _pack(rows, qtype)
        out[f"{pre}.self_attn.o_proj.weight"] = _pack(layer.self_attn.o_proj.weight, "Q8_0")
        out[f"{pre}.mlp.down_proj.weight"] = _pack(layer.mlp.down_proj.weight, "Q4_1")
    return out


def test_quantized_engine_decodes_as_its_dequantized_twin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFLIGHT_CPU_PREPACK", "0")  # both models' weights are replaced below: keep them float
    model_dir = make_demo_model(tmp_path / "llama", arch="llama", size="tiny", seed=3)
    quant, dense = LLM(str(model_dir), **ENGINE), LLM(str(model_dir), **ENGINE)
    model = quant.engine.runner.model
    before = resident_weight_bytes(model)
    summary = quantize_model(model, _weights(dense.engine.runner.model))
    assert summary.num_quantized == 4 * 2 + 1 and summary.kept_float == ()
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and resident_weight_bytes(model) < before / 3
    quant.engine.runner.ops = with_quantized_linear(quant.engine.runner.ops)
    copied = 0
    with torch.no_grad():  # the twin: float weights equal to the dequantized blocks
        for name, param in dense.engine.runner.model.named_parameters():
            packed = model.get_submodule(name.rsplit(".", 1)[0]).__dict__.get("weight")
            if name.endswith(".weight") and isinstance(packed, QuantizedWeight):
                param.copy_(dequantize(packed))
                copied += 1
    assert copied == 4 * 2 + 1  # the tied head shares the embedding's
    prompts = [list(range(3, 40)), [5, 9, 11], list(range(100, 112))]  # one prompt over 8 rows: the GEMM path
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ours = [o.token_ids for o in quant.generate(prompts, params)]
    twin = [o.token_ids for o in dense.generate(prompts, params)]
    assert ours == twin


def test_tensor_parallel_and_moe_models_are_refused() -> None:
    class Fake:
        tp = object()
        spec = type("S", (), {"moe": None})()

    with pytest.raises(ValueError, match="single-rank dense"):
        quantize_model(Fake(), {})
