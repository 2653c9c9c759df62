"""EAGLE-3 speculation (``"method": "eagle3"``) with heads written here in the published layout
(``EAGLE3-LLaMA3.1-Instruct-8B``'s config keys and tensor names): greedy output identical with the
head on and off (a random head, and a head that copies an echoing target so nearly every draft is
kept, through the chain and a reduced draft vocabulary), with chunked prompts, forced preemption
and prefix hits; seeded sampling still reproducible; the acceptance counters behind the
``spec_decode_*`` metrics; the aux hidden states the target hands over; the start-up refusals
(another hidden size or vocabulary, missing tensors, aux layers the target lacks, EAGLE-1);
tensor parallelism (TP=2) token for token."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.demo.model import make_demo_model
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.spec_decode.eagle3 import Eagle3Proposer
from tests.runtime.test_speculative import CASE_KNOBS, _engine, _requests, _run
from tests.runtime.test_speculative_draft import CHI2_999, _chi_square, _hf_probs

AUX = [0, 1, 3]  # the embeddings and the states entering layers 1 and 3 of the 4-layer target
LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "rms_norm_eps", "rope_parameters", "max_position_embeddings", "vocab_size")  # fmt: skip


def eagle3_spec(head: Path, k: int = 3) -> str:
    return json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": k,
                       "disable_by_batch_size": 64})  # fmt: skip


def make_head(target: Path, out: Path, *, copy: bool = False, draft_ids: list[int] | None = None,
              seed: int = 0, norm: float = 1.0, **config_extra: object) -> Path:  # fmt: skip
    """A head for ``target`` in the published layout: random (seeded), or with ``copy`` one that
    proposes the token at its position (``fc`` passes the embeddings through, attention and MLP
    add nothing, ``lm_head`` is the target's embedding table) for the echoing target below."""
    cfg = json.loads((target / "config.json").read_text())
    weights = load_file(target / "model.safetensors")
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    vocab = cfg["vocab_size"]
    ids = torch.arange(vocab) if draft_ids is None else torch.tensor(sorted(draft_ids))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return 0.1 * torch.randn(*shape, generator=gen)

    head = {
        "fc.weight": rand(hidden, 3 * hidden), "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden), "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": rand(q, 2 * hidden), "midlayer.self_attn.k_proj.weight": rand(kv, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv, 2 * hidden), "midlayer.self_attn.o_proj.weight": rand(hidden, q),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden), "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter), "norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(len(ids), hidden),
        "d2t": ids - torch.arange(len(ids)), "t2d": torch.isin(torch.arange(vocab), ids),
    }  # fmt: skip
    if copy:
        head["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, 2 * hidden)], dim=1)
        head["midlayer.self_attn.o_proj.weight"].zero_()
        head["midlayer.mlp.down_proj.weight"].zero_()
        head["lm_head.weight"] = weights["model.embed_tokens.weight"][ids].clone()
        head["norm.weight"].fill_(norm)
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in head.items()}, out / "model.safetensors", metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
              **{key: cfg[key] for key in LAYER_KEYS}, "draft_vocab_size": len(ids), "torch_dtype": "float32",
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX, "use_aux_hidden_state": True},
              **config_extra}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    return out


def echo_target(out: Path, norm: float = 1.0) -> Path:
    """A 4-layer llama whose layers add nothing and whose head is its (tied) embedding table: its
    greedy next token is its current one, so a copying head's drafts are kept. A small final
    ``norm`` spreads its sampling distribution around that token."""
    target = make_demo_model(out, "llama", config_overrides={"num_hidden_layers": 4})
    weights = load_file(target / "model.safetensors")
    for name, value in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            value.zero_()
        if name == "model.norm.weight":
            value.fill_(norm)
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eagle3")
    target = make_demo_model(root / "target", "llama", config_overrides={"num_hidden_layers": 4})
    echo = echo_target(root / "echo")
    soft = echo_target(root / "soft-echo", norm=0.05)
    prompts = {t for prompt, _ in _requests(1024) for t in prompt}
    subset = sorted(prompts | set(range(0, 1024, 3)))  # a reduced draft vocabulary holding every prompt token
    return {"target": target, "random": make_head(target, root / "random"), "echo": echo,
            "random-subset": make_head(target, root / "random-subset", draft_ids=subset, seed=1),
            "soft-echo": soft, "soft-copy": make_head(soft, root / "soft-copy", copy=True, draft_ids=subset, norm=0.05),
            "copy": make_head(echo, root / "copy", copy=True),
            "copy-subset": make_head(echo, root / "copy-subset", copy=True, draft_ids=subset)}  # fmt: skip


def _check_counters(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats.spec_num_drafts > 0, stats
    assert sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens
    assert stats.spec_num_draft_tokens <= 3 * stats.spec_num_drafts
    assert engine.pool.num_used_blocks == 0  # every finished request gave its blocks back


@pytest.mark.parametrize("case", ["plain", *CASE_KNOBS])
def test_greedy_output_is_identical_with_a_random_head(models, case: str) -> None:
    knobs = CASE_KNOBS.get(case, {})
    requests = _requests(1024)
    off = _run(_engine(models["target"], None, **knobs), requests)
    engine = _engine(models["target"], eagle3_spec(models["random"]), **knobs)
    assert isinstance(engine.drafter, Eagle3Proposer)
    assert _run(engine, requests) == off
    _check_counters(engine)
    if case == "preemption":
        assert engine.stats().num_preemptions > 0
    if case == "prefix-cache":
        assert engine.stats().prefix_cache_hits > 0


@pytest.mark.parametrize("head", ["copy", "copy-subset"])
@pytest.mark.parametrize("case", ["plain", *CASE_KNOBS])
def test_a_copying_head_has_its_chain_kept(models, head: str, case: str) -> None:
    knobs = CASE_KNOBS.get(case, {})
    requests = _requests(1024)
    off = _run(_engine(models["echo"], None, **knobs), requests)
    engine = _engine(models["echo"], eagle3_spec(models[head]), **knobs)
    assert _run(engine, requests) == off
    _check_counters(engine)
    stats = engine.stats()
    assert stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens > 0.9, stats
    assert stats.spec_accepted_per_position[2] > 0.7 * stats.spec_accepted_per_position[0]  # the chain's third draft
    # a request whose prompt the cache held but for its last token speculates before any state is kept
    assert engine.drafter.num_fallback_proposals <= 0.1 * stats.spec_num_drafts
    if case == "prefix-cache":
        assert stats.prefix_cache_hits > 0


def test_seeded_sampling_stays_seeded(models) -> None:
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    requests = [(prompt, p) for (prompt, _), p in zip(_requests(1024), params, strict=False)]
    runs = []
    for head in ("random", "random", "copy"):
        target = models["echo"] if head == "copy" else models["target"]
        engine = _engine(target, eagle3_spec(models[head]))
        runs.append(_run(engine, requests))
        _check_counters(engine)
    assert runs[0] == runs[1]
    assert len({out[0] for out in runs[0].values()}) == 3  # the seeds differ, so do the samples


@pytest.mark.parametrize(("target", "head"), [("target", "random-subset"), ("soft-echo", "soft-copy")])
def test_sampled_tokens_follow_the_target_distribution(models, target: str, head: str) -> None:
    """As for a draft model: over many seeds, given the most common first token, the second (the
    first the verification emits) follows transformers' target distribution, whether the head's
    ``q`` (over a reduced draft vocabulary, -inf elsewhere) rarely overlaps ``p`` (a random head:
    mostly residual draws) or often equals it (a copying head on a softly echoing target: mostly
    kept drafts, which only ``min(1, p/q)`` with the head's own ``q`` keeps at the right rate)."""
    target_dir = models[target]
    prompt = _requests(1024)[1][0]
    temperature, top_k, num = 1.5, 6, 1500
    engine = _engine(target_dir, eagle3_spec(models[head]), max_num_sequences=32, num_kv_blocks=1024,
                     max_num_tokens=1024, max_queue_len=num)  # fmt: skip
    params = [SamplingParams(max_tokens=5, temperature=temperature, top_k=top_k, seed=s, ignore_eos=True)
              for s in range(num)]  # fmt: skip
    out = _run(engine, [(prompt, p) for p in params])
    stats = engine.stats()
    assert stats.spec_num_draft_tokens > num, stats  # nearly every request's second token was verified
    if head == "soft-copy":
        assert stats.spec_accepted_per_position[0] > 0.15 * stats.spec_num_drafts, stats  # ~0.05 with an n-gram q
    firsts = torch.tensor([tokens[0] for _, tokens, _ in out.values()])
    mode = int(firsts.mode().values)
    seconds = torch.tensor([tokens[1] for _, tokens, _ in out.values() if tokens[0] == mode])
    assert len(seconds) >= 200
    counts = torch.bincount(seconds, minlength=engine.vocab_size).float()
    stat, dof = _chi_square(counts, _hf_probs(target_dir, prompt + [mode], temperature, top_k))
    assert dof >= 2 and stat < CHI2_999[dof], (stat, dof)


def test_the_head_reads_the_targets_aux_states(models) -> None:
    """The kept state is ``fc`` of the residual stream entering layers 0, 1 and 3 at the prompt's
    last position (the head ran the others at once), as transformers' own forward computes them
    (its hidden_states[i] enters layer i)."""
    from transformers import AutoModelForCausalLM

    engine = _engine(models["target"], eagle3_spec(models["random"]))
    prompt = _requests(1024)[2][0]
    engine.add_request("a", prompt, SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()
    drafter = engine.drafter
    kept = next(iter(drafter._kept.values()))
    hf = AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32)
    with torch.no_grad():
        states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    aux = torch.cat([states[i][0] for i in AUX], dim=-1)
    want = aux[-1:] @ drafter.head.fc.weight.T
    assert kept.start == len(prompt) - 1 and kept.hidden.shape == want.shape
    assert engine.scheduler.running[0].draft_kv_lag == 1
    torch.testing.assert_close(kept.hidden, want, atol=2e-4, rtol=2e-4)


def _refused(models, tmp_path: Path, edit, match: str, source: str, weights: bool) -> None:
    """Refused by the engine's start, and (a config problem, not a ``weights`` one) by
    ``inflight serve``'s preflight, which reads no weights."""
    from inflight.runtime.engine_core.served_facts import read_served_facts

    head = tmp_path / "head"
    shutil.copytree(models[source], head)
    edit(head)
    with pytest.raises(ValueError, match=match):
        _engine(models["target"], eagle3_spec(head))
    if not weights:
        with pytest.raises(ValueError, match=match):
            read_served_facts(models["target"], EngineConfig(speculative_config=eagle3_spec(head)))


def _config_edit(**changes: object):
    def edit(head: Path) -> None:
        cfg = json.loads((head / "config.json").read_text())
        cfg.update(changes)
        (head / "config.json").write_text(json.dumps(cfg))
    return edit


def _drop_tensor(name: str):
    def edit(head: Path) -> None:
        weights = load_file(head / "model.safetensors")
        del weights[name]
        save_file(weights, head / "model.safetensors")
    return edit


CONFIG, WEIGHTS = False, True  # where a problem shows: the head's config.json, or its tensors


@pytest.mark.parametrize(("edit", "match", "source", "weights"), [
    (_config_edit(target_hidden_size=128), "hidden size 128; the served model's is 64", "random", CONFIG),
    (_config_edit(vocab_size=2048), "vocabulary of 2048 tokens; the served model has 1024", "random", CONFIG),
    (_config_edit(architectures=["LlamaForCausalLM"]), "is not an EAGLE-3 head", "random", CONFIG),
    (_config_edit(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}), "three different ids in 0..3",
     "random", CONFIG),
    (_config_edit(eagle_config={}), r"layers \[2, 2, 1\] \(vLLM's default", "random", CONFIG),
    (_config_edit(num_hidden_layers=2), "only one-layer heads", "random", CONFIG),
    (_drop_tensor("midlayer.hidden_norm.weight"), "missing hidden_norm.weight", "random", WEIGHTS),
    (_drop_tensor("d2t"), "no d2t tensor", "copy-subset", WEIGHTS),
    (_config_edit(hidden_size=32, target_hidden_size=64), "needs embed_tokens.weight of its own", "random", WEIGHTS),
    (_config_edit(draft_vocab_size=100), r"lm_head.weight is \[1024, 64\], its config says \[100, 64\]", "random",
     WEIGHTS),
])  # fmt: skip
def test_a_mismatched_head_is_refused_at_start(models, tmp_path: Path, edit, match: str, source: str,
                                               weights: bool) -> None:  # fmt: skip
    _refused(models, tmp_path, edit, match, source, weights)


def test_a_head_with_the_full_vocabulary_needs_no_d2t(models, tmp_path: Path) -> None:
    head = make_head(models["target"], tmp_path / "full")
    weights = load_file(head / "model.safetensors")
    del weights["d2t"], weights["t2d"]
    save_file(weights, head / "model.safetensors")
    engine = _engine(models["target"], eagle3_spec(head))
    requests = _requests(1024)[:3]
    assert _run(engine, requests) == _run(_engine(models["target"], None), requests)


@pytest.mark.parametrize(("text", "match"), [
    ('{"method": "eagle", "model": "/m"}', 'method "eagle" .EAGLE-1/2 heads. is not served'),
    ('{"method": "eagle3"}', 'method "eagle3" needs "model"'),
])  # fmt: skip
def test_config_refusals(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(speculative_config=text)


@pytest.mark.parametrize("head", ["random", "copy"])
def test_tensor_parallel_two_ranks_give_the_same_tokens(models, head: str) -> None:
    """TP=2 (gloo, a worker process): the head runs on rank 0 over rank 0's whole hidden states,
    with the served model's whole embedding table; tokens equal TP=1 without speculation."""
    target = models["echo" if head == "copy" else "target"]
    requests = _requests(1024)
    knobs = dict(enable_prefix_caching=True, num_kv_blocks=64)
    off = _run(_engine(target, None, **knobs), requests)
    engine = _engine(target, eagle3_spec(models[head]), tensor_parallel_size=2, **knobs)
    try:
        assert engine.drafter.embeddings is not None
        assert _run(engine, requests) == off
        _check_counters(engine)
        stats = engine.stats()
        if head == "copy":
            assert stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens > 0.9, stats
    finally:
        engine.close()


def test_the_heads_kv_equals_one_pass_over_the_sequence(models) -> None:
    """The head's KV built step by step (prompt at once, the kept rows a step later, chained
    drafts overwritten once verified) equals one pass of the head over the whole sequence, with
    the target's states as transformers computes them, wherever it is not lagging."""
    from transformers import AutoModelForCausalLM

    from inflight.runtime.spec_decode.eagle3 import _Pass
    from inflight.runtime.worker.batch_inputs import Segment

    engine = _engine(models["target"], eagle3_spec(models["random"]), enable_prefix_caching=False,
                     max_num_tokens=24)  # fmt: skip
    prompt = _requests(1024)[4][0]
    engine.add_request("a", prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for _ in range(12):
        engine.step()
    req = engine.scheduler.running[0]
    n = req.num_computed_tokens - req.draft_kv_lag
    assert n > len(prompt) + 3 and engine.stats().spec_num_drafts > 0
    hf = AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32)
    with torch.no_grad():
        states = hf(torch.tensor([req.token_ids[:n]]), output_hidden_states=True).hidden_states
    drafter = engine.drafter
    fused = torch.cat([states[i][0] for i in AUX], dim=-1) @ drafter.head.fc.weight.T
    live = drafter.kv_caches[0]
    drafter.kv_caches = [(torch.zeros_like(live[0]), torch.zeros_like(live[1]))]
    drafter._run(_Pass([Segment(req.token_ids[1 : n + 1], 0, req.block_ids, False)], [fused]))
    bs = engine.runner.block_size
    slots = torch.tensor([req.block_ids[p // bs] * bs + p % bs for p in range(n)])
    for got, want in zip(live, drafter.kv_caches[0], strict=True):
        torch.testing.assert_close(got.flatten(0, 1)[slots], want.flatten(0, 1)[slots], atol=1e-3, rtol=1e-3)


def test_the_host_tier_copies_the_heads_kv_too(models) -> None:
    """With kv_offloading_size, blocks evicted to the host and brought back carry the head's KV
    beside the target's: multi-turn chats in a pool too small to keep them give the tokens of
    the head off, with host hits, and the copying head's drafts still kept."""
    from tests.engine.test_host_tier_engine import _chats

    knobs = dict(block_size=4, num_kv_blocks=12, max_num_sequences=2, max_num_tokens=64)
    off = _chats(_engine(models["echo"], None, **knobs))
    engine = _engine(models["echo"], eagle3_spec(models["copy"]), kv_offloading_size=0.001, **knobs)
    assert engine.host_kv is not None  # each host block holds the target's KV and the head's
    assert engine.host_kv.bytes_per_block == engine.runner.bytes_per_block + engine.drafter.bytes_per_block
    assert _chats(engine) == off
    stats = engine.stats()
    assert stats.external_prefix_cache_hits > 0 and stats.kv_offload_loaded_blocks > 0, stats
    assert stats.spec_num_accepted_tokens > 0.8 * stats.spec_num_draft_tokens, stats
