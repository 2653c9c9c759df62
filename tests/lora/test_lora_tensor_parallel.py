"""Multi-LoRA under tensor parallelism (TP=2, gloo on the CPU): the workers get each adapter's
tensors through the control channel and keep their shard (column-parallel q/k/v/gate/up: B's
rows; row-parallel o/down: A's columns, the delta added before the all-reduce). Four adapters and
the base model in one burst, with fewer device slots than adapters, token-exact against peft."""

from __future__ import annotations

from inflight.runtime.llm import LLM
from tests.lora.engine_helpers import Job, run_jobs
from tests.lora.peft_helpers import peft_greedy
from tests.runtime.hf_reference import prompts_of_lengths

NAMES = [None, "a0", "a1", "a2", "a3"]


def test_tp2_four_adapters_and_the_base_model_match_peft(lora_models):
    model_dir, adapters = lora_models("llama")
    with LLM(model_dir, device="cpu", dtype="float32", tensor_parallel_size=2, num_kv_blocks=64,
             enable_lora=True, max_loras=2, max_lora_rank=16) as llm:  # fmt: skip
        engine = llm.engine
        for i, path in enumerate(adapters):
            engine.add_lora(f"a{i}", str(path))
        prompts = prompts_of_lengths(engine.tokenizer, [5, 17, 9, 24, 12, 30, 7, 20, 11, 14])
        jobs = [Job(p, NAMES[i % 5], 6) for i, p in enumerate(prompts)]
        got = run_jobs(engine, jobs, per_step=3)
        assert engine.lora is not None and engine.lora.num_slot_loads > 4  # slots reloaded on every rank
    by_name = {f"a{i}": path for i, path in enumerate(adapters)}
    assert got == [peft_greedy(model_dir, by_name.get(j.lora) if j.lora else None, j.prompt, j.max_tokens)
                   for j in jobs]  # fmt: skip
