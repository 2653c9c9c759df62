"""GGUF K-quants (Q4_K, Q5_K, Q6_K): torch reference vs gguf's own dequantize (bit for bit),
native C kernels vs the reference, and an engine whose weights are K-quant blocks decoding as
its dequantized float twin.

gguf 0.19 dequantizes the K-quants but cannot quantize them, so the tests make blocks two
ways: random bytes with small finite fp16 scale fields (every bit pattern of the packed
fields, for exactness), and a small round-to-nearest quantizer here (``quantize_k``) whose
blocks gguf dequantizes back close to the float weight (realistic weights for the linear and
engine tests)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from inflight.kernels import cpu_kquant, cpu_quant, quant_reference
from inflight.kernels.quant_reference import BLOCK_BYTES, K_QUANTS, QK_K, QuantizedWeight

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

EPS = float(np.finfo(np.float32).eps)


def random_blocks(qtype: str, rows: int, in_features: int, seed: int = 0) -> np.ndarray:  # [rows, row_bytes]
    """Random bytes, with each fp16 scale field set to a small finite value of either sign."""
    rng = np.random.default_rng(seed)
    nb = in_features // QK_K
    blocks = rng.integers(0, 256, (rows, nb, BLOCK_BYTES[qtype]), dtype=np.uint8)
    halves = (rng.standard_normal((rows, nb, 2)) * 0.01).astype(np.float16)
    if qtype == "Q6_K":
        blocks[..., 208:210] = halves[..., :1].view(np.uint8)  # d
    else:
        blocks[..., 0:4] = halves.view(np.uint8)  # d, dmin
    return blocks.reshape(rows, -1)


def _q45_k_bytes(qtype: str, d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, m: np.ndarray,
                 q: np.ndarray) -> np.ndarray:
    """Pack Q4_K/Q5_K fields (d, dmin ``[..]`` fp16; sc, m ``[.., 8]``; q ``[.., 8, 32]``) into bytes."""
    sc, m, q = sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8)
    scales = np.concatenate([(sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
                             (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], axis=-1)  # [.., 12]
    nibbles = ((q[..., 0::2, :] & 15) | ((q[..., 1::2, :] & 15) << 4)).reshape(*q.shape[:-2], 128)
    parts = [d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), scales]
    if qtype == "Q5_K":
        bits = ((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[:, None]  # [.., 8, 32]
        parts.append(np.bitwise_or.reduce(bits, axis=-2))
    return np.concatenate([*parts, nibbles], axis=-1)


def _q6_k_bytes(d: np.ndarray, sc: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Pack Q6_K fields (d ``[..]`` fp16; sc ``[.., 16]`` int8; q ``[.., 256]`` in 0..63) into bytes."""
    q = q.astype(np.uint8).reshape(*q.shape[:-1], 2, 128)  # [.., half, 128]
    low = ((q[..., :64] & 15) | ((q[..., 64:] & 15) << 4)).reshape(*q.shape[:-2], 128)
    high = q.reshape(*q.shape[:-1], 4, 32) >> 4  # [.., half, quarter, 32]
    high = (high << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(axis=-2, dtype=np.uint8)
    return np.concatenate([low, high.reshape(*q.shape[:-2], 64), sc.astype(np.int8).view(np.uint8),
                           d[..., None].view(np.uint8)], axis=-1)


def quantize_k(qtype: str, w: np.ndarray) -> np.ndarray:  # [rows, in] float32 -> [rows, row_bytes] uint8
    """Round-to-nearest K-quant blocks of ``w`` (llama.cpp searches scales better; any valid block will do)."""
    rows = w.shape[0]
    if qtype == "Q6_K":
        g = w.reshape(rows, -1, 16, 16).astype(np.float32)
        scale = np.abs(g).max(-1) / 31  # [rows, nb, 16]
        d = (scale.max(-1) / 127).astype(np.float16)
        sc = np.round(scale / np.maximum(d.astype(np.float32), 1e-30)[..., None]).clip(0, 127)
        ds = d.astype(np.float32)[..., None] * sc
        q = np.round(g / np.where(ds == 0, 1, ds)[..., None]).clip(-32, 31) + 32
        return _q6_k_bytes(d, sc, q.reshape(rows, -1, QK_K)).reshape(rows, -1)
    qmax = 15 if qtype == "Q4_K" else 31
    g = w.reshape(rows, -1, 8, 32).astype(np.float32)
    low = np.minimum(g.min(-1), 0)
    scale, mins = (g.max(-1) - low) / qmax, -low  # [rows, nb, 8]
    d, dmin = (scale.max(-1) / 63).astype(np.float16), (mins.max(-1) / 63).astype(np.float16)
    sc = np.round(scale / np.maximum(d.astype(np.float32), 1e-30)[..., None]).clip(0, 63)
    m = np.round(mins / np.maximum(dmin.astype(np.float32), 1e-30)[..., None]).clip(0, 63)
    ds, dm = d.astype(np.float32)[..., None] * sc, dmin.astype(np.float32)[..., None] * m
    q = np.round((g + dm[..., None]) / np.where(ds == 0, 1, ds)[..., None]).clip(0, qmax)
    return _q45_k_bytes(qtype, d, dmin, sc, m, q).reshape(rows, -1)


def packed(qtype: str, blocks: np.ndarray, in_features: int) -> QuantizedWeight:
    return QuantizedWeight(qtype, torch.from_numpy(np.ascontiguousarray(blocks)), in_features)


def _exact(qtype: str, blocks: np.ndarray) -> torch.Tensor:  # [rows, in] float32, gguf's dequantize
    return torch.from_numpy(np.ascontiguousarray(gguf_dequantize(blocks, gguf.GGMLQuantizationType[qtype])))


def _native() -> None:
    lib, why = cpu_kquant.load_library()
    if lib is None:
        pytest.skip(f"no native K-quant build: {why}")


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_reference_dequantizes_exactly_as_gguf(qtype: str) -> None:
    blocks = random_blocks(qtype, 13, 3 * QK_K, seed=1)
    weight, exact = packed(qtype, blocks, 3 * QK_K), _exact(qtype, blocks)
    assert torch.isfinite(exact).all()
    assert torch.equal(quant_reference.dequantize(weight), exact)
    ids = torch.tensor([3, 0, 12, 3])
    assert torch.equal(quant_reference.quant_embedding(ids, weight), exact[ids])


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_quantizer_round_trips_through_gguf(qtype: str) -> None:
    w = np.random.default_rng(2).standard_normal((8, 2 * QK_K)).astype(np.float32) * 0.1
    back = gguf_dequantize(quantize_k(qtype, w), gguf.GGMLQuantizationType[qtype])
    bits = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6}[qtype]
    assert np.sqrt(np.mean((back - w) ** 2)) < 0.1 * 2.0 ** (2 - bits)  # about a quantization step


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_native_dequantize_is_bit_identical(qtype: str) -> None:
    _native()
    blocks = random_blocks(qtype, 301, 2 * QK_K, seed=3)  # n * k above the kernels' threading threshold
    weight, exact = packed(qtype, blocks, 2 * QK_K), _exact(qtype, blocks)
    assert torch.equal(cpu_quant.dequantize_rows(weight, 0, 301), exact)
    assert torch.equal(cpu_quant.dequantize_rows(weight, 17, 18), exact[17:18])
    ids = torch.tensor([7, 300, 0, 7])
    assert torch.equal(cpu_quant.quant_embedding(ids, weight), exact[ids])


def _assert_within_summation_error(got: torch.Tensor, expected: torch.Tensor, x: torch.Tensor,
                                   weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
    """The native kernel sums the reference's float32 products in another order, and takes
    Q4_K/Q5_K's offsets ``dmin * m`` out as ``dmin * m * sum(x sub-block)``. Each side is then
    within about ``k * eps * sum_i |x_i| (|w_i| + 2 |offset_i|)`` of the exact sum (reordering
    a k-term float32 sum, the regrouping), the size of a summation-order difference; a layout
    mistake is of the size of the output itself."""
    rows, nb = weight.shape[0], weight.in_features // QK_K
    dense = quant_reference.dequantize(weight)  # [out, in]
    offsets = torch.zeros_like(dense)
    if weight.qtype != "Q6_K":  # all q = 0 leaves each weight at -dmin * m
        zeroed = weight.blocks.reshape(rows, nb, -1).clone()
        zeroed[..., 16:] = 0
        offsets = quant_reference.dequantize_blocks(weight.qtype, zeroed.reshape(rows, -1), weight.in_features)
    terms = x.abs() @ (dense.abs() + 2 * offsets.abs()).t()  # [num_rows, out]
    bound = weight.in_features * EPS * (terms if bias is None else terms + bias.abs())
    worst = ((got - expected).abs() / bound).max().item()
    assert got.shape == expected.shape and worst <= 1.0, f"off by {worst:.3g} x the summation bound"


@pytest.mark.parametrize("qtype", K_QUANTS)
@pytest.mark.parametrize(("out_features", "in_features"), [(7, QK_K), (301, 3 * QK_K)])
def test_native_linear_matches_reference(qtype: str, out_features: int, in_features: int) -> None:
    _native()
    w = np.random.default_rng(out_features).standard_normal((out_features, in_features)).astype(np.float32) * 0.1
    weight = packed(qtype, quantize_k(qtype, w), in_features)
    gen = torch.Generator().manual_seed(in_features)
    bias = torch.randn(out_features, generator=gen)
    for num_rows in (1, 2, 3, 4, 5, 8, 9, 13):  # 1-4: the fused decode kernel; 5+: dequantized tiles x GEMM
        x = torch.randn(num_rows, in_features, generator=gen)
        for b in (None, bias):
            expected = quant_reference.quant_linear(x, weight, b)
            _assert_within_summation_error(cpu_quant.quant_linear(x, weight, b), expected, x, weight, b)


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_native_linear_handles_every_bit_pattern(qtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _native()
    monkeypatch.setattr(cpu_quant, "FEW_ROWS_K", 8)  # the fused kernel's later row groups too
    weight = packed(qtype, random_blocks(qtype, 33, 2 * QK_K, seed=4), 2 * QK_K)
    gen = torch.Generator().manual_seed(5)
    for num_rows in (1, 4, 6, 7, 12):
        x = torch.randn(num_rows, 2 * QK_K, generator=gen)
        expected = quant_reference.quant_linear(x, weight)
        _assert_within_summation_error(cpu_quant.quant_linear(x, weight), expected, x, weight, None)


def test_in_features_must_fill_super_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantizedWeight("Q4_K", torch.zeros(2, 72, dtype=torch.uint8), 128)
    with pytest.raises(ValueError, match=r"uint8 \[out, 420\]"):
        QuantizedWeight("Q6_K", torch.zeros(2, 210, dtype=torch.uint8), 512)
    assert QuantizedWeight("Q5_K", torch.zeros(2, 352, dtype=torch.uint8), 512).shape == (2, 512)


def test_engine_with_k_quant_weights_decodes_as_its_dequantized_twin(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFLIGHT_CPU_PREPACK", "0")  # both models' weights are replaced below: keep them float
    from inflight.kernels.dispatch import with_quantized_linear
    from inflight.runtime import LLM, SamplingParams
    from inflight.runtime.demo.model import make_demo_model
    from inflight.runtime.model.quantized import QuantizedEmbedding, quantize_model

    # tiny llama, widened so every in_features (hidden 256, intermediate 512, heads 4 x 64) fills super-blocks
    wide = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
    model_dir = make_demo_model(tmp_path / "llama", arch="llama", size="tiny", seed=5, config_overrides=wide)
    engine = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_num_sequences=4)
    quant, dense = LLM(str(model_dir), **engine), LLM(str(model_dir), **engine)
    model = quant.engine.runner.model
    summary = quantize_model(model, _k_weights(dense.engine.runner.model))
    assert summary.num_quantized == 4 * 2 + 1 and summary.kept_float == ()
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    quant.engine.runner.ops = with_quantized_linear(quant.engine.runner.ops)
    with torch.no_grad():  # the twin: float weights equal to the dequantized blocks
        for name, param in dense.engine.runner.model.named_parameters():
            blocks = model.get_submodule(name.rsplit(".", 1)[0]).__dict__.get("weight")
            if name.endswith(".weight") and isinstance(blocks, QuantizedWeight):
                param.copy_(quant_reference.dequantize(blocks))
    prompts = [list(range(3, 40)), [5, 9, 11], list(range(100, 112))]  # one prompt over 8 rows: the GEMM path
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ours = [o.token_ids for o in quant.generate(prompts, params)]
    assert ours == [o.token_ids for o in dense.generate(prompts, params)]


def _k_weights(model) -> dict[str, QuantizedWeight]:  # noqa: ANN001 - a CausalLM
    """transformers-named K-quant weights made from the model's own (fused) float weights."""
    spec = model.spec
    q, kv, inter = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size

    def pack(weight: torch.Tensor, qtype: str) -> QuantizedWeight:
        return packed(qtype, quantize_k(qtype, weight.detach().numpy()), weight.shape[1])

    out = {"model.embed_tokens.weight": pack(model.embed_tokens.weight, "Q6_K")}
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}"
        qkv, gate_up = layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight
        for name, rows in (("q", qkv[:q]), ("k", qkv[q:q + kv]), ("v", qkv[q + kv:])):
            out[f"{pre}.self_attn.{name}_proj.weight"] = pack(rows, "Q4_K")
        out[f"{pre}.mlp.gate_proj.weight"] = pack(gate_up[:inter], "Q4_K")
        out[f"{pre}.mlp.up_proj.weight"] = pack(gate_up[inter:], "Q4_K")
        out[f"{pre}.self_attn.o_proj.weight"] = pack(layer.self_attn.o_proj.weight, "Q5_K")
        out[f"{pre}.mlp.down_proj.weight"] = pack(layer.mlp.down_proj.weight, "Q6_K")
    return out
