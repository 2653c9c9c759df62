"""GGUF conversion without a download: a demo model written as GGUF the way llama.cpp writes one.

The test writes a seeded demo Llama as a GGUF file with the ``gguf`` package's writer
(q/k rows permuted as llama.cpp's converter does, tokenizer as tokens + merges + types, chat
template), converts it back with ``gguf_convert`` and checks: float32 weights bit-identical,
the same tokenization and chat template, the same greedy tokens from our engine; a Q8_0 file
dequantizes to within the quantization step; an unsupported architecture or tensor type is
refused naming what is supported; processes converting one file at once convert it once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from inflight.runtime import LLM, SamplingParams
from inflight.runtime.demo.model import make_demo_model
from inflight.runtime.model.float_export import float_checkpoint_dir
from inflight.runtime.model.gguf_convert import check_supported, convert_gguf, unpermute_rows
from inflight.runtime.model.gguf_source import model_dir_problem, resolve_model_dir
from inflight.runtime.model.loader import checkpoint_tensors
from inflight.runtime.tokenizer import load_tokenizer

_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
          "post_attention_layernorm": "ffn_norm"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permutation of q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf in globals_:
        return globals_[hf]
    _, _, layer, *rest = hf.split(".")
    return f"blk.{layer}.{_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"


def write_gguf(model_dir: Path, path: Path, qtype: gguf.GGMLQuantizationType, arch: str = "llama") -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {a["id"] for a in tok["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i in special else 1 for _, i in vocab])
    w.add_token_merges([" ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(True)
    w.add_chat_template(load_tokenizer(model_dir).chat_template)
    for name, t in load_file(str(model_dir / "model.safetensors")).items():
        arr = t.numpy()
        if ".q_proj." in name:
            arr = llama_cpp_permute(arr, cfg["num_attention_heads"])
        elif ".k_proj." in name:
            arr = llama_cpp_permute(arr, cfg["num_key_value_heads"])
        if arr.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def demo_unscaled_rope(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny demo Llama whose rope is unscaled (GGUF's llama rope scaling is not converted)."""
    model_dir = make_demo_model(tmp_path_factory.mktemp("gguf-src") / "demo", "llama", "tiny", seed=3)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (model_dir / "config.json").write_text(json.dumps(cfg))
    return model_dir


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    for heads in (1, 2, 3):
        assert np.array_equal(unpermute_rows(llama_cpp_permute(w, heads), heads), w)


def test_float32_gguf_round_trips_exactly(demo_unscaled_rope: Path, tmp_path: Path) -> None:
    path = tmp_path / "demo.gguf"
    write_gguf(demo_unscaled_rope, path, gguf.GGMLQuantizationType.F32)
    out = convert_gguf(path, tmp_path / "converted")
    original = load_file(str(demo_unscaled_rope / "model.safetensors"))
    for shard in out.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                assert torch.equal(f.get_tensor(name), original[name]), name
    ours, theirs = load_tokenizer(out), load_tokenizer(demo_unscaled_rope)
    for text in ("def fib(n):\n    return n", "<|im_start|>user\nhi<|im_end|>", "ünïcode 123"):
        assert ours.encode(text) == theirs.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(messages, tokenize=False)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = ["def fib(n):", "import os\n", "class A:"]
    engine = dict(num_kv_blocks=64, max_model_len=256)
    a = [o.token_ids for o in LLM(str(out), **engine).generate(prompts, params)]
    b = [o.token_ids for o in LLM(str(demo_unscaled_rope), **engine).generate(prompts, params)]
    assert a == b


def test_q8_0_dequantizes_within_one_step(demo_unscaled_rope: Path, tmp_path: Path) -> None:
    path = tmp_path / "demo-q8.gguf"
    write_gguf(demo_unscaled_rope, path, gguf.GGMLQuantizationType.Q8_0)
    out = convert_gguf(path, tmp_path / "q8")
    written = {n for shard in out.glob("*.safetensors") for n in load_file(str(shard))}
    converted = {name: part[:] for name, part in checkpoint_tensors(out)}
    assert written and all(not n.endswith("proj.weight") for n in written)  # only the float (norm) tensors on disk
    for name, t in load_file(str(demo_unscaled_rope / "model.safetensors")).items():
        step = t.abs().max() / 127  # Q8_0: 8-bit per 32-value block, scale = block max / 127
        assert (converted[name] - t).abs().max() <= step, name


def test_cache_dir_and_clear_refusals(demo_unscaled_rope: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFLIGHT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    write_gguf(demo_unscaled_rope, path, gguf.GGMLQuantizationType.F32)
    first = resolve_model_dir(path)
    assert first.parent == tmp_path / "cache" / "gguf" and resolve_model_dir(path) == first
    llm = LLM(str(path), num_kv_blocks=16, max_model_len=128)  # the offline API takes the file too
    assert llm.engine.runner.model_dir == first and llm.generate("def", SamplingParams(max_tokens=2))[0].token_ids
    bad = tmp_path / "bad.gguf"
    write_gguf(demo_unscaled_rope, bad, gguf.GGMLQuantizationType.F32, arch="gpt2")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'.*llama"):
        resolve_model_dir(bad)
    assert "hub id" in (model_dir_problem("meta-llama/Llama-3.2-1B") or "")
    assert "not a GGUF file" in (model_dir_problem(str(demo_unscaled_rope / "config.json")) or "")
    assert "no config.json" in (model_dir_problem(str(tmp_path)) or "")


def test_servers_started_at_once_on_one_file_convert_it_once(demo_unscaled_rope: Path, tmp_path: Path) -> None:
    """The second waits on the first's lock, then finds its result (no conversion deleting a
    directory another is reading)."""
    path = tmp_path / "m.gguf"
    write_gguf(demo_unscaled_rope, path, gguf.GGMLQuantizationType.F32)
    probe = ("import sys\nfrom inflight.runtime.model.gguf_source import resolve_model_dir\n"
             f"print(resolve_model_dir({str(path)!r}, lambda m: print(m, file=sys.stderr)))\n")
    env = {**os.environ, "INFLIGHT_CACHE_DIR": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", probe], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(3)]  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    dirs = {out.strip() for out, _ in outs}
    logs = "".join(err for _, err in outs)
    assert len(dirs) == 1 and logs.count("converted m.gguf ->") == 1 and logs.count("using the converted") == 2, logs
    assert load_tokenizer(dirs.pop()).encode("def f") == load_tokenizer(demo_unscaled_rope).encode("def f")


def test_unsupported_tensor_type_is_named() -> None:
    field = SimpleNamespace
    reader = SimpleNamespace(
        fields={
            "general.architecture": field(contents=lambda: "llama"),
            **{f"llama.{k}": field(contents=lambda: 4) for k in (
                "attention.head_count", "embedding_length", "block_count", "feed_forward_length",
                "context_length", "attention.layer_norm_rms_epsilon")},
        },
        tensors=[SimpleNamespace(name="token_embd.weight", shape=[4, 8],
                                 tensor_type=gguf.GGMLQuantizationType.Q8_K)],
    )
    with pytest.raises(ValueError, match=r"unsupported GGUF tensor type\(s\) Q8_K; supported: .*Q4_1"):
        check_supported(reader)
    reader.tensors = [SimpleNamespace(name="token_embd.weight", shape=[4, 8], tensor_type=gguf.GGMLQuantizationType.F32),
                      SimpleNamespace(name="rope_freqs.weight", shape=[2], tensor_type=gguf.GGMLQuantizationType.F32)]
    with pytest.raises(ValueError, match="rope_freqs"):  # Llama 3.1 scaling: refused, never ignored
        check_supported(reader)


def test_a_quantized_file_is_served_packed_by_default(demo_unscaled_rope: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFLIGHT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "demo-q8.gguf"
    write_gguf(demo_unscaled_rope, path, gguf.GGMLQuantizationType.Q8_0)
    engine = dict(num_kv_blocks=64, max_model_len=256, device="cpu", dtype="float32")
    packed, dense = LLM(str(path), **engine), LLM(str(path), quantization="none", **engine)
    assert (packed.engine.runner.quantization.method, dense.engine.runner.quantization.method) == ("gguf", "none")
    model = packed.engine.runner.model
    assert "weight" not in model.layers[0].self_attn.qkv_proj._parameters  # installed packed, never loaded in float
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in dense.engine.runner.model.parameters()) / 4
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = ["def fib(n):", "import os\n", "class A:"]
    assert [o.token_ids for o in packed.generate(prompts, params)] == [o.token_ids for o in dense.generate(prompts, params)]


def test_a_float_reference_directory_for_transformers(demo_unscaled_rope: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = tmp_path / "demo-q8.gguf"
    write_gguf(demo_unscaled_rope, path, gguf.GGMLQuantizationType.Q8_0)
    out = convert_gguf(path, tmp_path / "q8")
    assert float_checkpoint_dir(demo_unscaled_rope) == demo_unscaled_rope  # a plain checkpoint is its own
    ref = float_checkpoint_dir(out)
    assert ref != out and float_checkpoint_dir(out) == ref  # made once
    ours = {name: part[:] for name, part in checkpoint_tensors(out)}
    theirs = AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32).state_dict()
    for name, t in ours.items():
        assert torch.equal(theirs[name], t), name
