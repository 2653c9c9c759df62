"""Speculative decoding with a draft model (``"method": "draft_model"``): greedy output identical
with the draft on and off (the target as its own draft, which keeps ~every draft; a perturbed
copy that keeps about half; a one-layer and an other-architecture draft that keep few; four
architectures), with chunked prompts, forced preemption, prefix caching, ``n`` choices, stop
strings, a grammar-bound request in the batch, sliding windows and decode graphs; the draft
model's KV equal to the target's wherever the prefix cache or a running request relies on it;
no leaked blocks; sampled output distributed as the target
model says (chi-square against transformers' probabilities) with drafts kept as often as
``min(1, p/q)`` makes them; the acceptance counters; the start-up refusals (no directory,
another vocabulary or tokenizer, too few positions, tensor parallelism); the CR's draft-model
keys reaching the flag."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.demo.model import make_demo_model
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.spec_decode.verify import verify_sampled
from inflight.runtime.worker.sampler import SamplingRow
from tests.runtime.test_speculative import ARCHS, CASE_KNOBS, _engine, _requests, _run, run_choices

# Chi-square critical values at p = 0.001 by degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}


def draft_spec(draft_dir: Path, k: int = 3, **extra) -> str:
    return json.dumps({"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": k,
                       "disable_by_batch_size": 64, **extra})  # fmt: skip


def perturbed_copy(model_dir: Path, out: Path, scale: float) -> Path:
    """``model_dir`` with noise of ``scale`` x each layer matrix's spread: a draft that agrees
    with its target often but not always."""
    shutil.copytree(model_dir, out)
    weights = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    for name, value in weights.items():
        if "layers." in name and value.dim() == 2:
            weights[name] = value + scale * value.std() * torch.randn(value.shape, generator=gen)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def drafts(model_factory, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Drafts for the tiny llama target, by how often they agree with it."""
    target = model_factory("llama")
    root = tmp_path_factory.mktemp("drafts")
    return {
        "self": target,
        "perturbed": perturbed_copy(target, root / "perturbed", 0.1),
        "one-layer": make_demo_model(root / "one-layer", "llama", config_overrides={"num_hidden_layers": 1}),
        "qwen2": model_factory("qwen2"),  # another architecture, the same tokenizer
    }


def _acceptance(engine: LLMEngine) -> float:
    stats = engine.stats()
    assert stats.spec_num_draft_tokens > 0, stats
    return stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens


@pytest.mark.parametrize("draft", ["self", "perturbed", "one-layer", "qwen2"])
def test_greedy_output_is_identical_with_a_draft_model(model_factory, drafts, draft: str) -> None:
    target = model_factory("llama")
    requests = _requests(1000)
    off = _run(_engine(target, None), requests)
    engine = _engine(target, draft_spec(drafts[draft]))
    assert _run(engine, requests) == off
    stats = engine.stats()
    acceptance = _acceptance(engine)
    if draft == "self":
        assert acceptance > 0.95, stats
    if draft == "perturbed":
        assert 0.2 < acceptance < 0.9, stats
    assert sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens
    assert stats.spec_num_draft_tokens <= 3 * stats.spec_num_drafts


@pytest.mark.parametrize("arch", ARCHS)
def test_each_architecture_as_its_own_draft(model_factory, arch: str) -> None:
    model_dir = model_factory(arch)
    requests = _requests(1000)[:5]
    off = _run(_engine(model_dir, None), requests)
    engine = _engine(model_dir, draft_spec(model_dir, k=4))
    assert _run(engine, requests) == off
    assert _acceptance(engine) > 0.9


@pytest.mark.parametrize("case", ["chunked", "preemption", "prefix-cache"])
def test_greedy_identity_with_chunking_preemption_and_prefix_hits(model_factory, drafts, case: str) -> None:
    target = model_factory("llama")
    knobs = CASE_KNOBS[case]
    requests = _requests(1000)
    off = _run(_engine(target, None, **knobs), requests)
    engine = _engine(target, draft_spec(drafts["perturbed"]), **knobs)
    assert _run(engine, requests) == off
    if case == "preemption":
        assert engine.stats().num_preemptions > 0
    if case == "prefix-cache":
        assert engine.stats().prefix_cache_hits > 0
    assert engine.stats().spec_num_accepted_tokens > 0


def _assert_draft_kv_matches(engine: LLMEngine) -> int:
    """With the target as its own draft, the draft's KV must equal the target's at every
    position a running request has computed (but the one it may lag behind) and in every block
    the prefix cache holds; returns how many positions were compared."""
    assert engine.drafter is not None
    target, draft, bs = engine.runner.kv_caches, engine.drafter.runner.kv_caches, engine.runner.block_size
    slots: list[int] = []
    for req in engine.scheduler.running:
        slots += [req.block_ids[p // bs] * bs + p % bs for p in range(req.num_computed_tokens - req.draft_kv_lag)]
    for block, key in enumerate(engine.pool.block_hash):
        if key is not None:
            slots += range(block * bs, (block + 1) * bs)
    index = torch.tensor(slots, dtype=torch.long)
    for (tk, tv), (dk, dv) in zip(target, draft, strict=True):
        for t, d in ((tk, dk), (tv, dv)):
            flat_t, flat_d = t.flatten(0, 1)[index], d.flatten(0, 1)[index]
            torch.testing.assert_close(flat_d, flat_t, atol=1e-4, rtol=1e-4)
    return len(slots)


def test_the_draft_kv_is_valid_wherever_the_target_kv_is(model_factory) -> None:
    """Requests of many lengths (so some end right after a step that kept every draft, with
    the draft's KV one position behind) share prefixes; a follow-up turn reuses a finished
    answer from the prefix cache and still keeps ~every draft of the target-as-draft."""
    target = model_factory("llama")
    engine = _engine(target, draft_spec(target), enable_prefix_caching=True, max_num_tokens=40)
    pattern = [(11 * j + 5) % 990 + 5 for j in range(23)]
    prompts = [(pattern * 4)[: 17 + 5 * i] for i in range(12)]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=9 + 3 * i, temperature=0.0, ignore_eos=True))
    compared = 0
    answers: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            answers.setdefault(out.req_id, []).extend(out.new_token_ids)
        compared += _assert_draft_kv_matches(engine)
    assert compared > 1000 and engine.stats().num_used_kv_blocks == 0
    follow_up = prompts[5] + answers["5"] + pattern[:7]
    engine.add_request("turn-2", follow_up, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    before = engine.stats()
    while engine.has_unfinished_requests():
        engine.step()
        _assert_draft_kv_matches(engine)
    after = engine.stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 32
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    assert after.spec_num_accepted_tokens - before.spec_num_accepted_tokens > 0.95 * drafted


def test_stop_strings_max_tokens_and_grammars_beside_a_draft_model(model_factory, drafts) -> None:
    from inflight.runtime.structured import StructuredOutputsParams

    model_dir = model_factory("llama")
    schema = StructuredOutputsParams.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    base = _requests(1000)[:3]
    free = _run(_engine(model_dir, None), base)
    stop = free["1"][0][3:6]  # a string the greedy text reaches: it must end the request there
    requests = [
        (base[0][0], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)),
        (base[1][0], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])),
        (base[2][0], SamplingParams(max_tokens=30, temperature=0.0)),  # may stop at EOS
        (base[2][0], SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=0.5)),  # not speculated
        (base[0][0], SamplingParams(max_tokens=12, temperature=0.0, structured=schema)),  # nor a grammar
    ]
    off = _run(_engine(model_dir, None), requests)
    engine = _engine(model_dir, draft_spec(drafts["self"]))
    on = _run(engine, requests)
    assert on == off
    assert len(on["0"][1]) == 7 and on["0"][2] == "length"
    assert on["1"][2] == "stop" and stop not in on["1"][0]


def test_n_choices_and_sampled_requests_with_a_draft_model(model_factory, drafts) -> None:
    model_dir = model_factory("llama")
    prompt = _requests(1000)[2][0]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7 + c, ignore_eos=True)
               for c in range(3)]  # fmt: skip

    off, _ = run_choices(_engine(model_dir, None, enable_prefix_caching=True), prompt, greedy, sampled)
    on, engine = run_choices(_engine(model_dir, draft_spec(drafts["perturbed"]), enable_prefix_caching=True),
                             prompt, greedy, sampled)
    assert {on[f"g{c}"] for c in range(4)} == {off["g0"]} and len(off["g0"]) == 24
    assert all(len(on[f"s{c}"]) == 20 for c in range(3))
    assert engine.stats().spec_num_accepted_tokens > 0


def test_draft_passes_run_on_decode_graphs(model_factory, drafts) -> None:
    from inflight.runtime.worker.graph_backend import RecordingGraphBackend

    model_dir = model_factory("llama")
    requests = _requests(1000)[:4]
    off = _run(_engine(model_dir, None), requests)
    backend = RecordingGraphBackend()
    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=128, max_num_tokens=256, kernel_backend="cpu",
                          max_num_sequences=32, speculative_config=draft_spec(drafts["perturbed"]))  # fmt: skip
    engine = LLMEngine.from_model_dir(model_dir, config, graph_backend=backend)
    assert engine.drafter is not None and engine.drafter.runner.graphs is not None
    assert _run(engine, requests) == off
    assert backend.num_replays > 0 and engine.stats().spec_num_drafts > 0


def _hf_probs(model_dir: Path, prompt: list[int], temperature: float, top_k: int) -> torch.Tensor:
    """transformers' next-token distribution after ``prompt`` under temperature and top-k."""
    from tests.runtime.hf_reference import _hf_model

    with torch.no_grad():
        logits = _hf_model(str(model_dir))(torch.tensor([prompt])).logits[0, -1].float() / temperature
    kept = logits.topk(top_k).indices
    masked = torch.full_like(logits, float("-inf"))
    masked[kept] = logits[kept]
    return torch.softmax(masked, dim=-1)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom; tokens expected fewer than 5 times pooled."""
    n = float(counts.sum())
    expected = probs * n
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    wanted = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = wanted > 0
    assert float(observed[~keep].sum()) == 0, "a token the target never samples was emitted"
    observed, wanted = observed[keep], wanted[keep]
    return float(((observed - wanted) ** 2 / wanted).sum()), int(keep.sum()) - 1


def test_sampled_tokens_follow_the_target_distribution(model_factory, drafts) -> None:
    """The first output token comes from the plain sampler; the second is the first one the
    verification emits (an accepted draft, a residual draw or the bonus token): over many seeds,
    given the most common first token, the second follows transformers' target distribution,
    though the perturbed draft model proposes from a different one."""
    model_dir = model_factory("llama")
    prompt = _requests(1000)[1][0]
    temperature, top_k, num = 1.5, 6, 1500
    engine = _engine(model_dir, draft_spec(drafts["perturbed"]), max_num_sequences=128, num_kv_blocks=1024,
                     max_num_tokens=1024, max_queue_len=num)  # fmt: skip
    params = [SamplingParams(max_tokens=5, temperature=temperature, top_k=top_k, seed=s, ignore_eos=True)
              for s in range(num)]  # fmt: skip
    out = _run(engine, [(prompt, p) for p in params])
    assert _acceptance(engine) < 0.9  # the draft's q differs from p: rejections happen
    firsts = torch.tensor([tokens[0] for _, tokens, _ in out.values()])
    mode = int(firsts.mode().values)
    seconds = torch.tensor([tokens[1] for _, tokens, _ in out.values() if tokens[0] == mode])
    assert len(seconds) >= 200
    counts = torch.bincount(seconds, minlength=engine.vocab_size).float()
    stat, dof = _chi_square(counts, _hf_probs(model_dir, prompt + [mode], temperature, top_k))
    assert dof >= 2 and stat < CHI2_999[dof], (stat, dof)


def test_rejection_sampling_with_the_draft_distribution() -> None:
    """Drafts drawn from ``q``: the emitted token follows ``p`` (chi-square) whatever ``q`` is,
    and a draft is kept as often as ``min(1, p/q)`` makes it (``sum(min(p, q))``): the rule
    uses ``q``, not the n-gram's point mass (which keeps ``sum(p * q)``)."""
    torch.manual_seed(0)
    vocab, trials = 6, 6000
    logits = torch.randn(2, vocab) * 1.5
    logits[:, 5] = float("-inf")  # the target never picks token 5
    params = SamplingParams(temperature=0.8, max_tokens=8, seed=1)
    p = torch.softmax(logits[0] / 0.8, dim=-1)
    near = torch.softmax(logits[0] / 0.8 + 0.7 * torch.randn(vocab), dim=-1)
    for q in (near, torch.full((vocab,), 1.0 / vocab), torch.tensor([0.05, 0.05, 0.05, 0.05, 0.05, 0.75])):
        gen = torch.Generator().manual_seed(int(q[0] * 1e6))
        row = SamplingRow(params, [1], [], gen, (0,))
        counts = torch.zeros(vocab)
        for _ in range(trials):
            draft = int(torch.multinomial(q, 1, generator=gen))
            counts[verify_sampled(logits, (draft,), row, q[None])[0]] += 1
        stat, dof = _chi_square(counts, p)
        assert stat < CHI2_999[dof], (q.tolist(), stat, counts.tolist())
    gen = torch.Generator().manual_seed(3)
    row = SamplingRow(params, [1], [], gen, (0,))
    accepted = sum(len(verify_sampled(logits, (d,), row, near[None])) == 2
                   for d in torch.multinomial(near, trials, replacement=True, generator=gen).tolist())
    want = float(torch.minimum(p, near).sum())
    assert abs(accepted / trials - want) < 4 * (want * (1 - want) / trials) ** 0.5, (accepted / trials, want)


def test_sampled_requests_keep_every_draft_of_the_target_as_its_own_draft(model_factory) -> None:
    """q equals p when the draft is the target, so min(1, p/q) keeps every draft (a point-mass
    rule would keep only sum(p^2) of them)."""
    model_dir = model_factory("llama")
    engine = _engine(model_dir, draft_spec(model_dir))
    params = [SamplingParams(max_tokens=25, temperature=1.5, seed=i, ignore_eos=True) for i in range(4)]
    out = _run(engine, [(prompt, p) for (prompt, _), p in zip(_requests(1000)[:4], params, strict=True)])
    assert all(len(tokens) == 25 for _, tokens, _ in out.values())
    assert _acceptance(engine) > 0.95


def test_a_draft_model_must_exist_and_share_the_vocabulary(model_factory, tmp_path: Path) -> None:
    target = model_factory("llama")
    other_vocab = model_factory("llama", "small")  # 4096 tokens, the target has 1024
    swapped = tmp_path / "swapped"
    shutil.copytree(target, swapped)
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    cases = [
        (tmp_path / "missing", "is not a directory"),
        (tmp_path, "has no config.json"),
        (other_vocab, "vocabulary (4096 tokens"),
        (swapped, "the draft model's tokenizer"),
    ]
    for draft, said in cases:
        with pytest.raises(ValueError, match=re.escape(said)):
            LLMEngine.from_model_dir(target, EngineConfig(device="cpu", speculative_config=draft_spec(draft)))
    short = tmp_path / "short"
    shutil.copytree(target, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    with pytest.raises(ValueError, match=r"supports 512 positions \(.*\), fewer than max_model_len 1024; set --max-model-len 512"):
        LLMEngine.from_model_dir(target, EngineConfig(device="cpu", speculative_config=draft_spec(short)))
    with pytest.raises(ValueError, match="needs tensor_parallel_size 1"):
        EngineConfig(speculative_config=draft_spec(target), tensor_parallel_size=2)


def test_serve_refuses_a_bad_draft_before_loading(model_factory, tmp_path: Path, capsys, logging_restored) -> None:
    from inflight.runtime.cli.command import main

    target = model_factory("llama")
    other_vocab = model_factory("llama", "small")
    for draft, said in ((tmp_path / "nope", "is not a directory"), (other_vocab, "differs from the served model's")):
        assert main(["serve", str(target), "--port", "0", "--speculative-config", draft_spec(draft)]) == 1
        err = capsys.readouterr().err
        assert said in err and "loading weights" not in err, err
    with pytest.raises(SystemExit) as usage:
        main(["serve", str(target), "--port", "0", "--speculative-config", '{"method": "draft_model"}'])
    assert usage.value.code == 2 and 'needs "model"' in capsys.readouterr().err


def test_the_cr_carries_a_draft_model_to_the_flag() -> None:
    """``spec.engine.speculativeConfig`` with vLLM's draft-model keys: the CRD keeps ``model``
    (a structural schema would prune an unknown key) and it reaches ``--speculative-config``."""
    from inflight.operator import crd, engine_args

    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec_props = schema["properties"]["spec"]["properties"]["engine"]["properties"]["speculativeConfig"]
    assert spec_props["properties"]["model"]["type"] == "string"
    assert "draft_model" in spec_props["properties"]["method"]["enum"]
    cr = {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 3}
    values = engine_args.parse_engine({"speculativeConfig": cr})
    assert json.loads(values["speculative_config"]) == cr
    with pytest.raises(ValueError, match='needs "model"'):
        engine_args.parse_engine({"speculativeConfig": {"method": "draft_model"}})


def test_blocks_leave_only_once_out_of_both_models_windows(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from inflight.runtime.core.kv_manager import release_window

    def spec(window: int | None, layers: int = 2) -> SimpleNamespace:
        return SimpleNamespace(sliding_window=window, sliding_layers=tuple(range(layers)) if window else (),
                               num_layers=layers)  # fmt: skip

    assert release_window(spec(16), spec(32)) == 32  # the wider window keeps its blocks
    assert release_window(spec(16), spec(None)) is None  # a full-attention draft reads every block
    assert release_window(spec(None), spec(16)) is None
    windowed = make_demo_model(tmp_path / "windowed", "mistral", config_overrides={"sliding_window": 16})
    requests = [(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
                for prompt, _ in _requests(1000)[:4]]  # fmt: skip
    off = _run(_engine(windowed, None), requests)
    engine = _engine(windowed, draft_spec(windowed))
    assert engine.kv.sliding_window == 16
    assert _run(engine, requests) == off
    assert _acceptance(engine) > 0.9


def test_a_hybrid_draft_model_is_refused_at_start(model_factory, tmp_path: Path) -> None:
    """A hybrid model (a recurrent state per sequence) drafts nothing: refused before loading, with the reason
    (a hybrid *served* model may take a plain draft: tests/engine/test_hybrid_speculative.py)."""
    from tests.runtime.granite_hybrid_models import make_granite_hybrid

    target = model_factory("llama")
    hybrid = make_granite_hybrid(tmp_path / "granite")
    with pytest.raises(ValueError, match=r"is a hybrid model \(granite.*\); a draft model must be a plain decoder"):
        LLMEngine.from_model_dir(target, EngineConfig(device="cpu", speculative_config=draft_spec(hybrid)))
