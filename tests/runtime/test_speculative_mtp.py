"""MTP speculation (``"method": "mtp"``): the served model's own multi-token-prediction layer drafts,
on tiny random DeepSeek-V3 and GLM-4.5 checkpoints that carry one MTP layer under the published
names (``model.layers.3.{enorm,hnorm,eh_proj,shared_head.norm,shared_head.head,embed_tokens}`` beside
a full decoder layer ``model.layers.3.{self_attn,mlp,...}``, with ``num_nextn_predict_layers`` 1):
greedy output identical with MTP on and off (k=1 and k=3, the one layer reused for the chain) with
chunked prompts, forced preemption and prefix hits; drafts equal to a plain torch reference of the
MTP forward (transformers' own decoder layer over the checkpoint's tensors: transformers has no MTP);
an MTP layer that copies an echoing target has nearly every draft kept; sampled tokens still follow
the target's distribution; the acceptance counters; TP=2 equal to TP=1; what is refused."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from inflight.runtime.config import EngineConfig
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.spec_decode.mtp import MtpProposer
from tests.runtime.family_models import make_family_model
from tests.runtime.test_speculative import CASE_KNOBS, _engine, _requests, _run
from tests.runtime.test_speculative_draft import CHI2_999, _chi_square, _hf_probs

VOCAB = 1024
MTP = 3  # the targets have 3 decoder layers; their MTP layer is model.layers.3
ARCHS = ("deepseek_v3", "glm4_moe")
ZEROED = ("o_proj.weight", "down_proj.weight", "o_proj.bias")  # what an echoing model's blocks add: nothing


def mtp_spec(k: int = 3, method: str = "mtp") -> str:
    return json.dumps({"method": method, "num_speculative_tokens": k, "disable_by_batch_size": 64})


def make_mtp_model(out: Path, arch: str, *, echo: bool = False, seed: int = 3) -> Path:
    """A 3-layer ``arch`` model whose checkpoint carries an MTP layer: a 4-layer random model's last
    decoder layer renamed ``model.layers.3`` (its place in a published checkpoint) with the MTP
    tensors beside it. ``echo``: every block adds nothing and the LM heads are the embedding table,
    so the target's greedy next token is its current one, and the MTP layer (``eh_proj`` passing the
    normed embedding through) proposes that same token: a layer that agrees with its target."""
    full = make_family_model(out.with_name(out.name + "-full"), arch, seed, {"num_hidden_layers": MTP + 1})
    shutil.copytree(full, out)
    weights = load_file(out / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    hidden = cfg["hidden_size"]
    gen = torch.Generator().manual_seed(seed + 100)
    embed = weights["model.embed_tokens.weight"]
    prefix = f"model.layers.{MTP}."
    weights.update({
        prefix + "enorm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=gen),
        prefix + "hnorm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=gen),
        prefix + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen) / (2 * hidden) ** 0.5,
        prefix + "shared_head.norm.weight": 1.0 + 0.1 * torch.randn(hidden, generator=gen),
        prefix + "shared_head.head.weight": 0.1 * torch.randn(VOCAB, hidden, generator=gen),
        prefix + "embed_tokens.weight": embed.clone(),  # the published checkpoints carry a copy
        # the served model's final norm scaled (transformers starts it at 1), so that the layer reading
        # the state after it in place of the one before it would draft otherwise
        "model.norm.weight": 1.0 + 0.5 * torch.randn(hidden, generator=gen),
    })  # fmt: skip
    if echo:
        for name, value in weights.items():
            if name.endswith(ZEROED):
                value.zero_()
            if name.endswith("norm.weight") and ".self_attn." not in name:
                value.fill_(1.0)
        weights["lm_head.weight"] = embed.clone()
        weights[prefix + "shared_head.head.weight"] = embed.clone()
        weights[prefix + "eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    save_file({k: v.contiguous() for k, v in weights.items()}, out / "model.safetensors", metadata={"format": "pt"})
    cfg.update(num_hidden_layers=MTP, num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp")
    made = {}
    for arch in ARCHS:
        made[arch] = make_mtp_model(root / arch, arch)
        made[f"{arch}-echo"] = make_mtp_model(root / f"{arch}-echo", arch, echo=True)
    made["shared"] = without_own_tables(made["deepseek_v3-echo"], root / "shared")
    return made


def without_own_tables(model_dir: Path, out: Path) -> Path:
    """``model_dir`` with no ``embed_tokens`` / ``shared_head.head`` in its MTP layer."""
    shutil.copytree(model_dir, out)
    weights = load_file(out / "model.safetensors")
    del weights[f"model.layers.{MTP}.embed_tokens.weight"], weights[f"model.layers.{MTP}.shared_head.head.weight"]
    save_file(weights, out / "model.safetensors")
    return out


def _check_counters(engine, k: int = 3) -> None:
    stats = engine.stats()
    assert isinstance(engine.drafter, MtpProposer)
    assert stats.spec_num_drafts > 0, stats
    assert sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens
    assert stats.spec_num_draft_tokens <= k * stats.spec_num_drafts
    assert engine.pool.num_used_blocks == 0  # every finished request gave its blocks back


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("case", ["plain", *CASE_KNOBS])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_is_identical_with_mtp_on_and_off(models, arch: str, case: str, k: int) -> None:
    knobs = CASE_KNOBS.get(case, {})
    requests = _requests(VOCAB)
    off = _run(_engine(models[arch], None, **knobs), requests)
    engine = _engine(models[arch], mtp_spec(k), **knobs)
    assert _run(engine, requests) == off
    _check_counters(engine, k)
    if case == "preemption":
        assert engine.stats().num_preemptions > 0
    if case == "prefix-cache":
        assert engine.stats().prefix_cache_hits > 0


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@functools.lru_cache(maxsize=2)
def _reference_parts(model_dir: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """transformers' model of the checkpoint before its last layer was renamed, and the MTP layer's tensors."""
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(model_dir.with_name(model_dir.name + "-full"), dtype=torch.float32,
                                                attn_implementation="eager")  # fmt: skip
    prefix = f"model.layers.{MTP}."
    weights = load_file(model_dir / "model.safetensors")
    return full, {name.removeprefix(prefix): value for name, value in weights.items() if name.startswith(prefix)}


def reference_drafts(model_dir: Path, tokens: list[int], k: int) -> list[int]:
    """The MTP layer's ``k`` chained greedy drafts after ``tokens`` (the last not yet computed), in
    plain torch: the served model's last-layer outputs from transformers (the 4-layer model the
    checkpoint was cut from: its ``hidden_states[3]`` enters layer 3) through the served model's
    final norm (the model's output, as vLLM and SGLang hand it to the layer), and the MTP layer as
    DeepSeek-V3's paper and vLLM compute it, with transformers' own decoder layer as its
    block (``model.layers[3]`` of that model, whose tensors the MTP layer's are)."""
    full, t = _reference_parts(model_dir)
    eps = full.config.rms_norm_eps
    s = len(tokens) - 1
    with torch.no_grad():
        target = full(torch.tensor([tokens[:s]]), output_hidden_states=True).hidden_states[MTP][0]  # [s, hidden]
        target = _rms(target, load_file(model_dir / "model.safetensors")["model.norm.weight"], eps)  # the served norm
        ids, states = list(tokens[1:]), [target[p] for p in range(s)]
        drafts: list[int] = []
        for _ in range(k):
            n = len(ids)
            positions = torch.arange(n)
            emb = t["embed_tokens.weight"][torch.tensor(ids)].clone()
            emb[positions == 0] = 0.0
            x = torch.cat([_rms(emb, t["enorm.weight"], eps), _rms(torch.stack(states), t["hnorm.weight"], eps)], -1)
            x = x @ t["eh_proj.weight"].T
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            rope = full.model.rotary_emb(x[None], positions[None])
            out = full.model.layers[MTP](x[None], attention_mask=mask, position_ids=positions[None],
                                         position_embeddings=rope)  # fmt: skip
            out = (out[0] if isinstance(out, tuple) else out)[0]  # [n, hidden], before shared_head.norm
            logits = _rms(out[-1], t["shared_head.norm.weight"], eps) @ t["shared_head.head.weight"].T
            drafts.append(int(logits.argmax()))
            ids.append(drafts[-1])
            states.append(out[-1])
    return drafts


@pytest.mark.parametrize("arch", ARCHS)
def test_drafts_equal_a_plain_torch_reference_of_the_mtp_layer(models, arch: str) -> None:
    """Every draft chain of a decoding request (the first draft from the target's state, the next two
    from the layer's own) is what the reference computes from the tokens known at that step."""
    engine = _engine(models[arch], mtp_spec(3), enable_prefix_caching=False, max_num_tokens=16)
    seen: list[tuple[int, tuple[int, ...]]] = []
    propose = engine.drafter.propose

    def recording(chunks, sampling_row):
        fallbacks = engine.drafter.num_fallback_proposals
        proposal = propose(chunks, sampling_row)
        if engine.drafter.num_fallback_proposals == fallbacks:  # not the last-token proposal of a state-less chunk
            seen.extend((c.start, c.draft_token_ids) for c in proposal.chunks if c.draft_token_ids)
        return proposal

    engine.drafter.propose = recording
    prompt = _requests(VOCAB)[3][0]
    out = _run(engine, [(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))])
    tokens = prompt + list(out["0"][1])
    # the prompt's last 16-token chunk ends one short of it: its last token speculates as a chunk of its own
    # before any state is kept (eagle3.py's rare case), so proposes its last token
    assert len(seen) >= 4 and engine.drafter.num_fallback_proposals == 1
    for start, drafts in seen:
        assert list(drafts) == reference_drafts(models[arch], tokens[: start + 1], len(drafts)), start


@pytest.mark.parametrize("case", ["plain", *CASE_KNOBS])
@pytest.mark.parametrize("arch", ARCHS)
def test_an_mtp_layer_that_agrees_with_its_target_has_its_chain_kept(models, arch: str, case: str) -> None:
    knobs = CASE_KNOBS.get(case, {})
    requests = _requests(VOCAB)
    echo = models[f"{arch}-echo"]
    off = _run(_engine(echo, None, **knobs), requests)
    engine = _engine(echo, mtp_spec(3), **knobs)
    assert _run(engine, requests) == off
    _check_counters(engine)
    stats = engine.stats()
    assert stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens > 0.9, stats
    assert stats.spec_accepted_per_position[2] > 0.7 * stats.spec_accepted_per_position[0]  # the chain's third draft
    assert engine.drafter.num_fallback_proposals <= 0.1 * stats.spec_num_drafts  # the drafts are the layer's own
    if case == "preemption":
        assert stats.num_preemptions > 0
    if case == "prefix-cache":
        assert stats.prefix_cache_hits > 0


def test_a_checkpoint_sharing_the_served_models_tables_reads_them(models) -> None:
    """Without ``embed_tokens`` and ``shared_head.head`` of its own the layer reads the served model's
    embedding table and LM head (here both the embedding table of the echoing model)."""
    requests = _requests(VOCAB)[:4]
    engine = _engine(models["shared"], mtp_spec(3))
    assert engine.drafter.head.embed_tokens is None and engine.drafter.head.lm_head_weight is not None
    assert _run(engine, requests) == _run(_engine(models["shared"], None), requests)
    stats = engine.stats()
    assert stats.spec_num_accepted_tokens > 0.9 * stats.spec_num_draft_tokens, stats


def test_seeded_sampling_stays_seeded(models) -> None:
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    requests = [(prompt, p) for (prompt, _), p in zip(_requests(VOCAB), params, strict=False)]
    runs = [_run(_engine(models["deepseek_v3"], mtp_spec(3)), requests) for _ in range(2)]
    assert runs[0] == runs[1]
    assert len({out[0] for out in runs[0].values()}) == 3  # the seeds differ, so do the samples


@pytest.mark.parametrize("model", ["glm4_moe", "glm4_moe-echo"])
def test_sampled_tokens_follow_the_target_distribution(models, model: str) -> None:
    """As for a draft model and an EAGLE-3 head: over many seeds, given the most common first token,
    the second (the first the verification emits) follows transformers' target distribution, whether
    the layer's ``q`` rarely overlaps ``p`` (random weights) or nearly equals it (the echoing layer
    on its echoing target, whose drafts are kept at the rate ``min(1, p/q)`` sets)."""
    model_dir = models[model]
    prompt = _requests(VOCAB)[1][0]
    temperature, top_k, num = 1.5, 6, 1000
    engine = _engine(model_dir, mtp_spec(3), max_num_sequences=32, num_kv_blocks=1024, max_num_tokens=1024,
                     max_queue_len=num)  # fmt: skip
    params = [SamplingParams(max_tokens=5, temperature=temperature, top_k=top_k, seed=s, ignore_eos=True)
              for s in range(num)]  # fmt: skip
    out = _run(engine, [(prompt, p) for p in params])
    stats = engine.stats()
    assert stats.spec_num_draft_tokens > num, stats  # nearly every request's second token was verified
    if model.endswith("-echo"):  # q near p: many drafts kept (a random layer's are nearly never)
        assert stats.spec_accepted_per_position[0] > 0.3 * stats.spec_num_drafts, stats
    firsts = torch.tensor([tokens[0] for _, tokens, _ in out.values()])
    mode = int(firsts.mode().values)
    seconds = torch.tensor([tokens[1] for _, tokens, _ in out.values() if tokens[0] == mode])
    assert len(seconds) >= 150
    counts = torch.bincount(seconds, minlength=engine.vocab_size).float()
    stat, dof = _chi_square(counts, _hf_probs(model_dir, prompt + [mode], temperature, top_k))
    assert dof >= 2 and stat < CHI2_999[dof], (stat, dof)


@pytest.mark.parametrize("model", ["deepseek_v3", "glm4_moe-echo", "shared"])
def test_tensor_parallel_two_ranks_give_the_same_tokens(models, model: str) -> None:
    """TP=2 (gloo, a worker process): the MTP layer runs whole on rank 0 over rank 0's whole hidden
    states (with the served model's whole tables read from the checkpoint when it has none of its
    own); tokens equal TP=1 without speculation, under prefix hits."""
    requests = _requests(VOCAB)
    knobs = dict(enable_prefix_caching=True, num_kv_blocks=64)
    off = _run(_engine(models[model], None, **knobs), requests)
    engine = _engine(models[model], mtp_spec(3), tensor_parallel_size=2, **knobs)
    try:
        assert (engine.drafter.embeddings is not None) == (model == "shared")
        assert _run(engine, requests) == off
        _check_counters(engine)
        stats = engine.stats()
        if model != "deepseek_v3":
            assert stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens > 0.9, stats
    finally:
        engine.close()


@pytest.mark.parametrize(("text", "method"), [
    ('{"method": "mtp", "num_speculative_tokens": 1}', "mtp"),
    ('{"method": "deepseek_mtp", "num_speculative_tokens": 1}', "mtp"),  # vLLM's older names
    ('{"method": "glm4_moe_mtp", "num_speculative_tokens": 2}', "mtp"),
])  # fmt: skip
def test_vllm_spellings_parse(text: str, method: str) -> None:
    from inflight.runtime.spec_decode.speculative import parse_speculative_config

    spec = parse_speculative_config(text)
    assert spec is not None and spec.method == method and spec.model is None


def test_a_model_key_is_refused() -> None:
    with pytest.raises(ValueError, match=r"method \"mtp\" reads the served model's own .* leave it out"):
        EngineConfig(speculative_config='{"method": "mtp", "model": "/models/draft"}')


def _refused(model_dir: Path, match: str, *, preflight: bool = True) -> None:
    """Refused by the engine's start, and (a config or tensor-name problem) by ``inflight serve``'s
    preflight, which reads no weights."""
    from inflight.runtime.engine_core.served_facts import read_served_facts

    with pytest.raises(ValueError, match=match):
        _engine(model_dir, mtp_spec(1))
    if preflight:
        with pytest.raises(ValueError, match=match):
            read_served_facts(model_dir, EngineConfig(speculative_config=mtp_spec(1)))


def _edited(models, tmp_path: Path, source: str, config: dict | None = None, drop: str | None = None,
            reshape: str | None = None) -> Path:  # fmt: skip
    out = tmp_path / "edited"
    shutil.copytree(models[source], out)
    if config:
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(config)
        (out / "config.json").write_text(json.dumps(cfg))
    if drop or reshape:
        weights = load_file(out / "model.safetensors")
        if drop:
            del weights[drop]
        if reshape:
            weights[reshape] = weights[reshape][:-1].contiguous()
        save_file(weights, out / "model.safetensors")
    return out


def test_a_model_without_mtp_layers_is_refused(models, tmp_path: Path) -> None:
    _refused(_edited(models, tmp_path, "deepseek_v3", config={"num_nextn_predict_layers": 0}),
             r"declares no multi-token-prediction layers \(config.json num_nextn_predict_layers 0\)")


def test_a_checkpoint_saved_without_its_mtp_layer_is_refused(tmp_path: Path) -> None:
    """transformers' save_pretrained keeps num_nextn_predict_layers 1 in config.json but drops the layer."""
    plain = make_family_model(tmp_path / "plain", "glm4_moe")
    _refused(plain, r"declares num_nextn_predict_layers 1 but the checkpoint .* has no tensor of its first MTP "
                    r"layer \(model.layers.3.\*\)")


@pytest.mark.parametrize(("drop", "reshape", "match"), [
    (f"model.layers.{MTP}.eh_proj.weight", None, f"lacks 1 tensor.*model.layers.{MTP}.eh_proj.weight"),
    (f"model.layers.{MTP}.mlp.experts.5.up_proj.weight", None, r"mlp.experts.gate_up_proj \(expert 5 up\)"),
    (None, f"model.layers.{MTP}.hnorm.weight", r"hnorm.weight: shape \[255\], expected \[256\]"),
])  # fmt: skip
def test_a_damaged_mtp_layer_is_refused_at_start(models, tmp_path: Path, drop, reshape, match: str) -> None:
    _refused(_edited(models, tmp_path, "deepseek_v3", drop=drop, reshape=reshape), match, preflight=False)


def test_other_families_are_refused(tmp_path: Path) -> None:
    from inflight.runtime.demo.model import make_demo_model
    from tests.engine.qwen3_next_models import make_qwen3_next

    llama = make_demo_model(tmp_path / "llama", "llama")
    _refused(llama, "multi-token-prediction layers of DeepSeek-V3 .* the served model is LlamaForCausalLM, which "
                    "has none")
    _refused(make_qwen3_next(tmp_path / "qwen3-next"), "Qwen3-Next checkpoint in .* has no MTP layer")


@pytest.mark.parametrize("case", ["plain", "preemption", "prefix-cache"])
@pytest.mark.parametrize("model", ["deepseek_v3", "glm4_moe-echo"])
def test_async_scheduling_gives_the_synchronous_tokens(models, model: str, case: str) -> None:
    """With async scheduling (core/async_steps.py) the MTP layer follows every pipelined step and
    drafts in the drained ones: greedy tokens equal those without speculation."""
    knobs = CASE_KNOBS.get(case, {})
    requests = _requests(VOCAB)
    off = _run(_engine(models[model], None, **knobs), requests)
    engine = _engine(models[model], mtp_spec(3), async_scheduling=True, **knobs)
    try:
        assert engine.pipeline is not None
        assert _run(engine, requests) == off
        _check_counters(engine)
        if model.endswith("-echo"):
            stats = engine.stats()
            assert stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens > 0.9, stats
    finally:
        engine.close()


def test_the_host_tier_copies_the_layers_latent_kv_too(models) -> None:
    """With kv_offloading_size, blocks evicted to the host and brought back carry the MTP layer's
    latent cache beside the target's: multi-turn chats in a pool too small to keep them give the
    tokens of speculation off, with host hits, and the agreeing layer's drafts still kept."""
    from tests.engine.test_host_tier_engine import _chats

    echo = models["deepseek_v3-echo"]
    knobs = dict(block_size=4, num_kv_blocks=12, max_num_sequences=2, max_num_tokens=64)
    off = _chats(_engine(echo, None, **knobs))
    engine = _engine(echo, mtp_spec(3), kv_offloading_size=0.001, **knobs)
    assert engine.host_kv is not None
    assert engine.host_kv.bytes_per_block == engine.runner.bytes_per_block + engine.drafter.bytes_per_block
    assert engine.drafter.bytes_per_block == 4 * (64 + 16) * 4  # one layer's latent + roped key, float32
    assert _chats(engine) == off
    stats = engine.stats()
    assert stats.external_prefix_cache_hits > 0 and stats.kv_offload_loaded_blocks > 0, stats
    assert stats.spec_num_accepted_tokens > 0.8 * stats.spec_num_draft_tokens, stats
