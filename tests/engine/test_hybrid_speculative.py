"""Speculative decoding on the hybrid models (Qwen3-Next's Gated DeltaNet, Granite 4's Mamba-2):
a verified chunk leaves each sequence's state slot holding the state after its last accepted
token (worker/hybrid_cache.py), so greedy output is token-identical with speculation on and off.

Drafts come from n-gram lookup on repeating prompts (Granite's tiny model repeats itself, so its
drafts are both kept and rejected; Qwen3-Next's never repeats, so all of its are rejected) and from
an oracle fake (the no-speculation run's own tokens with some deliberately wrong, so every
accepted count from none to all occurs), with chunked prompts, preemption, async scheduling and a
draft model and an EAGLE-3 head (the hybrid forward hands it the states entering its layers);
seeded sampling stays seeded; the scratch states are sized by the speculating rows, not by the
sequences.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.core.state_pool import hybrid_refusal
from inflight.runtime.model.loader import load_hf_config
from inflight.runtime.model.spec import spec_from_hf_config
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.spec_decode.speculative import NgramIndex
from tests.runtime.granite_hybrid_models import make_granite_hybrid

from .qwen3_next_models import make_qwen3_next

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
FAMILIES = ["qwen3_next", "granite"]
MAKERS: dict[str, Callable[[Path], Path]] = {"qwen3_next": make_qwen3_next, "granite": make_granite_hybrid}
CASES = {"plain": {}, "chunked": dict(max_num_tokens=24, enable_chunked_context=True),
         "preemption": dict(num_kv_blocks=16, block_size=16)}  # fmt: skip

Requests = list[tuple[list[int], SamplingParams]]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: make(tmp_path_factory.mktemp(name)) for name, make in MAKERS.items()}


def _engine(model_dir: Path, spec: str | None, **knobs: object) -> LLMEngine:
    config = dict(device="cpu", dtype="float32", num_kv_blocks=128, max_num_tokens=256, speculative_config=spec)
    return LLMEngine.from_model_dir(model_dir, EngineConfig(**{**config, **knobs}))  # type: ignore[arg-type]


def _run(engine: LLMEngine, requests: Requests) -> dict[str, list[int]]:
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(requests))}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            out[o.req_id].extend(o.new_token_ids)
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.num_used_kv_blocks == 0, "blocks leaked"
    pool = engine.kv.state_pool
    assert pool is not None and pool.num_used == 0, "state slots leaked"
    return out


def _repeating(max_tokens: int = 40) -> Requests:
    """Prompts of a repeated 9-token pattern (n-gram proposals match them), several lengths."""
    pattern = [(7 * j + 3) % 200 + 5 for j in range(9)]
    greedy = dict(temperature=0.0, ignore_eos=True)
    return [((pattern * 8)[: 10 + 13 * i], SamplingParams(max_tokens=max_tokens + i, **greedy)) for i in range(6)]


def _distinct(count: int = 6, max_tokens: int = 24) -> Requests:
    """Prompts of distinct pseudo-random tokens (lengths 5 .. 70), so no prompt starts another."""
    prompts = [[(31 * i + 17 * j * j + 11) % 900 + 20 for j in range(5 + 13 * i)] for i in range(count)]
    return [(p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)) for p in prompts]


def _oracle(monkeypatch: pytest.MonkeyPatch, requests: Requests, outputs: dict[str, list[int]]) -> None:
    """N-gram proposals replaced by the no-speculation run's next tokens, some made wrong: at
    output position ``t`` the draft is wrong when ``t % 3 == 2`` unless ``t % 5 == 0`` (so a
    chunk keeps none, some or all of its drafts, depending on where it starts)."""
    known = [(prompt, outputs[str(i)]) for i, (prompt, _) in enumerate(requests)]

    def propose(self: NgramIndex, token_ids: list[int], k: int) -> list[int]:
        for prompt, out in known:
            n = len(prompt)
            if token_ids[:n] == prompt and token_ids[n:] == out[: len(token_ids) - n]:
                t = len(token_ids) - n
                return [tok if (t + j) % 3 != 2 or (t + j) % 5 == 0 else (tok + 1) % 900 + 20
                        for j, tok in enumerate(out[t : t + k])]  # fmt: skip
        raise AssertionError("a sequence no reference run made")

    monkeypatch.setattr(NgramIndex, "propose", propose)


def _kept_and_rejected(engine: LLMEngine) -> tuple[int, int]:
    stats = engine.spec_stats
    return stats.num_accepted_tokens, stats.num_draft_tokens - stats.num_accepted_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_ngram_greedy_output_is_identical_with_speculation_on_and_off(models: dict[str, Path], family: str) -> None:
    requests = _repeating()
    off = _run(_engine(models[family], None), requests)
    engine = _engine(models[family], NGRAM)
    assert _run(engine, requests) == off
    kept, rejected = _kept_and_rejected(engine)
    assert rejected > 0  # every rejection rolls a slot back to an earlier position's state
    if family == "granite":  # its tiny model repeats itself: the pattern's drafts are kept too
        assert kept > 0


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", FAMILIES)
def test_every_accepted_count_keeps_the_right_state(models: dict[str, Path], family: str, case: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Oracle drafts with planted mistakes: chunks keep 0 .. 4 drafts, and each later token still
    equals the run without speculation (chunked prompts beside speculating rows; preemption
    dropping a speculating sequence's state and recomputing it)."""
    requests = _distinct()
    off = _run(_engine(models[family], None, **CASES[case]), requests)
    _oracle(monkeypatch, requests, off)
    engine = _engine(models[family], NGRAM, **CASES[case])
    assert _run(engine, requests) == off
    kept, rejected = _kept_and_rejected(engine)
    per_position = engine.spec_stats.accepted_per_position
    assert kept > 0 and rejected > 0 and per_position[0] > 0 and per_position[-1] > 0, engine.spec_stats
    if case == "preemption":
        assert engine.stats().num_preemptions > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_async_scheduling_drains_for_speculation_and_keeps_the_tokens(
    models: dict[str, Path], family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under async scheduling a speculating step runs synchronously (the pipeline drains), so the
    accepted count is on the host when the slots are rolled back."""
    requests = _distinct(count=4)
    off = _run(_engine(models[family], None), requests)
    _oracle(monkeypatch, requests, off)
    engine = _engine(models[family], NGRAM, async_scheduling=True)
    assert _run(engine, requests) == off
    assert min(_kept_and_rejected(engine)) > 0


def test_a_draft_model_speculates_for_a_hybrid_target(models: dict[str, Path], model_factory) -> None:
    """A (non-hybrid) draft model sharing the tokenizer proposes; the hybrid target verifies."""
    draft = model_factory("llama")
    requests = _repeating(max_tokens=20)
    off = _run(_engine(models["granite"], None), requests)
    spec = json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    engine = _engine(models["granite"], spec)
    assert _run(engine, requests) == off
    assert engine.spec_stats.num_draft_tokens > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_seeded_sampling_stays_seeded(models: dict[str, Path], family: str) -> None:
    """A seeded request speculating draws the same tokens in two engines, alone or beside others."""
    prompt, _ = _repeating()[3]
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)
    alone = _run(_engine(models[family], NGRAM), [(prompt, params)])["0"]
    others = [(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)) for p, _ in _distinct(count=3)]
    crowded = _engine(models[family], NGRAM)
    assert _run(crowded, [*others, (prompt, params)])["3"] == alone and len(alone) == 30
    assert crowded.spec_stats.num_drafts > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_an_eagle3_head_reads_the_hybrid_targets_hidden_states(models: dict[str, Path], family: str,
                                                               tmp_path: Path) -> None:  # fmt: skip
    """A (random) EAGLE-3 head fed the states entering the target's layers 0, 1 and 3: greedy output
    unchanged; the speculation rules the same for every method (nothing refused for hybrids)."""
    from tests.runtime.test_speculative_eagle3 import eagle3_spec, make_head

    target = models[family]
    cfg = json.loads((target / "config.json").read_text())
    if "head_dim" not in cfg:  # Granite's config leaves it to hidden_size / num_attention_heads
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
        target = tmp_path / "target"
        target.mkdir()
        for f in models[family].iterdir():
            (target / f.name).symlink_to(f)
        (target / "config.json").unlink()
        (target / "config.json").write_text(json.dumps(cfg))
    head = make_head(target, tmp_path / "head")
    spec = spec_from_hf_config(load_hf_config(target))
    assert hybrid_refusal(spec, EngineConfig(device="cpu", speculative_config=eagle3_spec(head))) is None
    requests = _distinct(count=4, max_tokens=16)
    off = _run(_engine(target, None), requests)
    engine = _engine(target, eagle3_spec(head))
    assert _run(engine, requests) == off
    assert engine.spec_stats.num_draft_tokens > 0


def test_scratch_states_are_sized_by_the_speculating_rows(models: dict[str, Path],
                                                          caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """min(max_num_sequences, disable_by_batch_size - 1) rows x num_speculative_tokens scratch
    slots after the running ones; none without speculation."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 5})
    with caplog.at_level(logging.INFO):
        engine = _engine(models["qwen3_next"], spec, max_num_sequences=16)
    scratch = engine.runner.draft_scratch
    assert scratch is not None and (scratch.first, scratch.num_rows, scratch.num_drafts) == (16, 4, 3)
    conv, rec = next(iter(engine.runner.state_caches.values()))
    assert conv.shape[0] == rec.shape[0] == 16 + 12
    assert "12 scratch state slots for speculation (4 rows x 3 drafts" in caplog.text
    assert _engine(models["qwen3_next"], None).runner.draft_scratch is None
