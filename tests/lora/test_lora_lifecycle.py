"""LoRA adapters loaded and unloaded between steps under traffic, malformed adapters refused
with their reason (and nothing loaded lost), the engine surface (list, stats, unknown names),
the offline ``LLM(enable_lora=True).generate(lora_request=...)`` (issue 49)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from inflight.runtime import LoRARequest
from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.core.engine_types import EngineRequest
from inflight.runtime.llm import LLM
from inflight.runtime.lora.types import LoRAError, UnknownLoRA
from inflight.runtime.sampling_params import SamplingParams
from tests.lora.engine_helpers import Job, assert_no_leaks, run_jobs
from tests.lora.peft_helpers import edit_config, make_adapter, peft_greedy
from tests.runtime.hf_reference import prompts_of_lengths

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def _engine(model_dir, **knobs) -> LLMEngine:
    knobs = {"num_kv_blocks": 64, "max_loras": 2, "max_lora_rank": 16, **knobs}
    return LLMEngine.from_model_dir(model_dir, EngineConfig(device="cpu", dtype="float32", enable_lora=True, **knobs))


def _drain(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    return tokens


def test_add_and_remove_between_steps_under_traffic(lora_models):
    model_dir, adapters = lora_models("llama")
    engine = _engine(model_dir)
    prompt = prompts_of_lengths(engine.tokenizer, [12])[0]
    info = engine.add_lora("a0", str(adapters[0]))
    assert engine.add_lora("a0", str(adapters[0])) == info  # same name and path: the loaded one
    assert info.rank == 8 and info.alpha == 16.0 and len(info.target_modules) == 7
    engine.add_request("r0", prompt, GREEDY, lora_name="a0")
    engine.add_request("base", prompt, GREEDY)
    tokens: dict[str, list[int]] = {}
    for out in engine.step():
        tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    engine.remove_lora("a0")  # r0 was admitted with it: it finishes with it
    assert [i.name for i in engine.list_loras()] == []
    with pytest.raises(UnknownLoRA):
        engine.add_request("late", prompt, GREEDY, lora_name="a0")
    engine.add_lora("a1", str(adapters[1]))  # loaded between steps
    engine.add_request("r1", prompt, GREEDY, lora_name="a1")
    assert engine.lora_stats() == (["a0"], ["a1"])
    for req_id, toks in _drain(engine).items():
        tokens.setdefault(req_id, []).extend(toks)
    assert tokens["r0"] == peft_greedy(model_dir, adapters[0], prompt, 6)
    assert tokens["r1"] == peft_greedy(model_dir, adapters[1], prompt, 6)
    assert tokens["base"] == peft_greedy(model_dir, None, prompt, 6)
    assert_no_leaks(engine)
    assert engine.lora is not None and engine.lora.resident == ["a1"]  # a0's weights dropped once r0 finished
    with pytest.raises(UnknownLoRA):
        engine.remove_lora("a0")


def test_a_reloaded_name_with_new_weights_never_meets_its_old_kv(lora_models):
    model_dir, adapters = lora_models("llama")
    engine = _engine(model_dir, block_size=8)
    prompt = prompts_of_lengths(engine.tokenizer, [33])[0]
    engine.add_lora("x", str(adapters[0]))
    assert run_jobs(engine, [Job(prompt, "x", 4)]) == [peft_greedy(model_dir, adapters[0], prompt, 4)]
    engine.remove_lora("x")
    engine.add_lora("x", str(adapters[1]))
    hits = engine.kv.prefix_cache_hits
    assert run_jobs(engine, [Job(prompt, "x", 4)]) == [peft_greedy(model_dir, adapters[1], prompt, 4)]
    assert engine.kv.prefix_cache_hits == hits


def test_batched_adds_carry_the_adapter_and_unknown_names_add_nothing(lora_models):
    model_dir, adapters = lora_models("llama")
    engine = _engine(model_dir)
    engine.add_lora("a0", str(adapters[0]))
    prompt = prompts_of_lengths(engine.tokenizer, [8])[0]
    with pytest.raises(UnknownLoRA):
        engine.add_requests([EngineRequest("x0", prompt, GREEDY, lora_name="a0"),
                             EngineRequest("x1", prompt, GREEDY, lora_name="nope")])
    assert not engine.has_unfinished_requests()
    engine.add_requests([EngineRequest("y0", prompt, GREEDY, lora_name="a0")])
    assert _drain(engine)["y0"] == peft_greedy(model_dir, adapters[0], prompt, 6)


def _corrupt_shape(src, dst):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "adapter_model.safetensors"))
    key = next(k for k in tensors if "q_proj.lora_B" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0] + 2, tensors[key].shape[1])
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


def _extra_tensor(src, dst, key):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "adapter_model.safetensors"))
    tensors[key] = torch.zeros(4, 4)
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


def _garbage_weights(src, dst):
    shutil.copytree(src, dst)
    (dst / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    return dst


def _bad_json(src, dst):
    shutil.copytree(src, dst)
    (dst / "adapter_config.json").write_text("{not json")
    return dst


def _pickled(src, dst):
    dst.mkdir()
    shutil.copy(src / "adapter_config.json", dst)
    (dst / "adapter_model.bin").write_bytes(b"not loaded")
    return dst


MALFORMED = {
    "rank over max_lora_rank": (lambda src, dst: src, "over max_lora_rank"),
    "embed_tokens targeted": (lambda src, dst: edit_config(src, dst, target_modules=["q_proj", "embed_tokens"]),
                              "embed_tokens"),
    "lm_head by regex": (lambda src, dst: edit_config(src, dst, target_modules=r".*(q_proj|lm_head)"), "lm_head"),
    "modules_to_save": (lambda src, dst: edit_config(src, dst, modules_to_save=["lm_head"]), "modules_to_save"),
    "DoRA": (lambda src, dst: edit_config(src, dst, use_dora=True), "DoRA"),
    "wrong shapes": (_corrupt_shape, "the base model wants"),
    "an embedding tensor": (lambda src, dst: _extra_tensor(src, dst, "base_model.model.model.embed_tokens.lora_embedding_A"),
                            "embed_tokens"),
    "pickled weights": (_pickled, "pickle"),
    "corrupt weights": (lambda src, dst: _garbage_weights(src, dst), "not a readable safetensors file"),
    "bad JSON": (lambda src, dst: _bad_json(src, dst), "not readable JSON"),
    "no directory": (lambda src, dst: dst, "is not a directory"),
    "no config": (lambda src, dst: (dst.mkdir(), dst)[1], "no adapter_config.json"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_adapter_is_refused_with_its_reason_and_loses_nothing(lora_models, tmp_path, case):
    model_dir, adapters = lora_models("llama")
    engine = _engine(model_dir, max_lora_rank=8 if case == "rank over max_lora_rank" else 16)
    engine.add_lora("good", str(adapters[0]))
    make, reason = MALFORMED[case]
    bad = make(adapters[2] if case == "rank over max_lora_rank" else adapters[0], tmp_path / "bad")
    with pytest.raises(LoRAError, match=reason):
        engine.add_lora("bad", str(bad))
    with pytest.raises(LoRAError, match="already loaded"):
        engine.add_lora("good", str(adapters[1]))
    assert [i.name for i in engine.list_loras()] == ["good"]
    prompt = prompts_of_lengths(engine.tokenizer, [9])[0]
    engine.add_request("g", prompt, GREEDY, lora_name="good")
    assert _drain(engine)["g"] == peft_greedy(model_dir, adapters[0], prompt, 6)


def test_an_adapter_of_another_model_is_refused(lora_models, tmp_path):
    """An adapter made for a model of other widths (the tiny llama with 8 heads of 8) fails the
    shape check, naming the shapes the base model wants."""
    from inflight.runtime.demo.model import make_demo_model

    model_dir, _ = lora_models("llama")
    other = make_demo_model(tmp_path / "other-model", "llama", "tiny", 0, config_overrides={"num_attention_heads": 8})
    adapter = make_adapter(other, tmp_path / "other", seed=7, r=4, targets=["q_proj"])
    engine = _engine(model_dir)
    with pytest.raises(LoRAError, match="an adapter of another model"):
        engine.add_lora("other", str(adapter))


def test_lora_off_refuses_adapters(lora_models):
    model_dir, adapters = lora_models("llama")
    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(device="cpu", dtype="float32", num_kv_blocks=32))
    with pytest.raises(LoRAError, match="--enable-lora"):
        engine.add_lora("a0", str(adapters[0]))
    with pytest.raises(UnknownLoRA):
        engine.add_request("r", [1, 2, 3], GREEDY, lora_name="a0")
    assert engine.list_loras() == [] and engine.lora_stats() == ([], [])


def test_offline_llm_generate_with_a_lora_request(lora_models):
    model_dir, adapters = lora_models("llama")
    with LLM(model_dir, device="cpu", dtype="float32", num_kv_blocks=32, enable_lora=True, max_loras=2) as llm:
        prompt = prompts_of_lengths(llm.engine.tokenizer, [10])[0]
        one = llm.generate({"prompt_token_ids": prompt}, GREEDY, lora_request=LoRARequest("a0", str(adapters[0])))
        mixed = llm.generate([{"prompt_token_ids": prompt}] * 2, GREEDY,
                             lora_request=[None, LoRARequest("a1", str(adapters[1]))])
    assert one[0].token_ids == peft_greedy(model_dir, adapters[0], prompt, 6)
    assert mixed[0].token_ids == peft_greedy(model_dir, None, prompt, 6)
    assert mixed[1].token_ids == peft_greedy(model_dir, adapters[1], prompt, 6)


def test_structured_outputs_with_adapters(lora_models):
    """A grammar masks an adapter's logits as it does the base model's."""
    import re

    from inflight.runtime.structured.params import StructuredOutputsParams

    model_dir, adapters = lora_models("llama")
    params = SamplingParams(max_tokens=12, temperature=0.0, structured=StructuredOutputsParams.regex("[0-9]{3}-[a-z]{2}"))
    with LLM(model_dir, device="cpu", dtype="float32", num_kv_blocks=32, enable_lora=True, max_loras=2) as llm:
        outs = llm.generate(["say", "say", "say"], params,
                            lora_request=[None, LoRARequest("a0", str(adapters[0])), LoRARequest("a1", str(adapters[1]))])
    assert all(re.fullmatch("[0-9]{3}-[a-z]{2}", o.text) for o in outs), [o.text for o in outs]


def test_a_host_copy_read_again_from_changed_files_fails_only_its_requests(lora_models, tmp_path):
    """With one host copy, an adapter dropped from the host is read again from its directory; if
    its files changed since add_lora, its requests finish with an error, the others run on."""
    model_dir, adapters = lora_models("llama")
    engine = _engine(model_dir, max_loras=1, max_cpu_loras=1)
    moving = shutil.copytree(adapters[0], tmp_path / "moving")
    engine.add_lora("a0", str(moving))
    engine.add_lora("a1", str(adapters[1]))  # a0's host copy is dropped
    shutil.copy(adapters[3] / "adapter_model.safetensors", moving / "adapter_model.safetensors")
    prompt = prompts_of_lengths(engine.tokenizer, [9])[0]
    engine.add_request("bad", prompt, GREEDY, lora_name="a0")
    engine.add_request("good", prompt, GREEDY, lora_name="a1")
    finished: dict[str, str | None] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.finished:
                finished[out.req_id] = out.finish_reason
    assert finished == {"bad": "error", "good": "length"}
    assert tokens["good"] == peft_greedy(model_dir, adapters[1], prompt, 6)
    assert_no_leaks(engine)
