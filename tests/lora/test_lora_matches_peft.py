"""Multi-LoRA token-exact against transformers + peft (float32, CPU; issue 49).

Four adapters (ranks 2 to 16, all seven modules, attention only, rsLoRA, a regex target) and the
base model mixed in one staggered burst, for llama, qwen3 and mistral (and qwen2, gemma3); then under preemption (a
small pool), with prefix hits, with fewer device slots than adapters (adapters evicted to the host
and back, host copies dropped and read again) and with n-gram speculation; peft runs one request
at a time. Every run ends with every KV block free.
"""

from __future__ import annotations

import json

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.demo.model import make_demo_model
from inflight.runtime.lora.types import LoRAError
from tests.devices import on_devices
from tests.lora.engine_helpers import Job, run_jobs
from tests.lora.peft_helpers import edit_config, make_adapter, peft_greedy
from tests.runtime.hf_reference import prompts_of_lengths

LENGTHS = [5, 17, 9, 33, 3, 24, 12, 40, 7, 20]
MAX_TOKENS = [8, 6, 10, 5, 9, 7, 6, 8, 10, 5]
NAMES = [None, "a0", "a1", "a2", "a3"]


def _engine(model_dir, adapters, device: str = "cpu", **knobs) -> LLMEngine:
    knobs = {"num_kv_blocks": 128, "max_loras": 4, "max_lora_rank": 16, **knobs}
    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(device=device, dtype="float32", enable_lora=True,
                                                              **knobs))  # fmt: skip
    for i, path in enumerate(adapters):
        engine.add_lora(f"a{i}", str(path))
    return engine


def _jobs(engine, lengths=LENGTHS, names=NAMES) -> list[Job]:
    prompts = prompts_of_lengths(engine.tokenizer, lengths)
    return [Job(p, names[i % len(names)], MAX_TOKENS[i % len(MAX_TOKENS)]) for i, p in enumerate(prompts)]


def _expected(model_dir, adapters, jobs: list[Job]) -> list[list[int]]:
    by_name = {f"a{i}": path for i, path in enumerate(adapters)}
    return [peft_greedy(model_dir, by_name.get(job.lora) if job.lora else None, job.prompt, job.max_tokens)
            for job in jobs]  # fmt: skip


@pytest.mark.parametrize("device", on_devices("cpu", "cuda"))
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "qwen2", "gemma3"])  # qwen2: q/k/v biases; gemma3: sandwich norms, GeGLU
def test_four_adapters_and_the_base_model_in_one_burst(lora_models, arch, device):
    """On CUDA: the Triton bundle's lora_delta, LoRA steps eager beside the base model's graphs."""
    model_dir, adapters = lora_models(arch)
    engine = _engine(model_dir, adapters, device)
    jobs = _jobs(engine)
    expected = _expected(model_dir, adapters, jobs)
    assert len({tuple(e) for e in expected[:5]}) == 5  # every adapter changes the tokens
    assert run_jobs(engine, jobs, per_step=3) == expected


def test_preemption_under_a_small_pool_keeps_each_adapter(lora_models):
    model_dir, adapters = lora_models("llama")
    engine = _engine(model_dir, adapters, num_kv_blocks=9, block_size=8, enable_prefix_caching=False)
    jobs = _jobs(engine)
    assert run_jobs(engine, jobs, per_step=4) == _expected(model_dir, adapters, jobs)
    assert engine.scheduler.num_preemptions > 0


def test_prefix_hits_stay_within_one_adapter(lora_models):
    model_dir, adapters = lora_models("llama")
    engine = _engine(model_dir, adapters, block_size=8)
    prompt = prompts_of_lengths(engine.tokenizer, [33])[0]
    order = ["a0", "a0", None, "a1", None, "a1", "a0"]
    jobs = [Job(prompt, name, 4) for name in order]
    for job in jobs:  # one at a time: each sees what the earlier ones cached
        assert run_jobs(engine, [job]) == _expected(model_dir, adapters, [job])
    assert engine.kv.prefix_cache_hits == 4 * 32  # the 2nd a0, 2nd base, 2nd a1 and 3rd a0 hit 4 blocks


def test_prefix_hit_rows_in_a_mixed_burst(lora_models):
    model_dir, adapters = lora_models("qwen3")
    engine = _engine(model_dir, adapters, block_size=8)
    prompts = prompts_of_lengths(engine.tokenizer, [30, 30])
    jobs = [Job(prompts[i % 2], NAMES[i % 3], 5) for i in range(12)]  # each (prompt, adapter) twice
    assert run_jobs(engine, jobs, per_step=1) == _expected(model_dir, adapters, jobs)
    assert engine.kv.prefix_cache_hits == 6 * 24  # the second of each pair hits its 3 full blocks


@pytest.mark.parametrize("max_loras,max_cpu_loras", [(1, 4), (2, None)])
def test_fewer_slots_than_adapters_gives_the_same_tokens(lora_models, max_loras, max_cpu_loras):
    """Adapters leave the device slots for their host copies (and, with max_cpu_loras 2, the host
    copies for the disk) and come back with the same tokens; no step has more than max_loras."""
    model_dir, adapters = lora_models("llama")
    engine = _engine(model_dir, adapters, max_loras=max_loras, max_cpu_loras=max_cpu_loras)
    jobs = _jobs(engine) + _jobs(engine)[::-1]
    assert run_jobs(engine, jobs, per_step=3) == _expected(model_dir, adapters, jobs)
    assert engine.lora is not None and engine.lora.num_slot_loads > 4
    if max_cpu_loras is None:  # host copies: max_loras (2) for 4 adapters
        assert engine.lora.num_disk_reads > 0


def test_ngram_speculation_with_adapters_is_exact(lora_models):
    model_dir, adapters = lora_models("llama")
    engine = _engine(model_dir, adapters, speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    prompt = prompts_of_lengths(engine.tokenizer, [40])[0]
    jobs = [Job(prompt + prompt[1:20], name, 12) for name in NAMES]
    assert run_jobs(engine, jobs, per_step=5) == _expected(model_dir, adapters, jobs)


def test_the_fair_policy_shares_slots_between_tenants_with_adapters(lora_models):
    """Two tenants, four adapters over two device slots, the fair policy: still exact, no leak."""
    model_dir, adapters = lora_models("llama")
    engine = _engine(model_dir, adapters, scheduler_policy="fair", max_loras=2, max_num_tokens=48)
    jobs = [Job(j.prompt, j.lora, j.max_tokens, tenant=f"t{i % 2}") for i, j in enumerate(_jobs(engine))]
    assert run_jobs(engine, jobs, per_step=4) == _expected(model_dir, adapters, jobs)


def test_draft_model_speculation_runs_the_base_draft_and_verifies_with_the_adapter(lora_models):
    """The draft model (here the base model itself) proposes without adapters; the target verifies
    each row with its adapter, so greedy output stays exact."""
    model_dir, adapters = lora_models("llama")
    spec = json.dumps({"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3})
    engine = _engine(model_dir, adapters, speculative_config=spec)
    jobs = _jobs(engine, lengths=[9, 20, 14, 6, 30])
    assert run_jobs(engine, jobs, per_step=5) == _expected(model_dir, adapters, jobs)
    assert engine.stats().spec_num_drafts > 0


def test_a_moe_model_takes_attention_adapters_and_refuses_expert_targets(tmp_path):
    """qwen3_moe: an attention-only adapter is token-exact; one naming the MLP modules is refused."""
    model_dir = make_demo_model(tmp_path / "moe", "qwen3_moe", "tiny", 0)
    attention = make_adapter(model_dir, tmp_path / "attn", seed=5, r=4, targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    engine = _engine(model_dir, [attention])
    with pytest.raises(LoRAError, match="mixture-of-experts"):
        engine.add_lora("mlp", str(edit_config(attention, tmp_path / "mlp", target_modules=["q_proj", "gate_proj"])))
    jobs = _jobs(engine, lengths=[9, 20, 14], names=[None, "a0"])
    assert run_jobs(engine, jobs, per_step=3) == _expected(model_dir, [attention], jobs)


def test_llama4_attention_adapters_follow_its_permuted_q_k_rows(tmp_path):
    """Llama 4 keeps q/k rows in rotate-half order (the loader permutes the checkpoint's interleaved
    pairs), so an adapter's q/k B rows are permuted the same way: token-exact against peft."""
    from tests.runtime.family_models import make_family_model

    model_dir = make_family_model(tmp_path / "llama4", "llama4_text")
    adapter = make_adapter(model_dir, tmp_path / "attn", seed=7, r=4, targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    engine = _engine(model_dir, [adapter])
    jobs = _jobs(engine, lengths=[9, 20, 14], names=[None, "a0"])
    expected = _expected(model_dir, [adapter], jobs)
    assert expected[0] != expected[1] or expected[1] != _expected(model_dir, [], [jobs[1]])[0]
    assert run_jobs(engine, jobs, per_step=3) == expected
