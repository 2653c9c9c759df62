"""The simulated device (``device="sim"``): deterministic tokens that obey grammar masks, stop
ids, lengths and ``ignore_eos``; busy time that grows with steps; its profile file. Every engine
here runs a zero step time: no test knows how fast anything is."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from inflight.runtime import LLM, SamplingParams
from inflight.runtime.config import EngineConfig
from inflight.runtime.structured.params import StructuredOutputsParams
from inflight.runtime.worker.sim_device import SimProfile

PROMPTS = ["hello world", "def f(x):", "the cat sat on the mat"]


@pytest.fixture(scope="module")
def zero_profile(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("sim") / "zero.json"
    path.write_text(json.dumps({"base_ms": 0, "decode_row_ms": 0, "prefill_token_ms": 0,
                                "attention_ms_per_1k_context": 0}))
    return str(path)


def _llm(model_dir: Path, profile: str, **extra) -> LLM:
    config = {"num_kv_blocks": 128, "max_model_len": 512, "max_num_sequences": 4, **extra}
    return LLM(model_dir, device="sim", sim_profile=profile, **config)


def _run(llm: LLM, params: SamplingParams | list[SamplingParams], prompts: list[str] = PROMPTS):
    try:
        return [(tuple(o.token_ids), o.finish_reason) for o in llm.generate(prompts, params)]
    finally:
        llm.close()


def test_tokens_are_deterministic_greedy_and_seeded(llama_dir: Path, zero_profile: str) -> None:
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.5, seed=7, ignore_eos=True)]
    first = _run(_llm(llama_dir, zero_profile, async_scheduling=False), params)
    again = _run(_llm(llama_dir, zero_profile, max_num_sequences=1), params)  # other batches, same tokens
    overlapped = _run(_llm(llama_dir, zero_profile, async_scheduling=True), params)
    assert first == again == overlapped
    assert all(len(tokens) == 12 and reason == "length" for tokens, reason in first)
    same_prompt = _run(_llm(llama_dir, zero_profile), params, PROMPTS[:1] * 3)
    assert same_prompt[1] == same_prompt[2] != same_prompt[0]  # the seed decides, not the temperature


def test_max_tokens_stop_ids_and_eos(llama_dir: Path, zero_profile: str) -> None:
    free = _run(_llm(llama_dir, zero_profile), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    tokens = free[0][0]
    stop_id = tokens[5]
    first_stop = tokens.index(stop_id)
    stopped = _run(_llm(llama_dir, zero_profile),
                   SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]),
                   PROMPTS[:1])  # fmt: skip
    assert stopped[0][1] == "stop"
    assert stopped[0][0][:first_stop] == tokens[:first_stop] and len(stopped[0][0]) <= first_stop + 1
    short = _run(_llm(llama_dir, zero_profile), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert [t for t, _ in short] == [t[:3] for t, _ in free] and {r for _, r in short} == {"length"}


def test_eos_ends_a_request_unless_ignore_eos(llama_dir: Path, zero_profile: str) -> None:
    llm = _llm(llama_dir, zero_profile)
    eos = set(llm.engine.eos_token_ids)
    seeds = range(64)
    long = [SamplingParams(max_tokens=200, temperature=1.0, seed=s, ignore_eos=True) for s in seeds]
    runs = _run(llm, long, PROMPTS[:1] * len(long))
    hit = next((s, tokens) for s, (tokens, _) in zip(seeds, runs, strict=True) if eos & set(tokens))
    seed, tokens = hit
    where = min(i for i, t in enumerate(tokens) if t in eos)
    ended = _run(_llm(llama_dir, zero_profile), SamplingParams(max_tokens=200, temperature=1.0, seed=seed),
                 PROMPTS[:1])  # fmt: skip
    assert ended[0][1] == "stop" and ended[0][0][:where] == tokens[:where] and len(ended[0][0]) <= where + 1


@pytest.mark.parametrize("kind", ["regex", "json"])
def test_grammar_masks_are_obeyed(llama_dir: Path, zero_profile: str, kind: str) -> None:
    if kind == "regex":
        structured, check = StructuredOutputsParams.regex("(the cat |a dog )+end"), re.compile("(the cat |a dog )+end")
    else:
        structured = StructuredOutputsParams.json_schema({"type": "object", "required": ["a"],
                                                          "properties": {"a": {"type": "integer"}}})
        check = None
    llm = _llm(llama_dir, zero_profile)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=60, temperature=0.0, structured=structured))
    llm.close()
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert finished, [o.text for o in outs]
    for o in finished:
        if check is not None:
            assert check.fullmatch(o.text), o.text
        else:
            assert isinstance(json.loads(o.text)["a"], int), o.text


def test_busy_seconds_grow_with_steps(llama_dir: Path, tmp_path: Path) -> None:
    tiny = tmp_path / "tiny.json"
    tiny.write_text(json.dumps({"base_ms": 0.001}))  # a step takes some time; how much is not asserted
    llm = _llm(llama_dir, str(tiny))
    before = llm.engine.stats().device_busy_seconds
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    middle = llm.engine.stats().device_busy_seconds
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    after = llm.engine.stats().device_busy_seconds
    assert llm.engine.summary().resolved["device"] == "sim"
    llm.close()
    assert before is not None and middle is not None and after is not None
    assert before < middle < after


def test_profile_file_and_config_checks(tmp_path: Path) -> None:
    assert SimProfile.load(None) == SimProfile()
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"base_ms": 10}))
    profile = SimProfile.load(path)
    assert profile.base_ms == 10 and profile.decode_row_ms == SimProfile().decode_row_ms
    assert SimProfile(1, 0.5, 0.25, 2).step_ms(4, 8, 3000) == 1 + 2 + 2 + 6
    path.write_text(json.dumps({"base_ms": 10, "nope": 1}))
    with pytest.raises(ValueError, match="keys among"):
        SimProfile.load(path)
    with pytest.raises(ValueError, match="base_ms"):
        SimProfile(base_ms=-1)
    with pytest.raises(ValueError, match="device sim"):
        EngineConfig(sim_profile=str(path))
    with pytest.raises(ValueError, match="tensor parallelism"):
        EngineConfig(device="sim", tensor_parallel_size=2)
