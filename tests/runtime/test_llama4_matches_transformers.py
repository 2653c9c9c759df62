"""Llama 4 text (``Llama4ForCausalLM``): greedy outputs token-identical to transformers ``generate``
(float32, CPU) on tiny random models from transformers' own ``Llama4TextConfig``.

Llama 4's layer pattern in small: three RoPE layers with chunked attention (16-token chunks: a
query sees only the keys of its own chunk) and an L2 q/k norm, then a NoPE layer with attention
temperature tuning (``floor_scale`` 4 so the scale moves within the prompts); expert layers every
second layer (4 experts, top-1 by sigmoid router score applied to the expert's input, plus a
shared expert) and dense layers ``intermediate_size_mlp`` wide between. Prompts to 90 tokens and
generations across several chunks, mixed steps, chunked context under small token budgets (prompt
chunks that cross chunk boundaries), KV blocks of 8 and 16 tokens, preemption, prefix caching,
the native CPU kernels, the torch reference and the Triton kernels (interpreter), and TP=2 equal
to TP=1. A copy of the model whose chunks are longer than any sequence gives other
tokens (the chunking is what makes the tokens equal).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from inflight.runtime.model.batch import AttentionMetadata
from inflight.runtime.model.llama4 import chunked_metadata, halves_from_pairs
from inflight.runtime.model.loader import load_hf_config
from inflight.runtime.model.spec import spec_from_hf_config

from .family_checks import (
    LENGTHS,
    MAX_TOKENS,
    check_preemption,
    check_prefix_caching,
    check_tp2_matches_tp1,
    check_triton_matches_hf,
    cpu_config,
    prompts_for,
)
from .family_models import make_family_model
from .hf_reference import assert_engine_matches_hf, hf_greedy


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_family_model(tmp_path_factory.mktemp("llama4"), "llama4_text")


def test_spec_reads_the_llama4_config(model_dir: Path) -> None:
    spec = spec_from_hf_config(load_hf_config(model_dir))
    assert spec.arch == "llama4_text" and spec.attention_chunk_size == 16
    assert spec.chunked_layers == (0, 1, 2) and spec.nope_layers == (3,)
    assert spec.l2_qk_norm and spec.attn_temperature == (4.0, 0.5) and not spec.qk_norm
    assert spec.intermediate_size == 128  # intermediate_size_mlp: the dense layers
    moe = spec.moe
    assert moe is not None and moe.sparse_layers == (1, 3) and moe.scoring == "sigmoid_input"
    assert moe.intermediate_size == 64 and moe.shared_intermediate_size == 64 and moe.top_k == 1


def test_vision_checkpoint_and_top_k_above_1_are_refused(model_dir: Path) -> None:
    import transformers

    with pytest.raises(ValueError, match="vision-language checkpoint is not served"):
        spec_from_hf_config(transformers.Llama4Config(architectures=["Llama4ForConditionalGeneration"]))
    with pytest.raises(ValueError, match="Llama 4's multimodal config"):
        spec_from_hf_config(transformers.Llama4Config(architectures=["Llama4ForCausalLM"]))
    config = load_hf_config(model_dir)
    config.num_experts_per_tok = 2
    with pytest.raises(ValueError, match="num_experts_per_tok 2 is not supported"):
        spec_from_hf_config(config)


def test_halves_from_pairs_turns_interleaved_rotary_into_rotate_half() -> None:
    """Rotating interleaved pairs (Llama 4) of x equals rotating halves (our kernels) of x permuted."""
    from inflight.kernels.reference import rotary_embedding

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, 8, generator=gen)  # [tokens, heads, head_dim]
    angles = torch.randn(5, 4, generator=gen)
    pairs = torch.view_as_real(torch.view_as_complex(x.reshape(5, 2, 4, 2)) * torch.polar(torch.ones_like(angles), angles)[:, None]).flatten(2)  # noqa: E501
    table = torch.cat([angles.cos(), angles.sin()], dim=-1)  # [5 positions, 8]
    permuted = halves_from_pairs(x.reshape(5, 16).T, 8).T.reshape(5, 2, 8)  # features are rows of the weight
    halves, _ = rotary_embedding(torch.arange(5), permuted, permuted, table)
    torch.testing.assert_close(halves, halves_from_pairs(pairs.reshape(5, 16).T, 8).T.reshape(5, 2, 8))


def test_chunked_metadata_cuts_each_query_to_its_chunk() -> None:
    """Decode rows start at their chunk's first block; a prompt chunk crossing chunk boundaries is
    split into pieces, each a sequence whose keys start at its chunk."""
    table = torch.arange(10, dtype=torch.int32).reshape(1, 10).repeat(2, 1)  # block b holds positions 4b..4b+3
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(13, dtype=torch.int64), num_decode_tokens=2,
        decode_block_tables=table, decode_context_lens=torch.tensor([8, 9], dtype=torch.int32),
        prefill_block_tables=table[:1] + 100, prefill_query_start_loc=torch.tensor([0, 11], dtype=torch.int32),
        prefill_context_lens=torch.tensor([20], dtype=torch.int32), num_prefills=1,
    )  # fmt: skip
    out = chunked_metadata(meta, chunk_size=8, block_size=4)
    assert out.decode_context_lens.tolist() == [8, 1]  # query at 7: chunk 0..7; query at 8: chunk 8..
    assert out.decode_block_tables[:, 0].tolist() == [0, 2]
    # queries at positions 9..19 (11 of them): pieces 9..15 and 16..19
    assert out.num_prefills == 2 and out.prefill_query_start_loc.tolist() == [0, 7, 11]
    assert out.prefill_context_lens.tolist() == [8, 4] and out.prefill_block_tables[:, 0].tolist() == [102, 104]
    with pytest.raises(ValueError, match="not a multiple of the KV block size 16"):
        chunked_metadata(meta, chunk_size=8, block_size=16)


def test_mixed_steps_across_chunks(model_dir: Path) -> None:
    config = cpu_config(num_kv_blocks=256, max_num_tokens=512)
    assert_engine_matches_hf(model_dir, config, prompts_for(model_dir, LENGTHS), MAX_TOKENS)


def test_torch_reference_kernels(model_dir: Path) -> None:
    """The torch reference kernels (the specification) under the rewritten metadata too."""
    config = cpu_config(num_kv_blocks=256, max_num_tokens=24, enable_chunked_context=True, kernel_backend="torch")
    assert_engine_matches_hf(model_dir, config, prompts_for(model_dir, LENGTHS[:8]), MAX_TOKENS[:8])


def test_triton_kernels_in_the_interpreter(model_dir: Path) -> None:
    """The Triton kernels under the rewritten metadata: prompt chunks crossing chunks."""
    check_triton_matches_hf(model_dir, (17, 40, 5), (8, 8, 20))


@pytest.mark.parametrize(("budget", "block_size"), [(13, 16), (24, 8)])
def test_chunked_context_small_budget(model_dir: Path, budget: int, block_size: int) -> None:
    config = cpu_config(num_kv_blocks=512, block_size=block_size, max_num_tokens=budget, enable_chunked_context=True)
    assert_engine_matches_hf(model_dir, config, prompts_for(model_dir, LENGTHS), MAX_TOKENS)


def test_preemption_under_a_small_cache(model_dir: Path) -> None:
    check_preemption(model_dir)


def test_prefix_caching_shared_prefix(model_dir: Path) -> None:
    check_prefix_caching(model_dir)


def test_the_chunking_decides_the_tokens(model_dir: Path, tmp_path: Path) -> None:
    """The same weights with chunks longer than any sequence (transformers' reference) give other
    tokens: the fixture exercises the chunk mask, and the tests above would catch a missing one."""
    for f in model_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["attention_chunk_size"] = 4096
    (tmp_path / "config.json").write_text(json.dumps(config))
    prompts = prompts_for(model_dir, [48, 64, 90])
    assert any(hf_greedy(model_dir, p, 12) != hf_greedy(tmp_path, p, 12) for p in prompts)


def test_tensor_parallel_2_matches_1(model_dir: Path) -> None:
    check_tp2_matches_tp1(model_dir, "Llama 4")


def test_a_block_size_that_splits_a_chunk_is_refused_at_startup(model_dir: Path) -> None:
    from inflight.runtime.core.engine import LLMEngine

    with pytest.raises(ValueError, match="attention_chunk_size 16 must be a multiple of the KV block size 32"):
        LLMEngine.from_model_dir(model_dir, cpu_config(num_kv_blocks=16, block_size=32))
